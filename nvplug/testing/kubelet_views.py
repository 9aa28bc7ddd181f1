"""What the kubelet stand-in records and publishes: snapshots of plugins, updates and registrations.

State is published as immutable snapshots (frozen dataclasses, tuples, read-only
mappings) that are replaced, never mutated, so other threads may read them at any
time without locks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

from nvplug.protos import deviceplugin_pb2 as pb

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# The error recorded for a Register that a hung kubelet took and never answered.
HUNG = "never answered: the kubelet is hung"


@dataclass(frozen=True)
class PluginOptions:
    pre_start_required: bool
    get_preferred_allocation_available: bool

    @staticmethod
    def from_pb(msg: pb.DevicePluginOptions) -> PluginOptions:
        return PluginOptions(
            pre_start_required=msg.pre_start_required,
            get_preferred_allocation_available=msg.get_preferred_allocation_available,
        )


@dataclass(frozen=True)
class DeviceView:
    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        # Any string other than exactly "Healthy" counts as unhealthy, as in the kubelet.
        return self.health == HEALTHY

    @staticmethod
    def from_pb(dev: pb.Device) -> DeviceView:
        nodes = tuple(n.ID for n in dev.topology.nodes) if dev.HasField("topology") else ()
        return DeviceView(id=dev.ID, health=dev.health, numa_nodes=nodes)


@dataclass(frozen=True)
class Update:
    """One ListAndWatch message, as received."""

    at: float  # time.monotonic()
    devices: tuple[DeviceView, ...]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices)

    @property
    def healthy_ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices if d.healthy)


@dataclass(frozen=True)
class RegistrationRecord:
    at: float  # time.monotonic(), once decided (after the dial-back)
    received_at: float  # time.monotonic(), as the call arrived
    resource: str
    endpoint: str
    version: str
    accepted: bool
    error: str | None = None
    # The options sent in the request; current kubelets ignore them and ask the plugin.
    request_options: PluginOptions | None = None


def frozen_devices(d: Mapping[str, DeviceView]) -> Mapping[str, DeviceView]:
    """A read-only copy: a published view's devices never change under a reader."""
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class PluginView:
    """What the kubelet knows about one registered plugin (one registration)."""

    resource: str
    endpoint: str
    socket_path: Path
    serial: int  # increases with each accepted registration, across resources
    registered_at: float
    options: PluginOptions
    updates: tuple[Update, ...] = ()
    # The current device set, keyed by ID: replaced by each update, all Unhealthy once the stream ends.
    devices: Mapping[str, DeviceView] = field(default_factory=lambda: frozen_devices({}), hash=False)
    stream_ended_at: float | None = None
    # How the stream ended: "EOF", "<CODE>: details", or why the kubelet cancelled it.
    stream_end: str | None = None

    @property
    def stream_open(self) -> bool:
        return self.stream_ended_at is None

    @property
    def capacity(self) -> int:
        return len(self.devices)

    @property
    def allocatable(self) -> int:
        return sum(1 for d in self.devices.values() if d.healthy)

    @property
    def healthy_ids(self) -> tuple[str, ...]:
        return tuple(i for i, d in self.devices.items() if d.healthy)

    def describe(self) -> str:
        state = "open" if self.stream_open else f"ended ({self.stream_end})"
        head = (
            f"{self.resource}: endpoint={self.endpoint} capacity={self.capacity} "
            f"allocatable={self.allocatable} updates={len(self.updates)} stream={state} "
            f"options={self.options}"
        )
        devs = [f"    {d.id} {d.health} numa={list(d.numa_nodes)}" for d in self.devices.values()]
        return "\n".join([head, *devs])


def ended_view(view: PluginView, at: float, how: str) -> PluginView:
    """``view`` once its ListAndWatch stream ended at ``at``, ``how`` saying why."""
    # The kubelet marks every device of the resource unhealthy the moment the stream ends.
    devices = frozen_devices({i: replace(d, health=UNHEALTHY) for i, d in view.devices.items()})
    return replace(view, devices=devices, stream_ended_at=at, stream_end=how)
