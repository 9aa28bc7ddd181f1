"""Answers to Allocate and GetPreferredAllocation, computed from state alone.

Nothing here calls NVML: a GPU that fell off the bus must not break the
allocation of the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .resources import Device, Resource
from .topology import best_set

# Driver-wide nodes every GPU container needs, when the host has them.
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"


class AllocationError(ValueError):
    """A request the plugin must refuse; the message names the offending ID."""


@dataclass(frozen=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class ContainerAllocation:
    devices: tuple[Device, ...]
    envs: Mapping[str, str]
    device_nodes: tuple[DeviceNode, ...]


def resolve(resource: Resource, device_ids: Sequence[str]) -> list[Device]:
    """The devices behind `device_ids`, refusing unknown, unhealthy or repeated IDs."""
    if not device_ids:
        raise AllocationError(f"{resource.name}: the request names no device")
    devices: list[Device] = []
    seen: set[str] = set()
    for device_id in device_ids:
        device = resource.get(device_id)
        if device is None:
            raise AllocationError(f"{resource.name}: unknown device ID {device_id!r}")
        if not device.health.healthy:
            raise AllocationError(
                f"{resource.name}: device {device_id!r} is {device.health.health.value}: {device.health.reason}"
            )
        if device_id in seen:
            raise AllocationError(f"{resource.name}: device ID {device_id!r} is requested twice")
        seen.add(device_id)
        devices.append(device)
    return devices


def allocate(
    resource: Resource,
    device_ids: Sequence[str],
    host_path: Callable[[str], str],
    node_exists: Callable[[str], bool],
) -> ContainerAllocation:
    """One container's response. `host_path` maps /dev/... under the driver root."""
    devices = resolve(resource, device_ids)
    nodes: list[DeviceNode] = []
    for device in devices:
        path = device.gpu.device_node
        if path is not None:
            nodes.append(DeviceNode(path, host_path(path)))
    nodes += [DeviceNode(p, host_path(p)) for p in CONTROL_NODES if node_exists(host_path(p))]
    envs = {VISIBLE_DEVICES_ENV: ",".join(d.gpu.uuid for d in devices)}
    return ContainerAllocation(tuple(devices), envs, tuple(nodes))


def preferred(resource: Resource, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """Must-include first, then the best-connected rest; among equals, the lowest GPU index."""
    if size <= 0:
        raise AllocationError(f"{resource.name}: allocation size {size} is not positive")
    offered = set(available)
    if len(offered) < size:
        raise AllocationError(f"{resource.name}: allocation size {size} exceeds the {len(offered)} available")
    missing = [i for i in must_include if i not in offered]
    if missing:
        raise AllocationError(f"{resource.name}: must-include IDs {missing} are not among the available")
    chosen = list(dict.fromkeys(must_include))
    if len(chosen) > size:
        raise AllocationError(f"{resource.name}: {len(chosen)} must-include IDs exceed allocation size {size}")

    def order(device_id: str) -> tuple[int, str]:
        device = resource.get(device_id)
        # IDs we don't know go last rather than failing the whole answer.
        return (device.gpu.index if device is not None else 1 << 30, device_id)

    return best_set(resource.topology.score, sorted(offered, key=order), chosen, size)
