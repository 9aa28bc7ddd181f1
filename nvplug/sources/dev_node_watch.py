"""inotify on the dev root's /dev and /dev/nvidia-caps: NVIDIA device nodes that appear or go away.

At boot, nvidia-persistenced or a udev rule may make /dev/nvidiaN after nvplug started: a GPU
held back for its missing node must come back as soon as the node exists, not at some later scan.
Each change in those directories lists the NVIDIA nodes again (on the observer's thread) and
publishes the set when it differs; the core re-checks what Allocate needs from it, with no NVML call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers.api import ObservedWatch

from nvplug.core.events import DeviceNodesChanged
from nvplug.core.mig import CAPS_DIR
from nvplug.edges.edge_protocols import BlockingRunsOn, Publish
from nvplug.inotify.inotify_observer import InotifyObserver

log = logging.getLogger(__name__)

NODE_PREFIX = "nvidia"


def list_nodes(dev_root: Path) -> frozenset[str]:
    """The NVIDIA nodes under the dev root, named as a container sees them (/dev/nvidia3)."""
    present: set[str] = set()
    for directory in ("/dev", CAPS_DIR):
        try:
            names = [p.name for p in (dev_root / directory.lstrip("/")).iterdir()]
        except OSError:
            continue
        present.update(f"{directory}/{name}" for name in names if name.startswith(NODE_PREFIX))
    return frozenset(present)


class _NodeEvents(FileSystemEventHandler):
    def __init__(self, watch: DevNodeWatch) -> None:
        self._watch = watch

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed", "closed_no_write", "modified"):
            return  # a node opened or written is still the same node
        names = {Path(os.fsdecode(event.src_path)).name, Path(os.fsdecode(event.dest_path)).name}
        if any(n.startswith(NODE_PREFIX) for n in names):
            self._watch.changed()


class DevNodeWatch:
    """Runs watchdog's observer thread on the dev root's /dev (and nvidia-caps, once it exists)."""

    name = "the device nodes' watch"
    blocking: BlockingRunsOn = "own thread"
    without: str | None = "a device node made later is seen only at the next scan"

    def __init__(self, dev_root: Path, publish: Publish) -> None:
        self.dev_dir = dev_root / "dev"
        self.caps_dir = dev_root / CAPS_DIR.lstrip("/")
        self._dev_root = dev_root
        self._publish = publish
        self._handler = _NodeEvents(self)
        self._observer: InotifyObserver | None = None
        self._caps_watch: ObservedWatch | None = None
        self._lock = threading.Lock()
        self._last: frozenset[str] | None = None

    def start(self) -> None:
        observer = InotifyObserver()
        observer.schedule(self._handler, str(self.dev_dir), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer
        self._watch_caps()
        self.changed()  # the first listing: from now on the core checks nodes against the watch's
        log.info("watching %s for NVIDIA device nodes", self.dev_dir)

    def changed(self) -> None:
        """On the observer's thread: list again, publish a set that differs from the last one."""
        self._watch_caps()
        with self._lock:
            present = list_nodes(self._dev_root)
            if present == self._last:
                return
            self._last = present
        log.debug("device nodes changed: %d NVIDIA nodes", len(present))
        self._publish(DeviceNodesChanged(present))

    def _watch_caps(self) -> None:
        """nvidia-caps comes and goes with MIG (nvidia-modprobe makes it): follow it when it does."""
        observer = self._observer
        exists = self.caps_dir.is_dir()
        if observer is None or exists == (self._caps_watch is not None):
            return
        if self._caps_watch is not None:
            old, self._caps_watch = self._caps_watch, None
            with contextlib.suppress(KeyError, OSError):  # its emitter ended with the directory
                observer.unschedule(old)
            return
        try:
            self._caps_watch = observer.schedule(self._handler, str(self.caps_dir), recursive=False)
        except OSError as err:
            log.warning("cannot watch %s: %s", self.caps_dir, err)

    async def follow(self, dev_root: Path) -> None:
        """A reload moved flags.nvidiaDevRoot: watch the new root's directories, and publish its nodes."""
        if dev_root == self._dev_root:
            return
        running = self._observer is not None
        await self.stop()
        self.dev_dir, self.caps_dir = dev_root / "dev", dev_root / CAPS_DIR.lstrip("/")
        self._dev_root = dev_root
        self._caps_watch = None
        with self._lock:
            self._last = None  # the new root's first listing is published, even if it lists the same names
        if not running:
            return
        try:
            self.start()
        except OSError as err:
            log.error("cannot watch %s: %s; %s (until a restart)", self.dev_dir, err, self.without)

    async def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            # Off the loop: the observer may be inside an inotify read.
            await asyncio.to_thread(observer.join, 5)
