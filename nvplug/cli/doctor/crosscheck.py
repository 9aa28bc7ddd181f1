"""The kubelet's view of nvplug's devices against nvplug's own, for `nvplug doctor`.

Three disagreements matter: a device the kubelet counts as allocatable while nvplug
says it is Unhealthy (pods would land on a broken GPU); a resource the kubelet still
lists though nvplug no longer serves it (capacity that is not there); and devices the
kubelet's checkpoint gives to pods that no longer run (capacity that is lost). Pure,
but for reading the kubelet's checkpoint file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvplug.pods.pod_holders import OUR_DOMAIN, ContainerDevices

# The kubelet's device-manager checkpoint, in its device-plugin directory.
CHECKPOINT = "kubelet_internal_checkpoint"


@dataclass(frozen=True)
class Finding:
    problem: str
    fix: str


@dataclass(frozen=True)
class CheckpointEntry:
    """One container's devices of one resource, as the kubelet's checkpoint records them."""

    pod_uid: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


def read_checkpoint(path: Path) -> list[CheckpointEntry]:
    """Its PodDeviceEntries (DeviceIDs by NUMA node since kubelet 1.20, a list before). Raises OSError, ValueError."""
    doc = json.loads(path.read_text())
    out = []
    for entry in (doc.get("Data") or {}).get("PodDeviceEntries") or []:
        ids: Any = entry.get("DeviceIDs") or []
        flat = [i for per_node in ids.values() for i in per_node] if isinstance(ids, dict) else list(ids)
        uid, container, resource = (str(entry.get(key, "?")) for key in ("PodUID", "ContainerName", "ResourceName"))
        out.append(CheckpointEntry(uid, container, resource, tuple(str(i) for i in flat)))
    return out


def unhealthy_ids(status: Mapping[str, Any]) -> dict[str, set[str]]:
    """The device IDs nvplug advertises as Unhealthy, by resource, from its /status document."""
    out: dict[str, set[str]] = {}
    for gpu in status.get("gpus") or []:
        sick_migs = {m.get("uuid") for m in gpu.get("mig") or [] if m.get("health") != "Healthy"}
        whole_sick = gpu.get("health") != "Healthy"
        for resource, ids in (gpu.get("advertised") or {}).items():
            for device_id in ids:
                if whole_sick or device_id in sick_migs:
                    out.setdefault(resource, set()).add(device_id)
    return out


def cross_check(
    status: Mapping[str, Any],
    allocatable: Mapping[str, Sequence[str]],
    pods: Iterable[ContainerDevices],
    checkpoint: Iterable[CheckpointEntry] = (),
) -> list[Finding]:
    served = {str(r.get("name")) for r in status.get("resources") or []}
    findings = []
    sick = unhealthy_ids(status)
    for resource, ids in sorted(allocatable.items()):
        wrong = sorted(set(ids) & sick.get(resource, set()))
        if wrong:
            findings.append(
                Finding(
                    f"the kubelet counts {len(wrong)} {resource} device(s) as allocatable that nvplug says are "
                    f"Unhealthy: {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}",
                    "the kubelet has not taken nvplug's last ListAndWatch list: check that nvplug is registered "
                    "(step 7) and its stream open (`journalctl -u nvplug | grep ListAndWatch`); "
                    "`systemctl restart nvplug` sends the list again",
                )
            )
        if resource.startswith(OUR_DOMAIN) and resource not in served and ids:
            findings.append(
                Finding(
                    f"the kubelet still lists {resource} ({len(ids)} devices) that nvplug does not serve",
                    "the kubelet keeps a stopped plugin's resource for 5 minutes; if it stays longer, another plugin "
                    "(NVIDIA's?) serves it: stop that one, or restart the kubelet to forget it",
                )
            )
    pods = list(pods)
    findings += _dra_findings(status.get("dra") or {}, pods)
    held = {(e.resource, i) for e in pods for i in e.device_ids}
    for entry in checkpoint:
        if entry.resource not in served and not entry.resource.startswith(OUR_DOMAIN):
            continue
        lost = [i for i in entry.device_ids if (entry.resource, i) not in held]
        if lost:
            findings.append(
                Finding(
                    f"the kubelet's checkpoint gives {entry.resource} {', '.join(lost[:3])} to pod {entry.pod_uid} "
                    f"(container {entry.container}), which no running pod holds",
                    "the kubelet frees a deleted pod's devices when it cleans up; if they stay held, "
                    "`systemctl restart kubelet` rebuilds its allocations from the running pods",
                )
            )
    return findings


def _dra_findings(dra: Mapping[str, Any], pods: Iterable[ContainerDevices]) -> list[Finding]:
    """The kubelet's DRA devices of nvplug's driver and pool (PodResources' dynamic resources, 1.36)
    against the claims nvplug prepared: a pod on a device nvplug never prepared for it is a fault."""
    if not dra:
        return []
    prepared = {(c.get("namespace"), c.get("name")): set(c.get("devices") or []) for c in dra.get("claims") or []}
    findings = []
    for entry in pods:
        if entry.pool is None or entry.resource != dra.get("driver") or entry.pool != dra.get("node"):
            continue
        claim = (entry.namespace, entry.claim)
        devices = prepared.get(claim)
        missing = [d for d in entry.device_ids if devices is None or d not in devices]
        if missing:
            findings.append(
                Finding(
                    f"the kubelet gives {entry.resource} {', '.join(missing)} to {entry.namespace}/{entry.pod} "
                    f"(container {entry.container}, claim {entry.claim}), which nvplug has not prepared for it",
                    "nvplug's claims checkpoint was lost or the claim was prepared by another driver instance: "
                    "delete the pod so that the kubelet prepares its claim again",
                )
            )
    return findings
