"""inotify on the MPS groups' log directories: a control.log line that reports trouble asks for a probe.

The control daemon writes what goes wrong there (a server's fatal exception, a client refused), and
nothing else tells: a daemon that still runs may no longer serve. Lines are read on the loop as the
inotify reader reads, from where the last read ended.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nvplug.inotify.inotify_binding import (
    IN_ATTRIB,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_MODIFY,
    IN_MOVED_TO,
    IN_ONLYDIR,
    InotifyEvent,
    WatchDescriptor,
    reason,
)
from nvplug.inotify.inotify_reader import CallbackId, InotifyReader

log = logging.getLogger("nvplug.mps")

CONTROL_LOG = "control.log"
# What the control daemon's lines say when something failed (lower case).
TROUBLE = ("fatal", "error", "exception", "failed", "valid credentials", "cannot")
MAX_READ = 1 << 20
# control.log written, made, or renamed onto its name.
_WRITTEN = IN_MODIFY | IN_ATTRIB | IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE
_MASK = _WRITTEN | IN_ONLYDIR


def trouble_in(lines: list[str]) -> str | None:
    return next((line for line in lines if any(word in line.lower() for word in TROUBLE)), None)


class _LogEvents:
    """What the inotify reader calls, on the loop, for one group's log directory."""

    def __init__(self, watch: ControlLogWatch, group: str) -> None:
        self._watch = watch
        self._group = group

    def on_event(self, event: InotifyEvent) -> None:
        if event.mask & _WRITTEN and os.fsdecode(event.name) == CONTROL_LOG:
            self._watch.changed(self._group)

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        self._watch.watch_ended(self._group, wd)

    def on_queue_overflow(self) -> None:
        self._watch.changed(self._group)  # events were dropped: the lines since the last read tell


@dataclass(frozen=True, slots=True)
class _Watched:
    wd: WatchDescriptor
    key: CallbackId
    path: Path


class ControlLogWatch:
    def __init__(self, on_trouble: Callable[[str, str], None]) -> None:
        self._on_trouble = on_trouble
        self._reader: InotifyReader | None = None
        self._watches: dict[str, _Watched] = {}
        self._offsets: dict[str, int] = {}
        # Each watch's callback its own id: a group watched again may share its directory's watch.
        self._ids = itertools.count()

    def watch(self, group: str, log_dir: str) -> None:
        """From the loop: follow the group's control.log from its current end."""
        self.unwatch(group)
        path = Path(log_dir) / CONTROL_LOG
        self._offsets[group] = _size(path)
        key = CallbackId(next(self._ids))
        try:
            if self._reader is None:
                reader = InotifyReader()
                reader.start()
                self._reader = reader
            wd = self._reader.add_callback(os.fsencode(log_dir), _MASK, _LogEvents(self, group), key)
        except OSError as err:
            log.warning("cannot watch %s: %s; its daemon's errors are seen when it exits", log_dir, reason(err))
            return
        self._watches[group] = _Watched(wd, key, path)

    def unwatch(self, group: str) -> None:
        found = self._watches.pop(group, None)
        if found is not None and self._reader is not None:
            with contextlib.suppress(OSError):
                self._reader.remove_callbacks([(found.wd, found.key)])

    def changed(self, group: str) -> None:
        """On the loop: the lines written since the last read."""
        found = self._watches.get(group)
        if found is None:
            return
        start = self._offsets.get(group, 0)
        try:
            with found.path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                end = f.tell()
                if end < start:
                    start = 0  # the log was started anew
                f.seek(start)
                data = f.read(min(end - start, MAX_READ))
        except OSError:
            return
        self._offsets[group] = start + len(data)
        line = trouble_in(data.decode(errors="replace").splitlines())
        if line is not None:
            self._on_trouble(group, line.strip())

    def watch_ended(self, group: str, wd: WatchDescriptor) -> None:
        """The kernel ended the watch: the directory went (its daemon's errors are seen when it exits)."""
        found = self._watches.get(group)
        if found is not None and found.wd == wd:
            del self._watches[group]

    async def stop(self) -> None:
        reader, self._reader = self._reader, None
        self._watches.clear()
        if reader is not None:
            reader.stop()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
