"""inotify on the MPS groups' log directories: a control.log line that reports trouble asks for a probe.

The control daemon writes what goes wrong there (a server's fatal exception, a client refused), and
nothing else tells: a daemon that still runs may no longer serve. Lines are read on watchdog's
observer thread, from where the last read ended; the verdict crosses to the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers.api import ObservedWatch

from nvplug.inotify.inotify_observer import InotifyObserver

log = logging.getLogger("nvplug.mps")

CONTROL_LOG = "control.log"
# What the control daemon's lines say when something failed (lower case).
TROUBLE = ("fatal", "error", "exception", "failed", "valid credentials", "cannot")
MAX_READ = 1 << 20


def trouble_in(lines: list[str]) -> str | None:
    return next((line for line in lines if any(word in line.lower() for word in TROUBLE)), None)


class _LogEvents(FileSystemEventHandler):
    def __init__(self, watch: ControlLogWatch, group: str) -> None:
        self._watch = watch
        self._group = group

    def on_any_event(self, event: FileSystemEvent) -> None:
        written = event.event_type in ("modified", "created", "closed")
        if written and Path(os.fsdecode(event.src_path)).name == CONTROL_LOG:
            self._watch.changed(self._group)


class ControlLogWatch:
    def __init__(self, on_trouble: Callable[[str, str], None]) -> None:
        self._on_trouble = on_trouble
        self._observer: InotifyObserver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watches: dict[str, tuple[ObservedWatch, Path]] = {}
        self._offsets: dict[str, int] = {}
        self._lock = threading.Lock()

    def watch(self, group: str, log_dir: str) -> None:
        """From the loop: follow the group's control.log from its current end."""
        self.unwatch(group)
        if self._observer is None:
            self._loop = asyncio.get_running_loop()
            self._observer = InotifyObserver()
            self._observer.daemon = True
            self._observer.start()
        path = Path(log_dir) / CONTROL_LOG
        with self._lock:
            self._offsets[group] = _size(path)
        try:
            watch = self._observer.schedule(_LogEvents(self, group), log_dir, recursive=False)
        except OSError as err:
            log.warning("cannot watch %s: %s; its daemon's errors are seen when it exits", log_dir, err)
            return
        self._watches[group] = (watch, path)

    def unwatch(self, group: str) -> None:
        found = self._watches.pop(group, None)
        if found is not None and self._observer is not None:
            with contextlib.suppress(KeyError, OSError):
                self._observer.unschedule(found[0])

    def changed(self, group: str) -> None:
        """On the observer's thread: the lines written since the last read."""
        found = self._watches.get(group)
        if found is None:
            return
        with self._lock:
            start = self._offsets.get(group, 0)
            try:
                with found[1].open("rb") as f:
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
        loop = self._loop
        if line is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._on_trouble, group, line.strip())

    async def stop(self) -> None:
        observer, self._observer = self._observer, None
        self._watches.clear()
        if observer is not None:
            observer.stop()
            await asyncio.to_thread(observer.join, 5)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
