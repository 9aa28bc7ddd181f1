"""A small asyncio client for the Kubernetes API server: the few calls the DRA driver makes.

Why not kubernetes-asyncio or lightkube: nvplug makes five kinds of request on two
resources. kubernetes-asyncio is a 3 MB wheel of generated models over aiohttp and its
compiled dependencies; lightkube 1.x pulls a fork of httpx, msgspec and truststore.
Each would be shipped in the deb and RPM and pinned by hash for one Python. This
client is HTTP/1.1 over asyncio streams and the standard ssl module: one connection,
reused, on the daemon's own loop, with no thread. Credentials are read from the
kubeconfig at every new connection, so rotated client certificates (the kubelet's
own kubeconfig points at a rotating file) are picked up without a restart.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

# Kubernetes' own client gives up on a request after this long by default.
TIMEOUT = 30.0
MAX_BODY = 64 << 20


class KubeConfigError(ValueError):
    """The kubeconfig cannot be used; the message names the file and the key."""


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(self, method: str, path: str, status: int, reason: str, message: str) -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class KubeConfig:
    """The current context's cluster and user, as far as a host service needs them."""

    source: str
    server: str
    ca_file: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    cert_data: bytes | None = None
    key_data: bytes | None = None
    token: str | None = None
    token_file: str | None = None

    @classmethod
    def load(cls, path: Path) -> KubeConfig:
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as err:
            raise KubeConfigError(f"{path}: cannot read the kubeconfig: {err}") from err
        if not isinstance(doc, dict):
            raise KubeConfigError(f"{path}: not a kubeconfig (no mapping at the top)")
        base = path.parent

        def named(kind: str, name: Any) -> dict[str, Any]:
            for item in doc.get(kind) or []:
                if isinstance(item, dict) and item.get("name") == name and isinstance(item.get(kind[:-1]), dict):
                    return dict(item[kind[:-1]])
            raise KubeConfigError(f"{path}: {kind}: no entry named {name!r}")

        if not doc.get("current-context"):
            raise KubeConfigError(f"{path}: current-context is not set")
        context = named("contexts", doc["current-context"])
        cluster = named("clusters", context.get("cluster"))
        user = named("users", context.get("user")) if context.get("user") else {}
        if "exec" in user or "auth-provider" in user:
            raise KubeConfigError(
                f"{path}: users: exec and auth-provider credentials are not supported; "
                "use a token, a token file or a client certificate"
            )
        server = cluster.get("server")
        if not isinstance(server, str) or urlsplit(server).scheme not in ("http", "https"):
            raise KubeConfigError(f"{path}: clusters: server must be an http(s) URL, not {server!r}")

        def file(value: Any) -> str | None:
            return None if value is None else str(base / str(value))

        def data(value: Any, key: str) -> bytes | None:
            if value is None:
                return None
            try:
                return base64.b64decode(str(value), validate=True)
            except ValueError as err:
                raise KubeConfigError(f"{path}: {key} is not base64") from err

        return cls(
            source=str(path),
            server=server.rstrip("/"),
            ca_file=file(cluster.get("certificate-authority")),
            ca_data=data(cluster.get("certificate-authority-data"), "certificate-authority-data"),
            insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
            tls_server_name=cluster.get("tls-server-name"),
            cert_file=file(user.get("client-certificate")),
            key_file=file(user.get("client-key")),
            cert_data=data(user.get("client-certificate-data"), "client-certificate-data"),
            key_data=data(user.get("client-key-data"), "client-key-data"),
            token=user.get("token"),
            token_file=file(user.get("tokenFile")),
        )

    def bearer(self) -> str | None:
        """The token, from the file each time (projected tokens are rotated in place)."""
        if self.token_file is not None:
            try:
                return Path(self.token_file).read_text().strip()
            except OSError as err:
                raise KubeConfigError(f"{self.source}: tokenFile {self.token_file}: {err.strerror}") from err
        return self.token

    def ssl_context(self) -> ssl.SSLContext | None:
        """None for plain http; made anew for each connection, so that rotated files are read."""
        if urlsplit(self.server).scheme != "https":
            return None
        ctx = ssl.create_default_context(cafile=self.ca_file, cadata=self.ca_data.decode() if self.ca_data else None)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        try:
            if self.cert_data is not None and self.key_data is not None:
                with _private_files(self.cert_data, self.key_data) as (cert, key):
                    ctx.load_cert_chain(cert, key)
            elif self.cert_file is not None:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as err:
            raise KubeConfigError(f"{self.source}: the client certificate cannot be loaded: {err}") from err
        return ctx


@contextlib.contextmanager
def _private_files(*contents: bytes) -> Iterator[list[str]]:
    """ssl loads a certificate chain from files only: write them where only we can read, then remove."""
    with tempfile.TemporaryDirectory(prefix="nvplug-kube-") as directory:
        paths = []
        for n, content in enumerate(contents):
            p = Path(directory) / str(n)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            paths.append(str(p))
        yield paths


