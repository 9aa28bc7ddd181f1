"""What the plugin advertises: the inventory mapped to device IDs per resource name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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


def whole_gpus(snapshot: Snapshot, name: str = GPU_RESOURCE) -> Resource:
    """Each GPU once, under its UUID, in index order."""
    devices = tuple(Device(g.uuid, g, snapshot.health[g.uuid]) for g in snapshot.gpus if g.uuid in snapshot.health)
    return Resource(name, devices, snapshot.topology)


def replicated(
    snapshot: Snapshot,
    name: str,
    replicas: int,
    select: Callable[[Gpu], bool] = lambda gpu: True,
    fail_requests_greater_than_one: bool = False,
) -> Resource:
    """Each selected GPU `replicas` times, as <uuid>::<n>; every replica shares its GPU's health."""
    devices = tuple(
        Device(f"{g.uuid}{REPLICA_SEPARATOR}{n}", g, snapshot.health[g.uuid], replica=n)
        for g in snapshot.gpus
        if g.uuid in snapshot.health and select(g)
        for n in range(replicas)
    )
    return Resource(name, devices, snapshot.topology, replicas, fail_requests_greater_than_one)
