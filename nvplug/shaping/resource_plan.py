"""What the plugin advertises: the inventory mapped to device IDs per resource name."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, repeat
from operator import itemgetter
from types import MappingProxyType
from typing import NamedTuple

from nvplug import config
from nvplug.config import GPU_RESOURCE, RESOURCE_DOMAIN, Config, Devices, MigStrategy
from nvplug.config.selectors import DeviceFilter, Selector, matches
from nvplug.core.gpu import NO_NUMA_NODE, Gpu, MigDevice, uuid_of
from nvplug.core.health import HealthState
from nvplug.core.mig import CapMinors
from nvplug.core.mps_state import NOT_STARTED
from nvplug.core.snapshot import Snapshot
from nvplug.core.topology import Topology
from nvplug.shaping.mps_groups import MpsGroup, MpsShare, groups_of, too_old

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
    # MPS: the groups whose daemons serve the devices; none for other resources.
    mps_groups: tuple[MpsGroup, ...] = ()
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

    def group_of(self, device: Device) -> MpsGroup | None:
        """The MPS group serving the device; None if the resource is not shared through MPS."""
        uuid = uuid_of(device.gpu, device.mig)
        return next((g for g in self.mps_groups if uuid in g.uuids), None)

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


@dataclass(frozen=True)
class Naming:
    """The resource each GPU and MIG device belongs to before sharing: resources.gpus and
    resources.mig (first match wins; an unmatched GPU keeps nvidia.com/gpu), flags.migStrategy,
    and nvplug.devices (an excluded GPU and its MIG devices belong to none). A GPU given to DRA
    (nvplug.dra) belongs to no resource of the device plugin: no GPU is offered through both."""

    gpus: tuple[config.ResourcePattern, ...] = config.Resources().gpus
    mig: tuple[config.ResourcePattern, ...] = ()
    strategy: MigStrategy = "none"
    devices: DeviceFilter = field(default_factory=DeviceFilter)
    # nvplug.dra.devices when DRA is on (empty: every GPU); None when it is off.
    dra: tuple[Selector, ...] | None = None
    # nvplug.dra.extendedResources: a GPU whose model's name is one of them is DRA's too.
    dra_extended: frozenset[str] = frozenset()
    # GPUs a reload moves between the two: offered by neither meanwhile.
    moving: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, cfg: Config) -> Naming:
        dra = cfg.dra.devices if cfg.dra.enabled else None
        extended = frozenset(cfg.dra.extended_resources if cfg.dra.enabled else ())
        return cls(
            cfg.resources.gpus, cfg.resources.mig, cfg.flags.mig_strategy, cfg.devices, dra, extended, cfg.dra.moving
        )

    def dra_owns(self, gpu: Gpu) -> bool:
        """Whether the GPU is offered through DRA (and so not by the device plugin)."""
        return not self.devices.excludes(gpu) and gpu.uuid not in self.moving and self._picked_by_dra(gpu)

    def serves(self, gpu: Gpu) -> bool:
        """Whether the device plugin offers the GPU or its MIG devices: not excluded, not DRA's."""
        return not self.devices.excludes(gpu) and gpu.uuid not in self.moving and not self._picked_by_dra(gpu)

    def _picked_by_dra(self, gpu: Gpu) -> bool:
        if self.dra is None:
            return False
        # No selector and no extended resource: every GPU.
        if (not self.dra and not self.dra_extended) or any(s.picks(gpu) for s in self.dra):
            return True
        # By its model's name (resources.gpus), which its MIG mode does not change: a GPU changes sides only
        # in a reload, which gives it up on both sides first.
        return self.gpu_name(gpu) in self.dra_extended

    def gpu_name(self, gpu: Gpu) -> str:
        """The name of the GPU's model: its resource as a whole GPU, and its MIG devices' under single."""
        product = gpu.name or ""
        return next((r.name for r in self.gpus if matches(r.pattern, product)), GPU_RESOURCE)

    def name(self, gpu: Gpu, mig: MigDevice | None) -> str | None:
        """The resource of a whole GPU (`mig` None) or of a MIG device; None if not offered as such."""
        return self._unit_name(gpu, mig) if self.serves(gpu) else None

    def _unit_name(self, gpu: Gpu, mig: MigDevice | None) -> str | None:
        """`name` for a GPU the device plugin serves."""
        if mig is None:
            return None if gpu.mig_enabled and self.strategy != "none" else self.gpu_name(gpu)
        if self.strategy == "none" or not gpu.mig_enabled:
            return None
        found = next((r.name for r in self.mig if matches(r.pattern, mig.profile)), None)
        if found is not None:
            return found
        # single: MIG devices stand in for their GPUs; mixed: NVIDIA's one resource per profile.
        return self.gpu_name(gpu) if self.strategy == "single" else f"{RESOURCE_DOMAIN}/mig-{mig.profile}"

    def units(self, snapshot: Snapshot) -> Iterator[tuple[Gpu, MigDevice | None, str]]:
        """Every device offered, with its resource, in GPU index order."""
        for gpu in snapshot.gpus:
            if not self.serves(gpu):  # once per GPU: a filter's patterns are not matched per MIG device
                continue
            for mig in (None, *gpu.mig):
                name = self._unit_name(gpu, mig)
                if name is not None:
                    yield gpu, mig, name


