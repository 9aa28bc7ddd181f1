"""inotify on the kubelet's directories: a new kubelet.sock, our own socket gone (in the device-plugin
directory, or in the directories of the DRA plugin's sockets), and each of those directories gone or back.

A node re-join or a kubelet reinstall may wipe /var/lib/kubelet and make it again. A watched directory
that goes has its watch moved to the nearest parent that exists, and back down as the missing part is
made again, however many levels at once (`mkdir -p`); the sockets are served again from the events
(`WatchedDirChanged`). Nothing polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.events import DirCreatedEvent, DirDeletedEvent, DirMovedEvent, FileSystemEvent, FileSystemEventHandler
from watchdog.observers.api import ObservedWatch

from nvplug.core.events import Event, KubeletSocketCreated, PluginSocketRemoved, WatchedDirChanged
from nvplug.edges.edge_protocols import BlockingRunsOn, Publish
from nvplug.protos import KUBELET_SOCKET
from nvplug.sources.inotify_observer import InotifyObserver

# The name it had before the layout by role: it is part of every log line.
log = logging.getLogger("nvplug.events.kubelet_dir")

# Told on the observer's thread: a followed directory, and whether it exists now.
DirChange = Callable[[Path, bool], None]
# How often a settle looks again when the directory it is about to watch keeps vanishing under it.
_SETTLE_TRIES = 64


class _KubeletDirEvents(FileSystemEventHandler):
    """What happens inside a watched directory: kubelet.sock made, one of our sockets removed."""

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


def nearest_existing(directory: Path) -> Path:
    """The directory itself if it exists, else its nearest parent that does (/ always does)."""
    while not directory.is_dir() and directory != directory.parent:
        directory = directory.parent
    return directory


@dataclass(eq=False)
class _Followed:
    """One followed directory: the watches kept for it now, and what was last said of it."""

    target: Path
    # Ours to make again once its parent is made again: nobody else does (the DRA plugin's own directory).
    make: bool
    # The deepest directory of the target's path that exists: the target itself, or a parent.
    watched: Path | None = None
    # Its watch, and its parent's: a directory removed while a socket in it is still bound (a kubelet
    # still serving) is only freed, and tells its own deletion, once that socket closes; its parent
    # tells the removal (or a rename) at once.
    watches: dict[Path, ObservedWatch] = field(default_factory=dict)
    exists: bool = True
    handler: FileSystemEventHandler = field(default_factory=FileSystemEventHandler)


class _FollowEvents(FileSystemEventHandler):
    """The events of the directories watched for one followed directory."""

    def __init__(self, follower: DirFollower, followed: _Followed) -> None:
        self._follower = follower
        self._followed = followed

    def dispatch(self, event: FileSystemEvent) -> None:
        self._follower.seen(self._followed, event)


class _Recheck(DirCreatedEvent):
    """Not from inotify: asks the dispatch thread to look at a followed directory's path again."""


