"""udev hotplug: NVIDIA PCI devices appearing, vanishing or (un)binding a driver.

Listens on udevd's netlink group (2) through pyudev with an in-kernel filter on
`SUBSYSTEM=pci`, reading on the asyncio loop itself (no thread). Each event for
vendor 10DE becomes a `PciChanged`. Bad input is dropped with a rate-limited
warning; nothing a message contains can raise out of the reader callback.

If the socket overflows (the kernel reports ENOBUFS), events were lost and the
caller's `on_overflow` is called so that it can rescan everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import socket
import time
from collections.abc import Callable

import pyudev  # type: ignore[import-untyped]

from nvplug.core.events import PciChanged
from nvplug.core.gpu import normalize_bus_id
from nvplug.edges.edge_protocols import BlockingRunsOn, Publish

log = logging.getLogger(__name__)

NVIDIA_VENDOR = "10DE"
ACTIONS = frozenset({"add", "remove", "bind", "unbind", "change"})

# libudev (systemd 252) already asks for 128 MiB; we only make sure of a floor,
# for libudev builds that ask for less. SO_RCVBUFFORCE needs root.
MIN_RECEIVE_BUFFER = 16 * 1024 * 1024
# Per wake-up, so a flood cannot starve the loop; the reader is level-triggered,
# so whatever is left is read on the next pass.
MAX_PER_WAKEUP = 512
# After an unexplained receive error, stop reading for a while instead of spinning.
ERROR_PAUSE_S = 1.0
WARNING_INTERVAL_S = 60.0

# sysfs spells bus ids DDDD:BB:DD.F; VMD domains have 5 hex digits or more.
_BUS_ID = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_PCI_ID = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{4}")


class _Drop(Exception):
    """A message we cannot use; `kind` groups identical problems for rate limiting."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class WarningLimiter:
    """Logs the first warning of each kind, then at most one per `interval` seconds.

    The line that ends a quiet spell says how many were held back. Kinds are a
    small fixed set chosen by the caller, so the state stays bounded.
    """

    def __init__(
        self, logger: logging.Logger, interval: float = WARNING_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._state: dict[str, tuple[float, int]] = {}  # kind -> (last logged, held back since)

    def warn(self, kind: str, message: str) -> bool:
        """Log `message` unless one of this kind was logged recently; True if logged."""
        now = self._clock()
        state = self._state.get(kind)
        if state is not None:
            last, held = state
            if now - last < self._interval:
                self._state[kind] = (last, held + 1)
                return False
            if held:
                message = f"{message} ({held} more like this in the last {now - last:.0f}s)"
        self._state[kind] = (now, 0)
        self._logger.warning("%s", message)
        return True


class UdevSource:
    """Emits `PciChanged` for NVIDIA PCI uevents, from the loop's own thread.

    `on_overflow`, if given, is called (on the loop) each time the kernel reports
    that the receive buffer overflowed and events were lost: the daemon should
    then rescan all GPUs, since any add, remove or (un)bind may be among the lost.
    `receive_buffer_size`, if given, sets the buffer to exactly that many bytes
    (tests use it to provoke an overflow); by default it is raised to at least
    `MIN_RECEIVE_BUFFER` and never lowered.
    """

    name = "udev hotplug events"
    blocking: BlockingRunsOn = "loop reader"
    without: str | None = "new GPUs are found only by rescans"

    def __init__(
        self,
        emit: Publish,
        on_overflow: Callable[[], None] | None = None,
        *,
        receive_buffer_size: int | None = None,
    ) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._emit = emit
        self._on_overflow = on_overflow
        self._receive_buffer_size = receive_buffer_size
        self._monitor: pyudev.Monitor | None = None
        self._fd = -1
        self._resume: asyncio.TimerHandle | None = None
        self._warnings = WarningLimiter(log)

    def start(self) -> None:
        if self._monitor is not None:
            return
        try:
            context = pyudev.Context()
            monitor = pyudev.Monitor.from_netlink(context, source="udev")
            monitor.filter_by(subsystem="pci")
            monitor.start()
        except Exception as exc:
            raise OSError(f"cannot listen for udev events (netlink group 2, subsystem pci): {exc}") from exc
        self._set_buffer(monitor)
        self._monitor = monitor
        self._fd = int(monitor.fileno())
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._on_readable)
        log.info("listening for udev pci events")

    async def stop(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._monitor is None or self._loop is None:
            return
        self._loop.remove_reader(self._fd)
        # pyudev has no close(): dropping the last reference unrefs the libudev
        # monitor, which closes the socket. Closing the fd ourselves would leave
        # libudev to close a number that may by then belong to someone else.
        self._monitor = None
        self._fd = -1

    def fileno(self) -> int:
        """The netlink socket (-1 when stopped); only for inspection, never read it."""
        return self._fd

    def _set_buffer(self, monitor: pyudev.Monitor) -> None:
        wanted = self._receive_buffer_size
        if wanted is None:
            current = self._sockopt(monitor, socket.SO_RCVBUF)
            # Linux reports twice what was set (the rest is bookkeeping overhead).
            if current is not None and current // 2 >= MIN_RECEIVE_BUFFER:
                return
            wanted = MIN_RECEIVE_BUFFER
        try:
            monitor.set_receive_buffer_size(wanted)
        except Exception as exc:
            # Needs CAP_NET_ADMIN; without it we live with the default.
            log.debug("cannot set the udev receive buffer to %d bytes: %s", wanted, exc)

    @staticmethod
    def _sockopt(monitor: pyudev.Monitor, option: int) -> int | None:
        """Reads a SOL_SOCKET option through a duplicate of libudev's fd (which stays libudev's)."""
        try:
            with socket.socket(fileno=os.dup(int(monitor.fileno()))) as sock:
                return int(sock.getsockopt(socket.SOL_SOCKET, option))
        except OSError as exc:
            log.debug("cannot read socket option %d of the udev monitor: %s", option, exc)
            return None

    def _on_readable(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        for _ in range(MAX_PER_WAKEUP):
            try:
                device = monitor.poll(timeout=0)
            except ValueError as exc:
                # EINVAL from libudev: a malformed message (bad header, unknown ACTION,
                # missing DEVPATH...). It has been consumed; carry on with the next.
                self._warnings.warn("unparsable", f"dropped a udev message that libudev rejected: {exc}")
                continue
            except Exception as exc:
                # pyudev raises on POLLERR without an errno; SO_ERROR tells (and clears) why.
                code = getattr(exc, "errno", None) or self._sockopt(monitor, socket.SO_ERROR)
                if code == errno.ENOBUFS:
                    self._overflowed()
                    continue
                self._warnings.warn(
                    "receive", f"cannot receive udev events ({exc!r}); pausing {ERROR_PAUSE_S:.0f}s before retrying"
                )
                self._pause()
                return
            if device is None:
                return
            self._handle(device)

    def _pause(self) -> None:
        loop = asyncio.get_running_loop()  # a reader's callback runs on the loop
        loop.remove_reader(self._fd)
        self._resume = loop.call_later(ERROR_PAUSE_S, self._resume_reading)

    def _resume_reading(self) -> None:
        self._resume = None
        if self._monitor is not None:
            asyncio.get_running_loop().add_reader(self._fd, self._on_readable)

    def _overflowed(self) -> None:
        self._warnings.warn("overflow", "udev receive buffer overflowed: events were lost, asking for a full rescan")
        if self._on_overflow is None:
            return
        try:
            self._on_overflow()
        except Exception:
            log.exception("the udev overflow callback failed")

    def _handle(self, device: pyudev.Device) -> None:
        try:
            event = self._parse(device)
        except _Drop as drop:
            self._warnings.warn(drop.kind, str(drop))
            return
        except Exception as exc:
            self._warnings.warn("parse", f"dropped a udev event that could not be read: {exc!r}")
            return
        if event is None:
            return
        try:
            self._emit(event)
        except Exception:
            log.exception("emitting %s failed", event)

    @staticmethod
    def _parse(device: pyudev.Device) -> PciChanged | None:
        properties = device.properties

        def get(key: str) -> str | None:
            try:
                value = properties.get(key)
            except UnicodeDecodeError as exc:
                raise _Drop(
                    "undecodable", f"dropped udev pci event {where}: {key} is not UTF-8 ({exc.object!r:.80})"
                ) from None
            return None if value is None else str(value)

        where = "(no DEVPATH)"
        # Only names the event in warnings; the fields that matter are checked below.
        with contextlib.suppress(_Drop):
            where = f"{get('DEVPATH')} (SEQNUM {get('SEQNUM')})"

        pci_id = get("PCI_ID")
        if pci_id is None:
            raise _Drop("no PCI_ID", f"dropped udev pci event {where}: no PCI_ID")
        if not _PCI_ID.fullmatch(pci_id):
            raise _Drop(
                "bad PCI_ID", f"dropped udev pci event {where}: PCI_ID {pci_id!r:.80} is not VENDOR:DEVICE in hex"
            )
        pci_id = pci_id.upper()
        if not pci_id.startswith(NVIDIA_VENDOR + ":"):
            return None
        action = get("ACTION")
        if action not in ACTIONS:
            raise _Drop("unknown ACTION", f"dropped udev pci event {where}: ACTION {action!r:.80} is not one we handle")
        slot = get("PCI_SLOT_NAME")
        if slot is None:
            raise _Drop("no PCI_SLOT_NAME", f"dropped udev pci event {where}: no PCI_SLOT_NAME")
        if not _BUS_ID.fullmatch(slot):
            raise _Drop("bad PCI_SLOT_NAME", f"dropped udev pci event {where}: PCI_SLOT_NAME {slot!r:.80} is no bus id")
        return PciChanged(action, normalize_bus_id(slot), get("DRIVER") or None, pci_id)
