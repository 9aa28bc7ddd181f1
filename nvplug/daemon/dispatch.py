"""Event dispatch: each event from the bus into the state, and each new snapshot to the sinks, in order.

The rule that keeps lists true is written here once: between `NodeState.apply` and the last sink that
runs at once (`Sink.before_list`: the CDI spec, the device-plugin fleet) there is no await, so each has
seen the new snapshot before any ListAndWatch stream, which waits on the snapshots its fleet is
handed, runs again. What a sink feeds back (the CDI check) is applied at once, inside the same step;
so is what a part emits outside a dispatch (`emit`, handed to each part that feeds events back).

The stream runs in the loop turn right after the change; the other sinks (the log,
labels, DRA, the status line) in the turn after that, with every update since merged into one.
A sink is called only when a field it reads changed (`Sink.reads`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
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
from nvplug.core.latest_snapshot import LatestSnapshot
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import COUNTERS, changed_between
from nvplug.edges.edge_protocols import Sink, StateUpdate, Worker
from nvplug.sources.event_bus import EventBus
from nvplug.status.status_server import Metrics

log = logging.getLogger("nvplug")

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

    def __init__(self, state: NodeState, metrics: Metrics | None = None, workers: Sequence[Worker] = ()) -> None:
        self.state = state
        # Made first, so that every part is built with its `emit`: the metrics and the parts join later.
        self.metrics = metrics
        # The parts that do work for events, in the wiring's order.
        self.workers = tuple(workers)
        # Every sink, in the wiring's order, and split by whether a list waits for it.
        self._sinks: tuple[Sink, ...] = ()
        self._for_list: tuple[Sink, ...] = ()
        self._after_list: tuple[Sink, ...] = ()
        # The update the sinks after the list have not seen yet, and their loop turn.
        self._later: StateUpdate | None = None
        self._later_turn: asyncio.Handle | None = None
        self._failed: asyncio.Future[None] | None = None
        # The newest revision timed per resource, and since when each resource rejoins the kubelet.
        self._timed: dict[str, int] = {}
        self._rejoining: dict[str, float] = {}
        # When each recent revision's event arrived.
        self._arrived: dict[int, float] = {}
        # Each snapshot it made, for the daemon's own waits (READY=1 held for the driver).
        self.made = LatestSnapshot(state.current)

    async def run(self, bus: EventBus) -> None:
        while True:
            await self.handle(*await bus.next())

    async def handle(self, event: Event, arrived: float | None = None) -> None:
        """One event from a source, through the bus (published at `arrived`): into the state if it is
        state, then to each part that does work for its type, in order."""
        self._take(event, arrived)
        await self._work(event)

    def emit(self, event: Event) -> asyncio.Future[None]:
        """An event a part feeds back (edge_protocols.Emit): into the state at once, as `handle` does;
        the work it asks for, if any, in a task of its own, which the result is."""
        self._take(event, None)
        if not any(type(event) in worker.works for worker in self.workers):
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return asyncio.ensure_future(self._work(event))

    def _take(self, event: Event, arrived: float | None) -> None:
        match event:
            case KubeletSocketCreated():
                self._count(event)
                self._rejoin(arrived)
                log.info("kubelet.sock appeared: registering")
            case PluginSocketRemoved():
                self._count(event)
                self._rejoin(arrived)
            case NotesChanged():
                pass  # the daemon's own word to its status report, not something that happened to the node
            case WatchedDirChanged() | MigConfigChanged():
                # Work, not state: the sockets in a directory that came back are served again.
                self._count(event)
            case PciChanged(action=action, bus_id=bus_id, driver=driver):
                log.info("udev: %s %s %s", action, bus_id, driver or "")
                self.apply(event, arrived)
            case (
                InventoryFound()
                | ProbeResult()
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
                self.apply(event, arrived)
            case _:
                assert_never(event)

    async def _work(self, event: Event) -> None:
        for worker in self.workers:
            if type(event) in worker.works:
                await worker.work(event)

    def apply(self, event: Event, arrived: float | None = None) -> None:
        """Into the state, then through the sinks the list needs (no await, so no list goes out in
        between), then, in the next loop turn, the others. `arrived`: when a source published it."""
        arrived = time.monotonic() if arrived is None else arrived
        before = self.state.current
        self._count(event)
        changes = tuple(self.state.apply(event, arrived))
        snap = self.state.current
        self.made.show(snap)
        revised = snap.revision != before.revision
        changed = changed_between(before, snap)
        if revised:
            self._arrived[snap.revision] = arrived
            if len(self._arrived) > TIMED_REVISIONS:
                del self._arrived[min(self._arrived)]
        # Counters alone wake no sink; an unlisted field (the CDI spec's optional names) does, with no revision.
        if not (changes or revised or changed - COUNTERS):
            return
        update = self._run(self._for_list, StateUpdate(snap, changes, revised, changed))
        self._later = update if self._later is None else self._later.then(update)
        if self._later_turn is None:
            self._later_turn = asyncio.get_running_loop().call_soon(self._run_later)

    def _run(self, sinks: Sequence[Sink], update: StateUpdate) -> StateUpdate:
        """Each sink that reads what changed, in order; the update as the last of them saw it."""
        for sink in sinks:
            if not sink.wants(update):
                continue
            fed_back = sink.update(update)
            before = update.snapshot
            for event in fed_back:
                self.apply(event)
            if fed_back and self.state.current is not before:
                # The sinks after this one go on from the newer state, as the earlier ones saw it.
                now = self.state.current
                revised = update.revised or now.revision != before.revision
                update = StateUpdate(now, update.changes, revised, update.changed | changed_between(before, now))
        return update

    def _run_later(self) -> None:
        """The sinks no list waits for, once, with every update since they last ran."""
        self._later_turn = None
        update, self._later = self._later, None
        if update is None:
            return
        try:
            self._run(self._after_list, update)
        except Exception as err:
            # As in the list's path: a sink that fails stops the daemon, not a line in the loop's log.
            if not self._failure().done():
                self._failure().set_exception(err)

    async def failed(self) -> None:
        """Raises what a sink after the list raised; waits until one does."""
        await self._failure()

    def _failure(self) -> asyncio.Future[None]:
        if self._failed is None:
            self._failed = asyncio.get_running_loop().create_future()
        return self._failed

    @property
    def sinks(self) -> Sequence[Sink]:
        return self._sinks

    @sinks.setter
    def sinks(self, sinks: Sequence[Sink]) -> None:
        """Every sink, in the wiring's order; those the list needs run first, the rest after it."""
        self._sinks = tuple(sinks)
        self._for_list = tuple(s for s in sinks if s.before_list)
        self._after_list = tuple(s for s in sinks if not s.before_list)

    def sent(self, resource: str, revision: int, first: bool) -> None:
        """A ListAndWatch message carrying `revision` went out: the first of each revision times its event,
        and a new stream's first after the kubelet's socket or ours changed times the rejoin."""
        if self.metrics is None:
            return
        now = time.monotonic()
        if revision > self._timed.get(resource, -1):
            self._timed[resource] = revision
            arrived = self._arrived.get(revision)
            if arrived is not None:
                self.metrics.latency.labels(resource).observe(now - arrived)
        if first and resource in self._rejoining:
            self.metrics.rejoin.labels(resource).observe(now - self._rejoining.pop(resource))

    def _rejoin(self, arrived: float | None) -> None:
        """The kubelet's socket, or ours, went or came: each resource's next stream is timed from the last
        of these, the moment nvplug knew all it needed."""
        if self.metrics is None:
            return
        at = time.monotonic() if arrived is None else arrived
        self._rejoining = {view.resource.name: at for view in self.metrics.resources()}

    def _count(self, event: Event) -> None:
        if self.metrics is None:
            return
        self.metrics.events.labels(event.source, type(event).__name__).inc()
        if isinstance(event, AutoResetStep):
            self.metrics.auto_reset.labels(event.step).inc()
        failed = failed_call(event)
        if failed:
            self.metrics.nvml_errors.labels(failed).inc()
