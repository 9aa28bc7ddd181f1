"""sd_notify without a library: datagrams to $NOTIFY_SOCKET. Silent when not under systemd."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        # A leading @ names the abstract namespace.
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._watchdog_interval: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            # Ping at half the timeout, as systemd advises.
            self._watchdog_interval = int(usec) / 2e6
        self._failed = False
        # The last status line: READY=1 says it again (a reload's RELOADING=1 replaced it in systemd's view).
        self._status = ""

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings, or None when no watchdog is set."""
        return self._watchdog_interval if self.enabled else None

    def ready(self) -> None:
        self.send("READY=1", f"STATUS={self._status}")

    def status(self, status: str) -> None:
        self._status = status
        self.send(f"STATUS={status}")

    def meanwhile(self, status: str) -> None:
        """A status line for a while (a wait): READY=1 says the last one `status` sent, not this."""
        self.send(f"STATUS={status}")

    def reloading(self) -> None:
        self.send("RELOADING=1", "STATUS=reloading the config")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def send(self, *fields: str) -> None:
        if not self._address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(fields).encode(), self._address)
        except OSError as err:
            # Once is enough: systemd going away must not flood the log.
            if not self._failed:
                log.warning("sd_notify to %s failed: %s", self._address.lstrip("\0"), err)
                self._failed = True
