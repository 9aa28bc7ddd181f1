"""Which pod holds which device: the kubelet's PodResources answer mapped onto nvplug's devices.

Pure. The kubelet reports the device IDs a plugin advertised: a GPU's UUID, a
time-sliced replica `<uuid>::<n>`, a MIG device's UUID; and, from a plugin that
advertised them so, indices `N` and `N:M`. Each is mapped back to the GPU or MIG
device behind it, so that a GPU knows its pods.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nvplug.core.gpu import Gpu
from nvplug.core.snapshot import Snapshot
from nvplug.shaping.resource_plan import REPLICA_SEPARATOR

# Device IDs of resources in this domain may be ours, even under a name we no longer serve.
OUR_DOMAIN = "nvidia.com/"


@dataclass(frozen=True)
class ContainerDevices:
    """One container's devices of one resource, as PodResources lists them. A DRA device (its
    `dynamic_resources`) has `resource` its driver, `device_ids` its device name, and its pool and claim."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
    pool: str | None = None
    claim: str | None = None


@dataclass(frozen=True)
class Holder:
    """A container that holds a device (a GPU, a MIG device, or one replica of a GPU)."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str
    replica: int | None = None
    # DRA: the ResourceClaim through which the pod holds it (its container is not known then), and the pool.
    claim: str | None = None
    pool: str | None = None

    @property
    def text(self) -> str:
        """ml/trainer-0 (container main), or with `, replica 3`; ml/trainer-0 (claim gpus) through DRA."""
        if self.claim is not None:
            container = f"container {self.container}, " if self.container else ""
            return f"{self.namespace}/{self.pod} ({container}claim {self.claim})"
        replica = f", replica {self.replica}" if self.replica is not None else ""
        return f"{self.namespace}/{self.pod} (container {self.container}{replica})"

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Holder:
        """As /status gives it (`as_dict`): what the CLI shows from the daemon's answer."""
        return cls(
            str(doc.get("namespace")),
            str(doc.get("pod")),
            str(doc.get("container") or ""),
            str(doc.get("resource") or ""),
            str(doc.get("device_id") or ""),
            doc.get("replica"),
            doc.get("claim"),
            doc.get("pool"),
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "namespace": self.namespace,
            "pod": self.pod,
            "container": self.container,
            "resource": self.resource,
            "device_id": self.device_id,
            "replica": self.replica,
            "claim": self.claim,
            "pool": self.pool,
        }


def resolve(device_id: str, gpus: Iterable[Gpu]) -> tuple[str, int | None] | None:
    """The UUID of the GPU or MIG device behind a kubelet device ID, and the replica; None if not ours."""
    gpus = tuple(gpus)
    uuid, sep, replica_text = device_id.partition(REPLICA_SEPARATOR)
    replica = int(replica_text) if sep and replica_text.isdigit() else None
    if sep and replica is None:
        return None
    for gpu in gpus:
        if uuid == gpu.uuid or any(uuid == m.uuid for m in gpu.mig):
            return uuid, replica
    index, colon, mig_index = uuid.partition(":")
    if not sep and index.isdigit() and (not colon or mig_index.isdigit()):
        by_index = next((g for g in gpus if g.index == int(index)), None)
        if by_index is None:
            return None
        if not colon:
            return by_index.uuid, None
        position = int(mig_index)
        return (by_index.mig[position].uuid, None) if position < len(by_index.mig) else None
    return None


def holders(entries: Iterable[ContainerDevices], snap: Snapshot, served: Iterable[str]) -> dict[str, list[Holder]]:
    """Holders by the UUID of the device they hold (GPU or MIG). Resources neither served by nvplug nor in
    the nvidia.com domain are someone else's, and skipped: their `0` is not our GPU 0."""
    ours = set(served)
    out: dict[str, list[Holder]] = {}
    for entry in entries:
        if entry.pool is not None:
            continue  # a DRA device: its driver knows its names (DraDriver.holders)
        if entry.resource not in ours and not entry.resource.startswith(OUR_DOMAIN):
            continue
        for device_id in entry.device_ids:
            found = resolve(device_id, snap.gpus)
            if found is None:
                continue
            uuid, replica = found
            holder = Holder(entry.namespace, entry.pod, entry.container, entry.resource, device_id, replica)
            out.setdefault(uuid, []).append(holder)
    return out


def of_gpu(by_device: Mapping[str, list[Holder]], gpu: Gpu) -> list[Holder]:
    """Who holds the GPU: the whole GPU, a replica of it, or one of its MIG devices."""
    return [h for uuid in (gpu.uuid, *(m.uuid for m in gpu.mig)) for h in by_device.get(uuid, [])]