class DirFollower:
    """Keeps inotify watches per followed directory: on the directory while it exists, else on its
    nearest existing parent, moved back down when the missing part is made again (and on the parent
    of whichever it is, which tells its removal at once).

    All its work after `start()` runs on the observer's one dispatch thread, so it needs no lock of
    its own (a lock beside the observer's would be taken in the opposite order by the loop's thread).
    """

    def __init__(self, inside: FileSystemEventHandler, changed: DirChange) -> None:
        self._observer = InotifyObserver()
        self._observer.daemon = True
        self._inside = inside
        self._changed = changed
        self._followed: dict[Path, _Followed] = {}
        # The last removal handled: every handler of its watch gets the same event.
        self._last_lost: FileSystemEvent | None = None

    def follow(self, directory: Path, *, make: bool = False) -> None:
        """Follow `directory` (before `start`); `make`: make it again when its parent is made again."""
        if directory in self._followed:
            return
        followed = _Followed(directory, make)
        followed.handler = _FollowEvents(self, followed)
        self._followed[directory] = followed
        found = nearest_existing(directory)
        # Emitters start with the observer: a directory that vanishes meanwhile is looked at again then.
        for path in dict.fromkeys((found, found.parent)):
            followed.watches[path] = self._observer.schedule(followed.handler, str(path), recursive=False)
        followed.watched, followed.exists = found, found == directory
        if not followed.exists:
            log.warning("%s does not exist: watching %s until it is made", directory, found)

    def start(self) -> None:
        self._observer.start()
        # Something made between the look in follow() and the watch shows now, as no event would.
        for followed in self._followed.values():
            if followed.watched is not None and followed.watched in followed.watches:
                recheck = _Recheck(str(followed.watched))
                self._observer.event_queue.put((recheck, followed.watches[followed.watched]))

    def stop(self) -> None:
        self._observer.stop()

    def join(self, timeout: float) -> None:
        self._observer.join(timeout)

    def exists(self, directory: Path) -> bool:
        """Whether the followed directory exists, as last said."""
        return self._followed[directory].exists

    def watching(self, directory: Path) -> Path | None:
        """The directory watched for a followed one: itself, or its nearest existing parent."""
        return self._followed[directory].watched

    # On the observer's thread.

    def seen(self, followed: _Followed, event: FileSystemEvent) -> None:
        src = Path(os.fsdecode(event.src_path))
        dest = Path(os.fsdecode(event.dest_path)) if event.dest_path else None
        watched = followed.watched
        if isinstance(event, _Recheck):
            self._settle(followed)
        elif watched is not None and (
            (isinstance(event, (DirDeletedEvent, DirMovedEvent)) and src == watched)
            or (isinstance(event, DirMovedEvent) and dest == watched)
        ):
            # Removed (told by its parent, or by its own watch once freed), renamed away, or replaced.
            if event is not self._last_lost:
                self._last_lost = event
                self._lost(watched)
        elif watched == followed.target and followed.target in (src.parent, dest.parent if dest else None):
            self._inside.dispatch(event)
        elif isinstance(event, (DirCreatedEvent, DirMovedEvent)) and watched is not None:
            made = dest or src
            if (made == followed.target or made in followed.target.parents) and watched in made.parents:
                self._settle(followed)

    def _lost(self, path: Path) -> None:
        """`path` went: its watch off the observer for everyone who used it, then each settles anew."""
        users = [f for f in self._followed.values() if path in f.watches]
        watch = None
        for followed in users:
            watch = followed.watches.pop(path)
        if watch is not None:
            with contextlib.suppress(KeyError, OSError):  # its emitter may have ended with the directory
                self._observer.unschedule(watch)
        for followed in users:
            self._settle(followed)

    def _settle(self, followed: _Followed) -> None:
        """Watch the deepest directory of the target's path that exists (and its parent), then say
        whether the target exists."""
        before = followed.watched
        had = followed.target in followed.watches
        for _ in range(_SETTLE_TRIES):
            found = nearest_existing(followed.target)
            if followed.make and found == followed.target.parent and before is not None and before in found.parents:
                # Its parent is being made again (rm -rf removes bottom up, so this is no removal under way).
                try:
                    followed.target.mkdir(exist_ok=True)
                    found = followed.target
                    log.info("made %s again", followed.target)
                except OSError as err:
                    log.warning("cannot make %s again: %s", followed.target, err)
            wanted = dict.fromkeys((found, found.parent))
            if followed.watched == found and all(p in followed.watches for p in wanted):
                break
            try:
                self._watch(followed, wanted)
            except OSError as err:
                if all(p.is_dir() for p in wanted):
                    # Not a directory gone meanwhile (the inotify watch limit, say): said, not retried.
                    log.error("cannot watch %s for %s: %s", found, followed.target, err)
                    break
                continue  # gone again before the watch was on: look again
            followed.watched = found
            # Looked at again once the new watches are on: `mkdir -p` is quicker than a new watch.
        exists = followed.watched == followed.target and followed.target in followed.watches
        # Also when it was removed and made again before this look: its sockets went with the old one.
        came_back = exists and not had
        if exists != followed.exists or came_back:
            followed.exists = exists
            if exists:
                log.info("%s is back: watching it again", followed.target)
            else:
                log.warning("%s was removed: watching %s until it is made again", followed.target, followed.watched)
            self._changed(followed.target, exists)

    def _watch(self, followed: _Followed, wanted: dict[Path, None]) -> None:
        """The watches of `followed` onto `wanted`: the new ones first, so that nothing made meanwhile is
        missed, then the old ones off (each once no other followed directory uses it)."""
        for path in wanted:
            if path not in followed.watches:
                followed.watches[path] = self._observer.schedule(followed.handler, str(path), recursive=False)
        for path in [p for p in followed.watches if p not in wanted]:
            watch = followed.watches.pop(path)
            shared = any(path in f.watches for f in self._followed.values())
            with contextlib.suppress(KeyError, OSError):  # its emitter ended with the directory
                if shared:
                    self._observer.remove_handler_for_watch(followed.handler, watch)
                else:
                    self._observer.unschedule(watch)


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
        self._emit = emit
        self._handler = _KubeletDirEvents(str(plugin_dir / KUBELET_SOCKET), own_sockets, emit)
        self._follower: DirFollower | None = None

    def start(self) -> None:
        follower = DirFollower(self._handler, self._dir_changed)
        follower.follow(self.plugin_dir)
        for directory in self.more_dirs:
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                # Whoever needs the directory says why it cannot be used; the device plugin goes on.
                log.warning("cannot make %s: %s", directory, err)
            # nvplug makes these at start, so it makes them again after a wipe (once their parent is back).
            follower.follow(directory, make=True)
        follower.start()
        self._follower = follower
        log.info("watching %s for the kubelet's socket", self.plugin_dir)

    def set_own(self, own_sockets: Iterable[Path]) -> None:
        """Our sockets changed (a reload); swapped whole, so the observer thread sees one or the other."""
        self._handler.own = frozenset(str(p) for p in own_sockets)

    def _dir_changed(self, directory: Path, exists: bool) -> None:
        self._emit(WatchedDirChanged(str(directory), exists))

    async def stop(self) -> None:
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.stop()
            # Off the loop: the observer may be inside an inotify read.
            await asyncio.to_thread(follower.join, 5)
