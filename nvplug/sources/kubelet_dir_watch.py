"""inotify on the device-plugin directory: a new kubelet.sock, or our own socket gone (there, or in
the directories of the DRA plugin's sockets)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler

from nvplug.core.events import Event, KubeletSocketCreated, PluginSocketRemoved
from nvplug.edges.edge_protocols import BlockingRunsOn, Publish
from nvplug.protos import KUBELET_SOCKET
from nvplug.sources.inotify_observer import InotifyObserver

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
        self._observer: InotifyObserver | None = None

    def start(self) -> None:
        observer = InotifyObserver()
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
