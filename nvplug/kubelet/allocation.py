"""Answers to Allocate and GetPreferredAllocation, computed from state alone.

Nothing here calls NVML: a GPU that fell off the bus must not break the
allocation of the others.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from nvplug.cdi.cdi_spec import GPU_KIND, device_name, qualified
from nvplug.core.device_nodes import CONTROL_NODES
from nvplug.core.gpu import Gpu, uuid_of
from nvplug.core.topology import best_set
from nvplug.shaping.mps_groups import client_limits, container_view
from nvplug.shaping.resource_plan import Device, Resource

# Driver-wide nodes every GPU container needs, when the host has them.
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
# The container toolkit reads the device list from mount points under here.
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
# What the toolkit reads as "no devices", so it injects none of its own accord.
NO_DEVICES = "void"
LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
ID_STRATEGIES = ("uuid", "index")


@dataclass(frozen=True)
class AllocationPolicy:
    """How Allocate names the devices (NVIDIA's flags.plugin.* settings)."""

    list_strategies: tuple[str, ...] = ("envvar",)
    id_strategy: str = "uuid"
    pass_device_specs: bool = True
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    # Whole GPUs and MIG devices alike, as NVIDIA's plugin names them.
    cdi_kind: str = GPU_KIND
    # CDI names every container gets besides its devices' (IMEX channels, GDS, MOFED, GDRCopy).
    cdi_extra: tuple[str, ...] = ()
    # Where GetPreferredAllocation puts replicas: distributed over GPUs, or packed onto few.
    packed: bool = False
    # MPS (nvplug.mps): the root of the groups' directories, and whether clients get their limits too.
    mps_root: str = ""
    mps_client_limits: bool = False

    @property
    def uses_cdi(self) -> bool:
        return any(s.startswith("cdi") for s in self.list_strategies)

    def __post_init__(self) -> None:
        unknown = set(self.list_strategies) - set(LIST_STRATEGIES)
        if unknown or self.id_strategy not in ID_STRATEGIES:
            raise ValueError(f"unknown strategy {sorted(unknown) or self.id_strategy!r}")


class AllocationError(ValueError):
    """A request the plugin must refuse; the message names the offending ID."""


@dataclass(frozen=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True)
class ContainerAllocation:
    devices: tuple[Device, ...]
    # The physical GPUs behind them, each once, replicas folded.
    gpus: tuple[Gpu, ...]
    envs: Mapping[str, str]
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()


def resolve(resource: Resource, device_ids: Sequence[str]) -> list[Device]:
    """The devices behind `device_ids`, refusing unknown, unhealthy or repeated IDs."""
    if not device_ids:
        raise AllocationError(f"{resource.name}: the request names no device")
    devices: list[Device] = []
    seen: set[str] = set()
    for device_id in device_ids:
        device = resource.get(device_id)
        if device is None:
            raise AllocationError(f"{resource.name}: unknown device ID {_show(device_id)}")
        if not device.health.healthy:
            raise AllocationError(
                f"{resource.name}: device {_show(device_id)} is {device.health.health.value}: {device.health.reason}"
            )
        if device_id in seen:
            raise AllocationError(f"{resource.name}: device ID {_show(device_id)} is requested twice")
        seen.add(device_id)
        devices.append(device)
    return devices


def allocate(
    resource: Resource,
    device_ids: Sequence[str],
    policy: AllocationPolicy,
    host_path: Callable[[str], str],
    node_exists: Callable[[str], bool],
) -> ContainerAllocation:
    """One container's response. `host_path` maps /dev/... under the driver root."""
    if resource.fail_requests_greater_than_one and len(device_ids) > 1:
        raise AllocationError(
            f"{resource.name}: {len(device_ids)} replicas requested, but this shared resource gives one per "
            "container (failRequestsGreaterThanOne)"
        )
    devices = resolve(resource, device_ids)
    gpus = tuple({d.gpu.uuid: d.gpu for d in devices}.values())
    # What the container sees: whole GPUs or MIG devices, each once (replicas folded).
    units: list[Device] = list({d.mig.uuid: d for d in devices if d.mig is not None}.values())
    units += [Device(g.uuid, g, devices[0].health) for g in gpus if not any(d.gpu == g for d in units)]
    ids = [device_name(d.gpu, d.mig, policy.id_strategy) for d in units]
    strategies = set(policy.list_strategies)
    envs = {VISIBLE_DEVICES_ENV: NO_DEVICES}
    mounts: tuple[Mount, ...] = ()
    annotations: dict[str, str] = {}
    cdi_devices: tuple[str, ...] = ()
    if "envvar" in strategies:
        envs[VISIBLE_DEVICES_ENV] = ",".join(ids)
    if "volume-mounts" in strategies:
        envs[VISIBLE_DEVICES_ENV] = VOLUME_MOUNTS_ROOT
        mounts = tuple(Mount(f"{VOLUME_MOUNTS_ROOT}/{i}", "/dev/null") for i in ids)
    names = [qualified(policy.cdi_kind, i) for i in ids] + list(policy.cdi_extra)
    if "cdi-annotations" in strategies:
        # One key per container: the same devices always give the same key.
        unique = hashlib.sha256(",".join(names).encode()).hexdigest()[:16]
        annotations[f"{policy.cdi_annotation_prefix}nvplug_{unique}"] = ",".join(names)
    if "cdi-cri" in strategies:
        cdi_devices = tuple(names)
    mps_env, mps_mounts = _mps_view(resource, devices, units, policy)
    envs.update(mps_env)
    mounts += mps_mounts
    nodes: list[DeviceNode] = []
    if policy.pass_device_specs:
        nodes = [DeviceNode(g.device_node, host_path(g.device_node)) for g in gpus if g.device_node is not None]
        for d in units:
            caps = _cap_nodes(resource, d)
            nodes += [DeviceNode(p, host_path(p)) for p in caps]
        nodes += [DeviceNode(p, host_path(p)) for p in CONTROL_NODES if node_exists(host_path(p))]
    return ContainerAllocation(tuple(devices), gpus, envs, tuple(nodes), mounts, annotations, cdi_devices)


def _mps_view(
    resource: Resource, devices: Sequence[Device], units: Sequence[Device], policy: AllocationPolicy
) -> tuple[dict[str, str], tuple[Mount, ...]]:
    """An MPS client's env and mounts: its group's pipe directory, the shm, and its limits if asked."""
    if not resource.mps_groups:
        return {}, ()
    groups = {g.name: g for d in devices if (g := resource.group_of(d)) is not None}
    if len(groups) != 1:
        named = ", ".join(sorted(groups)) or "none"
        raise AllocationError(
            f"{resource.name}: the devices belong to {len(groups)} MPS groups ({named}); a "
            "container can talk to one MPS control daemon only"
        )
    group = next(iter(groups.values()))
    env, mounts = container_view(group.pipe_dir(policy.mps_root), policy.mps_root)
    if policy.mps_client_limits:
        env.update(client_limits(group.thread_percentage, group.pinned_of([uuid_of(d.gpu, d.mig) for d in units])))
    return env, tuple(Mount(inside, host) for inside, host in mounts)


def _cap_nodes(resource: Resource, device: Device) -> tuple[str, ...]:
    """The /dev/nvidia-caps nodes of a MIG device's GPU and compute instance."""
    mig, minor = device.mig, device.gpu.minor
    if mig is None or minor is None:
        return ()
    nodes = resource.cap_minors.nodes(minor, mig.gpu_instance, mig.compute_instance)
    if nodes is None:
        raise AllocationError(
            f"{resource.name}: no capability device minors listed for {mig.uuid} "
            f"(gpu {minor}, gi {mig.gpu_instance}, ci {mig.compute_instance})"
        )
    return nodes


def preferred(
    resource: Resource, available: Sequence[str], must_include: Sequence[str], size: int, packed: bool = False
) -> list[str]:
    """Must-include first, then the best-connected rest; among equals, the lowest GPU index.
    Replicas of shared GPUs go to the least-loaded GPUs, or with `packed` onto as few GPUs as may be."""
    if size <= 0:
        raise AllocationError(f"{resource.name}: allocation size {size} is not positive")
    # Only devices we know can be allocated: an ID we do not know (a GPU gone a moment ago,
    # or a bogus request) is no candidate, and must not cost time or memory.
    offered = resource.known(available)
    if len(offered) < size:
        raise AllocationError(f"{resource.name}: allocation size {size} exceeds the {len(offered)} available we know")
    missing = [i for i in must_include if i not in offered]
    if missing:
        raise AllocationError(f"{resource.name}: must-include IDs {_show_all(missing)} are not among the available")
    chosen = list(dict.fromkeys(must_include))
    if len(chosen) > size:
        raise AllocationError(f"{resource.name}: {len(chosen)} must-include IDs exceed allocation size {size}")
    # GPU index, then replica: the projection's order, looked up rather than computed.
    candidates = sorted(offered, key=resource.rank)
    if resource.shared:
        return _spread(resource, candidates, chosen, size, packed)
    return best_set(resource.topology.score, candidates, chosen, size)


def _show(device_id: str) -> str:
    """An ID as an error quotes it: cut short, since gRPC error details must stay small."""
    return repr(device_id if len(device_id) <= 80 else device_id[:80] + "...")


def _show_all(device_ids: Sequence[str]) -> str:
    shown = ", ".join(_show(i) for i in device_ids[:3])
    return f"[{shown}{f' and {len(device_ids) - 3} more' if len(device_ids) > 3 else ''}]"


def _spread(resource: Resource, candidates: list[str], chosen: list[str], size: int, packed: bool = False) -> list[str]:
    """Replicas from the least-loaded GPUs: fewest taken by this request, then most still free; among
    equals the lowest GPU index, and on a GPU its lowest replica. `packed` turns both around: the GPU
    this request already uses most, then the one with the fewest replicas left (the busiest), so that
    a GPU fills before the next is touched. One pass groups the candidates by GPU; each pick then
    looks at the GPUs, not at every candidate."""
    sign = -1 if packed else 1
    by_gpu: dict[str, list[str]] = {}
    for device_id in candidates:
        device = resource.get(device_id)
        assert device is not None  # candidates are known IDs
        by_gpu.setdefault(uuid_of(device.gpu, device.mig), []).append(device_id)
    taken = Counter(uuid_of(dev.gpu, dev.mig) for i in chosen if (dev := resource.get(i)) is not None)
    picked = set(chosen)
    next_of = dict.fromkeys(by_gpu, 0)
    while len(chosen) < size:
        best: tuple[tuple[int, int], str] | None = None
        for gpu, ids in by_gpu.items():  # in GPU-index order: the first of equals wins
            at = next_of[gpu]
            while at < len(ids) and ids[at] in picked:
                at += 1
            next_of[gpu] = at
            key = (sign * taken[gpu], -sign * len(ids))
            if at < len(ids) and (best is None or key < best[0]):
                best = (key, gpu)
        assert best is not None  # size <= len(candidates)
        gpu = best[1]
        pick = by_gpu[gpu][next_of[gpu]]
        picked.add(pick)
        chosen.append(pick)
        taken[gpu] += 1
    return chosen