@dataclass(frozen=True)
class ResourceSpec:
    """One advertised resource: devices of one base name (see Naming), and how many times each.

    A sharing entry with a rename takes the devices it picks into a resource of its own; the
    base resource keeps the rest whole, or replicates those of an entry without a rename.
    """

    name: str = GPU_RESOURCE
    replicas: int = 1
    fail_requests_greater_than_one: bool = False
    # The name the devices have before sharing renames them, and how that is decided.
    base: str = GPU_RESOURCE
    naming: Naming = field(default_factory=Naming)
    # Which devices of `base` are here: those `take` picks, but none that `leave` does.
    take: Devices = "all"
    leave: tuple[Devices, ...] = ()
    # Which of them are replicated, when replicas > 1.
    share: Devices = "all"
    # Shared through MPS: each device also needs its group's daemon up.
    mps: MpsShare | None = None

    def project(self, snapshot: Snapshot, previous: Resource | None = None) -> Resource:
        """Unshared devices by UUID; replicas as <uuid>::<n>, each with its device's health; index order.

        With the previous revision's projection, a device whose facts and health did not change keeps
        its block of devices: a health change costs the changed device's replicas, not every device.
        """
        kept = {_key(b): b for b in previous.blocks if b} if previous is not None else {}
        blocks: list[tuple[Device, ...]] = []
        mps_units: list[tuple[Gpu, MigDevice | None]] = []
        ordinal = -1  # the device's place among those of `base`: what a count of devices picks
        for gpu, mig, name in self.naming.units(snapshot):
            if name != self.base:
                continue
            ordinal += 1
            if not picks(self.take, gpu, mig, ordinal) or any(picks(d, gpu, mig, ordinal) for d in self.leave):
                continue
            health = device_health(snapshot, gpu, mig)
            if health is None:
                continue
            uuid = uuid_of(gpu, mig)
            if self.mps is not None:
                mps_units.append((gpu, mig))
                if health.healthy:
                    health = snapshot.mps_units.get(uuid, NOT_STARTED)
            copies = self.replicas if self.replicas > 1 and picks(self.share, gpu, mig, ordinal) else 0
            old = kept.get(uuid)
            if old is not None and old[0].gpu == gpu and old[0].health == health and _copies(old) == copies:
                blocks.append(old)
            elif copies and old is not None and _copies(old) == copies:
                # The same replicas with new facts: their IDs are kept, not formatted again.
                ids = [d.id for d in old]
                blocks.append(_replicas(ids, gpu, health, mig))
            elif copies:
                blocks.append(_replicas([f"{uuid}{REPLICA_SEPARATOR}{n}" for n in range(copies)], gpu, health, mig))
            else:
                blocks.append((Device(uuid, gpu, health, mig=mig),))
        devices = tuple(chain.from_iterable(blocks))
        by_id: Mapping[str, Device] = {}
        rank: Mapping[str, int] = {}
        if previous is not None and _same_layout(blocks, previous.blocks):
            # The same IDs in the same order: patch the lookup where blocks changed; the ranks stand.
            patched = dict(previous._by_id)
            for b in blocks:
                if kept[_key(b)] is not b:
                    patched.update(zip(map(itemgetter(0), b), b, strict=True))
            by_id, rank = patched, previous._rank
        return Resource(
            self.name,
            devices,
            snapshot.topology,
            self.replicas,
            self.fail_requests_greater_than_one,
            cap_minors=snapshot.cap_minors,
            mps_groups=tuple(groups_of(self.name, self.mps, mps_units)) if self.mps is not None else (),
            blocks=tuple(blocks),
            uniform_blocks=True,
            _by_id=by_id,
            _rank=rank,
        )


def mig_spec(name: str, profile: str) -> ResourceSpec:
    """The MIG devices of one profile, under migStrategy mixed, advertised as `name`."""
    return ResourceSpec(name, base=f"{RESOURCE_DOMAIN}/mig-{profile}", naming=Naming(strategy="mixed"))


