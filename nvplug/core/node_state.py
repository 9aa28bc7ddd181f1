"""NodeState: the fold of events into the node's next Snapshot (snapshot.py), under one revision number.

Pure: events go in, a new immutable Snapshot comes out. Sinks wait for a
revision newer than the one they last acted on, so a burst of events costs
them one wake-up, not one per event.

Health policy lives here too. A device turns Unhealthy on an event that says
so, and each fault records what clears it (health.Clears): a passing probe for
a GPU that was only unreachable; a scan that finds what Allocate needs; and
for a fault that needs a reset, evidence of one (the PCI device removed and
added or unbound and re-bound, NVML's recovery action back to none after it
asked for something, a reloaded driver, an operator's heal) followed by a
passing probe. A passing probe alone never clears a fault that needs a reset.
The steps each change takes (fault, heal, evidence) are SnapshotDraft's, in snapshot_draft.py.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import assert_never

from nvplug.core.events import (
    AutoResetStep,
    CdiChecked,
    ComputeModeRecorded,
    DeviceNodesChanged,
    DriverLoaded,
    Event,
    EvidenceFound,
    GpuFellOffBus,
    GpuNamedInLog,
    HealthReported,
    HealthWatchChanged,
    InventoryFound,
    KernelLogLost,
    KernelLogState,
    KernelXid,
    KubeletSocketCreated,
    MigConfigChanged,
    MpsGroupChanged,
    MpsGroupRemoved,
    NotesChanged,
    NvmlCallHung,
    NvmlFailed,
    PciChanged,
    PluginSocketRemoved,
    ProbeResult,
    RecoveryActionChanged,
    SwitchXid,
    WatchedDirChanged,
    XidOccurred,
)
from nvplug.core.gpu import Gpu
from nvplug.core.health import RESET_GPU, Clears, Fault, Health, HealthState, Recorded
from nvplug.core.mps_state import apply_group
from nvplug.core.snapshot import Change, HungCall, LoggedFault, Snapshot, SwitchErrors
from nvplug.core.snapshot_draft import SnapshotDraft
from nvplug.core.xid_policy import Verdict, XidPolicy

RECOVERY_ACTIONS = {0: "none", 1: "GPU reset", 2: "node reboot", 3: "drain P2P", 4: "drain and reset"}
GPU_RESET_ACTION = 1  # the driver asks for a GPU reset and nothing more
DRIVER_RELOADED = "the NVIDIA driver was reloaded"
DRIVER_LOADED = "the NVIDIA driver was loaded again (kernel log)"
# The same Xid from NVML and from the kernel log within this long is one fault, not two.
SAME_XID_SECONDS = 5.0
# The sources that report Xids, and how many unmatched reports of one Xid each keeps.
XID_SOURCES = (XidOccurred.source, KernelXid.source)
MAX_WAITING_REPORTS = 256
# Changes after which a GPU's earlier Xid reports are no one's word on a later fault.
ENDS_A_FAULT = ("healthy", "recovery evidence", "removed")
FELL_OFF_THE_BUS = 79  # the kernel's "fallen off the bus" line is Xid 79's fault, with or without the Xid


class NodeState:
    def __init__(
        self,
        xid_policy: XidPolicy | None = None,
        clock: Callable[[], float] = time.time,
        restored: Mapping[str, Recorded] | None = None,
        kernel_log_seq: int | None = None,
        auto_resets: Mapping[str, tuple[float, ...]] | None = None,
        compute_modes: Mapping[str, int] | None = None,
    ) -> None:
        self._clock = clock
        self._xid = xid_policy or XidPolicy()
        self._current = Snapshot(
            revision=0,
            restored=MappingProxyType(dict(restored or {})),
            kernel_log_seq=kernel_log_seq,
            auto_resets=MappingProxyType(dict(auto_resets or {})),
            compute_modes=MappingProxyType(dict(compute_modes or {})),
        )
        # When each source reported Xids the other source has not yet, by (GPU UUID, code, source),
        # oldest first: a flood of one code costs O(1) per report, not a scan of every report. By
        # UUID, not bus id: a GPU hot-added where another was must not match that one's reports.
        self._reports: dict[tuple[str, int, str], deque[float]] = {}
        # When the latest word on each device's health arrived (the `arrived` of apply): a probe
        # that began before it may have read what that word replaced, and is not counted.
        self._news: dict[str, float] = {}
        # When udev said each PCI address was removed (`arrived`), until a scan begun after it is applied:
        # a scan under way then may have read the GPU before it went.
        self._pci_removed: dict[str, float] = {}

    @property
    def current(self) -> Snapshot:
        return self._current

    @property
    def xid_policy(self) -> XidPolicy:
        return self._xid

    def set_xid_policy(self, policy: XidPolicy) -> None:
        """A new config; it applies to XIDs from now on."""
        self._xid = policy

    def apply(self, event: Event, arrived: float | None = None) -> list[Change]:
        """Fold one event into the state; bump the revision only if the picture changed.
        `arrived`: when its source published it (time.monotonic()), which orders it against probes."""
        draft = SnapshotDraft(self._current, self._clock())
        match event:
            case InventoryFound():
                self._inventory(draft, event)
            case ProbeResult():
                self._probe(draft, event)
            case HealthReported():
                draft.fault(event.uuid, event.reason, event.clears, kind=event.fault)
            case EvidenceFound():
                gpu = draft.gpu(event.uuid)
                if gpu is not None:
                    draft.evidence(gpu, event.evidence)
            case XidOccurred():
                self._xid_event(draft, event)
            case RecoveryActionChanged():
                self._recovery_action(draft, event)
            case PciChanged():
                if event.action == "remove" and arrived is not None:
                    self._pci_removed[event.bus_id] = arrived
                self._pci(draft, event)
            case NvmlFailed():
                self._nvml_failed(draft, event)
            case CdiChecked():
                draft.unresolved = MappingProxyType(dict(event.unresolved))
                draft.cdi_extra = event.extra
                draft.recheck()
            case DeviceNodesChanged():
                # The same check a scan makes, from the nodes the watch listed: no NVML call needed.
                draft.device_nodes = event.present
                draft.check_ready(draft.unready)
            case KernelXid() | GpuFellOffBus() | DriverLoaded() | GpuNamedInLog() | SwitchXid():
                self._kernel_record(draft, event)
            case AutoResetStep():
                self._auto_reset(draft, event)
            case NvmlCallHung():
                self._hung_call(draft, event)
            case MpsGroupChanged() | MpsGroupRemoved():
                self._mps(draft, event)
            case ComputeModeRecorded():
                modes = {u: m for u, m in draft.compute_modes.items() if u != event.uuid}
                if event.original is not None:
                    modes[event.uuid] = event.original
                draft.compute_modes = MappingProxyType(modes)
            case KernelLogLost():
                draft.kernel_log_lost += event.count or 0
                draft.note(Change("kernel log records lost", reason=event.why))
            case KernelLogState():
                if draft.kernel_log_error != event.error:
                    draft.kernel_log_error = event.error
                    what = "kernel log unreadable" if event.error else "kernel log read"
                    draft.note(Change(what, reason=event.error or ""))
            case HealthWatchChanged():
                if draft.health_watch_error != event.error:
                    draft.health_watch_error = event.error
                    what = "health watch failed" if event.error else "health watch running"
                    draft.note(Change(what, reason=event.error or ""))
            case KubeletSocketCreated() | PluginSocketRemoved() | MigConfigChanged() | WatchedDirChanged():
                pass  # work for the dispatcher (register, rescan), nothing in the node's picture
            case NotesChanged():
                pass  # the daemon's word to its status report
            case _:
                assert_never(event)
        # A report from before a repair cannot be the other source's word on a fault after it.
        repaired = {c.gpu.uuid for c in draft.changes if c.gpu and c.what in ENDS_A_FAULT}
        if repaired:
            for key in [k for k in self._reports if k[0] in repaired]:
                del self._reports[key]
            healed = {u for u in repaired if u in draft.health and draft.health[u].healthy}
            if healed & set(draft.auto_reset):
                draft.auto_reset = MappingProxyType({u: s for u, s in draft.auto_reset.items() if u not in healed})
        built = draft.build()
        if built is not None:
            self._current = built
        if arrived is not None:
            self._news.update(dict.fromkeys(draft.touched, arrived))
            if len(self._news) > len(self._current.health):
                self._news = {u: t for u, t in self._news.items() if u in self._current.health}
        return draft.changes

    def _mps(self, draft: SnapshotDraft, event: MpsGroupChanged | MpsGroupRemoved) -> None:
        before = draft.mps.get(event.group)
        draft.mps, what = apply_group(draft.mps, event, draft.now)
        if what is None:
            return
        units = event.units if isinstance(event, MpsGroupChanged) else before.units if before else ()
        owner = next((s[0] for u in units if (s := draft.subject(u)) is not None), None)
        reason = event.reason if isinstance(event, MpsGroupChanged) else "no MPS resource has its devices now"
        draft.note(Change(what, owner, f"MPS group {event.group}: {reason}"))

    def _inventory(self, draft: SnapshotDraft, event: InventoryFound) -> None:
        before = {g.uuid: g for g in draft.gpus}
        after = {g.uuid: g for g in event.gpus if not self._removed_since(g.bus_id, event.started)}
        if event.started is not None:
            self._pci_removed = {b: t for b, t in self._pci_removed.items() if t > event.started}
        # A GPU NVML still counts but cannot name (it fell off the bus) is not gone: keep
        # as many of the vanished as NVML counts lost, Unhealthy, until udev says removed.
        vanished = [g for g in draft.gpus if g.uuid not in after]
        vanished.sort(key=lambda g: draft.health[g.uuid].healthy)  # already Unhealthy ones first
        kept = vanished[: event.lost]
        after.update({g.uuid: g for g in kept})
        for uuid, gpu in after.items():
            if uuid not in before:
                draft.note(Change("added", gpu))
            elif before[uuid] != gpu:
                draft.note(Change("changed", gpu))
        for uuid, gpu in before.items():
            if uuid not in after:
                draft.note(Change("removed", gpu))
                # Out of NVML's list with no word from udev: the same GPU found again is no repaired
                # one, so its faults wait for it as a state file's do (a PCI remove or reset ends them).
                draft.restored.update((u, Recorded(gpu.bus_id, s)) for u, s in draft.devices_of(gpu) if not s.healthy)
        draft.gpus = tuple(sorted(after.values(), key=lambda g: g.index))
        # Health for every device present: kept, restored from the state file, or new and Healthy.
        present = [(u, g) for g in draft.gpus for u in (g.uuid, *(m.uuid for m in g.mig))]
        known = {u for u, _ in present}
        for uuid in [u for u in draft.health if u not in known]:
            del draft.health[uuid]
        for uuid, gpu in present:
            if uuid not in draft.health:
                draft.health[uuid] = self._first_health(draft, uuid, gpu)
        for gpu in kept:
            draft.fault(gpu.uuid, "GPU is lost: NVML counts it but cannot read it", Clears.PROBE, kind=Fault.LOST)
        if draft.logged:
            logged = dict(draft.logged)
            for gpu in draft.gpus:
                fault = logged.pop(gpu.bus_id, None)
                if fault is not None:
                    draft.fault(
                        gpu.uuid, fault.reason, Clears.RESET, remedy=fault.remedy, kind=Fault.XID, xid=fault.xid
                    )
            draft.logged = MappingProxyType(logged)
        draft.topology = event.topology
        draft.cap_minors = event.cap_minors
        if draft.nvml_error is not None:
            draft.note(Change("nvml recovered", reason=draft.nvml_error))
            draft.nvml_error = None
        if event.driver_instance is not None:
            draft.driver_instance = event.driver_instance
            for gpu in draft.gpus:
                draft.evidence(gpu, DRIVER_RELOADED, reloaded_from=event.driver_instance)
        if event.driver_version is not None:
            draft.driver_version = event.driver_version
        if event.cuda_version is not None:
            draft.cuda_version = event.cuda_version
        draft.check_ready(event.unready)
        for probe in event.probes:
            self._probe(draft, probe)

    @staticmethod
    def _first_health(draft: SnapshotDraft, uuid: str, gpu: Gpu) -> HealthState:
        """Healthy, unless the state file holds a fault of this device from this boot."""
        record = draft.restored.pop(uuid, None)
        if record is None:
            return HealthState(Health.HEALTHY, "discovered", draft.now)
        draft.note(Change("restored unhealthy", gpu, f"{record.state.reason} (recorded when it was last seen)"))
        return record.state

    def _nvml_failed(self, draft: SnapshotDraft, event: NvmlFailed) -> None:
        if draft.nvml_error == event.reason:
            return
        draft.nvml_error = event.reason
        draft.note(Change("nvml failed", reason=event.reason))
        # Nothing can check these GPUs now: stop offering them until NVML is back and probes pass.
        for gpu in draft.gpus:
            draft.fault(gpu.uuid, f"NVML unavailable: {event.reason}", Clears.PROBE, kind=Fault.UNMONITORED)

    def _probe(self, draft: SnapshotDraft, probe: ProbeResult) -> None:
        """A probe's word on each device counts unless newer word on that device came in while it read:
        a recovery action back to none, say, that its read of the field came just before. The GPU stays
        as that word left it, and the re-probes it is due go on."""
        gpu = draft.gpu(probe.uuid)
        if gpu is None:
            return
        if probe.failure is not None:
            if self._older_than_news(probe, gpu.uuid):
                return
            failure = f"probe failed: {probe.failure}"
            draft.fault(probe.uuid, failure, probe.clears, probe.recovery_action, kind=probe.fault)
            return
        for uuid, state in list(draft.devices_of(gpu)):
            if state.healthy or not state.probe_clears or self._older_than_news(probe, uuid):
                continue
            evidence = state.evidence or probe.evidence
            # The GPU's recovery covers faults of its MIG devices whose evidence is in.
            reason = (
                f"recovered: {evidence}, probe passed" if uuid == gpu.uuid else f"recovered with its GPU: {evidence}"
            )
            draft.heal(uuid, reason)

    def _removed_since(self, bus_id: str, started: float | None) -> bool:
        """Whether udev removed the PCI device at `bus_id` after a scan that began at `started`: the GPU
        the scan read there is gone, and the rescan the removal asked for says what is there now."""
        removed = self._pci_removed.get(bus_id)
        return removed is not None and started is not None and started < removed

    def _older_than_news(self, probe: ProbeResult, uuid: str) -> bool:
        news = self._news.get(uuid)
        return probe.started is not None and news is not None and probe.started < news

    def _xid_event(self, draft: SnapshotDraft, event: XidOccurred) -> None:
        gpu = draft.gpu(event.uuid)
        if gpu is None:
            return
        if self._seen_before(gpu, event.code, event.source, draft):
            return
        draft.count_xid(gpu, event.code)
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
            draft.fault(
                mig.uuid if mig else event.uuid,
                decision.reason,
                Clears.RESET,
                remedy=decision.action,
                kind=Fault.XID,
                xid=event.code,
            )
        elif decision.verdict is Verdict.HEALTHY:
            # Worth a log line even though the picture does not change.
            draft.note(Change("xid, stays healthy", gpu, decision.reason))
        elif decision.verdict is Verdict.INFORMATIONAL:
            draft.note(Change("xid without catalog action", gpu, decision.reason))
        else:
            draft.note(Change("xid, reading the recovery action", gpu, decision.reason))

    def _auto_reset(self, draft: SnapshotDraft, event: AutoResetStep) -> None:
        gpu = draft.gpu(event.uuid)
        if gpu is None:
            return
        draft.auto_reset = MappingProxyType({**draft.auto_reset, gpu.uuid: f"{event.step}: {event.detail}"})
        if event.step == "reset":
            resets = (*draft.auto_resets.get(gpu.uuid, ()), event.at)
            draft.auto_resets = MappingProxyType({**draft.auto_resets, gpu.uuid: resets})
        if event.step in ("failed", "budget spent"):
            # A person must look now: the reason says why, and nvplug does not try again by itself.
            for uuid, state in list(draft.devices_of(gpu)):
                if state.clears is Clears.RESET and state.evidence is None:
                    draft.health[uuid] = replace(state, reason=f"{event.detail}; {state.reason}", remedy=None)
        draft.note(Change(f"auto-reset {event.step}", gpu, event.detail))

    def _hung_call(self, draft: SnapshotDraft, event: NvmlCallHung) -> None:
        hung = dict(draft.hung_calls)
        gpu = draft.gpu(event.uuid) if event.uuid is not None else None
        if gpu is None and event.index is not None:
            gpu = next((g for g in draft.gpus if g.index == event.index), None)
        if event.returned:
            hung.pop(event.number, None)
            if gpu is not None:
                # Answering again is the evidence a hang needs; the re-probe that confirms it runs at once.
                draft.note(Change("nvml answered again", gpu, f"{event.call} returned after {event.seconds:.0f} s"))
        else:
            hung[event.number] = HungCall(event.call, gpu.uuid if gpu else event.uuid, event.index, event.since)
            if event.past_limit and gpu is not None:
                draft.fault(
                    gpu.uuid,
                    f"the driver has not answered for {event.seconds:.0f} s ({event.call})",
                    Clears.PROBE,
                    kind=Fault.UNMONITORED,
                )
            elif not event.past_limit:
                draft.note(Change("nvml call hung", gpu, hung[event.number].describe()))
        draft.hung_calls = MappingProxyType(hung)

    def _seen_before(self, gpu: Gpu, code: int, source: str, draft: SnapshotDraft) -> bool:
        """Whether the other source reported this Xid already; if not, it waits for that report.

        One report matches one earlier report of the other source (same GPU, same code, within
        SAME_XID_SECONDS), so an Xid that really happens twice, reported twice by both, counts twice.
        """
        now = draft.now
        for other in XID_SOURCES:
            waiting = self._reports.get((gpu.uuid, code, other)) if other != source else None
            while waiting and now - waiting[0] > SAME_XID_SECONDS:
                waiting.popleft()
            if waiting:
                waiting.popleft()
                draft.xids_matched += 1
                draft.note(Change("xid reported by NVML and the kernel log", gpu, self._xid.name(code)))
                return True
        own = self._reports.setdefault((gpu.uuid, code, source), deque(maxlen=MAX_WAITING_REPORTS))
        while own and now - own[0] > SAME_XID_SECONDS:
            own.popleft()
        own.append(now)
        return False

    def _kernel_record(
        self, draft: SnapshotDraft, event: KernelXid | GpuFellOffBus | DriverLoaded | GpuNamedInLog | SwitchXid
    ) -> None:
        draft.kernel_log_seq = max(event.seq, draft.kernel_log_seq or event.seq)
        if isinstance(event, SwitchXid):
            before = draft.switch_errors.get(event.bus_id)
            count = before.count + 1 if before is not None else 1
            errors = dict(draft.switch_errors)
            errors[event.bus_id] = SwitchErrors(event.switch, count, event.code, event.message)
            draft.switch_errors = MappingProxyType(errors)
            draft.note(Change("nvswitch sxid", reason=f"{event.switch} ({event.bus_id}): SXid {event.code}"))
            return
        if isinstance(event, DriverLoaded):
            if not event.replayed:
                for each in draft.gpus:
                    draft.evidence(each, DRIVER_LOADED)
            return
        gpu = draft.by_bus_id(event.bus_id)
        if isinstance(event, GpuNamedInLog):
            if gpu is not None and gpu.uuid != event.uuid:
                why = f"the kernel log names {event.uuid} at {event.bus_id}, NVML {gpu.uuid}"
                draft.note(Change("kernel log disagrees with NVML", gpu, why))
            return
        code = event.code if isinstance(event, KernelXid) else FELL_OFF_THE_BUS
        when = "in the kernel log before this start" if event.replayed else "from the kernel log"
        if gpu is not None:
            # A replayed record was never NVML's to report; the live one may have been.
            live_xid = isinstance(event, KernelXid) and not event.replayed
            if live_xid and self._seen_before(gpu, code, event.source, draft):
                return
            draft.count_xid(gpu, code)
        if isinstance(event, GpuFellOffBus):
            reason = f"{self._xid.name(code)}: GPU has fallen off the bus ({when})"
            remedy = self._xid.decide(code).action or None
        else:
            if event.recovery_action is not None:
                if gpu is not None:
                    self._recovery_action(draft, RecoveryActionChanged(gpu.uuid, event.recovery_action))
                return
            decision = self._xid.decide(code)
            if decision.verdict is not Verdict.UNHEALTHY:
                draft.note(Change("xid in the kernel log, stays healthy", gpu, f"{decision.reason} ({when})"))
                return
            reason, remedy = f"{decision.reason} ({when})", decision.action or None
        if gpu is None:
            # Kept by bus id until a scan finds the GPU (NVML down at the start, say).
            logged = dict(draft.logged)
            logged[event.bus_id] = LoggedFault(reason, event.seq, remedy, code)
            draft.logged = MappingProxyType(logged)
            draft.note(Change("kernel log fault of a GPU not found yet", reason=f"{event.bus_id}: {reason}"))
            return
        draft.fault(gpu.uuid, reason, Clears.RESET, remedy=remedy, kind=Fault.XID, xid=code)

    def _recovery_action(self, draft: SnapshotDraft, event: RecoveryActionChanged) -> None:
        gpu = draft.gpu(event.uuid)
        if gpu is None:
            return
        if event.action != 0:
            name = RECOVERY_ACTIONS.get(event.action, f"action {event.action}")
            remedy = RESET_GPU if event.action == GPU_RESET_ACTION else name
            draft.fault(event.uuid, f"NVML recovery action: {name}", Clears.RESET, event.action, remedy)
        else:
            # The driver says nothing is needed any more, having asked for something: a probe must still confirm it.
            draft.evidence(gpu, "NVML recovery action back to none", after_recovery_action=True)

    def _pci(self, draft: SnapshotDraft, event: PciChanged) -> None:
        gpu = draft.by_bus_id(event.bus_id)
        if event.action in ("remove", "unbind"):
            # A fault recorded when its GPU was last seen, of one not seen since, was for the device just reset.
            for uuid in [u for u, r in draft.restored.items() if r.bus_id == event.bus_id]:
                del draft.restored[uuid]
        if gpu is None:
            return
        if event.action == "remove":
            # Gone from the bus: no ID to offer, so the kubelet sees it removed.
            for uuid, _ in list(draft.devices_of(gpu)):
                del draft.health[uuid]
            draft.gpus = tuple(g for g in draft.gpus if g.uuid != gpu.uuid)
            draft.note(Change("removed", gpu, "PCI device removed"))
        elif event.action == "unbind":
            # Still on the bus, perhaps being reset: keep the ID, stop offering it. NVML sees it
            # again only once re-bound, so the unbind is the evidence of the re-bind to come.
            draft.fault(gpu.uuid, "driver unbound from the PCI device", Clears.RESET, kind=Fault.LOST)
            draft.evidence(gpu, "driver unbound and re-bound")
