"""inotify on the device-plugin directory: a new kubelet.sock, or our own socket gone."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers.inotify import InotifyObserver

from ..event import Event, KubeletSocketCreated, PluginSocketRemoved
from ..kubelet.api import KUBELET_SOCKET

log = logging.getLogger(__name__)


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
    """Runs watchdog's observer thread; `emit` must be thread-safe."""

    def __init__(self, plugin_dir: Path, own_sockets: Iterable[Path], emit: Callable[[Event], None]) -> None:
        self.plugin_dir = plugin_dir
        self._handler = _Handler(str(plugin_dir / KUBELET_SOCKET), own_sockets, emit)
        self._observer: InotifyObserver | None = None

    def start(self) -> None:
        observer = InotifyObserver()
        observer.schedule(self._handler, str(self.plugin_dir), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer
        log.info("watching %s for the kubelet's socket", self.plugin_dir)

    def set_own(self, own_sockets: Iterable[Path]) -> None:
        """Our sockets changed (a reload); swapped whole, so the observer thread sees one or the other."""
        self._handler.own = frozenset(str(p) for p in own_sockets)

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(timeout=5)
