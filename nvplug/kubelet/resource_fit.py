"""How a plan's resources meet the kubelet: Allocate's policy from the config, a list past the kubelet's
message limit, two specs that list the same devices, and devices Allocate cannot hand out.

Pure functions of the config and a snapshot; the fleet (plugin_fleet.py) acts on what they say.
"""

from __future__ import annotations

from collections.abc import Iterable

from nvplug.config import Config
from nvplug.core.snapshot import Snapshot
from nvplug.kubelet.allocation import AllocationPolicy
from nvplug.kubelet.device_plugin import MAX_MESSAGE, list_size
from nvplug.shaping.resource_plan import ResourceSpec


def allocation_policy(cfg: Config) -> AllocationPolicy:
    """How Allocate names devices: NVIDIA's flags.plugin settings."""
    plugin = cfg.flags.plugin
    return AllocationPolicy(
        list_strategies=tuple(plugin.device_list_strategy),
        id_strategy=plugin.device_id_strategy,
        pass_device_specs=plugin.pass_device_specs,
        cdi_annotation_prefix=plugin.cdi_annotation_prefix,
        packed=cfg.shared_policy == "packed",
        mps_root=cfg.mps_root,
        mps_client_limits=cfg.mps.client_limits,
    )


def oversized(specs: Iterable[ResourceSpec], snapshot: Snapshot) -> dict[str, str]:
    """Resources whose ListAndWatch message would pass the kubelet's limit, with the count and size."""
    out = {}
    for spec in specs:
        devices = spec.project(snapshot).devices
        size = list_size(devices)
        if size > MAX_MESSAGE:
            out[spec.name] = (
                f"{spec.name} would advertise {len(devices):,} devices in a {size:,}-byte ListAndWatch message, "
                f"over the kubelet's {MAX_MESSAGE:,}-byte limit (fewer replicas, or fewer GPUs per resource)"
            )
    return out


def socket_name(resource_name: str) -> str:
    """nvidia.com/gpu -> nvplug-nvidia.com-gpu.sock"""
    return "nvplug-" + resource_name.replace("/", "-") + ".sock"


def unready_note(snap: Snapshot) -> list[str]:
    """What the status line and /healthz say of devices Allocate could not hand out (nothing if none)."""
    out = {**snap.unresolved, **snap.unready}
    if not out:
        return []
    uuid, problem = next(iter(out.items()))
    return [f"{len(out)} devices cannot be allocated: {uuid}: {problem}"]


def same_list(spec: ResourceSpec, other: ResourceSpec, snapshot: Snapshot) -> bool:
    """Whether two specs advertise the same device IDs, and Allocate treats them alike."""
    if spec.fail_requests_greater_than_one != other.fail_requests_greater_than_one:
        return False
    return [d.id for d in spec.project(snapshot).devices] == [d.id for d in other.project(snapshot).devices]
