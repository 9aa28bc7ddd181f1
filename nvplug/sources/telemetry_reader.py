"""GPU telemetry on demand: a scrape asks, each GPU is read at most once a second, and each process is
placed in its container from the host's /proc and the kubelet's records.

The reads run on a thread of the telemetry's own, beside NVML's worker (sharing NVML with it,
nvml_sessions.py), so that no probe waits for them; a GPU whose read hangs is left behind on its thread and
holds up no other GPU's figures. A scrape waits at most `budget` for the reads; a GPU whose read fails,
or has not answered by then, keeps its last reading, marked stale with why, and its read goes on. Each
GPU's processes are placed right after its process list (process_places.py: a live process is held by a
pidfd and placed once; one that ends is let go first), so a PID that has gone, or been reused, is never
attributed to the pod it once was in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
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
        self._places = ProcessPlaces(proc_root, log_root, hold=True)
        self._read = read
        self._clock = clock
        self._gpus: tuple[Gpu, ...] = ()
        self._readings: dict[str, GpuReading] = {}
        self._tried: dict[str, float] = {}
        self._windows: dict[str, Window] = {}
        self._pass: asyncio.Task[None] | None = None
        self._pending: set[str] = set()  # the GPUs of the pass in progress not read yet
        self._left_behind: dict[str, _Job] = {}  # by the GPU whose read it waits on
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
            self._places.log_root = Path(cfg.telemetry.log_root)  # the processes held stay held

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
            if self._job is not None:
                self._collect(self._job)  # the reads done so far
        for uuid in self._pending:
            self._mark_stale(uuid, f"no answer from NVML in {budget:.1f} s")
        return self.latest()

    def status(self) -> object:
        return {
            "reads": self.read_count,
            "last_pass_ms": round(self.pass_seconds * 1000, 2),
            "processes_unattributed": self.unattributed,
            "processes_held": self._places.held,
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
        """One GPU after the other, in one job on one thread, handed to the loop once at its end: eight reads
        in a row cost less than eight threads contending for the interpreter, or eight hand-offs to the loop
        and back. A read slower than SLOW_READ is left behind on its thread (it hangs): that job ends with
        it, a fresh thread takes the rest, and that GPU is not read again until its read returns."""
        loop = asyncio.get_running_loop()
        began = self._clock()
        uuids = [g.uuid for g in due]
        while uuids:
            job = _Job([(u, self._windows.get(u, Window())) for u in uuids], loop)
            self._job = job
            self._worker.submit(job.run, self._read_shared, self._places.place)
            hung = await self._watch(job)
            self._collect(job)
            if hung is None:
                break
            uuid = uuids[hung]
            if job.taken <= hung:  # still being read: left behind on its thread
                self._pending.discard(uuid)
                self._mark_stale(uuid, f"no answer from NVML in {SLOW_READ:.2f} s")
                self._left_behind[uuid] = job
                job.finished.add_done_callback(functools.partial(self._returned, uuid))
                stuck, self._worker = self._worker, self._new_worker()
                stuck.shutdown(wait=False)  # its thread ends once the read returns
            uuids = uuids[hung + 1 :]
        self.pass_seconds = self._clock() - began

    @staticmethod
    async def _watch(job: _Job) -> int | None:
        """Waits for the job to finish: None once it has; else, once a turn has been read for SLOW_READ, stops
        the job after that turn and says which it is."""
        while not job.finished.done():
            at, since = job.current
            late = since + SLOW_READ - time.monotonic()
            if at == len(job.results) and late <= 0:
                return job.stop()
            await asyncio.wait({job.finished}, timeout=late if late > 0 else SLOW_READ)
        return None

    def _collect(self, job: _Job) -> None:
        """Takes the job's reads that have returned and are not taken yet."""
        results = job.results
        for at in range(job.taken, len(results)):
            uuid = job.turns[at][0]
            self._pending.discard(uuid)
            self._take(uuid, results[at])
        job.taken = len(results)

    def _returned(self, uuid: str, _finished: asyncio.Future[None]) -> None:
        """A read left behind came back: its figures are the newest there are."""
        job = self._left_behind.pop(uuid, None)
        if job is not None:
            self._collect(job)

    def _take(self, uuid: str, got: _Read | Exception) -> None:
        if isinstance(got, (NvmlUnavailable, NvmlBusy)):
            self._mark_stale(uuid, str(got))
            return
        if isinstance(got, Exception):  # a bug must cost this GPU's figures, never the scrape or the next read
            log.error("reading the figures of %s failed", uuid, exc_info=got)
            self._mark_stale(uuid, f"the read failed: {got!r}")
            return
        read, where = got
        self.read_count += 1
        self._windows[uuid] = read.window
        if all(g.uuid != uuid for g in self._gpus):  # it went while being read
            self._forget_window(uuid)
            return
        self._where[uuid] = where
        self._readings[uuid] = GpuReading(uuid, time.time(), read.figures, read.mig, read.processes)

    @staticmethod
    def _new_worker() -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="telemetry")

    def _read_shared(self, uuid: str, since: Window) -> GpuRead:
        with self._sessions.shared(timeout=SCRAPE_BUDGET):
            return self._read(uuid, since)

    async def close(self) -> None:
        if self._job is not None:
            self._job.stop()
        if self._pass is not None:
            self._pass.cancel()
            await asyncio.gather(self._pass, return_exceptions=True)
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._places.close()

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


class _Job:
    """A pass's reads on the telemetry's thread, each GPU's processes placed right after its read (a PID on
    several GPUs once a pass). The loop is woken once, when the job finishes; until then it watches the
    turn in progress (`current`) for a hang, and may take the reads done so far (`results`)."""

    def __init__(self, turns: Sequence[tuple[str, Window]], loop: asyncio.AbstractEventLoop) -> None:
        self.turns = turns
        self._loop = loop
        self._placed: dict[int, ProcessContainer | None] = {}
        # Appended on the thread in turn order: a read with its placements, or what it raised.
        self.results: list[_Read | Exception] = []
        # The turn being read and since when, as one value: the loop reads both at once.
        self.current = (0, time.monotonic())
        self.taken = 0  # results the loop has taken
        self.finished: asyncio.Future[None] = loop.create_future()
        # Set on the loop when a read hangs or the reader closes: the thread reads no further GPU. Setting it
        # and starting a turn are one step each, so a turn the loop gave up on is never read twice.
        self._stopped = False
        self._lock = threading.Lock()

    def stop(self) -> int:
        """No turn starts after this: the turn in progress, or the last one that ran."""
        with self._lock:
            self._stopped = True
            return self.current[0]

    def run(self, read: Callable[[str, Window], GpuRead], place: _Place) -> None:
        try:
            for at, (uuid, since) in enumerate(self.turns):
                with self._lock:
                    if self._stopped:
                        return
                    self.current = (at, time.monotonic())
                try:
                    got = read(uuid, since)
                    self._placed.update(place([p.pid for p in got.processes if p.pid not in self._placed]))
                except Exception as err:
                    self.results.append(err)
                else:
                    self.results.append((got, {p.pid: self._placed[p.pid] for p in got.processes}))
        finally:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for it
                self._loop.call_soon_threadsafe(self.finished.set_result, None)
