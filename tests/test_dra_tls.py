"""The DRA API client over TLS: the kubeconfig's CA (data or file) checks the server, its client
certificate (data or file) is presented, and a server the CA did not sign is refused.

The API-server stand-in speaks plain HTTP; a TLS front (asyncio, the standard ssl module)
forwards to it, with a certificate made here by openssl for 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from support.apiserver_standin import GROUP, FakeApiServer

from nvplug.dra.api_client import ApiClient, KubeConfig
from nvplug.dra.slice_publisher import FAILURES

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def make_cert(directory: Path, name: str, ca: tuple[Path, Path] | None = None) -> tuple[Path, Path]:
    """A key and certificate for 127.0.0.1: self-signed (a CA) or signed by `ca`."""
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    subject = ["-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"]
    if ca is None:
        argv = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", str(key), "-out", str(cert), "-days", "1", *subject]  # fmt: skip
        subprocess.run(argv, check=True, capture_output=True)
        return key, cert
    csr = directory / f"{name}.csr"
    subprocess.run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(csr), *subject], check=True, capture_output=True)  # fmt: skip
    ext = directory / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]),
                    "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext)],
                   check=True, capture_output=True)  # fmt: skip
    return key, cert


@contextlib.asynccontextmanager
async def tls_front(
    api: FakeApiServer, key: Path, cert: Path, client_ca: Path | None, clients: list[str] | None = None
) -> AsyncIterator[int]:
    """A TLS listener that pipes each connection to the stand-in; with `client_ca`, clients must show a
    certificate it signed (its common name is added to `clients` per connection). Yields the port."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if client_ca is not None:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if clients is not None:
            subject = dict(part[0] for part in (writer.get_extra_info("peercert") or {}).get("subject", ()))
            clients.append(str(subject.get("commonName")))
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", api.port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def write_kubeconfig(path: Path, server: str, user: dict[str, str], cluster: dict[str, str] | None = None) -> Path:
    """A kubeconfig of one cluster and one user, as `path`."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, **(cluster or {})}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def kubeconfig(path: Path, port: int, cluster: dict[str, str], user: dict[str, str]) -> KubeConfig:
    server = f"https://127.0.0.1:{port}"
    return KubeConfig.load(write_kubeconfig(path, server, {"token": "test-token", **user}, cluster))


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_tls_with_a_ca_and_a_client_certificate(tmp_path: Path) -> None:
    ca = make_cert(tmp_path, "ca")
    server_key, server_cert = make_cert(tmp_path, "server", ca)
    client_key, client_cert = make_cert(tmp_path, "client", ca)
    make_cert(tmp_path, "other")

    async def main(api: FakeApiServer) -> None:
        async with tls_front(api, server_key, server_cert, client_ca=ca[1]) as port:
            # CA and client certificate as data, as kubeadm writes them.
            pair = {"client-certificate-data": b64(client_cert), "client-key-data": b64(client_key)}
            inline = kubeconfig(tmp_path / "inline", port, {"certificate-authority-data": b64(ca[1])}, pair)
            # As files, relative to the kubeconfig (the kubelet's own kubeconfig points at rotating files).
            files = kubeconfig(tmp_path / "files", port, {"certificate-authority": "ca.crt"},
                               {"client-certificate": "client.crt", "client-key": "client.key"})  # fmt: skip
            for cfg in (inline, files):
                client = ApiClient(cfg, timeout=5.0)
                assert (await client.request("GET", f"/apis/{GROUP}"))["name"] == GROUP
                await client.close()
            # A server the configured CA did not sign: refused, as an API failure the publisher backs off on.
            wrong = kubeconfig(tmp_path / "wrong", port, {"certificate-authority": "other.crt"},
                               {"client-certificate": "client.crt", "client-key": "client.key"})  # fmt: skip
            client = ApiClient(wrong, timeout=5.0)
            with pytest.raises(ssl.SSLCertVerificationError) as info:
                await client.request("GET", f"/apis/{GROUP}")
            assert isinstance(info.value, FAILURES)
            await client.close()
            # No client certificate where the server wants one: the handshake or the request fails.
            bare = kubeconfig(tmp_path / "bare", port, {"certificate-authority": "ca.crt"}, {})
            client = ApiClient(bare, timeout=5.0)
            with pytest.raises(FAILURES):
                await client.request("GET", f"/apis/{GROUP}")
            await client.close()

    with FakeApiServer() as api:
        asyncio.run(main(api))
