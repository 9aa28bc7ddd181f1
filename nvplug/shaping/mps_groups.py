"""MPS groups: the devices one control daemon serves, the defaults it sets, and where its files live.

One group per MPS resource for its whole GPUs (one daemon, CUDA_VISIBLE_DEVICES the GPUs' UUIDs,
as NVIDIA runs one per resource), and one group per MIG device (a daemon selected by its MIG UUID,
which NVIDIA's plugin refuses). Pure: the supervisor starts what these say.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from nvplug.core.gpu import Gpu, MigDevice, uuid_of

# Under the root: one directory per group with these, and one tmpfs for every client's /dev/shm.
PIPE = "pipe"
LOG = "log"
SHM = "shm"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
CONTAINER_SHM = "/dev/shm"
# The groups of DRA claims (nvplug.dra), named after the claim that started them: a resource's
# directory name always holds an underscore for its slash, a MIG UUID starts with MIG-.
CLAIM_GROUP_PREFIX = "claim-"
# MPS needs Volta or newer for isolated address spaces and the thread percentage (mps-facts).
MIN_COMPUTE_CAPABILITY = (7, 0)


@dataclass(frozen=True)
class MpsShare:
    """An MPS resource's limits (nvplug.mps.resources); None: the equal split."""

    replicas: int
    thread_percentage: int | None = None
    pinned_mib: int | None = None


@dataclass(frozen=True)
class MpsGroup:
    name: str  # its directory under the root, unique on the node
    resource: str
    units: tuple[tuple[Gpu, MigDevice | None], ...]
    thread_percentage: int
    # MiB per unit, in `units`' order; None where the unit's memory is unknown (no limit set).
    pinned_mib: tuple[int | None, ...]

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(uuid_of(g, m) for g, m in self.units)

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """The physical GPUs whose compute mode the daemon needs, each once."""
        return tuple({g.uuid: g for g, _ in self.units}.values())

    @property
    def exclusive_gpus(self) -> tuple[Gpu, ...]:
        """The GPUs to put in EXCLUSIVE_PROCESS: whole ones. A GPU in MIG mode takes no compute mode
        (NVML answers NOT_SUPPORTED); its MIG devices' daemons run without one."""
        return tuple(g for g, m in self.units if m is None)

    @property
    def settings(self) -> tuple[object, ...]:
        """What a running daemon was started with: a change of any of it needs a restart."""
        return (self.uuids, self.thread_percentage, self.pinned_mib)

    def pipe_dir(self, root: str) -> str:
        return pipe_dir(root, self.name)

    def log_dir(self, root: str) -> str:
        return str(PurePosixPath(root) / self.name / LOG)

    def pinned_of(self, uuids: Sequence[str]) -> tuple[int | None, ...]:
        """The memory limits of these units, in this order: a container's view of its devices."""
        by_uuid = dict(zip(self.uuids, self.pinned_mib, strict=True))
        return tuple(by_uuid.get(u) for u in uuids)

    def describe(self) -> str:
        return f"MPS group {self.name} ({self.resource}: {', '.join(self.uuids)})"


def pipe_dir(root: str, group: str) -> str:
    return str(PurePosixPath(root) / group / PIPE)


def shm_dir(root: str) -> str:
    return str(PurePosixPath(root) / SHM)


def container_view(pipe_dir: str, root: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """What a client container of a group needs: its env, and (container path, host path) mounts.
    The pipe directory keeps its host path inside, as NVIDIA's plugin does; shm is the node's one tmpfs."""
    return {PIPE_ENV: pipe_dir}, [(pipe_dir, pipe_dir), (CONTAINER_SHM, shm_dir(root))]


def client_limits(thread_percentage: int, pinned_mib: Sequence[int | None]) -> dict[str, str]:
    """The limits as a client's variables, for the devices it sees in this order (index 0 first):
    a client may only lower what its daemon allows."""
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(thread_percentage)}
    pinned = [f"{n}={mib}M" for n, mib in enumerate(pinned_mib) if mib is not None]
    if pinned:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(pinned)
    return env


def groups_of(resource: str, share: MpsShare, units: Sequence[tuple[Gpu, MigDevice | None]]) -> list[MpsGroup]:
    """The groups of one MPS resource's devices: its whole GPUs together, each MIG device alone."""
    Unit = tuple[Gpu, MigDevice | None]
    whole: tuple[Unit, ...] = tuple((g, m) for g, m in units if m is None)
    sets: list[tuple[Unit, ...]] = [whole] if whole else []
    sets += [((g, m),) for g, m in units if m is not None]
    out = []
    for members in sets:
        mig = members[0][1] if members[0][1] is not None else None
        name = _dir_name(mig.uuid if mig is not None else resource)
        percentage = share.thread_percentage or max(1, 100 // share.replicas)
        pinned = tuple(share.pinned_mib or _split(g, m, share.replicas) for g, m in members)
        out.append(MpsGroup(name, resource, members, percentage, pinned))
    return out


def too_old(units: Sequence[tuple[Gpu, MigDevice | None]]) -> str | None:
    """Why these GPUs cannot take MPS limits (older than Volta); None if they can, or it is unknown."""
    for gpu, _ in units:
        cc = gpu.compute_capability
        if cc is not None and cc < MIN_COMPUTE_CAPABILITY:
            return (
                f"{gpu.label} has compute capability {cc[0]}.{cc[1]}; MPS limits need Volta "
                f"({MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]}) or newer"
            )
    return None


def _split(gpu: Gpu, mig: MigDevice | None, replicas: int) -> int | None:
    memory = mig.memory_mib if mig is not None else gpu.memory_mib
    return None if memory is None else max(1, memory // replicas)


def _dir_name(text: str) -> str:
    """A directory name: a resource's `nvidia.com/gpu` as `nvidia.com_gpu`, an old-style MIG UUID's slashes too."""
    return text.replace("/", "_")
