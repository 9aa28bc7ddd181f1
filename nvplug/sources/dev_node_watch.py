"""inotify on the dev root's /dev and /dev/nvidia-caps: NVIDIA device nodes that appear or go away.

At boot, nvidia-persistenced or a udev rule may make /dev/nvidiaN after nvplug started: a GPU
held back for its missing node must come back as soon as the node exists, not at some later scan.
Each change in those directories lists the NVIDIA nodes again (on the loop, as the inotify reader reads)
and publishes the set when it differs; the core re-checks what Allocate needs from it, with no NVML call.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from nvplug.core.events import DeviceNodesChanged
from nvplug.core.mig import CAPS_DIR
from nvplug.edges.edge_protocols import BlockingRunsOn, Publish
from nvplug.inotify.inotify_binding import (
    IN_CREATE,
    IN_DELETE,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_ONLYDIR,
    InotifyEvent,
    WatchDescriptor,
    reason,
)
from nvplug.inotify.inotify_reader import CallbackId, InotifyReader

log = logging.getLogger(__name__)

NODE_PREFIX = "nvidia"
# Entries made, removed or renamed: a node opened, written or chmod-ed is still the same node.
_MASK = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ONLYDIR
# The two watches' callbacks, told apart.
_DEV = CallbackId(0)
_CAPS = CallbackId(1)


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


class _NodeEvents:
    """What the inotify reader calls, on the loop, for both directories."""

    def __init__(self, watch: DevNodeWatch) -> None:
        self._watch = watch

    def on_event(self, event: InotifyEvent) -> None:
        # A rename comes as two events, each with its own name: either may be a node's.
        if os.fsdecode(event.name).startswith(NODE_PREFIX):
            self._watch.changed()

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        self._watch.watch_ended(wd)

    def on_queue_overflow(self) -> None:
        self._watch.changed()  # events were dropped: the listing tells what they would have


class DevNodeWatch:
    """Follows the dev root's /dev (and nvidia-caps, once it exists) with inotify read on the loop."""

    name = "the device nodes' watch"
    blocking: BlockingRunsOn = "loop reader"
    without: str | None = "a device node made later is seen only at the next scan"

    def __init__(self, dev_root: Path, publish: Publish) -> None:
        self.dev_dir = dev_root / "dev"
        self.caps_dir = dev_root / CAPS_DIR.lstrip("/")
        self._dev_root = dev_root
        self._publish = publish
        self._handler = _NodeEvents(self)
        self._reader: InotifyReader | None = None
        self._caps_watch: WatchDescriptor | None = None
        self._last: frozenset[str] | None = None

    def start(self) -> None:
        reader = InotifyReader()
        try:
            reader.add_callback(os.fsencode(self.dev_dir), _MASK, self._handler, _DEV)
        except OSError:
            reader.stop()
            raise
        reader.start()
        self._reader = reader
        self._watch_caps()
        self.changed()  # the first listing: from now on the core checks nodes against the watch's
        log.info("watching %s for NVIDIA device nodes", self.dev_dir)

    def changed(self) -> None:
        """On the loop: list again, publish a set that differs from the last one."""
        self._watch_caps()
        present = list_nodes(self._dev_root)
        if present == self._last:
            return
        self._last = present
        log.debug("device nodes changed: %d NVIDIA nodes", len(present))
        self._publish(DeviceNodesChanged(present))

    def watch_ended(self, wd: WatchDescriptor) -> None:
        """The kernel ended a watch (its directory removed, or unmounted): nvidia-caps is watched again
        if it is back, and what is there now is listed."""
        if wd == self._caps_watch:
            self._caps_watch = None
        if self._reader is not None:
            self.changed()

    def _watch_caps(self) -> None:
        """nvidia-caps comes and goes with MIG (nvidia-modprobe makes it): follow it when it does."""
        reader = self._reader
        exists = self.caps_dir.is_dir()
        if reader is None or exists == (self._caps_watch is not None):
            return
        if self._caps_watch is not None:
            old, self._caps_watch = self._caps_watch, None
            with contextlib.suppress(OSError):  # the kernel may have ended it with its directory
                reader.remove_callbacks([(old, _CAPS)])
            return
        try:
            self._caps_watch = reader.add_callback(os.fsencode(self.caps_dir), _MASK, self._handler, _CAPS)
        except OSError as err:
            log.warning("cannot watch %s: %s", self.caps_dir, reason(err))

    async def follow(self, dev_root: Path) -> None:
        """A reload moved flags.nvidiaDevRoot: watch the new root's directories, and publish its nodes."""
        if dev_root == self._dev_root:
            return
        running = self._reader is not None
        await self.stop()
        self.dev_dir, self.caps_dir = dev_root / "dev", dev_root / CAPS_DIR.lstrip("/")
        self._dev_root = dev_root
        self._caps_watch = None
        self._last = None  # the new root's first listing is published, even if it lists the same names
        if not running:
            return
        try:
            self.start()
        except OSError as err:
            log.error("cannot watch %s: %s; %s (until a restart)", self.dev_dir, reason(err), self.without)

    async def stop(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.stop()
