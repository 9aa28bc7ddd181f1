"""inotify read on the event loop: a non-blocking descriptor that the loop watches (a reader, no thread).

One watch per directory, shared by the callbacks that asked for it and told apart by an id; the watch
goes with its last callback, and its end (its directory freed, its filesystem unmounted) is told to
those left. Each event is handled as it is read, on the loop: no thread hand-off, whose wait was on
the way from a new kubelet.sock to the Register.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from typing import NewType, Protocol

from nvplug.inotify.inotify_binding import (
    InotifyEvent,
    WatchDescriptor,
    inotify_add_watch,
    inotify_init,
    inotify_rm_watch,
    parse,
)

# Tells apart the callbacks that share a watch.
CallbackId = NewType("CallbackId", int)
# Whole events only, as many as a read can give: the kernel never splits one across reads.
_READ_SIZE = 64 * 1024


class WatchCallback(Protocol):
    """What a watch's user is told, on the loop."""

    def on_event(self, event: InotifyEvent) -> None: ...

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        """The kernel ended the watch (IN_IGNORED): its directory was freed, or its filesystem unmounted."""

    def on_queue_overflow(self) -> None:
        """The kernel's queue overflowed: events were dropped, on any watch."""


class InotifyReader:
    """One inotify instance, read on the running loop between `start` and `stop`."""

    def __init__(self) -> None:
        self._fd = inotify_init()
        self._watches: dict[WatchDescriptor, dict[CallbackId, WatchCallback]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def add_callback(self, path: bytes, mask: int, callback: WatchCallback, id_: CallbackId) -> WatchDescriptor:
        """Watch `path` (the watch it has already, if any: inotify keeps one per inode, with the last mask)."""
        wd = inotify_add_watch(self._fd, path, mask)
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
                inotify_rm_watch(self._fd, wd)

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
            if self._fd < 0:
                return  # a callback stopped the reader: the rest is for nobody
            self.handle_event(event)
