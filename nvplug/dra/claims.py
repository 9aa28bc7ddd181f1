"""Prepared ResourceClaims: what NodePrepareResources handed out, and the checkpoint that keeps prepare
and unprepare idempotent across restarts of nvplug and of the kubelet.

The kubelet sends a claim's namespace, name and UID only; the devices come from the claim's
allocation result in the API server. Unprepare may come after the claim is deleted, and the
kubelet may ask again for a claim prepared before a restart: both are answered from the checkpoint.
The checkpoint (nvplug.base.checkpoint) records the boot that wrote it but stays valid across boots,
as it always has: the kubelet's own record of prepared claims outlives a reboot too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from nvplug.base.checkpoint import Checkpoint, CheckpointError, read_checkpoint, seal, write_checkpoint
from nvplug.dra import opaque_config
from nvplug.dra.device_taints import untolerated
from nvplug.dra.dra_devices import DraDevice
from nvplug.dra.opaque_config import ClaimMps, ClaimSharing

log = logging.getLogger("nvplug.dra")

CHECKPOINT = "dra-claims.json"
CHECKPOINT_KIND = "nvplug.dra-claims"
# 1: {"version": 1, "claims"}, no envelope; 2: the same claims in the envelope.
CHECKPOINT_VERSION = 2


class ClaimError(ValueError):
    """Why one claim cannot be prepared; the kubelet shows it in the pod's events."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"ResourceClaim {self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True)
class PreparedDevice:
    # The claim's requests it serves (subrequests folded into their request).
    requests: tuple[str, ...]
    pool: str
    device: str
    uuid: str
    cdi_ids: tuple[str, ...]
    # How the claim's opaque config shares it (None: not at all): kept to undo it at unprepare.
    sharing: ClaimSharing | None = None


@dataclass(frozen=True)
class PreparedClaim:
    claim: ClaimRef
    devices: tuple[PreparedDevice, ...]
    # The pods the claim is reserved for (status.reservedFor, in the claim's namespace), as read at
    # prepare: who holds its GPUs, as PodResources says for the device plugin's.
    pods: tuple[str, ...] = ()
    # The MPS group whose control daemon serves its MPS devices (shared with the claims that joined it).
    mps_group: str | None = None
    # Its own CDI spec file (the claim's edits), removed at unprepare.
    cdi_spec: str | None = None

    def shared(self, strategy: str) -> tuple[PreparedDevice, ...]:
        """Its devices shared through this strategy (TimeSlicing, MPS)."""
        return tuple(d for d in self.devices if d.sharing is not None and d.sharing.strategy == strategy)


def prepare(
    ref: ClaimRef,
    claim: Mapping[str, Any],
    driver: str,
    pool: str,
    offered: Mapping[str, DraDevice],
    cdi_ids: Callable[[DraDevice], tuple[str, ...]],
) -> PreparedClaim:
    """The devices of this driver in the claim's allocation, each checked against the pool now."""
    meta = claim.get("metadata") or {}
    if meta.get("uid") != ref.uid:
        raise ClaimError(f"{ref}: the API server has UID {meta.get('uid')} under that name (deleted and made again?)")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"{ref}: not allocated")
    results = [r for r in (allocation.get("devices") or {}).get("results") or [] if r.get("driver") == driver]
    configs = opaque_config.applicable(allocation, driver)
    by_device: dict[str, list[str]] = {}
    sharing: dict[str, ClaimSharing | None] = {}
    for result in results:
        name, where = str(result.get("device")), str(result.get("pool"))
        if where != pool:
            raise ClaimError(f"{ref}: device {name} is in pool {where}, not in this node's pool {pool}")
        device = offered.get(name)
        if device is None:
            raise ClaimError(f"{ref}: device {name} is not offered by {driver} on {pool} (unknown device)")
        if not device.healthy and not result.get("adminAccess") and _refused(device, result.get("tolerations")):
            why = f" (its taints {', '.join(map(str, device.taints))} not tolerated)" if device.taints else ""
            raise ClaimError(f"{ref}: device {name} ({device.uuid}) is Unhealthy: {device.reason}{why}")
        found = _check_config(ref, device, configs, str(result.get("request", "")))
        if name in sharing and sharing[name] != found:
            raise ClaimError(f"{ref}: device {name} is shared two ways by the requests that name it")
        sharing[name] = found
        request = str(result.get("request", "")).split("/")[0]
        by_device.setdefault(name, []).append(request)
    devices = tuple(
        PreparedDevice(tuple(dict.fromkeys(r)), pool, name, offered[name].uuid, cdi_ids(offered[name]), sharing[name])
        for name, r in by_device.items()
    )
    return PreparedClaim(ref, devices, reserved_pods(claim))


def _check_config(ref: ClaimRef, device: DraDevice, configs: list[Any], request: str) -> ClaimSharing | None:
    """How the opaque config that applies to the device's request shares it, checked as NVIDIA's driver
    checks it (None: it is not shared)."""
    try:
        found = opaque_config.for_request(configs, request)
    except opaque_config.OpaqueConfigError as err:
        raise ClaimError(f"{ref}: request {request}: {err}") from err
    if found is None:
        return None
    want = opaque_config.MIG_CONFIG if device.mig is not None else opaque_config.GPU_CONFIG
    if found.kind != want:
        what = "MIG device" if device.mig is not None else "GPU"
        raise ClaimError(
            f"{ref}: request {request}: {found.where}: a {found.kind} cannot configure "
            f"{device.name}, a {what} (use {want})"
        )
    sharing = found.sharing
    cc = device.gpu.compute_capability
    if sharing is not None and sharing.strategy == "MPS" and cc is not None and cc < (7, 0):
        raise ClaimError(
            f"{ref}: request {request}: {found.where}: MPS needs a Volta or newer GPU; "
            f"{device.name} is compute capability {cc[0]}.{cc[1]}"
        )
    return sharing


