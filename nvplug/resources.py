"""What the plugin advertises: the inventory mapped to device IDs per resource name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from .config import Config, ConfigError, Devices
from .gpu import NO_NUMA_NODE, Gpu
from .health import HealthState
from .state import Snapshot
from .topology import Topology

GPU_RESOURCE = "nvidia.com/gpu"
# Time-sliced replicas are advertised as <uuid>::<n>, as NVIDIA's plugin does.
REPLICA_SEPARATOR = "::"


@dataclass(frozen=True)
class Device:
    """One advertised device ID and the GPU behind it."""

    id: str
    gpu: Gpu
    health: HealthState
    replica: int | None = None

    @property
    def numa_node(self) -> int | None:
        return None if self.gpu.numa_node == NO_NUMA_NODE else self.gpu.numa_node


@dataclass(frozen=True)
class Resource:
    name: str
    devices: tuple[Device, ...] = ()
    topology: Topology = field(default_factory=Topology)
    # Time-slicing: each GPU offered this many times; optionally one replica per request.
    replicas: int = 1
    fail_requests_greater_than_one: bool = False
    _by_id: Mapping[str, Device] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {d.id: d for d in self.devices})

    def get(self, device_id: str) -> Device | None:
        return self._by_id.get(device_id)

    @property
    def shared(self) -> bool:
        return self.replicas > 1

    @property
    def healthy_count(self) -> int:
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

    def project(self, snapshot: Snapshot) -> Resource:
        """Unshared GPUs by UUID; replicas as <uuid>::<n>, each with its GPU's health; index order."""
        devices: list[Device] = []
        for g in snapshot.gpus:
            if g.uuid not in snapshot.health or not self.select(g):
                continue
            health = snapshot.health[g.uuid]
            if self.replicas > 1 and self.shared(g):
                devices += [
                    Device(f"{g.uuid}{REPLICA_SEPARATOR}{n}", g, health, replica=n) for n in range(self.replicas)
                ]
            else:
                devices.append(Device(g.uuid, g, health))
        return Resource(
            self.name, tuple(devices), snapshot.topology, self.replicas, self.fail_requests_greater_than_one
        )


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
