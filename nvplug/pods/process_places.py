"""Where host processes run: each PID's pod and container, from its `/proc/<pid>/cgroup` and the kubelet's
log records (process_pod.py parses both). File reads: call it off the event loop.

Placing for a scrape from the host's own /proc (`hold`), a process whose cgroup was read is held by a
pidfd while it lives and not read again (a container's processes do not move between cgroups): a scrape
of hundreds of processes reads only the new ones. A process that ends makes its pidfd readable, and each
call first drops those: a PID that has gone, or been reused, is read afresh, never placed in the pod it
once was in. The parse of a cgroup text, and the records' listings while their directories do not change,
are kept too. The records are looked up on every call, so a pod named after its process started is named
from then on.
"""

from __future__ import annotations

import errno
import functools
import os
import resource
import select
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Generic, TypeVar

from nvplug.core.telemetry import HOST, ProcessContainer
from nvplug.pods.process_pod import PodName, ProcessPod, container_names, pod_names, pod_of_cgroup, uids_by_name

T = TypeVar("T")

# The host's procfs: only its PIDs are the kernel's, to be held by a pidfd.
HOST_PROC = Path("/proc")
# Of the open-file soft limit, the share pidfds may take (the rest is the daemon's sockets and files).
HELD_SHARE = 4


def unattributed(where: ProcessContainer | None) -> bool:
    """A process whose cgroup could not be read (it ended), or in a pod the kubelet's records do not name."""
    return where is None or (where.pod_uid != "" and not where.pod)


class ProcessPlaces:
    """`log_root` holds the kubelet's records: `pods/<namespace>_<pod>_<uid>` and
    `containers/<pod>_<namespace>_<container>-<id>.log`."""

    def __init__(self, proc_root: Path = HOST_PROC, log_root: Path = Path("/var/log"), hold: bool = False) -> None:
        """`hold`: for a caller that places the same processes again and again (a scrape), and closes."""
        self.proc_root = proc_root
        self.log_root = log_root
        # The same cgroup texts come back scrape after scrape: each is parsed once.
        self._pod_of_cgroup = functools.lru_cache(maxsize=4096)(pod_of_cgroup)
        self._pod_names = _Listing(pod_names)
        self._container_names = _Listing(container_names)
        held = hold and proc_root == HOST_PROC
        self._held = _Held(resource.getrlimit(resource.RLIMIT_NOFILE)[0] // HELD_SHARE if held else 0)
        self._uids: tuple[Mapping[str, PodName], Mapping[tuple[str, str], str]] | None = None

    def place(self, pids: Iterable[int]) -> dict[int, ProcessContainer | None]:
        """Each PID's container: HOST for a process in no pod; the pod's UID alone (no names) for a pod the
        records do not name; None for a PID whose cgroup cannot be read (it ended, or is not ours to read)."""
        pids = list(pids)
        if not pids:
            return {}
        pods = self._pod_names.read(self.log_root / "pods")
        names = self._container_names.read(self.log_root / "containers")
        out: dict[int, ProcessContainer | None] = {}
        proc = str(self.proc_root)
        held = self._held
        with held.lock:
            held.forget_ended()
            for pid in pids:
                if pid in held.pods:
                    found = held.pods[pid]
                else:
                    pidfd = held.open(pid)  # before the read: what is read is that process's
                    try:
                        text = _read_small(f"{proc}/{pid}/cgroup")
                    except OSError:
                        held.close_fd(pidfd)
                        out[pid] = None
                        continue
                    found = self._pod_of_cgroup(text)
                    held.keep(pid, pidfd, found)
                if found is None:
                    out[pid] = HOST
                    continue
                pod = pods.get(found.uid)
                cid = found.container_id or ""
                if pod is None:
                    out[pid] = ProcessContainer(container=names.get(cid, ""), pod_uid=found.uid, container_id=cid)
                    continue
                out[pid] = ProcessContainer(pod.namespace, pod.name, names.get(cid, ""), found.uid, cid)
        return out

    def uids_by_name(self) -> Mapping[tuple[str, str], str]:
        """Each pod's UID by its namespace and name, as the kubelet's records give them (process_pod.py)."""
        pods = self._pod_names.read(self.log_root / "pods")
        if self._uids is None or self._uids[0] is not pods:  # the listing is the same object while unchanged
            self._uids = (pods, uids_by_name(pods))
        return self._uids[1]

    @property
    def held(self) -> int:
        """Processes held by a pidfd, not read again while they live."""
        return len(self._held.pods)

    def close(self) -> None:
        """Lets go of the processes held; later calls read every PID."""
        with self._held.lock:
            self._held.close()


class _Held:
    """Live processes whose cgroups were read, by PID, each held by a pidfd (pidfd_open(2)) that turns
    readable when its process ends. At most `limit` (0: none, for a /proc that is not the host's)."""

    def __init__(self, limit: int) -> None:
        self.lock = threading.Lock()
        self.pods: dict[int, ProcessPod | None] = {}  # None: in no pod
        self._limit = limit
        self._pids: dict[int, int] = {}  # pidfd -> PID
        self._ended = select.epoll() if limit else None

    def open(self, pid: int) -> int | None:
        if self._ended is None or len(self._pids) >= self._limit:
            return None
        try:
            return os.pidfd_open(pid)
        except OSError as err:
            if err.errno in (errno.ENOSYS, errno.EPERM, errno.EACCES):  # no pidfd here: read every PID
                self.close()
            return None  # ESRCH: it has gone, and its read fails too; EMFILE: read it, hold it later

    def keep(self, pid: int, pidfd: int | None, found: ProcessPod | None) -> None:
        if pidfd is None or self._ended is None:  # none opened, or let go since (then it is closed here)
            self.close_fd(pidfd)
            return
        self._ended.register(pidfd, select.EPOLLIN)
        self._pids[pidfd] = pid
        self.pods[pid] = found

    def forget_ended(self) -> None:
        while self._ended is not None and (ended := self._ended.poll(0)):
            for pidfd, _ in ended:
                del self.pods[self._pids.pop(pidfd)]
                os.close(pidfd)  # an epoll forgets a file once its last descriptor is closed

    @staticmethod
    def close_fd(pidfd: int | None) -> None:
        if pidfd is not None:
            os.close(pidfd)

    def close(self) -> None:
        for pidfd in self._pids:
            os.close(pidfd)
        self._pids.clear()
        self.pods.clear()
        if self._ended is not None:
            self._ended.close()
            self._ended = None


class _Listing(Generic[T]):
    """A directory's entries, parsed, read again only when the directory changed (its mtime): the kubelet's
    log records change when pods come and go, not on every scrape."""

    def __init__(self, parse: Callable[[list[str]], T]) -> None:
        self._parse = parse
        self._kept: tuple[Path, int, T] | None = None

    def read(self, directory: Path) -> T:
        try:
            stamp = directory.stat().st_mtime_ns
        except OSError:
            return self._parse([])
        if self._kept is not None and self._kept[:2] == (directory, stamp):
            return self._kept[2]
        parsed = self._parse(_listing(directory))
        self._kept = (directory, stamp, parsed)
        return parsed


def _read_small(path: str) -> str:
    """A procfs file in one read: hundreds of them a scrape, where Path.read_text's layers cost 5x more."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode(errors="replace")
    finally:
        os.close(fd)


def _listing(directory: Path) -> list[str]:
    """The entries' names (os.listdir: a Path for each of a busy node's thousands costs twice the time)."""
    try:
        return os.listdir(directory)  # noqa: PTH208
    except OSError:
        return []
