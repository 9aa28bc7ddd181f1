"""inotify on the kubelet's directories: a new kubelet.sock, our own socket gone (in the device-plugin
directory, or in the directories of the DRA plugin's sockets), and each of those directories gone or back.

A node re-join or a kubelet reinstall may wipe /var/lib/kubelet and make it again. A watched directory
that goes has its watch moved to the nearest parent that exists, and back down as the missing part is
made again, however many levels at once (`mkdir -p`); the sockets are served again from the events
(`WatchedDirChanged`). Nothing polls.

The inotify descriptor is read on the event loop (`InotifyReader`, a loop reader), which runs this
module's work as it reads each event: no thread in between, whose hand-off to the loop was on the way from
a new kubelet.sock (or our socket gone) to the Register (`bench/dir_watch.py`, `bench/compare.py --bare`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from nvplug.core.events import Event, KubeletSocketCreated, PluginSocketRemoved, WatchedDirChanged
from nvplug.edges.edge_protocols import BlockingRunsOn, Publish
from nvplug.inotify.inotify_binding import (
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_DONT_FOLLOW,
    IN_EXCL_UNLINK,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_ONLYDIR,
    InotifyEvent,
    WatchDescriptor,
)
from nvplug.inotify.inotify_reader import CallbackId, InotifyReader
from nvplug.protos import KUBELET_SOCKET

log = logging.getLogger(__name__)

# Told on the loop, as the inotify reader reads: a followed directory, and whether it exists now.
DirChange = Callable[[Path, bool], None]
# How often a settle looks again when the directory it is about to watch keeps vanishing under it.
_SETTLE_TRIES = 64
# One mask for every watch: inotify keeps one per directory, and a second watch's would replace the first's.
_MASK = (
    IN_CREATE
    | IN_DELETE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
    | IN_DONT_FOLLOW
    | IN_EXCL_UNLINK
)


class DirEvents(Protocol):
    """What is told of the entries of a followed directory that exists."""

    # A rename onto a path comes as its making, a rename away as its removal.
    def made(self, path: Path) -> None: ...

    def removed(self, path: Path) -> None: ...

    def overflowed(self, directory: Path) -> None:
        """inotify dropped events: what they would have told must be looked at in `directory`."""


class _KubeletDirEvents:
    """What happens inside a watched directory: kubelet.sock made, one of our sockets removed."""

    def __init__(self, kubelet_socket: str, own: Iterable[Path], emit: Callable[[Event], None]) -> None:
        self._kubelet_socket = kubelet_socket
        self.own = frozenset(str(p) for p in own)
        self._emit = emit

    def made(self, path: Path) -> None:
        if str(path) == self._kubelet_socket:
            self._emit(KubeletSocketCreated())

    def removed(self, path: Path) -> None:
        if str(path) in self.own:
            self._emit(PluginSocketRemoved(str(path)))

    def overflowed(self, directory: Path) -> None:
        # Told again from what is there: a Register goes only to a kubelet.sock not registered with yet,
        # and a socket of ours is rebound only if it is missing.
        kubelet_socket = Path(self._kubelet_socket)
        if kubelet_socket.parent == directory and kubelet_socket.exists():
            self._emit(KubeletSocketCreated())
        for path in sorted(self.own):
            if Path(path).parent == directory and not Path(path).exists():
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
    watches: dict[Path, WatchDescriptor] = field(default_factory=dict)
    exists: bool = True
    # What the inotify reader calls for its watches, and that callback's name on a watch it shares.
    told: _Told | None = None

    @property
    def key(self) -> CallbackId:
        return CallbackId(id(self))


class _Told:
    """The inotify reader's calls for one followed directory's watches."""

    def __init__(self, follower: DirFollower, followed: _Followed) -> None:
        self._follower = follower
        self._followed = followed

    def on_event(self, event: InotifyEvent) -> None:
        self._follower.told(self._followed, event)

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        self._follower.watch_ended(self._followed, wd)

    def on_queue_overflow(self) -> None:
        self._follower.overflowed(self._followed)


class DirFollower:
    """Keeps inotify watches per followed directory: on the directory while it exists, else on its
    nearest existing parent, moved back down when the missing part is made again (and on the parent
    of whichever it is, which tells its removal at once).

    Its work runs on the loop: at start, and as the inotify reader reads each event.
    """

    def __init__(self, inside: DirEvents, changed: DirChange) -> None:
        self._inotify = InotifyReader()
        self._inside = inside
        self._changed = changed
        self._followed: dict[Path, _Followed] = {}
        # Each watch's directory, as it was when watched: a moved one is lost, and watched anew.
        self._paths: dict[WatchDescriptor, Path] = {}
        # The last removal handled: every followed directory on its watch is told the same event.
        self._last_lost: InotifyEvent | None = None
        # Set at stop: the reader may still hand over events read before, to watches that are gone.
        self._stopped = False

    def follow(self, directory: Path, *, make: bool = False) -> None:
        """Follow `directory` (before `start`); `make`: make it again when its parent is made again."""
        if directory in self._followed:
            return
        followed = _Followed(directory, make)
        followed.told = _Told(self, followed)
        self._followed[directory] = followed
        found = nearest_existing(directory)
        self._watch(followed, dict.fromkeys((found, found.parent)))
        followed.watched, followed.exists = found, found == directory
        if not followed.exists:
            log.warning("%s does not exist: watching %s until it is made", directory, found)

    def start(self) -> None:
        self._inotify.start()
        # Something made or removed between the look in follow() and the watch shows now, as no event would.
        for followed in self._followed.values():
            self._settle(followed)

    def stop(self) -> None:
        self._stopped = True
        self._inotify.stop()

    def exists(self, directory: Path) -> bool:
        """Whether the followed directory exists, as last said."""
        return self._followed[directory].exists

    def watching(self, directory: Path) -> Path | None:
        """The directory watched for a followed one: itself, or its nearest existing parent."""
        return self._followed[directory].watched

    # On the loop, as the inotify reader reads.

    def told(self, followed: _Followed, event: InotifyEvent) -> None:
        at = self._paths.get(event.wd)
        if self._stopped or at is None or at not in followed.watches:
            return  # a watch taken off since the kernel queued the event
        # The watched directory itself gone or renamed away, or an entry in it.
        self_event = event.is_delete_self or event.is_move_self
        path = at if self_event else at / os.fsdecode(event.name)
        gone = self_event or event.is_delete or event.is_moved_from
        made = event.is_create or event.is_moved_to
        watched = followed.watched
        if watched is not None and path == watched and event.is_directory and (gone or event.is_moved_to):
            # Removed (told by its parent, or by its own watch once freed), renamed away, or replaced.
            if event is not self._last_lost:
                self._last_lost = event
                self._lost(watched)
        elif watched == followed.target and path.parent == followed.target and (gone or made):
            if made:
                self._inside.made(path)
            else:
                self._inside.removed(path)
        elif (
            made
            and event.is_directory
            and watched in path.parents
            and (path == followed.target or path in followed.target.parents)
        ):
            self._settle(followed)

    def watch_ended(self, followed: _Followed, wd: WatchDescriptor) -> None:
        """The kernel ended a watch: its directory was freed (the removal came as an event before, and is
        handled) or its filesystem unmounted (no event says so): looked at again either way."""
        for path in [p for p, w in followed.watches.items() if w == wd]:
            del followed.watches[path]
        self._forget(wd)
        if not self._stopped:
            self._settle(followed)

    def overflowed(self, followed: _Followed) -> None:
        """The kernel's queue overflowed and events were dropped: everything is looked at again."""
        if self._stopped:
            return
        log.warning("inotify dropped events: looking at %s again", followed.target)
        self._settle(followed)
        if followed.exists:
            self._inside.overflowed(followed.target)

    def _lost(self, path: Path) -> None:
        """`path` went: its watch off for everyone who used it, then each settles anew."""
        users = [f for f in self._followed.values() if path in f.watches]
        for followed in users:
            self._unwatch(followed, path)
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
        missed, then the old ones off (each watch stays while another followed directory uses it)."""
        for path in wanted:
            if path not in followed.watches:
                assert followed.told is not None
                wd = self._inotify.add_callback(os.fsencode(path), _MASK, followed.told, followed.key)
                followed.watches[path] = wd
                self._paths[wd] = path
        for path in [p for p in followed.watches if p not in wanted]:
            self._unwatch(followed, path)

    def _unwatch(self, followed: _Followed, path: Path) -> None:
        wd = followed.watches.pop(path)
        with contextlib.suppress(OSError):  # the kernel may have ended it with its directory
            self._inotify.remove_callbacks([(wd, followed.key)])
        self._forget(wd)

    def _forget(self, wd: WatchDescriptor) -> None:
        if not any(wd in f.watches.values() for f in self._followed.values()):
            self._paths.pop(wd, None)


class KubeletDirWatch:
    """Follows the kubelet's directories with inotify read on the loop, and hands events to the bus."""

    name = "the kubelet directories' watch"
    blocking: BlockingRunsOn = "loop reader"
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
        """Our sockets changed (a reload)."""
        self._handler.own = frozenset(str(p) for p in own_sockets)

    def _dir_changed(self, directory: Path, exists: bool) -> None:
        self._emit(WatchedDirChanged(str(directory), exists))

    async def stop(self) -> None:
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.stop()
