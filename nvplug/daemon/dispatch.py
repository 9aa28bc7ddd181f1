"""Event dispatch: each event from the bus into the state, and each new snapshot to every sink, in order.

The rule that keeps lists true is written here once: between `NodeState.apply` and the last
sink there is no await, so every sink (the CDI spec first of those a list depends on) has seen
the new snapshot before any ListAndWatch stream, which waits on the state's revision, runs again.
What a sink feeds back (the CDI check) is applied at once, inside the same step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

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
    NvmlCallHung,
    NvmlFailed,
    PciChanged,
    PluginSocketRemoved,
    ProbeResult,
    RecoveryActionChanged,
    SwitchXid,
    WatchedDirChanged,
    XidOccurred,
    assert_never,
)
from nvplug.core.node_state import NodeState
from nvplug.dra.dra_driver import DraDriver
from nvplug.edges.edge_protocols import Sink, StateUpdate
from nvplug.kubelet.plugin_fleet import PluginFleet
from nvplug.sources.event_bus import EventBus
from nvplug.sources.nvml_scanner import Scanner
from nvplug.status.status_server import Metrics

log = logging.getLogger("nvplug")

# udev actions after which NVML must enumerate again ("change": a MIG layout, for one).
RESCAN_ACTIONS = {"add", "bind", "remove", "change"}
# How many recent revisions keep their event's arrival time, for the event-to-list latency.
TIMED_REVISIONS = 1024


def failed_call(event: Event) -> str | None:
    """The NVML call an event says failed, for the NVML errors metric."""
    match event:
        case NvmlFailed():
            return "nvmlInit"
        case HealthWatchChanged(error=str()):
            return "nvmlEventSetWait"
        case ProbeResult() if not event.passed:
            return "probe"
        case NvmlCallHung(returned=False, past_limit=False, call=call):
            return f"{call} (hung)"
        case _:
            return None


class Dispatcher:
    """Applies events to the state and runs the sinks; routes the events that ask for work instead."""

    def __init__(
        self, state: NodeState, metrics: Metrics, fleet: PluginFleet, scanner: Scanner, dra: DraDriver | None
    ) -> None:
        self.state = state
        self._metrics = metrics
        self._fleet = fleet
        self._scanner = scanner
        self._dra = dra
        # Every sink, in the order they run: see the wiring.
        self.sinks: Sequence[Sink] = ()
        # When each recent revision's event arrived.
        self._arrived: dict[int, float] = {}

    async def run(self, bus: EventBus) -> None:
        while True:
            await self.handle(await bus.next())

    async def handle(self, event: Event) -> None:
        """One event, from a source through the bus or from an operator's heal."""
        match event:
            case KubeletSocketCreated():
                self._count(event)
                log.info("kubelet.sock appeared: registering")
                self._fleet.kubelet_started()
            case MigConfigChanged(uuid=uuid):
                self._count(event)
                self._scanner.request(f"MIG layout of {uuid} changed")
            case PluginSocketRemoved(path=path):
                self._count(event)
                if self._dra is not None:
                    self._dra.socket_removed(Path(path))
                await self._fleet.socket_removed(Path(path))
            case WatchedDirChanged(path=path, exists=exists):
                # Work, not state: the sockets in a directory that came back are served again.
                self._count(event)
                if self._dra is not None:
                    self._dra.dir_changed(Path(path), exists)
                await self._fleet.dir_changed(Path(path), exists)
            case PciChanged(action=action, bus_id=bus_id, driver=driver):
                log.info("udev: %s %s %s", action, bus_id, driver or "")
                if action in RESCAN_ACTIONS:
                    self._scanner.request(f"udev {action} of {bus_id}")
                self.apply(event)
            case InventoryFound():
                self.apply(event)
                await self._fleet.follow_inventory()
            case (
                ProbeResult()
                | NvmlFailed()
                | HealthReported()
                | EvidenceFound()
                | XidOccurred()
                | RecoveryActionChanged()
                | HealthWatchChanged()
                | CdiChecked()
                | DeviceNodesChanged()
                | KernelXid()
                | GpuFellOffBus()
                | DriverLoaded()
                | GpuNamedInLog()
                | SwitchXid()
                | KernelLogLost()
                | KernelLogState()
                | NvmlCallHung()
                | AutoResetStep()
                | MpsGroupChanged()
                | MpsGroupRemoved()
                | ComputeModeRecorded()
            ):
                self.apply(event)
            case _:
                assert_never(event)

    def apply(self, event: Event) -> None:
        """Into the state, then through every sink; no await, so no list goes out in between."""
        arrived = time.monotonic()
        before = self.state.current.revision
        self._count(event)
        changes = tuple(self.state.apply(event))
        snap = self.state.current
        revised = snap.revision != before
        if revised:
            self._arrived[snap.revision] = arrived
            if len(self._arrived) > TIMED_REVISIONS:
                del self._arrived[min(self._arrived)]
        if not (changes or revised):
            return
        update = StateUpdate(snap, changes, revised)
        for sink in self.sinks:
            fed_back = sink.update(update)
            for event in fed_back:
                self.apply(event)
            if fed_back and self.state.current is not update.snapshot:
                # The sinks after this one go on from the newer state, as the earlier ones saw it.
                update = StateUpdate(self.state.current, changes, True)

    def sent(self, resource: str, revision: int) -> None:
        """A ListAndWatch message carrying `revision` went out."""
        arrived = self._arrived.get(revision)
        if arrived is not None:
            self._metrics.latency.labels(resource).observe(time.monotonic() - arrived)

    def _count(self, event: Event) -> None:
        self._metrics.events.labels(event.source, type(event).__name__).inc()
        if isinstance(event, AutoResetStep):
            self._metrics.auto_reset.labels(event.step).inc()
        failed = failed_call(event)
        if failed:
            self._metrics.nvml_errors.labels(failed).inc()