class ApiClient:
    """JSON requests over one kept-alive HTTP/1.1 connection; a failed one is dropped and made again."""

    def __init__(self, config: KubeConfig, timeout: float = TIMEOUT) -> None:
        self.config = config
        self.timeout = timeout
        self._lock = asyncio.Lock()
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The answer's JSON; ApiError for an error status, OSError or TimeoutError if none came."""
        async with self._lock:
            for attempt in (1, 2):
                reused = self._conn is not None
                try:
                    return await asyncio.wait_for(self._exchange(method, path, body), self.timeout)
                except _Closed:
                    # The server closed the kept connection while it was idle (a restart, an idle
                    # timeout): nothing was answered, so the request goes once more, on a new one.
                    await self._drop()
                    if not reused or attempt == 2:
                        raise
                except BaseException:
                    await self._drop()
                    raise
            raise AssertionError("unreachable")

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    async def watch(self, path: str) -> AsyncIterator[dict[str, Any]]:
        """The events of a watch (`path` asks `watch=true`), each a JSON object, on a connection of its
        own, for as long as the server streams them. ApiError for an error status; OSError or
        TimeoutError when the connection fails or the answer does not begin in time."""
        reader, writer = await self._open()
        try:
            writer.write(self._request_bytes("GET", path, None))
            await writer.drain()
            status, headers = await asyncio.wait_for(_read_head(reader), self.timeout)
            if status >= 400:
                raise _error("GET", path, status, await asyncio.wait_for(_read_body(reader, headers), self.timeout))
            pending = b""
            async for chunk in _body_chunks(reader, headers):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        event = json.loads(line)
                        if isinstance(event, dict):
                            yield event
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _request_bytes(self, method: str, path: str, body: Mapping[str, Any] | None) -> bytes:
        url = urlsplit(self.config.server)
        payload = json.dumps(body, separators=(",", ":")).encode() if body is not None else b""
        headers = {
            "Host": url.netloc,
            "Accept": "application/json",
            "User-Agent": "nvplug",
            "Content-Length": str(len(payload)),
        }
        if body is not None:
            headers["Content-Type"] = "application/json"
        token = self.config.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        head = f"{method} {url.path}{path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return head.encode() + b"\r\n" + payload

    async def _exchange(self, method: str, path: str, body: Mapping[str, Any] | None) -> dict[str, Any]:
        reader, writer = await self._connection()
        writer.write(self._request_bytes(method, path, body))
        await writer.drain()
        status, reply_headers = await _read_head(reader)
        data = await _read_body(reader, reply_headers)
        if reply_headers.get("connection", "").lower() == "close":
            await self._drop()
        if status >= 400:
            raise _error(method, path, status, data)
        try:
            doc = json.loads(data) if data else {}
        except ValueError:
            doc = {}
        if not isinstance(doc, dict):
            raise ApiError(method, path, status, "BadResponse", "the answer is not a JSON object")
        return doc

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # A server's close of an idle connection shows as EOF on our side, not as a closing writer.
        if self._conn is None or self._conn[1].is_closing() or self._conn[0].at_eof():
            self._conn = await self._open()
        return self._conn

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        url = urlsplit(self.config.server)
        ctx = self.config.ssl_context()
        port = url.port or (443 if url.scheme == "https" else 80)
        server_name = (self.config.tls_server_name or url.hostname) if ctx is not None else None
        return await asyncio.open_connection(url.hostname, port, ssl=ctx, server_hostname=server_name)

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn[1].close()
            with contextlib.suppress(Exception):
                await conn[1].wait_closed()


class _Closed(ConnectionError):
    """The connection ended before any byte of an answer."""


def _error(method: str, path: str, status: int, data: bytes) -> ApiError:
    """The API server's Status body as an ApiError (its message, or the first bytes of what came)."""
    try:
        doc = json.loads(data) if data else {}
    except ValueError:
        doc = {}
    message = doc.get("message") if isinstance(doc, dict) else None
    reason = doc.get("reason") if isinstance(doc, dict) else None
    text = str(message or data[:200].decode(errors="replace"))
    return ApiError(method, path, status, str(reason or "Error"), text)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    try:
        line = await reader.readline()
    except ConnectionResetError as err:
        raise _Closed(str(err)) from err
    if not line:
        raise _Closed("the API server closed the connection")
    parts = line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ConnectionError(f"not an HTTP response: {line[:80]!r}")
    headers: dict[str, str] = {}
    while True:
        raw = await reader.readline()
        if raw in (b"\r\n", b"\n", b""):
            break
        key, _, value = raw.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _read_body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> bytes:
    body = bytearray()
    async for chunk in _body_chunks(reader, headers):
        if len(body) + len(chunk) > MAX_BODY:
            raise ConnectionError(f"answer larger than {MAX_BODY} bytes")
        body += chunk
    return bytes(body)


async def _body_chunks(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> AsyncIterator[bytes]:
    """The body as it comes: each chunk of a chunked one (a watch's events), or all of a sized one."""
    if headers.get("transfer-encoding", "").lower() != "chunked":
        length = int(headers.get("content-length", "0"))
        if length > MAX_BODY:
            raise ConnectionError(f"answer larger than {MAX_BODY} bytes")
        yield await reader.readexactly(length)
        return
    while True:
        line = await reader.readline()
        if not line:
            raise ConnectionError("the API server closed the connection inside a chunked answer")
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        if size > MAX_BODY:
            raise ConnectionError(f"a chunk larger than {MAX_BODY} bytes")
        chunk = await reader.readexactly(size)
        await reader.readexactly(2)
        yield chunk