def _refused(device: DraDevice, tolerations: Any) -> bool:
    """An Unhealthy device is handed out only where its taints let the scheduler give it: an effect of
    None, or one the request tolerates (a diagnostic pod's, say). Untainted, it is never."""
    if not device.taints:
        return True
    return bool(untolerated(device.taints, [t for t in tolerations or [] if isinstance(t, dict)]))


def reserved_pods(claim: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the pods in the claim's status.reservedFor (core group, resource pods)."""
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    return tuple(
        str(r["name"])
        for r in reserved
        if isinstance(r, dict) and r.get("resource") == "pods" and not r.get("apiGroup") and r.get("name")
    )


class ClaimStore:
    """The prepared claims by UID, saved to a file after each change (None: kept in memory only)."""

    def __init__(self, path: Path | None, boot_id: str | None = None) -> None:
        self.path = path
        # Recorded in the checkpoint for whoever reads it; a claim outlives a reboot here.
        self._boot_id = boot_id
        self._claims: dict[str, PreparedClaim] = {}
        # The time-slice intervals nvplug set, by GPU UUID, recorded before each is set: what a
        # restart after a crash sets back to Default where no prepared claim needs it any more.
        self.time_slices: dict[str, str] = {}

    def load(self) -> None:
        """What an earlier run prepared. A file that cannot be read is kept aside, not lost."""
        if self.path is None or not self.path.exists():
            return
        try:
            found = read_checkpoint(self.path, CHECKPOINT_KIND, CHECKPOINT_VERSION, legacy=_version_1)
            claims = [_claim_from(item) for item in found.body["claims"]]
            slices = {str(k): str(v) for k, v in (found.body.get("time_slices") or {}).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            aside = self.path.with_name(self.path.name + ".bad")
            why = err.reason if isinstance(err, CheckpointError) else err  # the path is in the line already
            log.error(
                "%s: unreadable DRA checkpoint (%s); kept as %s, starting with no prepared claims",
                self.path,
                why,
                aside,
            )
            self.path.replace(aside)
            return
        self._claims = {c.claim.uid: c for c in claims}
        self.time_slices = slices
        if claims:
            log.info("%d prepared ResourceClaims restored from %s", len(claims), self.path)

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def put(self, claim: PreparedClaim) -> None:
        self._claims[claim.claim.uid] = claim
        self._save()

    def record_time_slice(self, uuid: str, interval: str | None) -> None:
        """The interval nvplug sets on a GPU (None: Default again), saved before it is set."""
        if interval is None:
            self.time_slices.pop(uuid, None)
        else:
            self.time_slices[uuid] = interval
        self._save()

    def remove(self, uid: str) -> bool:
        if self._claims.pop(uid, None) is None:
            return False
        self._save()
        return True

    def __iter__(self) -> Iterator[PreparedClaim]:
        return iter(list(self._claims.values()))

    def __len__(self) -> int:
        return len(self._claims)

    def holding(self, uuid: str) -> list[PreparedClaim]:
        """The claims prepared with this device (a GPU's UUID also finds claims of its MIG devices'
        parent: callers pass each UUID they care about)."""
        return [c for c in self._claims.values() if any(d.uuid == uuid for d in c.devices)]

    def _save(self) -> None:
        if self.path is None:
            return
        body = {"claims": [asdict(c) for c in self._claims.values()], "time_slices": dict(self.time_slices)}
        write_checkpoint(self.path, seal(CHECKPOINT_KIND, CHECKPOINT_VERSION, body, self._boot_id))


def _version_1(doc: dict[str, Any]) -> Checkpoint:
    """A checkpoint from before the envelope: {"version": 1, "claims": [...]}, no checksum, no boot id."""
    if doc.get("version") != 1:
        raise ValueError(f"version {doc.get('version')!r} without the envelope (kind, sha256): only 1 had none")
    return Checkpoint(CHECKPOINT_KIND, 1, None, {"claims": doc.get("claims")}, sealed=False)


def _claim_from(item: Mapping[str, Any]) -> PreparedClaim:
    ref = ClaimRef(str(item["claim"]["namespace"]), str(item["claim"]["name"]), str(item["claim"]["uid"]))
    devices = tuple(_device_from(d) for d in item["devices"])
    # Absent in checkpoints from before the pods, and then sharing, were kept.
    group, spec = item.get("mps_group"), item.get("cdi_spec")
    pods = tuple(map(str, item.get("pods") or ()))
    return PreparedClaim(ref, devices, pods, None if group is None else str(group), None if spec is None else str(spec))


def _device_from(d: Mapping[str, Any]) -> PreparedDevice:
    requests, cdi_ids = tuple(map(str, d["requests"])), tuple(map(str, d["cdi_ids"]))
    return PreparedDevice(
        requests, str(d["pool"]), str(d["device"]), str(d["uuid"]), cdi_ids, _sharing_from(d.get("sharing"))
    )


def _sharing_from(d: Mapping[str, Any] | None) -> ClaimSharing | None:
    """A device's sharing as asdict wrote it."""
    if d is None:
        return None
    mps = d.get("mps")
    limits = None
    if mps is not None:
        per_device = mps.get("per_device_mib")
        limits = ClaimMps(
            mps.get("active_thread_percentage"),
            mps.get("pinned_memory_mib"),
            None if per_device is None else {str(k): int(v) for k, v in per_device.items()},
        )
    return ClaimSharing(d["strategy"], str(d.get("interval", "Default")), limits)
