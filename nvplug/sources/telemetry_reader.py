"""GPU telemetry on demand: a scrape asks, each GPU is read at most once a second, and each process is
placed in its container from the host's /proc and the kubelet's records.

The reads run on threads of the telemetry's own, beside NVML's worker (sharing NVML with it,
nvml_sessions.py), so that no probe waits for them; a GPU whose read hangs is left behind on its thread and
holds up no other GPU's figures. One thread reads the GPUs one after the other while that is quick; where
the driver is slow (a real GPU's read takes about 10 ms, nearly all of it in the driver), a pass is shared
by as many threads as keep it near PASS_TARGET. A scrape waits at most `budget` for the reads; a GPU whose
read fails, or has not answered by then, keeps its last reading, marked stale with why, and its read goes
on. Each GPU's processes are placed right after its process list (process_places.py: a live process is
held by a pidfd and placed once; one that ends is let go first), so a PID that has gone, or been reused,
is never attributed to the pod it once was in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
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
# What a pass should take: a pass whose reads would take longer, one after the other, is shared by more
# threads (lanes), at most MAX_LANES. The reads' time is measured, so a quick driver keeps one thread.
PASS_TARGET = 0.01
MAX_LANES = 8


def lanes_for(gpus: int, read_seconds: float) -> int:
    """One lane while the reads, one after the other, fit PASS_TARGET; else enough lanes that they would."""
    return max(1, min(math.ceil(gpus * read_seconds / PASS_TARGET), gpus, MAX_LANES))


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
        self._workers = [self._new_worker()]  # a lane's thread, by lane
        self._places = ProcessPlaces(proc_root, log_root, hold=True)
        self._placing = threading.Lock()  # the lanes place processes one at a time
        self._read = read
        self._clock = clock
        self._gpus: tuple[Gpu, ...] = ()
        self._readings: dict[str, GpuReading] = {}
        self._tried: dict[str, float] = {}
        self._windows: dict[str, Window] = {}
        self._pass: asyncio.Task[None] | None = None
        self._pending: set[str] = set()  # the GPUs of the pass in progress not read yet
        self._left_behind: dict[str, _Job] = {}  # by the GPU whose read it waits on
        self._jobs: dict[int, _Job] = {}  # the pass's job in progress, by lane
        self.read_seconds = 0.0  # a GPU's read, on average over the last pass: the next pass's lanes go by it
        self.lanes = 1  # the last pass's
        # Each reading's processes, placed as they were read: a container, or None where unattributed.
        self._where: dict[str, dict[int, ProcessContainer | None]] = {}
        self._pod_uids: Mapping[tuple[str, str], str] = {}  # as the last job read the kubelet's records
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
            self._workers[0].submit(release, self._windows.pop(uuid))

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
        return Telemetry(readings, containers, self._pod_uids)

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
            for job in self._jobs.values():
                self._collect(job)  # the reads done so far
        for uuid in self._pending:
            self._mark_stale(uuid, f"no answer from NVML in {budget:.1f} s")
        return self.latest()

    def status(self) -> object:
        return {
            "reads": self.read_count,
            "last_pass_ms": round(self.pass_seconds * 1000, 2),
            "read_ms": round(self.read_seconds * 1000, 2),
            "lanes": self.lanes,
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
        """The GPUs dealt to lanes, each lane one job on its own thread (see _read_lane)."""
        began = self._clock()
        lanes = self._lanes_for(len(due))
        uuids = [g.uuid for g in due]
        jobs = await asyncio.gather(*(self._read_lane(lane, uuids[lane::lanes]) for lane in range(lanes)))
        reads = sum(job.reads for lane in jobs for job in lane)
        if reads:
            self.read_seconds = sum(job.read_seconds for lane in jobs for job in lane) / reads
        self.lanes = lanes
        self.pass_seconds = self._clock() - began

    def _lanes_for(self, gpus: int) -> int:
        lanes = lanes_for(gpus, self.read_seconds)
        while len(self._workers) < lanes:
            self._workers.append(self._new_worker())
        return lanes

    async def _read_lane(self, lane: int, uuids: list[str]) -> list[_Job]:
        """One GPU after the other, in one job on the lane's thread, handed to the loop once at its end: reads
        in a row cost less than threads contending for the interpreter, or a hand-off to the loop and back
        for each. A read slower than SLOW_READ is left behind on its thread (it hangs): that job ends with
        it, a fresh thread takes the rest, and that GPU is not read again until its read returns."""
        loop = asyncio.get_running_loop()
        jobs: list[_Job] = []
        while uuids:
            job = _Job([(u, self._windows.get(u, Window())) for u in uuids], loop)
            jobs.append(job)
            self._jobs[lane] = job
            self._workers[lane].submit(job.run, self._read_shared, self._place, self._uids_by_name)
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
                stuck, self._workers[lane] = self._workers[lane], self._new_worker()
                stuck.shutdown(wait=False)  # its thread ends once the read returns
            uuids = uuids[hung + 1 :]
        self._jobs.pop(lane, None)
        return jobs

    def _place(self, pids: Iterable[int]) -> dict[int, ProcessContainer | None]:
        with self._placing:
            return self._places.place(pids)

    def _uids_by_name(self) -> Mapping[tuple[str, str], str]:
        with self._placing:
            return self._places.uids_by_name()

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
        if job.pod_uids is not None:
            self._pod_uids = job.pod_uids

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
        for job in self._jobs.values():
            job.stop()
        if self._pass is not None:
            self._pass.cancel()
            await asyncio.gather(self._pass, return_exceptions=True)
        for worker in self._workers:
            worker.shutdown(wait=False, cancel_futures=True)
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
        self.read_seconds = 0.0  # in the reads that returned, placing aside
        self.reads = 0
        self.pod_uids: Mapping[tuple[str, str], str] | None = None  # read once the turns are done
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

    def run(
        self, read: Callable[[str, Window], GpuRead], place: _Place, uids: Callable[[], Mapping[tuple[str, str], str]]
    ) -> None:
        try:
            for at, (uuid, since) in enumerate(self.turns):
                with self._lock:
                    if self._stopped:
                        return
                    self.current = (at, time.monotonic())
                try:
                    got = read(uuid, since)
                    self.read_seconds += time.monotonic() - self.current[1]
                    self.reads += 1
                    self._placed.update(place([p.pid for p in got.processes if p.pid not in self._placed]))
                except Exception as err:
                    self.results.append(err)
                else:
                    self.results.append((got, {p.pid: self._placed[p.pid] for p in got.processes}))
            self.pod_uids = uids()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for it
                self._loop.call_soon_threadsafe(self.finished.set_result, None)
