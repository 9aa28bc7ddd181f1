"""The node's state: inventory plus health per GPU, under one revision number.

Pure: events go in, a new immutable Snapshot comes out. Sinks wait for a
revision newer than the one they last acted on, so a burst of events costs
them one wake-up, not one per event.

Health policy lives here too. A GPU turns Unhealthy on an event that says so,
and turns Healthy again only on evidence: a probe that passed after its PCI
device was removed and re-added or unbound and re-bound, after NVML's
recovery action went back to none, or a re-probe of the Unhealthy GPU.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from .event import (
    Event,
    HealthReported,
    HealthWatchChanged,
    InventoryFound,
    NvmlFailed,
    PciChanged,
    ProbeResult,
    RecoveryActionChanged,
    XidOccurred,
)
from .gpu import Gpu, MigDevice
from .health import Health, HealthState
from .mig import CapMinors
from .topology import Topology
from .xid import Verdict, XidPolicy

RECOVERY_ACTIONS = {0: "none", 1: "GPU reset", 2: "node reboot", 3: "drain P2P", 4: "drain and reset"}


def find_gpu(gpus: tuple[Gpu, ...], uuid: str | None = None, bus_id: str | None = None) -> Gpu | None:
    return next((g for g in gpus if g.uuid == uuid or g.bus_id == bus_id), None)


@dataclass(frozen=True)
class Snapshot:
    revision: int
    gpus: tuple[Gpu, ...] = ()
    health: Mapping[str, HealthState] = field(default_factory=lambda: MappingProxyType({}))
    # Why NVML cannot be used right now; None while it works.
    nvml_error: str | None = None
    # Why health events cannot be received right now; None while they can.
    health_watch_error: str | None = None
    # Links between GPUs, read with the inventory.
    topology: Topology = field(default_factory=Topology)
    # The /dev/nvidia-caps minors of the MIG instances, read with the inventory.
    cap_minors: CapMinors = field(default_factory=CapMinors)

    def gpu(self, uuid: str) -> Gpu | None:
        return find_gpu(self.gpus, uuid=uuid)

    def by_bus_id(self, bus_id: str) -> Gpu | None:
        return find_gpu(self.gpus, bus_id=bus_id)

    def unhealthy(self) -> tuple[Gpu, ...]:
        """GPUs that are Unhealthy or hold an Unhealthy MIG device: the ones worth re-probing."""
        return tuple(
            g for g in self.gpus if not all(self.health[u].healthy for u in (g.uuid, *(m.uuid for m in g.mig)))
        )


@dataclass(frozen=True)
class Change:
    """One thing an event changed or meant, for the log and later for metrics."""

    what: str
    gpu: Gpu | None = None
    reason: str = ""


class NodeState:
    def __init__(self, xid_policy: XidPolicy | None = None, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._xid = xid_policy or XidPolicy()
        self._current = Snapshot(revision=0)
        # Replaced on every revision; waiters hold the one they saw.
        self._bumped = asyncio.Event()
        # GPUs whose PCI device was removed or unbound: a passing probe on the next scan heals them.
        self._reset_seen: dict[str, str] = {}

    @property
    def current(self) -> Snapshot:
        return self._current

    @property
    def xid_policy(self) -> XidPolicy:
        return self._xid

    def set_xid_policy(self, policy: XidPolicy) -> None:
        """A new config; it applies to XIDs from now on."""
        self._xid = policy

    def apply(self, event: Event) -> list[Change]:
        """Fold one event into the state; bump the revision only if the picture changed."""
        draft = _Draft(self._current, self._clock())
        if isinstance(event, InventoryFound):
            self._inventory(draft, event)
        elif isinstance(event, ProbeResult):
            self._probe(draft, event, rescan=False)
        elif isinstance(event, HealthReported):
            draft.set_health(event.uuid, event.health, event.reason)
        elif isinstance(event, XidOccurred):
            self._xid_event(draft, event)
        elif isinstance(event, RecoveryActionChanged):
            self._recovery_action(draft, event)
        elif isinstance(event, PciChanged):
            self._pci(draft, event)
        elif isinstance(event, NvmlFailed):
            self._nvml_failed(draft, event)
        elif isinstance(event, HealthWatchChanged) and draft.health_watch_error != event.error:
            draft.health_watch_error = event.error
            what = "health watch failed" if event.error else "health watch running"
            draft.note(Change(what, reason=event.error or ""))
        snap = draft.build()
        if snap is not None:
            self._publish(snap)
        return draft.changes

    async def wait_past(self, revision: int) -> Snapshot:
        """Return the first snapshot newer than `revision`, waiting if needed."""
        while self._current.revision <= revision:
            await self._bumped.wait()
        return self._current

    def _publish(self, snap: Snapshot) -> None:
        self._current = snap
        bumped, self._bumped = self._bumped, asyncio.Event()
        bumped.set()

    def _inventory(self, draft: _Draft, event: InventoryFound) -> None:
        before = {g.uuid: g for g in draft.gpus}
        after = {g.uuid: g for g in event.gpus}
        # A GPU NVML still counts but cannot name (it fell off the bus) is not gone: keep
        # as many of the vanished as NVML counts lost, Unhealthy, until udev says removed.
        vanished = [g for g in draft.gpus if g.uuid not in after]
        vanished.sort(key=lambda g: draft.health[g.uuid].healthy)  # already Unhealthy ones first
        kept = vanished[: event.lost]
        after.update({g.uuid: g for g in kept})
        for uuid, gpu in after.items():
            if uuid not in before:
                draft.health[uuid] = HealthState(Health.HEALTHY, "discovered", draft.now)
                draft.note(Change("added", gpu))
            elif before[uuid] != gpu:
                draft.note(Change("changed", gpu))
        for uuid, gpu in before.items():
            if uuid not in after:
                del draft.health[uuid]
                self._reset_seen.pop(uuid, None)
                draft.note(Change("removed", gpu))
        # MIG devices carry their own health (instance-scoped XIDs); new ones start Healthy.
        migs = {m.uuid for g in event.gpus for m in g.mig}
        for uuid in [u for u in draft.health if u not in after and u not in migs]:
            del draft.health[uuid]
        for uuid in migs - draft.health.keys():
            draft.health[uuid] = HealthState(Health.HEALTHY, "discovered", draft.now)
        draft.gpus = tuple(sorted(after.values(), key=lambda g: g.index))
        for gpu in kept:
            draft.set_health(gpu.uuid, Health.UNHEALTHY, "GPU is lost: NVML counts it but cannot read it")
        draft.topology = event.topology
        draft.cap_minors = event.cap_minors
        if draft.nvml_error is not None:
            draft.note(Change("nvml recovered", reason=draft.nvml_error))
            draft.nvml_error = None
        for probe in event.probes:
            self._probe(draft, probe, rescan=True)

    def _nvml_failed(self, draft: _Draft, event: NvmlFailed) -> None:
        if draft.nvml_error == event.reason:
            return
        draft.nvml_error = event.reason
        draft.note(Change("nvml failed", reason=event.reason))
        # Nothing can check these GPUs now: stop offering them until NVML is back and probes pass.
        for gpu in draft.gpus:
            if draft.health[gpu.uuid].healthy:
                self._reset_seen[gpu.uuid] = "NVML available again"
            draft.set_health(gpu.uuid, Health.UNHEALTHY, f"NVML unavailable: {event.reason}")

    def _probe(self, draft: _Draft, probe: ProbeResult, rescan: bool) -> None:
        gpu = draft.gpu(probe.uuid)
        if gpu is None:
            return
        if probe.failure is not None:
            draft.set_health(probe.uuid, Health.UNHEALTHY, f"probe failed: {probe.failure}")
            return
        sick_migs = [m for m in gpu.mig if not draft.health[m.uuid].healthy]
        if draft.health[probe.uuid].healthy and not sick_migs:
            return
        how = self._reset_seen.pop(probe.uuid, None)
        if rescan and how is None:
            return  # a scan alone is no evidence for a GPU already known Unhealthy
        evidence = how or probe.evidence
        draft.set_health(probe.uuid, Health.HEALTHY, f"recovered: {evidence}, probe passed")
        # The GPU's recovery covers faults of its MIG devices too.
        for mig in gpu.mig:
            draft.set_health(mig.uuid, Health.HEALTHY, f"recovered with its GPU: {evidence}")

    def _xid_event(self, draft: _Draft, event: XidOccurred) -> None:
        gpu = draft.gpu(event.uuid)
        if gpu is None:
            return
        decision = self._xid.decide(event.code)
        # An XID that names a GPU and compute instance belongs to that MIG device alone.
        mig = next(
            (
                m
                for m in gpu.mig
                if (m.gpu_instance, m.compute_instance) == (event.gpu_instance, event.compute_instance)
            ),
            None,
        )
        if decision.verdict is Verdict.UNHEALTHY:
            draft.set_health(mig.uuid if mig else event.uuid, Health.UNHEALTHY, decision.reason)
        elif decision.verdict is Verdict.HEALTHY:
            # Worth a log line even though the picture does not change.
            draft.note(Change("xid, stays healthy", gpu, decision.reason))
        elif decision.verdict is Verdict.INFORMATIONAL:
            draft.note(Change("xid without catalog action", gpu, decision.reason))
        else:
            draft.note(Change("xid, reading the recovery action", gpu, decision.reason))

    def _recovery_action(self, draft: _Draft, event: RecoveryActionChanged) -> None:
        gpu = draft.gpu(event.uuid)
        if gpu is None:
            return
        name = RECOVERY_ACTIONS.get(event.action, f"action {event.action}")
        if event.action != 0:
            draft.set_health(event.uuid, Health.UNHEALTHY, f"NVML recovery action: {name}")
        elif not draft.health[event.uuid].healthy:
            # The driver says nothing is needed any more; a probe must still confirm it.
            self._reset_seen[event.uuid] = "NVML recovery action back to none"
            draft.note(Change("recovery evidence", gpu, "NVML recovery action back to none"))

    def _pci(self, draft: _Draft, event: PciChanged) -> None:
        gpu = draft.by_bus_id(event.bus_id)
        if gpu is None:
            return
        if event.action == "remove":
            # Gone from the bus: no ID to offer, so the kubelet sees it removed.
            del draft.health[gpu.uuid]
            draft.gpus = tuple(g for g in draft.gpus if g.uuid != gpu.uuid)
            self._reset_seen.pop(gpu.uuid, None)
            draft.note(Change("removed", gpu, "PCI device removed"))
        elif event.action == "unbind":
            # Still on the bus, perhaps being reset: keep the ID, stop offering it.
            self._reset_seen[gpu.uuid] = "driver unbound and re-bound"
            draft.set_health(gpu.uuid, Health.UNHEALTHY, "driver unbound from the PCI device")


class _Draft:
    """The next snapshot under construction, with what changed on the way."""

    def __init__(self, base: Snapshot, now: float) -> None:
        self.base = base
        self.now = now
        self.gpus = base.gpus
        self.health = dict(base.health)
        self.nvml_error = base.nvml_error
        self.health_watch_error = base.health_watch_error
        self.topology = base.topology
        self.cap_minors = base.cap_minors
        self.changes: list[Change] = []

    def gpu(self, uuid: str) -> Gpu | None:
        return find_gpu(self.gpus, uuid=uuid)

    def by_bus_id(self, bus_id: str) -> Gpu | None:
        return find_gpu(self.gpus, bus_id=bus_id)

    def note(self, change: Change) -> None:
        self.changes.append(change)

    def set_health(self, uuid: str, health: Health, reason: str) -> None:
        """For a GPU, or a MIG device (logged under its GPU, the MIG device named first)."""
        gpu = self.gpu(uuid)
        subject = ""
        if gpu is None:
            found = self.mig_owner(uuid)
            if found is None:
                return
            gpu, mig = found
            subject = f"MIG {mig.profile} gi {mig.gpu_instance} ci {mig.compute_instance} ({mig.uuid}): "
        current = self.health.get(uuid)
        if current is None or current.health is health:
            return
        self.health[uuid] = HealthState(health, reason, self.now)
        self.note(Change(health.value.lower(), gpu, subject + reason))

    def mig_owner(self, uuid: str) -> tuple[Gpu, MigDevice] | None:
        return next(((g, m) for g in self.gpus for m in g.mig if m.uuid == uuid), None)

    def build(self) -> Snapshot | None:
        base = self.base
        unchanged = (
            self.gpus == base.gpus
            and self.health == base.health
            and self.nvml_error == base.nvml_error
            and self.health_watch_error == base.health_watch_error
            and self.topology == base.topology
            and self.cap_minors == base.cap_minors
        )
        if unchanged:
            return None
        return replace(
            base,
            revision=base.revision + 1,
            gpus=self.gpus,
            health=MappingProxyType(self.health),
            nvml_error=self.nvml_error,
            health_watch_error=self.health_watch_error,
            topology=self.topology,
            cap_minors=self.cap_minors,
        )
