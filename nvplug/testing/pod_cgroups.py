"""Real processes in real cgroups named as the kubelet names a pod's containers, and the kubelet's log records
that name them: what a host service sees of a pod's process (its /proc/<pid>/cgroup), without a kubelet.

Each pod lives under a root of its own (the kubelet's --cgroup-root) in one cgroup hierarchy of this
machine, so that nothing of the machine's own cgroups is touched, and all of it goes at `close`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CGROUP_FS = Path("/sys/fs/cgroup")
Driver = Literal["systemd", "cgroupfs"]
Qos = Literal["guaranteed", "burstable", "besteffort"]


class CgroupsUnavailable(Exception):
    """No cgroup hierarchy here takes a new cgroup and a process (not root, a read-only cgroupfs)."""


@dataclass(frozen=True)
class PodProcess:
    namespace: str
    pod: str
    container: str
    pod_uid: str
    container_id: str
    pid: int


def hierarchy() -> Path:
    """A hierarchy this process may make cgroups in: v1's pids (one line of /proc/<pid>/cgroup the kubelet's
    path is in), else the v2 mount. Raises CgroupsUnavailable."""
    candidates = [CGROUP_FS / "pids", CGROUP_FS / "unified", CGROUP_FS]
    for base in candidates:
        if not (base / "cgroup.procs").exists():
            continue
        probe = base / f"nvplug-probe-{secrets.token_hex(4)}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError:
            continue
        return base
    raise CgroupsUnavailable(f"no cgroup hierarchy under {CGROUP_FS} takes a new cgroup here")


class PodCgroups:
    """Pods' processes (`sleep`) under `<hierarchy>/<root>`, and their log records under `log_root`."""

    def __init__(self, log_root: Path, driver: Driver = "cgroupfs", base: Path | None = None) -> None:
        self.base = base if base is not None else hierarchy()
        self.root = self.base / f"nvplug-test-{secrets.token_hex(4)}"  # the kubelet's --cgroup-root
        self.log_root = log_root
        self.driver = driver
        self._procs: list[subprocess.Popen[bytes]] = []
        self.root.mkdir()

    def start(
        self,
        namespace: str,
        pod: str,
        container: str = "main",
        qos: Qos = "besteffort",
        pod_uid: str | None = None,
        pid: int | None = None,
    ) -> PodProcess:
        """A `sleep` in the container's cgroup, and the records naming it; `pod_uid` joins a pod already made,
        and `pid` is the PID it takes (one that has gone: a reused PID)."""
        uid = pod_uid or str(uuidlib.uuid4())
        cid = secrets.token_hex(32)
        directory = self.root / self._path(uid, cid, qos)
        directory.mkdir(parents=True, exist_ok=True)
        proc = _sleep(pid)
        self._procs.append(proc)
        self.move(proc.pid, directory)
        pods = self.log_root / "pods" / f"{namespace}_{pod}_{uid}" / container
        pods.mkdir(parents=True, exist_ok=True)
        (pods / "0.log").touch()
        links = self.log_root / "containers"
        links.mkdir(parents=True, exist_ok=True)
        (links / f"{pod}_{namespace}_{container}-{cid}.log").symlink_to(pods / "0.log")
        return PodProcess(namespace, pod, container, uid, cid, proc.pid)

    def move(self, pid: int, directory: Path) -> None:
        (directory / "cgroup.procs").write_text(f"{pid}\n")

    def cgroup_of(self, process: PodProcess, qos: Qos = "besteffort") -> Path:
        return self.root / self._path(process.pod_uid, process.container_id, qos)

    def _path(self, uid: str, cid: str, qos: Qos) -> Path:
        if self.driver == "cgroupfs":
            return Path("kubepods", *(() if qos == "guaranteed" else (qos,)), f"pod{uid}", cid)
        under = uid.replace("-", "_")
        if qos == "guaranteed":
            return Path("kubepods.slice", f"kubepods-pod{under}.slice", f"cri-containerd-{cid}.scope")
        return Path(
            "kubepods.slice",
            f"kubepods-{qos}.slice",
            f"kubepods-{qos}-pod{under}.slice",
            f"cri-containerd-{cid}.scope",
        )

    def stop(self, process: PodProcess) -> None:
        """End the process: its PID is gone from /proc."""
        for proc in self._procs:
            if proc.pid == process.pid:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        # Deepest first: a cgroup goes only once empty of processes and children.
        for directory in sorted((p for p in self.root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            self.root.rmdir()


def _sleep(pid: int | None) -> subprocess.Popen[bytes]:
    """A `sleep`, with the PID asked for: the kernel gives the one after ns_last_pid, unless another process
    of the machine took it first (then again)."""
    for _ in range(50):
        if pid is not None:
            Path("/proc/sys/kernel/ns_last_pid").write_text(f"{pid - 1}\n")
        proc = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL)
        if pid is None or proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    raise RuntimeError(f"PID {pid} was taken by others 50 times over")
