"""ResourceSlice objects for the node's pool, in the shape of each resource.k8s.io version."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nvplug.dra.dra_devices import DraDevice

GROUP = "resource.k8s.io"
# Newest first: the first the API server serves is used.
VERSIONS = ("v1", "v1beta2", "v1beta1")
# The API refuses a slice with more devices.
MAX_DEVICES = 128


def device_object(device: DraDevice, version: str, taints: bool = True) -> dict[str, Any]:
    """A device entry: v1beta1 nests attributes, capacity and taints under `basic`, later versions do not."""
    body: dict[str, Any] = {
        "attributes": {key: {kind: value} for key, (kind, value) in sorted(device.attributes.items())},
        "capacity": {key: {"value": value} for key, value in sorted(device.capacity.items())},
    }
    if taints and device.taints:
        body["taints"] = [t.as_object() for t in device.taints]
    return {"name": device.name, "basic": body} if version == "v1beta1" else {"name": device.name, **body}


def in_pool(device: DraDevice, taints: bool) -> bool:
    """Whether the device is in the slices: Healthy, or tainted where the API server keeps taints."""
    return device.healthy or bool(taints and device.taints)


def pool_devices(devices: Sequence[DraDevice], version: str, taints: bool = False) -> list[dict[str, Any]]:
    """What the pool offers, by name. With `taints` (the API server keeps them) an Unhealthy device stays,
    tainted; without, it leaves the pool, so that no new claim gets it."""
    kept = [d for d in devices if in_pool(d, taints)]
    return [device_object(d, version, taints) for d in sorted(kept, key=lambda d: d.name)]


def slices(
    devices: Sequence[Mapping[str, Any]],
    driver: str,
    node: str,
    generation: int,
    version: str,
    per_slice: int = MAX_DEVICES,
) -> list[dict[str, Any]]:
    """The pool in slices of at most `per_slice` devices (a slice with a taint holds 64, so a pool that
    may be tainted is cut at 64: a fault then changes one slice, not the cut); an empty pool is one
    empty slice, so that the pool (and its generation) still exists."""
    chunks = [list(devices[i : i + per_slice]) for i in range(0, len(devices), per_slice)] or [[]]
    return [
        {
            "apiVersion": f"{GROUP}/{version}",
            "kind": "ResourceSlice",
            "metadata": {"generateName": f"{node}-{driver}-"},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
                "devices": chunk,
            },
        }
        for chunk in chunks
    ]


def same_pool(known: list[dict[str, Any]], wanted: list[dict[str, Any]], generation: int) -> bool:
    """Whether the slices already hold exactly these devices, all of one current generation."""
    if not known or any(int(s["spec"]["pool"]["generation"]) != generation for s in known):
        return False
    if any(int(s["spec"]["pool"]["resourceSliceCount"]) != len(known) for s in known):
        return False
    return [d for s in known for d in s["spec"].get("devices") or []] == wanted
