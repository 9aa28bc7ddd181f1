"""GPU telemetry on demand: a scrape asks, each GPU is read at most once a second, and each process is
placed in its container from the host's /proc and the kubelet's records.

The reads run on a thread of the telemetry's own, beside NVML's worker (sharing NVML with it,
nvml_sessions.py), so that no probe waits for them; a GPU whose read hangs is left behind on its thread and
holds up no other GPU's figures. A scrape waits at most `budget` for the reads; a GPU whose read fails,
or has not answered by then, keeps its last reading, marked stale with why, and its read goes on. A
process's container is looked up afresh on every read, right after its GPU's process list, so a PID that
has gone, or been reused, is never attributed to the pod it once was in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from nvplug.config import Config
from nvplug.core.events import Event
from nvplug.core.gpu import Gpu
from nvplug.core.snapshot import Snapshot
from nvplug.core.telemetry import GpuFigures, GpuReading, ProcessContainer, Telemetry
from nvplug.edges.edge_protocols import Commit, Sink, StateUpdate
from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.nvml.nvml_sessions import NvmlBusy, NvmlSessions
from nvplug.pods.process_places import ProcessPlaces, unattributed
from nvplug.sources.nvml_telemetry import GpuRead, Window, read_gpu, release

log = logging.getLogger(__name__)

# However often it is scraped, a GPU is read at most this often.
READ_EVERY = 1.0
# A scrape waits this long for its reads, then answers with what it has: a scrape answers within 1 s.
SCRAPE_BUDGET = 0.7
# A GPU's read that takes longer hangs: the others are read on a fresh thread meanwhile.
SLOW_READ = 0.25


class GpuTelemetry(Sink):
    """The GPUs it reads are those of the snapshots it is handed."""

    name = "GPU telemetry"
    reads = frozenset({"gpus"})

    def __init__(
        self,
        sessions: NvmlSessions,
        proc_root: Path = Path("/proc"),
        log_root: Path = Path("/var/log"),
        read: Callable[[str, Window], GpuRead] = read_gpu,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessions = sessions
        self._worker = self._new_worker()
        self._places = ProcessPlaces(proc_root, log_root)
        self._read = read
        self._clock = clock
        self._gpus: tuple[Gpu, ...] = ()
        self._readings: dict[str, GpuReading] = {}
        self._tried: dict[str, float] = {}
        self._windows: dict[str, Window] = {}
        self._pass: asyncio.Task[None] | None = None
        self._pending: set[str] = set()  # the GPUs of the pass in progress not read yet
        self._left_behind: dict[str, asyncio.Future[_Read]] = {}
        self._job: _Job | None = None
        # Each reading's processes, placed as they were read: a container, or None where unattributed.
        self._where: dict[str, dict[int, ProcessContainer | None]] = {}
        self.read_count = 0  # reads that worked
        self.pass_seconds = 0.0

    async def open(self, snapshot: Snapshot) -> None:
        self._gpus = snapshot.gpus

    def update(self, update: StateUpdate) -> Sequence[Event]:
        self._gpus = update.snapshot.gpus
        known = {g.uuid for g in self._gpus}
        for uuid in [u for u in self._readings if u not in known]:  # a GPU gone has no series
            del self._readings[uuid]
            self._where.pop(uuid, None)
        for uuid in [u for u in self._windows if u not in known]:
            self._forget_window(uuid)
        return ()

    def _forget_window(self, uuid: str) -> None:
        """A gone GPU's window: its GPM samples are NVML's memory, freed off the loop, unless a read still
        uses them (that read frees them, and its own window is forgotten when it returns)."""
        if uuid not in self._pending and uuid not in self._left_behind:
            self._worker.submit(release, self._windows.pop(uuid))

    def prepare(self, cfg: Config) -> Commit:
        async def commit(snapshot: Snapshot) -> None:
            self._places = ProcessPlaces(self._places.proc_root, Path(cfg.telemetry.log_root))

        return commit

    def latest(self) -> Telemetry:
        order = [g.uuid for g in self._gpus]
        readings = tuple(self._readings[u] for u in order if u in self._readings)
        containers = {
            pid: where
            for r in readings
            for pid, where in self._where.get(r.uuid, {}).items()
            if where is not None and where.pod  # in a pod the records name
        }
        return Telemetry(readings, containers)

    @property
    def unattributed(self) -> int:
        """Processes of the readings placed in no pod the kubelet's records name, or whose cgroup is gone."""
        return len({pid for placed in self._where.values() for pid, where in placed.items() if unattributed(where)})

    async def refresh(self, budget: float = SCRAPE_BUDGET) -> Telemetry:
        """Read what is due (each GPU at most once per READ_EVERY) and wait up to `budget` for it."""
        if self._pass is None or self._pass.done():
            due = [g for g in self._gpus if g.uuid not in self._left_behind and self._due(g.uuid)]
            if due:
                self._pending = {g.uuid for g in due}
                self._pass = asyncio.create_task(self._read_pass(due), name="telemetry")
        if self._pass is not None and not self._pass.done():
            await asyncio.wait({self._pass}, timeout=budget)
        for uuid in self._pending:
            self._mark_stale(uuid, f"no answer from NVML in {budget:.1f} s")
        return self.latest()

    def status(self) -> object:
        return {
            "reads": self.read_count,
            "last_pass_ms": round(self.pass_seconds * 1000, 2),
            "processes_unattributed": self.unattributed,
            "left_behind": sorted(self._left_behind),
            "stale": {r.uuid: r.stale for r in self._readings.values() if r.stale},
        }

    def _due(self, uuid: str) -> bool:
        now = self._clock()
        if now - self._tried.get(uuid, float("-inf")) < READ_EVERY:
            return False
        self._tried[uuid] = now
        return True

    async def _read_pass(self, due: Sequence[Gpu]) -> None:
        """One GPU after the other, in one job on one thread: eight reads in a row cost less than eight
        threads contending for the interpreter, or eight hand-offs from the loop. A read slower than
        SLOW_READ is left behind on its thread (it hangs): that job ends with it, a fresh thread takes the
        rest, and that GPU is not read again until its read returns."""
        loop = asyncio.get_running_loop()
        began = self._clock()
        turns = [_Turn(g.uuid, self._windows.get(g.uuid, Window()), loop.create_future()) for g in due]
        while turns:
            job = _Job(turns, loop)
            self._job = job
            self._worker.submit(job.run, self._read_shared, self._places.place)
            for at, turn in enumerate(turns):
                done, _ = await asyncio.wait({turn.read}, timeout=SLOW_READ)
                self._pending.discard(turn.uuid)
                if done:
                    self._take(turn.uuid, turn.read)
                    continue
                job.abandoned = True  # its thread reads no GPU after this one
                self._mark_stale(turn.uuid, f"no answer from NVML in {SLOW_READ:.2f} s")
                self._left_behind[turn.uuid] = turn.read
                turn.read.add_done_callback(functools.partial(self._returned, turn.uuid))
                stuck, self._worker = self._worker, self._new_worker()
                stuck.shutdown(wait=False)  # its thread ends once the read returns
                turns = turns[at + 1 :]
                break
            else:
                turns = []
        self.pass_seconds = self._clock() - began

    def _returned(self, uuid: str, read: asyncio.Future[_Read]) -> None:
        """A read left behind came back: its figures are the newest there are."""
        self._left_behind.pop(uuid, None)
        if not read.cancelled():
            self._take(uuid, read)

    def _take(self, uuid: str, read: asyncio.Future[_Read]) -> None:
        try:
            got, where = read.result()
        except (NvmlUnavailable, NvmlBusy) as err:
            self._mark_stale(uuid, str(err))
            return
        except Exception as err:  # a bug must cost this GPU's figures, never the scrape or the next read
            log.exception("reading the figures of %s failed", uuid)
            self._mark_stale(uuid, f"the read failed: {err!r}")
            return
        self.read_count += 1
        self._windows[uuid] = got.window
        if all(g.uuid != uuid for g in self._gpus):  # it went while being read
            self._forget_window(uuid)
            return
        self._where[uuid] = where
        self._readings[uuid] = GpuReading(uuid, time.time(), got.figures, got.mig, got.processes)

    @staticmethod
    def _new_worker() -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="telemetry")

    def _read_shared(self, uuid: str, since: Window) -> GpuRead:
        with self._sessions.shared(timeout=SCRAPE_BUDGET):
            return self._read(uuid, since)

    async def close(self) -> None:
        if self._job is not None:
            self._job.abandoned = True
        if self._pass is not None:
            self._pass.cancel()
            await asyncio.gather(self._pass, return_exceptions=True)
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _mark_stale(self, uuid: str, why: str) -> None:
        old = self._readings.get(uuid)
        if old is None:
            self._readings[uuid] = GpuReading(uuid, 0.0, GpuFigures(), stale=why)
        elif old.stale != why:
            log.warning("the figures of %s are stale: %s", uuid, why)
            self._readings[uuid] = GpuReading(uuid, old.read_at, old.figures, old.mig, old.processes, why)


