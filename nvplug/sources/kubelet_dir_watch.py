"""inotify on the device-plugin directory: a new kubelet.sock, or our own socket gone (there, or in
the directories of the DRA plugin's sockets)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers.api import BaseObserver
from watchdog.observers.inotify import InotifyEmitter
from watchdog.observers.inotify_c import InotifyFD

from nvplug.core.events import Event, KubeletSocketCreated, PluginSocketRemoved
from nvplug.edges.edge_protocols import BlockingRunsOn, Publish
from nvplug.protos import KUBELET_SOCKET

# The name it had before the layout by role: it is part of every log line.
log = logging.getLogger("nvplug.events.kubelet_dir")


class _Handler(FileSystemEventHandler):
    def __init__(self, kubelet_socket: str, own: Iterable[Path], emit: Callable[[Event], None]) -> None:
        self._kubelet_socket = kubelet_socket
        self.own = frozenset(str(p) for p in own)
        self._emit = emit

    # The directory itself also reports modifications; only paths matter.
    def on_created(self, event: FileSystemEvent) -> None:
        if os.fsdecode(event.src_path) == self._kubelet_socket:
            self._emit(KubeletSocketCreated())

    def on_moved(self, event: FileSystemEvent) -> None:
        if os.fsdecode(event.dest_path) == self._kubelet_socket:
            self._emit(KubeletSocketCreated())

    def on_deleted(self, event: FileSystemEvent) -> None:
        path = os.fsdecode(event.src_path)
        if path in self.own:
            self._emit(PluginSocketRemoved(path))


class _Emitter(InotifyEmitter):
    """watchdog's emitter, stopped in an order that cannot race its own thread.

    InotifyEmitter.on_thread_stop() (watchdog 7.1, observers/inotify.py) first drops the watch group
    (`self._inotify = None`), then closes the group's queue. When the emitter thread is just then
    handling an event (one taken from the queue, or between loops), it finds the group gone and logs
    "InotifyEmitter.queue_events() called when the thread is inactive" at ERROR. Any event in the
    directory at that moment does it: our own sockets removed at shutdown, a restarting kubelet.

    Here the group is only closed. stop() has set the thread's stop flag already; closing the queue
    wakes a thread blocked in read_event() (it returns None), one that holds an event hands it on as
    usual, and either way the loop then sees the flag and ends. The group is never dropped under it.
    """

    def on_thread_stop(self) -> None:
        group = self._inotify
        # Also reached twice: from the thread itself when the directory is deleted, then from the observer.
        if group is not None and group.is_active:
            group.deactivate()


class _Observer(BaseObserver):
    """InotifyObserver with _Emitter: its own inotify fd and reader thread, ended after the emitters."""

    def __init__(self) -> None:
        self._inotify_fd = InotifyFD()
        self._inotify_fd.start()
        super().__init__(_Emitter, inotify_fd=self._inotify_fd)

    def on_thread_stop(self) -> None:
        super().on_thread_stop()  # stops and joins the emitters first
        self._inotify_fd.stop()
        self._inotify_fd.join()


class KubeletDirWatch:
    """Runs watchdog's observer thread, which hands events to the bus."""

    name = "the kubelet directories' watch"
    blocking: BlockingRunsOn = "own thread"
    without: str | None = None  # no registration without it

    def __init__(
        self,
        plugin_dir: Path,
        own_sockets: Iterable[Path],
        emit: Publish,
        more_dirs: Iterable[Path] = (),
    ) -> None:
        self.plugin_dir = plugin_dir
        self.more_dirs = tuple(dict.fromkeys(more_dirs))
        self._handler = _Handler(str(plugin_dir / KUBELET_SOCKET), own_sockets, emit)
        self._observer: _Observer | None = None

    def start(self) -> None:
        observer = _Observer()
        observer.schedule(self._handler, str(self.plugin_dir), recursive=False)
        for directory in self.more_dirs:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                observer.schedule(self._handler, str(directory), recursive=False)
            except OSError as err:
                # Whoever needs the directory says why it cannot be used; the device plugin goes on.
                log.warning("cannot watch %s: %s", directory, err)
        observer.daemon = True
        observer.start()
        self._observer = observer
        log.info("watching %s for the kubelet's socket", self.plugin_dir)

    def set_own(self, own_sockets: Iterable[Path]) -> None:
        """Our sockets changed (a reload); swapped whole, so the observer thread sees one or the other."""
        self._handler.own = frozenset(str(p) for p in own_sockets)

    async def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            # Off the loop: the observer may be inside an inotify read.
            await asyncio.to_thread(observer.join, 5)
