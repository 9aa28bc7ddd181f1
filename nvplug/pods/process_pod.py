"""Which pod a host process runs in, from what the kernel and the kubelet leave on the host. Pure.

A process's cgroup path (`/proc/<pid>/cgroup`) holds its pod's UID and its container's ID, in either of
the kubelet's cgroup drivers:
- systemd: `.../kubepods-<qos>-pod<UID, - as _>.slice/<runtime>-<container id>.scope`
  (Guaranteed pods have no qos part: `kubepods-pod<UID>.slice`);
- cgroupfs: `.../kubepods/<qos>/pod<UID>/<container id>` (Guaranteed: `kubepods/pod<UID>/...`).
The pod's namespace and name are in the name of its log directory, `/var/log/pods/<namespace>_<name>_<UID>`
(neither a namespace nor a pod name may hold `_`), and each container's name beside its ID in the link the
kubelet makes to its log, `/var/log/containers/<pod>_<namespace>_<container>-<container ID>.log`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# The cgroup v1 hierarchies whose path is the kubelet's container cgroup, as the kernel names them.
_V1_HIERARCHIES = ("name=systemd", "pids", "memory")
_UID = r"[0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}"
_POD_SEGMENT = re.compile(rf"^(?:kubepods(?:-[a-z]+)?-)?pod(?P<uid>{_UID})(?:\.slice)?$")
_SCOPE = re.compile(r"^(?:[a-z-]+-)?(?P<id>[0-9a-f]{12,64})\.scope$")
_CONTAINER_DIR = re.compile(r"^[0-9a-f]{12,64}$")
_LOG_DIR = re.compile(rf"^(?P<namespace>[^_/]+)_(?P<name>[^_/]+)_(?P<uid>{_UID})$")
_CONTAINER_LOG = re.compile(r"^(?P<pod>[^_/]+)_(?P<namespace>[^_/]+)_(?P<container>[^/]+)-(?P<id>[0-9a-f]{64})\.log$")


@dataclass(frozen=True)
class ProcessPod:
    """A process's pod, by UID; its container's runtime ID where the path has one."""

    uid: str
    container_id: str | None = None


@dataclass(frozen=True)
class PodName:
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_of_cgroup(text: str) -> ProcessPod | None:
    """The pod in a `/proc/<pid>/cgroup` text (v2's `0::` line, or a v1 hierarchy the kubelet places
    containers in); None: the process is in no pod."""
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        v2 = hierarchy == "0" and controllers == ""
        if not v2 and not any(c in _V1_HIERARCHIES for c in controllers.split(",")):
            continue
        found = _pod_in_path(path)
        if found is not None:
            return found
    return None


def _pod_in_path(path: str) -> ProcessPod | None:
    segments = [s for s in path.split("/") if s]
    for i, segment in enumerate(segments):
        matched = _POD_SEGMENT.match(segment)
        if matched is None:
            continue
        uid = matched["uid"].replace("_", "-").lower()
        following = segments[i + 1] if i + 1 < len(segments) else ""
        scope = _SCOPE.match(following)
        if scope is not None:
            return ProcessPod(uid, scope["id"])
        return ProcessPod(uid, following if _CONTAINER_DIR.match(following) else None)
    return None


def pod_names(log_dirs: Iterable[str]) -> Mapping[str, PodName]:
    """Pod UID to namespace and name, from the names of the kubelet's pod log directories."""
    names: dict[str, PodName] = {}
    for entry in log_dirs:
        matched = _LOG_DIR.match(entry)
        if matched is not None:
            names[matched["uid"].lower()] = PodName(matched["namespace"], matched["name"])
    return names


def uids_by_name(names: Mapping[str, PodName]) -> Mapping[tuple[str, str], str]:
    """Pod UID by namespace and name; none for a name two UIDs hold (a pod made again under its name while
    the kubelet still keeps the old one's records): which is which, the records cannot say."""
    found: dict[tuple[str, str], str] = {}
    twice: set[tuple[str, str]] = set()
    for uid, pod in names.items():
        key = (pod.namespace, pod.name)
        if key in found:
            twice.add(key)
        found[key] = uid
    return {key: uid for key, uid in found.items() if key not in twice}


def container_names(log_links: Iterable[str]) -> Mapping[str, str]:
    """Container ID to container name, from the names of the kubelet's links in /var/log/containers."""
    names: dict[str, str] = {}
    for entry in log_links:
        matched = _CONTAINER_LOG.match(entry)
        if matched is not None:
            names[matched["id"]] = matched["container"]
    return names