def picks(devices: Devices, gpu: Gpu, mig: MigDevice | None, ordinal: int) -> bool:
    """NVIDIA's `devices`: all; the first N of the resource; or GPU indices, MIG indices (`gpu:mig`,
    the MIG device's place on its GPU) and UUIDs. A GPU's index or UUID picks its MIG devices too."""
    if devices == "all":
        return True
    if isinstance(devices, int):
        return ordinal < devices
    if str(gpu.index) in devices or gpu.uuid in devices:
        return True
    return mig is not None and (mig.uuid in devices or f"{gpu.index}:{gpu.mig.index(mig)}" in devices)


def device_health(snapshot: Snapshot, gpu: Gpu, mig: MigDevice | None) -> HealthState | None:
    parent = snapshot.health.get(gpu.uuid)
    if mig is None or parent is None:
        return parent
    own = snapshot.health.get(mig.uuid)
    # A fault of the whole GPU is a fault of each of its MIG devices.
    return None if own is None else own if parent.healthy else parent


def _replicas(ids: list[str], gpu: Gpu, health: HealthState, mig: MigDevice | None) -> tuple[Device, ...]:
    """A GPU's replicas, made by tuple's own constructor: a named tuple's Python-level one costs twice as
    much, 1,024 times on each health change of a GPU."""
    rows = zip(ids, repeat(gpu), repeat(health), range(len(ids)), repeat(mig))
    return tuple(map(tuple.__new__, repeat(Device), rows))


def _key(block: tuple[Device, ...]) -> str:
    return uuid_of(block[0].gpu, block[0].mig)


def _copies(block: tuple[Device, ...]) -> int:
    return len(block) if block[0].replica is not None else 0


def _same_layout(blocks: Iterable[tuple[Device, ...]], before: Iterable[tuple[Device, ...]]) -> bool:
    """Blocks of the same devices, in the same order, of the same sizes: the same device IDs."""
    return [(_key(b), len(b)) for b in blocks if b] == [(_key(b), len(b)) for b in before if b]


@dataclass(frozen=True)
class Plan:
    """What a config advertises on the devices present."""

    specs: tuple[ResourceSpec, ...]
    # Why nothing is advertised (a MIG layout that does not fit migStrategy single); None if it fits.
    error: str | None = None
    # Resources not advertised, and why (two sharing entries pick one device).
    refused: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # GPUs left out by nvplug.devices, and why.
    excluded: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Selectors of nvplug.devices that pick no GPU present.
    unmatched: tuple[str, ...] = ()

    @property
    def served(self) -> list[ResourceSpec]:
        return [s for s in self.specs if s.name not in self.refused]


def moved(old: Config, new: Config, snapshot: Snapshot) -> frozenset[str]:
    """The GPUs (by UUID) that going from `old` to `new` moves between the device plugin and DRA."""
    before, after = Naming.from_config(old), Naming.from_config(new)
    return frozenset(
        g.uuid
        for g in snapshot.gpus
        if (before.dra_owns(g) and after.serves(g)) or (before.serves(g) and after.dra_owns(g))
    )


