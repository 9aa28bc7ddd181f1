"""What systemd listens on for sd_notify: one datagram per call, on a real unix socket."""

from __future__ import annotations

import socket
import time
from pathlib import Path

TIMEOUT = 15.0


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, dict[str, str]]] = []

    def _next(self, deadline: float, waiting_for: str) -> dict[str, str]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no {waiting_for} among {self.messages[-10:]}")
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(65536).decode()
        except TimeoutError:
            raise AssertionError(f"no {waiting_for} among {self.messages[-10:]}") from None
        fields = dict(line.split("=", 1) for line in data.splitlines())
        self.messages.append((time.monotonic(), fields))
        return fields

    def receive(self, until: str, timeout: float = TIMEOUT) -> dict[str, str]:
        """Collect messages until one carries `until` (KEY or KEY=VALUE); return it."""
        deadline = time.monotonic() + timeout
        key, _, value = until.partition("=")
        while True:
            fields = self._next(deadline, until)
            if key in fields and (not value or fields[key] == value):
                return fields

    def status_with(self, *parts: str, timeout: float = TIMEOUT) -> str:
        """The first STATUS= line (received so far or next) that holds every part."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for _, fields in self.messages[seen:]:
                line = fields.get("STATUS", "")
                if "STATUS" in fields and all(p in line for p in parts):
                    return line
            seen = len(self.messages)
            self._next(deadline, f"status line with {parts}")

    def close(self) -> None:
        self.sock.close()
