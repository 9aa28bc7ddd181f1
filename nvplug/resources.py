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


def _every_gpu(gpu: Gpu) -> bool:
    return True


@dataclass(frozen=True)
class ResourceSpec:
    """One advertised resource: a name, which GPUs, and how many times each (time-slicing)."""

    name: str = GPU_RESOURCE
    replicas: int = 1
    select: Callable[[Gpu], bool] = field(default=_every_gpu, compare=False)
    fail_requests_greater_than_one: bool = False

    def project(self, snapshot: Snapshot) -> Resource:
        """Unshared GPUs by UUID; replicas as <uuid>::<n>, each with its GPU's health; index order."""
        gpus = [g for g in snapshot.gpus if g.uuid in snapshot.health and self.select(g)]
        if self.replicas == 1:
            devices = tuple(Device(g.uuid, g, snapshot.health[g.uuid]) for g in gpus)
        else:
            devices = tuple(
                Device(f"{g.uuid}{REPLICA_SEPARATOR}{n}", g, snapshot.health[g.uuid], replica=n)
                for g in gpus
                for n in range(self.replicas)
            )
        return Resource(self.name, devices, snapshot.topology, self.replicas, self.fail_requests_greater_than_one)
