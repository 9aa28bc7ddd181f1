"""Who may hold NVML's init count. Reads beside the scanner (telemetry) share it; a scan that must count the
GPUs again, or a reset, takes it alone, since NVML enumerates again only at a count of zero.

A waiting scan goes first: no read starts while one waits, so a scrape every second cannot hold a
hot-added GPU back. A read that hangs holds its share until it returns, as a hung call holds a scan anyway.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class NvmlBusy(Exception):
    """No share within the time asked: a scan holds NVML alone, or waits to."""


class NvmlSessions:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sharing = 0
        self._alone: object | None = None  # who holds it alone
        self._waiting_alone = 0

    @contextlib.contextmanager
    def shared(self, timeout: float) -> Iterator[None]:
        """Raises NvmlBusy past `timeout`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._alone is None and not self._waiting_alone, timeout):
                raise NvmlBusy("NVML is being enumerated again")
            self._sharing += 1
        try:
            yield
        finally:
            with self._cond:
                self._sharing -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        held = self.take_alone()
        try:
            yield
        finally:
            self.release_alone(held)

    def take_alone(self) -> object:
        """The token that releases it."""
        with self._cond:
            self._waiting_alone += 1
            try:
                self._cond.wait_for(lambda: self._alone is None and not self._sharing)
            finally:
                self._waiting_alone -= 1
            self._alone = held = object()
        return held

    def release_alone(self, held: object | None) -> None:
        """Safe to repeat, and a no-op for a token no longer holding it (a scan left behind while it hung,
        returning after a later one took NVML alone)."""
        with self._cond:
            if held is not None and self._alone is held:
                self._alone = None
                self._cond.notify_all()
