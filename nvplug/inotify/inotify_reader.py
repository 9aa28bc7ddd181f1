"""inotify read on the event loop: a non-blocking descriptor that the loop watches (a reader, no thread).

Its watches and their callbacks are kept as watchdog's `InotifyFD` keeps them (one watch per directory,
shared by callbacks told apart by id), and it hands over watchdog's own `InotifyEvent` to the same
`WatchCallback`s; only the reading moved, from a thread of its own onto the loop. A new kubelet.sock
then reaches the loop with no thread hand-off at all.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import struct
from collections.abc import Iterable, Iterator

from watchdog.observers.inotify_c import (
    CallbackId,
    InotifyEvent,
    Mask,
    WatchCallback,
    WatchDescriptor,
    inotify_add_watch,
    inotify_init,
    inotify_rm_watch,
)

# struct inotify_event: wd, mask, cookie, len, then `len` bytes of name padded with NULs.
_HEADER = struct.Struct("iIII")
# Whole events only, as many as a read can give: the kernel never splits one across reads.
_READ_SIZE = 64 * 1024


class InotifyReader:
    """One inotify instance, read on the running loop between `start` and `stop`."""

    def __init__(self) -> None:
        fd = inotify_init()
        if fd < 0:
            raise _error("cannot make an inotify instance")
        os.set_blocking(fd, False)
        os.set_inheritable(fd, False)
        self._fd = fd
        self._watches: dict[WatchDescriptor, dict[CallbackId, WatchCallback]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def add_callback(self, path: bytes, mask: Mask, callback: WatchCallback, id_: CallbackId) -> WatchDescriptor:
        """Watch `path` (the watch it has already, if any: inotify keeps one per inode, with the last mask)."""
        wd = inotify_add_watch(self._fd, path, mask)
        if wd < 0:
            raise _error(f"cannot watch {os.fsdecode(path)}")
        self._watches.setdefault(wd, {})[id_] = callback
        return wd

    def remove_callbacks(self, callbacks: Iterable[tuple[WatchDescriptor, CallbackId]]) -> None:
        """Each callback off its watch; a watch left with none is taken off (unless the kernel did already)."""
        for wd, id_ in callbacks:
            users = self._watches.get(wd)
            if users is None:
                continue
            users.pop(id_, None)
            if not users:
                del self._watches[wd]
                if inotify_rm_watch(self._fd, wd) < 0 and ctypes.get_errno() != errno.EINVAL:
                    raise _error(f"cannot remove inotify watch {wd}")

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._read)

    def stop(self) -> None:
        """No more reads; the descriptor closes, and every watch with it. Safe to repeat."""
        if self._fd < 0:
            return
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        self._watches.clear()

    def handle_event(self, event: InotifyEvent) -> None:
        """One event to the callbacks of its watch (all of them, for the kernel's overflow record)."""
        if event.is_queue_overflow:
            everyone = {id(cb): cb for users in self._watches.values() for cb in users.values()}
            for callback in everyone.values():
                callback.on_queue_overflow()
        elif event.is_ignored:
            # The watch is gone: its directory was freed, or its filesystem unmounted.
            for callback in self._watches.pop(event.wd, {}).values():
                callback.on_watch_deleted(event.wd)
        else:
            # A copy: a callback may add or remove watches as it goes.
            for callback in list(self._watches.get(event.wd, {}).values()):
                callback.on_event(event)

    def _read(self) -> None:
        try:
            data = os.read(self._fd, _READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        for event in parse(data):
            self.handle_event(event)


def parse(data: bytes) -> Iterator[InotifyEvent]:
    """The events of one read, in order; the kernel's overflow record has no watch (wd -1)."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        wd, mask, cookie, length = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        name = data[start : start + length].rstrip(b"\0")
        offset = start + length
        yield InotifyEvent(WatchDescriptor(wd), Mask(mask), cookie, name)


def _error(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")
