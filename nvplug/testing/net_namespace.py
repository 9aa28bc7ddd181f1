"""A network namespace of a simulated node's own, so its udev traffic stays there.

udev's netlink group reaches every process in a network namespace, including a
real nvplug serving real GPUs on the same machine. A simulated node's daemon
therefore runs in a namespace of its own, and the uevents a test or the demo
sends are sent from a socket made in that namespace: nothing from outside
reaches the daemon, and nothing sent to it leaves.

The namespace is held by an open file descriptor, not by a process or a bind
mount, so it ends with the node and leaves nothing behind. Only a thread enters
it (setns works per thread), so the caller's own sockets stay where they were.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = struct.Struct("16sH22x")


class NamespaceUnavailable(OSError):
    """No network namespace could be made here (not root, or the kernel refused)."""


def _libc_call(name: str, *args: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _in_thread(fn: Callable[[], T]) -> T:
    """Run `fn` in a thread of its own and hand back its result or its exception.

    A namespace a thread enters stays with that thread: this one ends with the call.
    """
    outcome: list[T] = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # handed to the caller as it was
            failure.append(exc)

    thread = threading.Thread(target=body, name="netns", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


def _bring_loopback_up() -> None:
    """`ip link set lo up`: a stand-in served on 127.0.0.1 inside the namespace needs it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = bytearray(_IFREQ.pack(b"lo", 0))
        fcntl.ioctl(sock, _SIOCGIFFLAGS, request)
        flags = _IFREQ.unpack(request)[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))


def _new_namespace() -> int:
    try:
        _libc_call("unshare", CLONE_NEWNET)
    except OSError as exc:
        raise NamespaceUnavailable(exc.errno, f"cannot make a network namespace: {exc.strerror}") from exc
    fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _bring_loopback_up()
    except OSError:
        os.close(fd)
        raise
    return fd


class NetNamespace:
    """A fresh network namespace with its loopback up, or a process's (`of_process`). Needs root."""

    def __init__(self, fd: int | None = None) -> None:
        self._fd = _in_thread(_new_namespace) if fd is None else fd

    @classmethod
    def of_process(cls, pid: int) -> NetNamespace:
        """The namespace `pid` runs in (a container's), held open for as long as this object is."""
        return cls(os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC))

    def run(self, fn: Callable[[], T]) -> T:
        """Call `fn` in a thread inside the namespace: the sockets it makes belong to it."""

        def entered() -> T:
            _libc_call("setns", self._fd, CLONE_NEWNET)
            return fn()

        return _in_thread(entered)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace: nsenter joins it and execs, so the pid stays the program's."""
        if self._fd < 0:
            raise ValueError("the network namespace is closed")
        return ["nsenter", f"--net=/proc/{os.getpid()}/fd/{self._fd}", "--", *argv]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> NetNamespace:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@functools.cache
def user_namespaces() -> bool:
    """Whether this user can make a user namespace with a network namespace in it."""
    try:
        probe = subprocess.run(
            ["unshare", "--user", "--map-current-user", "--net", "true"], capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def isolated(argv: Sequence[str], netns: NetNamespace | None) -> list[str]:
    """`argv` in a network namespace of its own: `netns` when there is one (root), else a new user
    namespace's where the kernel allows it; as it is only where neither can be had."""
    if netns is not None:
        return netns.command(argv)
    if user_namespaces():
        return ["unshare", "--user", "--map-current-user", "--net", "--", *argv]
    return list(argv)
