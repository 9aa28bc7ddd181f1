"""What the plugin advertises: the inventory mapped to device IDs per resource name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .gpu import NO_NUMA_NODE, Gpu
from .health import HealthState
from .state import Snapshot
from .topology import Topology

GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class Device:
    """One advertised device ID and the GPU behind it."""

    id: str
    gpu: Gpu
    health: HealthState

    @property
    def numa_node(self) -> int | None:
        return None if self.gpu.numa_node == NO_NUMA_NODE else self.gpu.numa_node


@dataclass(frozen=True)
class Resource:
    name: str
    devices: tuple[Device, ...] = ()
    topology: Topology = field(default_factory=Topology)
    _by_id: Mapping[str, Device] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {d.id: d for d in self.devices})

    def get(self, device_id: str) -> Device | None:
        return self._by_id.get(device_id)

    @property
    def healthy_count(self) -> int:
        return sum(1 for d in self.devices if d.health.healthy)


def whole_gpus(snapshot: Snapshot, name: str = GPU_RESOURCE) -> Resource:
    """Each GPU once, under its UUID, in index order."""
    devices = tuple(Device(g.uuid, g, snapshot.health[g.uuid]) for g in snapshot.gpus if g.uuid in snapshot.health)
    return Resource(name, devices, snapshot.topology)
