"""Linux inotify through libc (ctypes): the three calls, the mask bits, and the kernel's event records.

Our own, small and fixed by the kernel's ABI (inotify(7)): nothing here depends on a library's private
internals, which change between its major versions.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, NewType

WatchDescriptor = NewType("WatchDescriptor", int)

# Events (inotify_add_watch's mask, and an event's).
IN_ACCESS: Final = 0x00000001
IN_MODIFY: Final = 0x00000002
IN_ATTRIB: Final = 0x00000004
IN_CLOSE_WRITE: Final = 0x00000008
IN_CLOSE_NOWRITE: Final = 0x00000010
IN_OPEN: Final = 0x00000020
IN_MOVED_FROM: Final = 0x00000040
IN_MOVED_TO: Final = 0x00000080
IN_CREATE: Final = 0x00000100
IN_DELETE: Final = 0x00000200
IN_DELETE_SELF: Final = 0x00000400
IN_MOVE_SELF: Final = 0x00000800
# Only in an event's mask: told by the kernel whatever the watch asked for.
IN_UNMOUNT: Final = 0x00002000
IN_Q_OVERFLOW: Final = 0x00004000
IN_IGNORED: Final = 0x00008000
IN_ISDIR: Final = 0x40000000
# Only in inotify_add_watch's mask: how the watch is made.
IN_ONLYDIR: Final = 0x01000000
IN_DONT_FOLLOW: Final = 0x02000000
IN_EXCL_UNLINK: Final = 0x04000000
IN_MASK_ADD: Final = 0x20000000
IN_ONESHOT: Final = 0x80000000

# struct inotify_event: wd, mask, cookie, len, then `len` bytes of name padded with NULs.
_HEADER = struct.Struct("iIII")

# The running process's own symbols: libc's, on any Linux libc (glibc, musl).
_libc = ctypes.CDLL(None, use_errno=True)
_init1 = _libc.inotify_init1
_init1.argtypes = [ctypes.c_int]
_init1.restype = ctypes.c_int
_add_watch = _libc.inotify_add_watch
_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_add_watch.restype = ctypes.c_int
_rm_watch = _libc.inotify_rm_watch
_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
_rm_watch.restype = ctypes.c_int


@dataclass(frozen=True, slots=True)
class InotifyEvent:
    """One record of an inotify read. `name`: the entry's, for an event in a watched directory; empty
    for the directory itself and for the kernel's records (its overflow: wd -1)."""

    wd: WatchDescriptor
    mask: int
    cookie: int
    name: bytes

    @property
    def is_create(self) -> bool:
        return bool(self.mask & IN_CREATE)

    @property
    def is_delete(self) -> bool:
        return bool(self.mask & IN_DELETE)

    @property
    def is_moved_from(self) -> bool:
        return bool(self.mask & IN_MOVED_FROM)

    @property
    def is_moved_to(self) -> bool:
        return bool(self.mask & IN_MOVED_TO)

    @property
    def is_modify(self) -> bool:
        return bool(self.mask & IN_MODIFY)

    @property
    def is_attrib(self) -> bool:
        return bool(self.mask & IN_ATTRIB)

    @property
    def is_close_write(self) -> bool:
        return bool(self.mask & IN_CLOSE_WRITE)

    @property
    def is_delete_self(self) -> bool:
        return bool(self.mask & IN_DELETE_SELF)

    @property
    def is_move_self(self) -> bool:
        return bool(self.mask & IN_MOVE_SELF)

    @property
    def is_ignored(self) -> bool:
        """The watch is gone: its inode freed, its filesystem unmounted, or inotify_rm_watch."""
        return bool(self.mask & IN_IGNORED)

    @property
    def is_queue_overflow(self) -> bool:
        return bool(self.mask & IN_Q_OVERFLOW)

    @property
    def is_directory(self) -> bool:
        return bool(self.mask & IN_ISDIR)


def parse(data: bytes) -> Iterator[InotifyEvent]:
    """The events of one read, in order (the kernel never splits one across reads)."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        wd, mask, cookie, length = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        name = data[start : start + length].rstrip(b"\0")
        offset = start + length
        yield InotifyEvent(WatchDescriptor(wd), mask, cookie, name)


def inotify_init() -> int:
    """A new inotify instance: its descriptor, non-blocking and closed on exec."""
    fd: int = _init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        raise _error("cannot make an inotify instance")
    return fd


def inotify_add_watch(fd: int, path: bytes, mask: int) -> WatchDescriptor:
    """The watch on `path` (the one it has already, if any: inotify keeps one per inode, with the last mask)."""
    wd: int = _add_watch(fd, path, mask)
    if wd < 0:
        raise _error(f"cannot watch {os.fsdecode(path)}")
    return WatchDescriptor(wd)


def inotify_rm_watch(fd: int, wd: WatchDescriptor) -> None:
    """The watch off; one the kernel ended already (EINVAL) is no error."""
    if _rm_watch(fd, wd) < 0:
        code = ctypes.get_errno()
        if code != errno.EINVAL:
            raise OSError(code, f"cannot remove inotify watch {wd}: {os.strerror(code)}")


def _error(what: str) -> OSError:
    code = ctypes.get_errno()
    # OSError picks the subclass from the code: FileNotFoundError, PermissionError, ...
    return OSError(code, f"{what}: {os.strerror(code)}")


def reason(err: OSError) -> str:
    """What a call's error says, without the path: for a log line that names the path itself."""
    return os.strerror(err.errno) if err.errno else str(err)