def plan(cfg: Config, snapshot: Snapshot) -> Plan:
    """The resources to serve: each name that has devices now, as many times as sharing says."""
    naming = Naming.from_config(cfg)
    excluded = {g.uuid: why for g in snapshot.gpus if (why := cfg.devices.why(g)) is not None}
    unmatched = tuple(cfg.devices.unmatched(snapshot.gpus))
    units = list(naming.units(snapshot))
    error = _single_misfit(naming, snapshot, units) if cfg.flags.mig_strategy == "single" else None
    if error is not None:
        return Plan((), error, excluded=excluded, unmatched=unmatched)
    # A name DRA serves is still registered, with no devices: the scheduler backs it with DRA only where
    # the node's allocatable for it is 0.
    bases = sorted({name for _, _, name in units} | naming.dra_extended) or [GPU_RESOURCE]
    specs: list[ResourceSpec] = []
    refused: dict[str, str] = {}
    sharing = cfg.sharing.replicated
    mps = cfg.sharing.strategy == "mps"

    def share(r: config.ReplicatedResource) -> MpsShare | None:
        if not mps:
            return None
        limits = cfg.mps.limits(r.advertised_name)
        return MpsShare(r.replicas, limits.active_thread_percentage, limits.pinned_memory_limit)

    for base in bases:
        entries = [r for r in sharing.resources if r.name == base]
        own = [
            ResourceSpec(
                r.advertised_name,
                r.replicas,
                sharing.fail_requests_greater_than_one,
                base,
                naming,
                take=r.devices,
                mps=share(r),
            )
            for r in entries
            if r.advertised_name != base
        ]
        in_place = next((r for r in entries if r.advertised_name == base), None)
        rest = ResourceSpec(base, base=base, naming=naming, leave=tuple(s.take for s in own))
        if in_place is not None:
            if mps and in_place.devices != "all":
                # The rest would mix MPS devices with whole ones in one resource: one Allocate, two kinds.
                refused[base] = (
                    f"{in_place.where or base}: an MPS entry without a rename must share all devices "
                    f"of {base}; give it a rename to share some of them"
                )
            rest = ResourceSpec(
                base,
                in_place.replicas,
                sharing.fail_requests_greater_than_one,
                base,
                naming,
                leave=rest.leave,
                share=in_place.devices,
                mps=share(in_place),
            )
        # Each projected once: the MPS check below reads the same projection.
        projected = [(s, s.project(snapshot)) for s in (rest, *own)]
        kept = [(s, p) for s, p in projected if p.devices] or projected[:1]
        chosen = [s for s, _ in kept]
        specs += chosen
        twice = _picked_twice(base, entries, units)
        if twice is not None:
            refused.update(dict.fromkeys((s.name for s in chosen), twice))
        for spec, resource in kept:
            old = too_old(resource.units) if spec.mps is not None else None
            if old is not None:
                refused[spec.name] = f"{spec.name}: {old}"
    # A sharing rename may not take the name of another resource: its devices would be in two lists.
    names = [s.name for s in specs]
    for name in {n for n in names if names.count(n) > 1}:
        refused[name] = (
            f"{cfg.source}: {name} would be advertised twice: a sharing rename must not take the "
            "name of a resource (resources.gpus, resources.mig or a MIG profile's)"
        )
    return Plan(tuple(specs), None, MappingProxyType(refused), MappingProxyType(excluded), unmatched)


def _single_misfit(naming: Naming, snapshot: Snapshot, units: list[tuple[Gpu, MigDevice | None, str]]) -> str | None:
    """migStrategy single: every GPU the device plugin hands out in MIG mode, or none; one profile per resource."""
    handed = [g for g in snapshot.gpus if naming.serves(g)]
    on = [g for g in handed if g.mig_enabled]
    if not on:
        return None
    off = [g.label for g in handed if not g.mig_enabled]
    profiles: dict[str, set[str]] = {}
    for _, mig, name in units:
        if mig is not None:
            profiles.setdefault(name, set()).add(mig.profile)
    mixed = [f"{name}: {sorted(p)}" for name, p in sorted(profiles.items()) if len(p) > 1]
    if not off and not mixed and profiles:
        return None
    why = f"GPUs without MIG: {off}" if off else f"MIG profiles {'; '.join(mixed) or 'none'}"
    return f"migStrategy single needs every GPU in MIG mode with one profile per resource; found {why}"


def _picked_twice(
    base: str, entries: list[config.ReplicatedResource], units: list[tuple[Gpu, MigDevice | None, str]]
) -> str | None:
    """Two sharing entries of one resource that pick one device (a GPU by UUID in one, by index in the other)."""
    ordinal = -1
    for gpu, mig, name in units:
        if name != base:
            continue
        ordinal += 1
        by = [r for r in entries if picks(r.devices, gpu, mig, ordinal)]
        if len(by) > 1:
            device = mig.uuid if mig is not None else gpu.label
            where = " and ".join(r.where or r.name for r in by)
            return f"{device} of {base} is picked by two sharing entries ({where}); a device may be shared by one"
    return None


def unserved_sharing(cfg: Config) -> list[str]:
    """Sharing entries for names no device of this config can have: a typo, most likely."""
    known = {GPU_RESOURCE, *(r.name for r in cfg.resources.gpus), *(r.name for r in cfg.resources.mig)}
    mig = f"{RESOURCE_DOMAIN}/mig-"
    return [
        r.name
        for r in cfg.sharing.replicated.resources
        if r.name not in known and not (r.name.startswith(mig) and cfg.flags.mig_strategy == "mixed")
    ]


def mps_groups(cfg: Config, snapshot: Snapshot) -> dict[str, MpsGroup]:
    """The MPS groups the config makes of the devices present, by name; none without sharing.mps."""
    if cfg.sharing.strategy != "mps":
        return {}
    served = plan(cfg, snapshot).served
    return {g.name: g for spec in served if spec.mps is not None for g in spec.project(snapshot).mps_groups}
