"""The next snapshot under construction: NodeState's working copy of the node's picture.

It holds the steps every health change goes through (fault, heal, evidence, the readiness
check), so that each keeps the rules in node_state.py's docstring and notes what it changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from nvplug.core.gpu import Gpu, MigDevice
from nvplug.core.health import Clears, Fault, Health, HealthState, Recorded, merged_remedy
from nvplug.core.mig import CapMinors
from nvplug.core.mps_state import MpsGroupState
from nvplug.core.readiness import unready
from nvplug.core.snapshot import (
    NODE_FIELDS,
    REVISED,
    Change,
    GpuLookups,
    HungCall,
    LoggedFault,
    Snapshot,
    SwitchErrors,
    differs,
)
from nvplug.core.topology import Topology


class SnapshotDraft(GpuLookups):
    """The next snapshot under construction, with what changed on the way (its Changes)."""

    # The snapshot's fields (NODE_FIELDS), typed for the fold: __init__ copies each from the base,
    # and build() puts each back. Health and restored are dicts here, edited in place.
    gpus: tuple[Gpu, ...]
    health: dict[str, HealthState]
    nvml_error: str | None
    health_watch_error: str | None
    topology: Topology
    cap_minors: CapMinors
    driver_instance: str | None
    unready: Mapping[str, str]
    unresolved: Mapping[str, str]
    driver_version: str | None
    cuda_version: int | None
    restored: dict[str, Recorded]
    device_nodes: frozenset[str] | None
    kernel_log_error: str | None
    kernel_log_seq: int | None
    kernel_log_lost: int
    logged: Mapping[str, LoggedFault]
    switch_errors: Mapping[str, SwitchErrors]
    hung_calls: Mapping[int, HungCall]
    xids: Mapping[str, int]
    xid_codes: Mapping[str, tuple[tuple[int, int], ...]]
    xids_matched: int
    auto_reset: Mapping[str, str]
    auto_resets: Mapping[str, tuple[float, ...]]
    mps: Mapping[str, MpsGroupState]
    compute_modes: Mapping[str, int]
    cdi_extra: tuple[str, ...]

    def __init__(self, base: Snapshot, now: float) -> None:
        self.base = base
        self.now = now
        for name in NODE_FIELDS:
            setattr(self, name, getattr(base, name))
        self.health = dict(base.health)
        self.restored = dict(base.restored)
        self.changes: list[Change] = []
        # Devices whose health this event spoke of (a fault, evidence, a heal), changed or not.
        self.touched: set[str] = set()

    def note(self, change: Change) -> None:
        self.changes.append(change)

    def count_xid(self, gpu: Gpu, code: int) -> None:
        xids = dict(self.xids)
        xids[gpu.uuid] = xids.get(gpu.uuid, 0) + 1
        self.xids = MappingProxyType(xids)
        codes = dict(self.xid_codes.get(gpu.uuid, ()))
        seen = codes.pop(code, 0) + 1  # popped, so that the last one taken in comes last
        self.xid_codes = MappingProxyType({**self.xid_codes, gpu.uuid: (*codes.items(), (code, seen))})

    def fault(
        self,
        uuid: str,
        reason: str,
        clears: Clears,
        recovery_action: int = 0,
        remedy: str | None = None,
        *,
        kind: Fault = Fault.OTHER,
        xid: int | None = None,
    ) -> None:
        """A fault of a GPU or MIG device (logged under its GPU, the MIG device named first).

        It replaces the fault a device already has only when it needs more to clear, or when it
        comes after the evidence that would have cleared that one: evidence must follow the fault.
        """
        found = self.subject(uuid)
        current = self.health.get(uuid)
        if found is None or current is None:
            return
        gpu, subject = found
        self.touched.add(uuid)
        replaces = (
            current.healthy
            or current.clears is None
            or clears.rank > current.clears.rank
            or (clears is Clears.RESET and current.evidence is not None)
            # "Cannot be checked" gives way to what a check then found (NVML back, the GPU lost).
            or (current.fault is Fault.UNMONITORED and kind is not Fault.UNMONITORED)
        )
        if not replaces:
            kept = replace(
                current,
                recovery_action=recovery_action or current.recovery_action,
                # A second fault that needs a reset too may ask for more than a reset.
                remedy=merged_remedy(current.remedy, remedy) if clears is Clears.RESET else current.remedy,
            )
            if kept != current:
                self.health[uuid] = kept
            return
        instance = self.driver_instance if clears is Clears.RESET else None
        self.health[uuid] = HealthState(
            Health.UNHEALTHY,
            reason,
            self.now,
            clears,
            None,
            recovery_action or current.recovery_action,
            instance,
            remedy if clears is Clears.RESET else None,
            kind,
            xid,
        )
        self.note(Change("unhealthy" if current.healthy else "fault while unhealthy", gpu, subject + reason))

    def unallocatable(self, uuid: str) -> str | None:
        """Why Allocate could not hand the device out (a node missing, its CDI name unresolved), if so."""
        return self.unready.get(uuid) or self.unresolved.get(uuid)

    def check_ready(self, scanned: Mapping[str, str]) -> None:
        """What Allocate could not hand out: from the dev watch's listing where it runs (newer than a
        scan's look at /dev, which it may have overtaken on the bus), else as the scan found it."""
        nodes = self.device_nodes
        found = unready(self.gpus, self.cap_minors, nodes.__contains__) if nodes is not None else scanned
        self.unready = MappingProxyType(dict(found))
        self.recheck()

    def recheck(self) -> None:
        """Fault the devices Allocate could not hand out; heal those it could again."""
        for uuid, state in list(self.health.items()):
            problem = self.unallocatable(uuid)
            if problem is not None:
                self.fault(uuid, f"cannot be allocated: {problem}", Clears.CHECK)
            elif state.clears is Clears.CHECK:
                self.heal(uuid, "recovered: what Allocate needs is present now")

    def heal(self, uuid: str, reason: str) -> None:
        found = self.subject(uuid)
        current = self.health.get(uuid)
        if found is None or current is None or current.healthy:
            return
        self.touched.add(uuid)
        problem = self.unallocatable(uuid)
        if problem is not None:
            # Never Healthy while Allocate would refuse it.
            self.health[uuid] = HealthState(
                Health.UNHEALTHY, f"cannot be allocated: {problem}", self.now, Clears.CHECK, fault=Fault.OTHER
            )
            self.note(Change("fault while unhealthy", found[0], found[1] + self.health[uuid].reason))
            return
        self.health[uuid] = HealthState(Health.HEALTHY, reason, self.now)
        self.note(Change("healthy", found[0], found[1] + reason))

    def evidence(
        self, gpu: Gpu, text: str, *, after_recovery_action: bool = False, reloaded_from: str | None = None
    ) -> None:
        """Evidence of a repair for the GPU's faults (its MIG devices' too) that have none yet."""
        noted = False
        for uuid, state in list(self.devices_of(gpu)):
            if state.healthy or state.evidence is not None:
                continue
            if after_recovery_action and not state.recovery_action:
                continue  # "back to none" counts only after the driver asked for something
            if reloaded_from is not None and state.driver_instance in (None, reloaded_from):
                continue  # the fault happened under this driver instance, or we cannot tell
            self.health[uuid] = replace(state, evidence=text)
            self.touched.add(uuid)
            noted = True
        if noted:
            self.note(Change("recovery evidence", gpu, text))

    def subject(self, uuid: str) -> tuple[Gpu, str] | None:
        """The GPU to log a change under, and how the device is named before the reason."""
        gpu = self.gpu(uuid)
        if gpu is not None:
            return gpu, ""
        found = self.mig_owner(uuid)
        if found is None:
            return None
        gpu, mig = found
        return gpu, f"MIG {mig.profile} gi {mig.gpu_instance} ci {mig.compute_instance} ({mig.uuid}): "

    def mig_owner(self, uuid: str) -> tuple[Gpu, MigDevice] | None:
        return next(((g, m) for g in self.gpus for m in g.mig if m.uuid == uuid), None)

    def build(self) -> Snapshot | None:
        """The next snapshot; None when nothing changed.

        Counters alone (COUNTERS) change the snapshot, not its revision: a flood of harmless Xids
        or kernel log records must not wake every ListAndWatch stream and sink for each one. Nor
        do the UNLISTED fields, which no list carries."""
        base = self.base
        values = {name: getattr(self, name) for name in NODE_FIELDS}
        values["health"] = MappingProxyType(self.health)
        values["restored"] = MappingProxyType(self.restored)
        changed = frozenset(name for name, value in values.items() if differs(value, getattr(base, name)))
        if not changed:
            return None
        bumped = not changed.isdisjoint(REVISED)
        return replace(base, revision=base.revision + bumped, **values)
