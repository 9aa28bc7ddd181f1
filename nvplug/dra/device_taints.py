"""Device taints (KEP-5055): an Unhealthy device stays in its slice, marked, instead of leaving the pool.

A taint tells the scheduler what is wrong (a broken GPU is not an absent one): NoSchedule keeps new
claims off it, NoExecute has the control plane evict the pods that hold it, None only says so. The
keys are those of NVIDIA's DRA driver, so that tolerations written for it work unchanged; nvplug
owns every taint under them and keeps every other one (an admin's) as the API server stores it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nvplug.config import TaintEffect, TaintEffects
from nvplug.core.health import Fault, HealthState

XID_KEY = "gpu.nvidia.com/xid"
LOST_KEY = "gpu.nvidia.com/gpu-lost"
UNMONITORED_KEY = "gpu.nvidia.com/unmonitored"
# Any other fault; its value says what clears it (reset, probe, check).
UNHEALTHY_KEY = "gpu.nvidia.com/unhealthy"
OWN_KEYS = frozenset({XID_KEY, LOST_KEY, UNMONITORED_KEY, UNHEALTHY_KEY})
# The API's limits: taints per device, and devices in a slice with any taint (against 128).
MAX_TAINTS = 16
MAX_TAINTED_DEVICES = 64
# Effects that keep a claim off the device unless it tolerates them.
BINDING = frozenset({"NoSchedule", "NoExecute"})
# What makes two taints the same taint; timeAdded is when it came.
_IDENTITY = ("key", "value", "effect")


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: TaintEffect

    def as_object(self) -> dict[str, str]:
        """As a slice holds it, without timeAdded: the API server sets it (or it is copied from the stored one)."""
        out = {"key": self.key, "effect": self.effect}
        if self.value:
            out["value"] = self.value
        return out

    def __str__(self) -> str:
        return f"{self.key}{'=' + self.value if self.value else ''}:{self.effect}"


def taints_for(state: HealthState, unchecked: bool, effects: TaintEffects) -> tuple[Taint, ...]:
    """The taint a device's health asks for: its fault's, or `unchecked` (an NVML call on its GPU hangs)."""
    out = [] if state.healthy else [_fault_taint(state, effects)]
    if unchecked and not any(t.key == UNMONITORED_KEY for t in out):
        out.append(Taint(UNMONITORED_KEY, "", effects.unmonitored))
    return tuple(out)


def _fault_taint(state: HealthState, effects: TaintEffects) -> Taint:
    match state.fault:
        case Fault.XID:
            return Taint(XID_KEY, str(state.xid) if state.xid is not None else "", effects.xid)
        case Fault.LOST:
            return Taint(LOST_KEY, "", effects.gpu_lost)
        case Fault.UNMONITORED:
            return Taint(UNMONITORED_KEY, "", effects.unmonitored)
        case Fault.OTHER | None:
            return Taint(UNHEALTHY_KEY, state.clears.value if state.clears else "", effects.unhealthy)


def unmonitored(taints: Iterable[Taint]) -> bool:
    """Whether nvplug cannot check the device, and knows no fault of it: what the kubelet calls Unknown."""
    keys = {t.key for t in taints}
    return UNMONITORED_KEY in keys and not keys - {UNMONITORED_KEY}


def untolerated(taints: Iterable[Taint], tolerations: Sequence[Mapping[str, Any]]) -> list[Taint]:
    """The taints that keep a claim off the device: binding ones none of its tolerations match."""
    return [t for t in taints if t.effect in BINDING and not any(tolerates(tol, t) for tol in tolerations)]


def tolerates(toleration: Mapping[str, Any], taint: Taint) -> bool:
    """A DeviceToleration against a taint, as the scheduler matches them."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.effect:
        return False
    key = toleration.get("key") or ""
    if (toleration.get("operator") or "Equal") == "Exists":
        return not key or key == taint.key
    return key == taint.key and (toleration.get("value") or "") == taint.value


def taint_fields(device: dict[str, Any]) -> dict[str, Any]:
    """Where a device object keeps its taints: under `basic` (v1beta1), or on the device itself."""
    basic = device.get("basic")
    return basic if isinstance(basic, dict) else device


def keep_stored(wanted: list[dict[str, Any]], stored: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Our devices with what the API server keeps of their taints, in the stored order: each of our
    taints that is stored already keeps its timeAdded (a PUT without it resets it, and NoExecute's
    tolerationSeconds count from it), and every taint under another key (an admin's) is kept."""
    by_name = {str(d.get("name")): taint_fields(dict(d)).get("taints") or [] for s in stored for d in _devices(s)}
    out = []
    for device in wanted:
        held = [t for t in by_name.get(str(device.get("name")), []) if isinstance(t, dict)]
        remaining = list(taint_fields(device).get("taints") or [])
        merged = []
        for old in held:
            if old.get("key") not in OWN_KEYS:
                merged.append(old)
                continue
            same = next((t for t in remaining if all(t.get(k, "") == old.get(k, "") for k in _IDENTITY)), None)
            if same is not None:
                remaining.remove(same)
                merged.append({**same, "timeAdded": old["timeAdded"]} if old.get("timeAdded") else same)
        merged = _at_most(merged + remaining)
        if not merged:
            out.append(device)
        elif "basic" in device:
            out.append({**device, "basic": {**device["basic"], "taints": merged}})
        else:
            out.append({**device, "taints": merged})
    return out


def others(stored: Iterable[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The taints under keys nvplug does not own (an admin's), by device name, as the API server stores them."""
    found: dict[str, list[dict[str, Any]]] = {}
    for slice_ in stored:
        for device in _devices(slice_):
            theirs = [t for t in taint_fields(dict(device)).get("taints") or [] if t.get("key") not in OWN_KEYS]
            if theirs:
                found[str(device.get("name"))] = [dict(t) for t in theirs]
    return found


def as_stored(taints: Mapping[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Taints by device name as a stored slice holds them: what keep_stored merges from."""
    return [{"spec": {"devices": [{"name": name, "taints": list(t)} for name, t in sorted(taints.items())]}}]


def stored_taint_text(taint: Mapping[str, Any]) -> str:
    """A stored taint as `key=value:Effect`."""
    value = taint.get("value")
    return f"{taint.get('key')}{'=' + str(value) if value else ''}:{taint.get('effect')}"


def kept(sent: Iterable[Mapping[str, Any]], stored: Iterable[Mapping[str, Any]]) -> bool:
    """Whether the API server kept the taints we sent: a server with DRADeviceTaints off drops the field."""
    ours = sum(1 for d in sent for t in taint_fields(dict(d)).get("taints") or [] if t.get("key") in OWN_KEYS)
    back = sum(1 for d in stored for t in taint_fields(dict(d)).get("taints") or [] if t.get("key") in OWN_KEYS)
    return ours == 0 or back >= ours


def _at_most(taints: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The API's 16 taints of a device, others' cut before ours: a fault left unsaid is a device untainted."""
    spare = MAX_TAINTS - sum(1 for t in taints if t.get("key") in OWN_KEYS)
    out = []
    for taint in taints:
        if taint.get("key") not in OWN_KEYS:
            if spare <= 0:
                continue
            spare -= 1
        out.append(taint)
    return out[:MAX_TAINTS]


def _devices(slice_: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list((slice_.get("spec") or {}).get("devices") or [])
