"""What the plugin advertises: the inventory mapped to device IDs per resource name."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import chain
from typing import NamedTuple

from .config import Config, ConfigError, Devices
from .gpu import NO_NUMA_NODE, Gpu, MigDevice, uuid_of
from .health import HealthState
from .mig import CapMinors
from .state import Snapshot
from .topology import Topology

GPU_RESOURCE = "nvidia.com/gpu"
# Time-sliced replicas are advertised as <uuid>::<n>, as NVIDIA's plugin does.
REPLICA_SEPARATOR = "::"


class Device(NamedTuple):
    """One advertised device ID and the GPU behind it. A named tuple: a GPU's replicas are made anew on
    each of its health changes, thousands at a time, and a tuple is made in half a dataclass's time."""

    id: str
    gpu: Gpu
    health: HealthState
    replica: int | None = None
    mig: MigDevice | None = None

    @property
    def numa_node(self) -> int | None:
        return None if self.gpu.numa_node == NO_NUMA_NODE else self.gpu.numa_node


@dataclass(frozen=True)
class Resource:
    """Projected once per state revision (the servers cache it): every request looks devices up by ID."""

    name: str
    devices: tuple[Device, ...] = ()
    topology: Topology = field(default_factory=Topology)
    # Time-slicing: each GPU offered this many times; optionally one replica per request.
    replicas: int = 1
    fail_requests_greater_than_one: bool = False
    # For MIG devices: the /dev/nvidia-caps minors of their instances.
    cap_minors: CapMinors = field(default_factory=CapMinors)
    # The devices in blocks, one per GPU (its replicas) where the projection made them so: a block
    # whose GPU and health did not change is the same tuple in the next revision's projection.
    blocks: tuple[tuple[Device, ...], ...] = field(default=(), repr=False, compare=False)
    # True when every block's devices share one health (one GPU's replicas).
    uniform_blocks: bool = field(default=False, repr=False, compare=False)
    _by_id: Mapping[str, Device] = field(default_factory=dict, repr=False, compare=False)
    # Each ID's position in `devices` (GPU index, then replica): sorting by it needs no Python key.
    _rank: Mapping[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.blocks:
            object.__setattr__(self, "blocks", (self.devices,))
        if not self._by_id:
            object.__setattr__(self, "_by_id", {d.id: d for d in self.devices})
        if not self._rank:
            object.__setattr__(self, "_rank", {d.id: n for n, d in enumerate(self.devices)})

    def get(self, device_id: str) -> Device | None:
        return self._by_id.get(device_id)

    def known(self, device_ids: Iterable[str]) -> set[str]:
        """The IDs among these that this resource advertises (a set operation in C, not a loop)."""
        return self._by_id.keys() & set(device_ids)

    def rank(self, device_id: str) -> int:
        return self._rank[device_id]

    @cached_property
    def units(self) -> tuple[tuple[Gpu, MigDevice | None], ...]:
        """The GPUs and MIG devices behind the devices, each once (replicas folded)."""
        if self.uniform_blocks:  # a block is one GPU's replicas
            return tuple((b[0].gpu, b[0].mig) for b in self.blocks if b)
        return tuple({uuid_of(d.gpu, d.mig): (d.gpu, d.mig) for d in self.devices}.values())

    @property
    def shared(self) -> bool:
        return self.replicas > 1

    @cached_property
    def healthy_count(self) -> int:
        if self.uniform_blocks:
            # Each block is one GPU's replicas, with its GPU's health: count blocks, not devices.
            return sum(len(b) for b in self.blocks if b and b[0].health.healthy)
        return sum(1 for d in self.devices if d.health.healthy)


def _every_gpu(gpu: Gpu) -> bool:
    return True


@dataclass(frozen=True)
class ResourceSpec:
    """One advertised resource: a name, which GPUs, and how many times each (time-slicing)."""

    name: str = GPU_RESOURCE
    replicas: int = 1
    select: Callable[[Gpu], bool] = field(default=_every_gpu, compare=False)
    fail_requests_greater_than_one: bool = False
    # Which of the selected GPUs are replicated; the others are offered whole.
    shared: Callable[[Gpu], bool] = field(default=_every_gpu, compare=False)
    # What `select` and `shared` were made from, so that two specs compare by it.
    selection: str = "all"

    def project(self, snapshot: Snapshot, previous: Resource | None = None) -> Resource:
        """Unshared GPUs by UUID; replicas as <uuid>::<n>, each with its GPU's health; index order.

        With the previous revision's projection, a GPU whose facts and health did not change keeps
        its block of devices: a health change costs the changed GPU's replicas, not every device.
        """
        kept = {b[0].gpu.uuid: b for b in previous.blocks if b} if previous is not None else {}
        blocks: list[tuple[Device, ...]] = []
        for g in snapshot.gpus:
            if g.uuid not in snapshot.health or not self.select(g):
                continue
            health = snapshot.health[g.uuid]
            old = kept.get(g.uuid)
            if old is not None and old[0].gpu == g and old[0].health == health:
                blocks.append(old)
            elif self.replicas > 1 and self.shared(g):
                blocks.append(
                    tuple(Device(f"{g.uuid}{REPLICA_SEPARATOR}{n}", g, health, replica=n) for n in range(self.replicas))
                )
            else:
                blocks.append((Device(g.uuid, g, health),))
        devices = tuple(chain.from_iterable(blocks))
        by_id: Mapping[str, Device] = {}
        rank: Mapping[str, int] = {}
        if previous is not None and _same_layout(blocks, previous.blocks):
            # The same IDs in the same order: patch the lookup where blocks changed; the ranks stand.
            patched = dict(previous._by_id)
            for b in blocks:
                if kept[b[0].gpu.uuid] is not b:
                    patched.update((d.id, d) for d in b)
            by_id, rank = patched, previous._rank
        return Resource(
            self.name,
            devices,
            snapshot.topology,
            self.replicas,
            self.fail_requests_greater_than_one,
            blocks=tuple(blocks),
            uniform_blocks=True,
            _by_id=by_id,
            _rank=rank,
        )


@dataclass(frozen=True)
class MigSpec:
    """The MIG devices of one profile, on every GPU in MIG mode."""

    name: str
    profile: str

    def project(self, snapshot: Snapshot, previous: Resource | None = None) -> Resource:
        devices = []
        for g in snapshot.gpus:
            parent = snapshot.health.get(g.uuid)
            if parent is None:
                continue
            for m in g.mig:
                own = snapshot.health.get(m.uuid)
                if m.profile == self.profile and own is not None:
                    # A fault of the whole GPU is a fault of each of its MIG devices.
                    devices.append(Device(m.uuid, g, own if parent.healthy else parent, mig=m))
        return Resource(self.name, tuple(devices), snapshot.topology, cap_minors=snapshot.cap_minors)


Spec = ResourceSpec | MigSpec


def _same_layout(blocks: Iterable[tuple[Device, ...]], before: Iterable[tuple[Device, ...]]) -> bool:
    """Blocks of the same GPUs, in the same order, of the same sizes: the same device IDs."""
    return [(b[0].gpu.uuid, len(b)) for b in blocks if b] == [(b[0].gpu.uuid, len(b)) for b in before if b]


def mig_plan(cfg: Config, snapshot: Snapshot) -> tuple[list[Spec], str | None]:
    """flags.migStrategy over the GPUs present: the specs to serve, or none and the reason why."""
    strategy = cfg.flags.mig_strategy
    whole = resource_specs(cfg)
    if strategy == "none":
        return list(whole), None
    on = [g for g in snapshot.gpus if g.mig_enabled]
    profiles = sorted({m.profile for g in on for m in g.mig})
    if strategy == "single":
        if not on:
            return list(whole), None
        off = [g.label for g in snapshot.gpus if not g.mig_enabled]
        if off or len(profiles) != 1:
            why = f"GPUs without MIG: {off}" if off else f"MIG profiles {profiles}"
            return [], f"migStrategy single needs every GPU in MIG mode with one profile; found {why}"
        return [MigSpec(cfg.resource_name, profiles[0])], None
    # mixed: whole GPUs where MIG is off, one resource per MIG profile.
    base = [replace(spec, select=_and_not_mig(spec.select), selection=f"{spec.selection}, MIG off") for spec in whole]
    return [*base, *(MigSpec(f"nvidia.com/mig-{p}", p) for p in profiles)], None


def _and_not_mig(select: Callable[[Gpu], bool]) -> Callable[[Gpu], bool]:
    return lambda gpu: not gpu.mig_enabled and select(gpu)


def unserved_sharing(cfg: Config) -> list[str]:
    """Sharing entries for resources nvplug does not advertise yet (MIG profiles): ignored, to be said."""
    return [r.name for r in cfg.sharing.time_slicing.resources if r.name != cfg.resource_name]


def resource_specs(cfg: Config) -> list[ResourceSpec]:
    """What the config asks to advertise: whole GPUs, and time-sliced replicas per sharing entry.

    A renamed entry gets a resource of its own; GPUs it does not take stay whole under the
    base name. An entry that keeps the base name offers its GPUs' replicas there, the rest whole.
    """
    if cfg.sharing.strategy == "mps":
        raise ConfigError(f"{cfg.source}: sharing.mps is not supported by nvplug yet; use timeSlicing")
    base = cfg.resource_name
    sharing = cfg.sharing.time_slicing
    fail_gt_one = sharing.fail_requests_greater_than_one
    entries = [r for r in sharing.resources if r.name == base]
    renamed = [(r, _device_filter(r.devices)) for r in entries if r.advertised_name != base]
    in_place = [(r, _device_filter(r.devices)) for r in entries if r.advertised_name == base]
    specs = [
        ResourceSpec(r.advertised_name, r.replicas, pick, fail_gt_one, selection=repr(r.devices)) for r, pick in renamed
    ]
    picks = [pick for _, pick in renamed]
    whole = ResourceSpec(
        base,
        select=lambda gpu: not any(pick(gpu) for pick in picks),
        selection="all but " + repr([r.devices for r, _ in renamed]) if renamed else "all",
    )
    if in_place:
        (entry, pick), *_ = in_place
        whole = replace(
            whole,
            replicas=entry.replicas,
            fail_requests_greater_than_one=fail_gt_one,
            shared=pick,
            selection=f"{whole.selection}, shared {entry.devices!r}",
        )
    if in_place or not renamed or any(r.devices != "all" for r, _ in renamed):
        specs.insert(0, whole)
    return specs


def _device_filter(devices: Devices) -> Callable[[Gpu], bool]:
    """NVIDIA's `devices`: all, the first N by index, or a list of indices and UUIDs."""
    if devices == "all":
        return _every_gpu
    if isinstance(devices, int):
        return lambda gpu: gpu.index < devices
    wanted = set(devices)
    return lambda gpu: str(gpu.index) in wanted or gpu.uuid in wanted
