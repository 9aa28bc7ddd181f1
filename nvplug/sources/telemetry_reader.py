"""GPU telemetry on demand: a scrape asks, each GPU is read at most once a second, and each process is
placed in its container from the host's /proc and the kubelet's records.

Each GPU's read runs on a thread of its own, beside NVML's worker (sharing NVML with it, nvml_sessions.py),
so that one GPU whose calls hang holds up no other GPU's figures, nor a probe. A scrape waits at most
`budget` for the reads; a GPU whose read fails, or has not answered by then, keeps its last reading,
marked stale with why, and its read goes on. A process's container is looked up afresh on every read, so
a PID that has gone, or been reused, is never attributed to the pod it once was in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
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
from nvplug.pods.process_pod import container_names, pod_names, pod_of_cgroup
from nvplug.sources.nvml_telemetry import GpuRead, read_gpu

log = logging.getLogger(__name__)

# However often it is scraped, a GPU is read at most this often.
READ_EVERY = 1.0
# A scrape waits this long for its reads, then answers with what it has: a scrape answers within 1 s.
SCRAPE_BUDGET = 0.7


class GpuTelemetry(Sink):
    """The GPUs it reads are those of the snapshots it is handed."""

    name = "GPU telemetry"
    reads = frozenset({"gpus"})

    def __init__(
        self,
        sessions: NvmlSessions,
        proc_root: Path = Path("/proc"),
        log_root: Path = Path("/var/log"),
        read: Callable[[str, int], GpuRead] = read_gpu,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessions = sessions
        # A thread per GPU read at once; one whose read hangs keeps its thread, and the others theirs.
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="telemetry")
        self._proc_root = proc_root
        self._log_root = log_root
        self._read = read
        self._clock = clock
        self._gpus: tuple[Gpu, ...] = ()
        self._readings: dict[str, GpuReading] = {}
        self._tried: dict[str, float] = {}
        self._last_seen: dict[str, int] = {}
        self._reading: dict[str, asyncio.Task[None]] = {}
        self._containers: dict[int, ProcessContainer] = {}
        # Processes of the last scrape placed in no pod the kubelet's records name; reads that worked.
        self.unattributed = 0
        self.read_count = 0

    async def open(self, snapshot: Snapshot) -> None:
        self._gpus = snapshot.gpus

    def update(self, update: StateUpdate) -> Sequence[Event]:
        self._gpus = update.snapshot.gpus
        known = {g.uuid for g in self._gpus}
        for uuid in [u for u in self._readings if u not in known]:  # a GPU gone has no series
            del self._readings[uuid]
            self._last_seen.pop(uuid, None)
        return ()

    def prepare(self, cfg: Config) -> Commit:
        async def commit(snapshot: Snapshot) -> None:
            self._log_root = Path(cfg.telemetry.log_root)

        return commit

    def latest(self) -> Telemetry:
        order = [g.uuid for g in self._gpus]
        readings = tuple(self._readings[u] for u in order if u in self._readings)
        return Telemetry(readings, dict(self._containers))

    async def refresh(self, budget: float = SCRAPE_BUDGET) -> Telemetry:
        """Read what is due (each GPU at most once per READ_EVERY), wait up to `budget` for it, then place
        the processes of every reading in their containers."""
        began = self._clock()
        pending = [self._due(gpu) for gpu in self._gpus]
        waiting = [t for t in pending if t is not None and not t.done()]
        if waiting:
            await asyncio.wait(waiting, timeout=budget)
        for gpu in self._gpus:
            task = self._reading.get(gpu.uuid)
            if task is not None and not task.done():
                self._mark_stale(gpu.uuid, f"no answer from NVML in {budget:.1f} s")
        pids = {p.pid for r in self._readings.values() for p in r.processes}
        left = max(0.05, budget - (self._clock() - began))
        with contextlib.suppress(TimeoutError):
            self._containers, self.unattributed = await asyncio.wait_for(
                asyncio.to_thread(self._place, sorted(pids)), left
            )
        return self.latest()

    def _due(self, gpu: Gpu) -> asyncio.Task[None] | None:
        running = self._reading.get(gpu.uuid)
        if running is not None and not running.done():
            return running
        if self._clock() - self._tried.get(gpu.uuid, float("-inf")) < READ_EVERY:
            return None
        self._tried[gpu.uuid] = self._clock()
        task = asyncio.create_task(self._read_one(gpu), name=f"telemetry {gpu.uuid}")
        self._reading[gpu.uuid] = task
        return task

    async def _read_one(self, gpu: Gpu) -> None:
        last_seen = self._last_seen.get(gpu.uuid, 0)
        try:
            loop = asyncio.get_running_loop()
            got = await loop.run_in_executor(self._threads, self._read_shared, gpu.uuid, last_seen)
        except (NvmlUnavailable, NvmlBusy) as err:
            self._mark_stale(gpu.uuid, str(err))
            return
        self.read_count += 1
        self._last_seen[gpu.uuid] = got.last_seen
        self._readings[gpu.uuid] = GpuReading(gpu.uuid, time.time(), got.figures, got.mig, got.processes)

    def _read_shared(self, uuid: str, last_seen: int) -> GpuRead:
        with self._sessions.shared(timeout=SCRAPE_BUDGET):
            return self._read(uuid, last_seen)

    async def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _mark_stale(self, uuid: str, why: str) -> None:
        old = self._readings.get(uuid)
        if old is None:
            self._readings[uuid] = GpuReading(uuid, 0.0, GpuFigures(), stale=why)
        elif old.stale != why:
            log.warning("the figures of %s are stale: %s", uuid, why)
            self._readings[uuid] = GpuReading(uuid, old.read_at, old.figures, old.mig, old.processes, why)

    def _place(self, pids: Iterable[int]) -> tuple[dict[int, ProcessContainer], int]:
        """Each PID's container: its cgroup names the pod's UID and the container's ID, the kubelet's log
        records name them. Off the loop: these are file reads. A PID whose cgroup cannot be read (it ended)
        or names a pod the records do not, is unattributed."""
        pids = list(pids)
        if not pids:
            return {}, 0
        pods = pod_names(_listing(self._log_root / "pods"))
        names = container_names(_listing(self._log_root / "containers"))
        out: dict[int, ProcessContainer] = {}
        unattributed = 0
        for pid in pids:
            try:
                text = (self._proc_root / str(pid) / "cgroup").read_text()
            except OSError:
                unattributed += 1
                continue
            found = pod_of_cgroup(text)
            if found is None:
                continue  # a host process: pod=""
            pod = pods.get(found.uid)
            if pod is None:
                unattributed += 1
                continue
            container = names.get(found.container_id or "", "")
            out[pid] = ProcessContainer(pod.namespace, pod.name, container, found.uid)
        return out, unattributed


def _listing(directory: Path) -> list[str]:
    try:
        return [entry.name for entry in directory.iterdir()]
    except OSError:
        return []
