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


def device_object(device: DraDevice, version: str) -> dict[str, Any]:
    """A device entry: v1beta1 nests attributes and capacity under `basic`, later versions do not."""
    body = {
        "attributes": {key: {kind: value} for key, (kind, value) in sorted(device.attributes.items())},
        "capacity": {key: {"value": value} for key, value in sorted(device.capacity.items())},
    }
    return {"name": device.name, "basic": body} if version == "v1beta1" else {"name": device.name, **body}


def pool_devices(devices: Sequence[DraDevice], version: str) -> list[dict[str, Any]]:
    """What the pool offers: the healthy devices, by name. An Unhealthy device leaves the pool (taints are
    alpha through Kubernetes 1.35), so that no new claim is allocated to it."""
    return [device_object(d, version) for d in sorted(devices, key=lambda d: d.name) if d.healthy]


def slices(
    devices: Sequence[Mapping[str, Any]], driver: str, node: str, generation: int, version: str
) -> list[dict[str, Any]]:
    """The pool in slices of at most MAX_DEVICES devices; an empty pool is one empty slice, so that
    the pool (and its generation) still exists."""
    chunks = [list(devices[i : i + MAX_DEVICES]) for i in range(0, len(devices), MAX_DEVICES)] or [[]]
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
