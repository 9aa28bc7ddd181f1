"""A client of the daemon's status endpoint: HTTP/1.1 GET over a unix socket or TCP."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

from nvplug import config

DEFAULT_LISTEN = "unix:/run/nvplug/status.sock"


class StatusUnavailable(OSError):
    """Nothing answers at the status address; the message says where and why."""


class _UnixConnection(http.client.HTTPConnection):
    """HTTPConnection to a unix socket; the Host header says `localhost`."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _connection(listen: str, timeout: float) -> http.client.HTTPConnection:
    if listen.startswith("unix:"):
        return _UnixConnection(listen.removeprefix("unix:"), timeout)
    try:
        host, port = config.tcp_address(listen)
    except ValueError:
        raise ValueError(f"status address {listen!r} is neither unix:/path nor HOST:PORT") from None
    return http.client.HTTPConnection(host, port, timeout=timeout)


def fetch(listen: str, path: str, timeout: float = 2.0, body: bytes | None = None) -> tuple[int, str]:
    """GET `path` (POST `body`, when given) at the status endpoint `listen`: (HTTP status, body).

    Raises StatusUnavailable.
    """
    if listen == "off":
        raise StatusUnavailable("the status endpoint is turned off (nvplug.status.listen: off)")
    conn = _connection(listen, timeout)
    try:
        headers = {"Connection": "close"}
        if body is None:
            conn.request("GET", path, headers=headers)
        else:
            conn.request("POST", path, body=body, headers={**headers, "Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    except FileNotFoundError as err:
        raise StatusUnavailable(f"no status socket at {listen} (is nvplug running?)") from err
    except ConnectionRefusedError as err:
        raise StatusUnavailable(f"nothing listens at {listen} (is nvplug running?)") from err
    except TimeoutError as err:
        raise StatusUnavailable(f"no answer from {listen} within {timeout:g} s") from err
    except (OSError, http.client.HTTPException) as err:
        raise StatusUnavailable(f"status endpoint {listen} failed: {err}") from err
    finally:
        conn.close()


def status(listen: str, timeout: float = 2.0, path: str = "/status") -> dict[str, Any]:
    """The daemon's /status document (or another JSON page's, `path`). Raises StatusUnavailable, also for a
    non-200 or non-JSON answer."""
    code, body = fetch(listen, path, timeout)
    if code != 200:
        raise StatusUnavailable(f"{listen}{path} answered HTTP {code}: {body.strip()[:200]}")
    try:
        doc = json.loads(body)
    except ValueError as err:
        raise StatusUnavailable(f"{listen}{path} is not JSON: {err}") from err
    if not isinstance(doc, dict):
        raise StatusUnavailable(f"{listen}{path} is not a JSON object")
    return doc


def listen_address(explicit: str | None, config_path: Path | None) -> str:
    """--status-listen, else the config's nvplug.status.listen, else the default unix socket.

    A config that cannot be loaded falls back to the default: the commands that ask
    still want an answer, and `nvplug doctor` reports the config on its own.
    """
    if explicit:
        return explicit
    try:
        cfg = config.load(config_path)
    except (config.ConfigError, OSError):
        return DEFAULT_LISTEN
    return configured_listen(cfg) or DEFAULT_LISTEN


def configured_listen(cfg: config.Config) -> str | None:
    """nvplug.status.listen where this Config has it (the key is newer than some Configs)."""
    for holder in (getattr(cfg, "status", None), cfg):
        for name in ("listen", "status_listen"):
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, str) and value:
                return value
    return None
