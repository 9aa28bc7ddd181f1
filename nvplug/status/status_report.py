"""What the daemon says of itself: the systemd status line, /healthz, /status and /metrics.

Everything here is read from the state, the device-plugin fleet and each sink's own notes and
status; nothing is kept twice. The status line goes to systemd whenever it changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from nvplug.config import Config, ConfigError
from nvplug.core.events import Event, NotesChanged
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import Snapshot
from nvplug.dra.dra_driver import DraDriver, node_name
from nvplug.edges.edge_protocols import Commit, Sink, StateUpdate, TelemetryReader
from nvplug.kubelet.plugin_fleet import PluginFleet
from nvplug.kubelet.podresources_client import PodView
from nvplug.kubelet.resource_fit import unready_note
from nvplug.pods.pod_holders import Holder, holders
from nvplug.shaping.resource_plan import moved
from nvplug.status.gpu_metrics import GpuMetrics, telemetry_document
from nvplug.status.status_server import PROMETHEUS_TEXT, Answer, Metrics, json_answer, status_document

# How long /status and /metrics wait for the kubelet's PodResources answer before serving without it.
PODS_READER_WAIT = 0.5


def node_notes(snap: Snapshot) -> list[str]:
    """What the status line says of NVML itself."""
    notes = [f"NVML unavailable: {snap.nvml_error}"] if snap.nvml_error else []
    notes += [f"health events unavailable: {snap.health_watch_error}"] if snap.health_watch_error else []
    notes += [call.describe() for call in snap.hung_calls.values()]
    return notes + ([f"kernel log unread: {snap.kernel_log_error}"] if snap.kernel_log_error else [])


class StatusReport(Sink):
    """The status line as a sink (sent to systemd when it changes), and the status routes. Since it knows
    who holds each device, it refuses a reload that would move a held GPU between the device plugin and DRA."""

    name = "status line"
    # A part's notes changed outside a dispatch (a retry, a registration, DRA's slices).
    works = frozenset({NotesChanged})

    def __init__(
        self,
        cfg: Config,
        state: NodeState,
        fleet: PluginFleet,
        pods: PodView,
        dra: DraDriver | None,
        telemetry: TelemetryReader,
        push: Callable[[str], None],
        roots: Mapping[str, str] | None = None,
    ) -> None:
        self._cfg = cfg
        self._state = state
        self._fleet = fleet
        self._pods = pods
        self._dra = dra
        self._push = push
        self._roots = roots
        self._telemetry = telemetry
        # Every sink, in the dispatcher's order: their notes and their parts of /status.
        self.sinks: Sequence[Sink] = ()
        self._said = ""
        self.metrics = Metrics(
            fleet.views,
            lambda: self.holders() or {},
            dra.status if dra is not None else lambda: None,
            lambda: self._state.current,
        )
        self._gpu_metrics = GpuMetrics(
            lambda: self._state.current,
            lambda: self.holders() or {},
            lambda: self._cfg.telemetry,
            node_name(cfg),
        )

    async def open(self, snapshot: Snapshot) -> None:
        """The last part but the endpoint: the line READY=1 says, once the others serve."""
        self.refresh()

    def update(self, update: StateUpdate) -> Sequence[Event]:
        if update.changes:
            self.refresh()
        return ()

    async def admit(self, cfg: Config) -> None:
        snapshot = self._state.current
        refuse_held(moved(self._cfg, cfg, snapshot), self.holders() or {}, snapshot)

    def prepare(self, cfg: Config) -> Commit:
        async def commit(snapshot: Snapshot) -> None:
            self._cfg = cfg
            self.refresh()  # after the others' commits: READY=1 says what the reload made of them

        return commit

    async def work(self, event: Event) -> None:
        self.refresh()

    def refresh(self) -> None:
        line = self.line()
        if line != self._said:
            self._said = line
            self._push(line)

    def line(self) -> str:
        # The fleet leads: what the kubelet is offered, then why it may be less than the node has.
        parts = [*self._fleet.registrations(), *node_notes(self._state.current), *self._fleet.notes()]
        parts += [note for sink in self.sinks if sink is not self._fleet for note in sink.notes()]
        return "; ".join(parts)

    async def close(self) -> None:
        """The last sink: nothing asks the kubelet's PodResources after it."""
        await self._pods.close()

    def holders(self) -> dict[str, list[Holder]] | None:
        """Who holds each device (GPU or MIG UUID): the device plugin's from the last PodResources answer,
        DRA's from the claims prepared (their pods). None if neither can say."""
        entries = self._pods.answer.entries
        dra = self._dra.holders(entries or ()) if self._dra is not None else {}
        if entries is None and not dra:
            return None
        out = holders(entries or (), self._state.current, [p.name for p in self._fleet.endpoints])
        for uuid, found in dra.items():
            out.setdefault(uuid, []).extend(found)
        return out

    def healthz(self) -> Answer:
        """200 when the loop answers (it does, or nothing would) and every part says it is healthy."""
        snap = self._state.current
        verdicts = [sink.verdict() for sink in self.sinks if sink is not self]
        # A hung NVML call: serving goes on from the state, but the node needs a person.
        if not snap.hung_calls and all(v.healthy for v in verdicts):
            # Serving; but say which devices are out because Allocate could not hand them out.
            notes = [*unready_note(snap), *(note for v in verdicts for note in v.notes)]
            return 200, "text/plain", "; ".join(["ok", *notes]).encode() + b"\n"
        return 503, "text/plain", (self.line() or "nothing to advertise").encode() + b"\n"

    async def status_page(self) -> Answer:
        answer = await self._pods.fresh(wait=PODS_READER_WAIT)
        doc = status_document(
            self._state.current,
            self._fleet.views(),
            self._fleet.plan_error,
            self.holders(),
            answer.error,
            self._fleet.excluded,
            self._dra.by_gpu() if self._dra is not None else None,
            self._roots,
        )
        for sink in self.sinks:
            part = sink.status()
            if part is not None:
                doc[sink.name] = part
        if self._dra is None:
            doc["dra"] = None  # DRA off: the document still says so
        return json_answer(doc)

    async def telemetry_page(self) -> Answer:
        """The GPUs' figures and processes, read as a scrape reads them (`nvplug top`)."""
        telemetry = await self._telemetry.refresh()
        return json_answer(telemetry_document(telemetry, self._state.current))

    async def metrics_page(self) -> Answer:
        """Within a second: the kubelet's answer and the GPUs' reads each wait a bounded time, at once."""
        _, telemetry = await asyncio.gather(self._pods.fresh(wait=PODS_READER_WAIT), self._telemetry.refresh())
        return 200, PROMETHEUS_TEXT, self.metrics.render() + self._gpu_metrics.render(telemetry)


def refuse_held(moving: frozenset[str], holders: Mapping[str, Sequence[Holder]], snapshot: Snapshot) -> None:
    """A GPU in use (a pod holds it, or one of its MIG devices, through either side) does not change sides:
    the other side would hand it out again while the pod runs."""
    for gpu in snapshot.gpus:
        if gpu.uuid not in moving:
            continue
        held = [h for uuid in (gpu.uuid, *(m.uuid for m in gpu.mig)) for h in holders.get(uuid, ())]
        if held:
            who = ", ".join(sorted({h.text for h in held}))
            raise ConfigError(
                f"the reload would move {gpu.label} between the device plugin and DRA while "
                f"{who} holds it; drain it first"
            )