# A GPU's read, and where each of its processes runs (placed right after the read: the same moment).
_Read = tuple[GpuRead, dict[int, ProcessContainer | None]]
_Place = Callable[[Iterable[int]], dict[int, ProcessContainer | None]]


@dataclass(frozen=True)
class _Turn:
    """A GPU's read in a pass: where its window starts, and where its result goes (on the loop)."""

    uuid: str
    since: Window
    read: asyncio.Future[_Read]


class _Job:
    """A pass's reads on the telemetry's thread, each handed to the loop as it returns, with its processes
    placed: a PID on several GPUs is placed once a pass."""

    def __init__(self, turns: Sequence[_Turn], loop: asyncio.AbstractEventLoop) -> None:
        self._turns = turns
        self._loop = loop
        self._placed: dict[int, ProcessContainer | None] = {}
        # Set on the loop when a read hangs or the reader closes: the thread reads no further GPU.
        self.abandoned = False

    def run(self, read: Callable[[str, Window], GpuRead], place: _Place) -> None:
        for turn in self._turns:
            if self.abandoned:
                return
            try:
                got = read(turn.uuid, turn.since)
                self._placed.update(place([p.pid for p in got.processes if p.pid not in self._placed]))
            except Exception as err:
                self._hand(turn.read, None, err)
            else:
                self._hand(turn.read, (got, {p.pid: self._placed[p.pid] for p in got.processes}), None)

    def _hand(self, future: asyncio.Future[_Read], got: _Read | None, err: Exception | None) -> None:
        def settle() -> None:
            if future.done():
                return  # the pass was cancelled: the reader closed
            if err is not None:
                future.set_exception(err)
            else:
                future.set_result(got)  # type: ignore[arg-type]

        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for it
            self._loop.call_soon_threadsafe(settle)
