"""Where host processes run: each PID's pod and container, from its `/proc/<pid>/cgroup` and the kubelet's
log records (process_pod.py parses both). File reads: call it off the event loop.

A PID's cgroup is read afresh on every call, so a PID that has gone, or been reused, is never placed in the
pod it once was in; only the parse of a cgroup text, and the records' listings while their directories do
not change, are kept.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Generic, TypeVar

from nvplug.core.telemetry import HOST, ProcessContainer
from nvplug.pods.process_pod import container_names, pod_names, pod_of_cgroup

T = TypeVar("T")


def unattributed(where: ProcessContainer | None) -> bool:
    """A process whose cgroup could not be read (it ended), or in a pod the kubelet's records do not name."""
    return where is None or (where.pod_uid != "" and not where.pod)


class ProcessPlaces:
    """`log_root` holds the kubelet's records: `pods/<namespace>_<pod>_<uid>` and
    `containers/<pod>_<namespace>_<container>-<id>.log`."""

    def __init__(self, proc_root: Path = Path("/proc"), log_root: Path = Path("/var/log")) -> None:
        self.proc_root = proc_root
        self.log_root = log_root
        # The same cgroup texts come back scrape after scrape: each is parsed once.
        self._pod_of_cgroup = functools.lru_cache(maxsize=4096)(pod_of_cgroup)
        self._pod_names = _Listing(pod_names)
        self._container_names = _Listing(container_names)

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
        for pid in pids:
            try:
                text = _read_small(f"{proc}/{pid}/cgroup")
            except OSError:
                out[pid] = None
                continue
            found = self._pod_of_cgroup(text)
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
    try:
        return [entry.name for entry in directory.iterdir()]
    except OSError:
        return []
