"""NVML scans, probes and resets, and the event watch of the GPUs found.

Everything that calls NVML from the loop's side goes through NvmlCalls: one worker thread, so a
rescan can take NVML's init count to zero without racing a probe, and a deadline on each call, so
a hung driver is reported and never waited on (see nvplug/nvml/nvml_calls.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from nvplug.base.backoff import Backoff, sleep_unless
from nvplug.core.device_nodes import host_path
from nvplug.core.events import Event, InventoryFound, MigConfigChanged, NvmlFailed, PciChanged, ProbeResult
from nvplug.core.health import Fault
from nvplug.core.readiness import unready
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import BlockingRunsOn, Publish
from nvplug.nvml.nvml_calls import NvmlCalls
from nvplug.nvml.nvml_errors import NvmlHung, NvmlUnavailable
from nvplug.nvml.nvml_sessions import NvmlSessions
from nvplug.sources.ecc_counts import DoubleBitCounts
from nvplug.sources.nvml_discovery import Enumerated, Nvml
from nvplug.sources.nvml_events import DEFAULT_WAIT_MS, EventPump, NvmlEventWatch, PumpEnded
from nvplug.sources.watch_overlap import WatchOverlap

log = logging.getLogger(__name__)

# udev actions after which NVML must enumerate again ("change": a MIG layout, for one).
RESCAN_ACTIONS = frozenset({"add", "bind", "remove", "change"})

# NVML may come up long after us (a driver loading at boot); don't hammer it.
RESCAN_BACKOFF = Backoff(first=1.0, maximum=300.0, jitter=True)
# Rescans for GPUs left without event subscriptions.
RESUBSCRIBE_BACKOFF = Backoff(first=1.0, maximum=300.0)


class Scanner:
    """NVML's one worker thread: scans, probes and resets; and the event watch of the GPUs it found."""

    name = "NVML"
    blocking: BlockingRunsOn = "own thread"
    without: str | None = None

    def __init__(
        self,
        nvml: Nvml,
        publish: Publish,
        wait_ms: int = DEFAULT_WAIT_MS,
        dev_root: Path = Path("/"),
        deadline: float = 10.0,
        hang_limit: float = 60.0,
    ) -> None:
        self._nvml = nvml
        # Public: a reload that moves flags.nvidiaDevRoot sets it.
        self.dev_root = dev_root
        self._publish = publish
        self._running: asyncio.Task[None] | None = None
        self._stopped = False
        self._wait_ms = wait_ms
        self.calls = NvmlCalls(publish, deadline, hang_limit, lambda: nvml.reading)
        # Reads beside the worker (telemetry) share NVML; what must take its count to zero waits for them.
        self.sessions = NvmlSessions()
        self._watch: NvmlEventWatch | None = None
        self._double_bit = DoubleBitCounts()
        self._overlap = WatchOverlap()
        self._wanted = asyncio.Event()
        # Whether a rescan owed must enumerate GPUs again (which hands the event watch over).
        self._recount = False
        self.scans = 0
        # A scan that left GPUs without event subscriptions is retried, with backoff, until none is left.
        self._resubscribe: asyncio.TimerHandle | None = None
        self._resubscribing = RESUBSCRIBE_BACKOFF.schedule()

    # A changed MIG layout, and udev's actions after which NVML must enumerate again ("change": a MIG layout).
    works = frozenset({MigConfigChanged, PciChanged})

    async def work(self, event: Event) -> None:
        match event:
            case MigConfigChanged(uuid=uuid):
                # MIG devices are read afresh in any session: the watch can stay.
                self.request(f"MIG layout of {uuid} changed", recount=False)
            case PciChanged(action=action, bus_id=bus_id) if action in RESCAN_ACTIONS:
                self.request(f"udev {action} of {bus_id}")
            case _:
                pass

    async def first_events(self, snapshot: Snapshot) -> Sequence[Event]:
        """The first scan (FirstEvents), applied before serving, so that the kubelet's first list is the real one."""
        first = await self.scan()
        if first is None or isinstance(first, NvmlFailed):
            self.request("NVML unavailable at start")
        return () if first is None else (first,)

    def request(self, why: str, recount: bool = True) -> None:
        """Rescan soon; requests that arrive during a scan fold into one more. `recount`: GPUs may have
        come or gone (udev, a lost GPU), so NVML must count them again."""
        log.debug("rescan requested: %s", why)
        self._recount |= recount
        self._wanted.set()

    async def scan(self, recount: bool = True) -> InventoryFound | NvmlFailed | None:
        """Scan, and keep every GPU found subscribed to events. To enumerate GPUs again (`recount`, or no
        watch running), hand the watch over, scan at init count zero and subscribe the GPUs found; else
        scan beside the running watch, which takes only the GPUs it lacks.

        None: the scan hung, or waits for a hung call (published as NvmlCallHung); scan again once clear."""
        try:
            result = await self.calls.run("scan", None, self._scan_blocking, recount)
        except NvmlHung as err:
            log.warning("no scan now: %s", err)
            return None
        if isinstance(result, InventoryFound):
            self._check_subscriptions(result)
        return result

    def _check_subscriptions(self, found: InventoryFound) -> None:
        """Never stop watching a GPU quietly: one lost (or failing) when the watch subscribed, or
        one NVML counts but cannot read, has no events until a later scan subscribes it."""
        if self._resubscribe is not None:
            self._resubscribe.cancel()
            self._resubscribe = None
        watch = self._watch
        subscribed = watch.subscriptions if watch is not None else {}
        unwatched = [g.label for g in found.gpus if g.uuid not in subscribed]
        if not unwatched and not found.lost:
            if self._resubscribing.failures:
                log.info("every GPU is subscribed to NVML events again")
            self._resubscribing.reset()
            return
        delay = self._resubscribing.next()
        lost = [f"{found.lost} that NVML cannot read"] if found.lost else []
        log.warning(
            "no NVML events from %s: rescanning in %.0f s to subscribe them", ", ".join(unwatched + lost), delay
        )
        # A GPU NVML counts but cannot name may need a new enumeration; a watch that failed, a new watch.
        recount = bool(found.lost) or watch is None or not watch.subscribed
        self._resubscribe = asyncio.get_running_loop().call_later(
            delay, functools.partial(self.request, "GPUs without event subscriptions", recount)
        )

    async def probe(self, uuid: str, evidence: str) -> ProbeResult:
        try:
            return await self.calls.run("probe", uuid, self._nvml.probe, uuid, evidence)
        except NvmlUnavailable as err:  # a hung call too: not answering is what a probe finds
            return ProbeResult(uuid, str(err), evidence, fault=Fault.UNMONITORED)

    async def processes(self, uuid: str) -> tuple[int, ...]:
        """Pids on the GPU. Raises NvmlUnavailable (NvmlHung too)."""
        return await self.calls.run("processes", uuid, self._nvml.processes, uuid)

    async def mps_clients(self, uuid: str) -> tuple[int, ...]:
        """Pids of MPS clients on the GPU. Raises NvmlUnavailable (NvmlHung too)."""
        return await self.calls.run("processes", uuid, self._nvml.mps_clients, uuid)

    async def compute_mode(self, uuid: str) -> int:
        """Raises NvmlUnavailable (NvmlHung too)."""
        return await self.calls.run("compute mode", uuid, self._nvml.compute_mode, uuid)

    async def set_compute_mode(self, uuid: str, mode: int) -> None:
        """Raises NvmlUnavailable (NvmlHung too)."""
        await self.calls.run("compute mode", uuid, self._nvml.set_compute_mode, uuid, mode)

    async def reset(self, command: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a GPU reset with our NVML reference dropped: a client holding the GPU blocks its reset.

        The event watch is gone afterwards; the caller's next scan subscribes again. Raises NvmlHung
        while an NVML call hangs: the reset would need the driver that does not answer.
        """
        return await self.calls.run("reset", None, self._reset_blocking, tuple(command), timeout, deadline=None)

    def _reset_blocking(self, command: tuple[str, ...], timeout: float) -> subprocess.CompletedProcess[str]:
        with self.sessions.alone():
            self._release_watch()
            return subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL
            )

    def start(self) -> asyncio.Task[None]:
        """Serve rescan requests from now on; the first scan is the caller's, so that it can act on it."""
        if self._running is None:
            self._running = asyncio.create_task(self._serve_requests(), name="scanner")
        return self._running

    async def _serve_requests(self) -> None:
        """Serve rescan requests, retrying with backoff while NVML is unusable."""
        while True:
            await self._wanted.wait()
            retrying = AsyncRetrying(
                wait=RESCAN_BACKOFF.wait(),
                retry=retry_if_exception_type(NvmlUnavailable),
                # A udev bind (the driver loading) cuts the backoff short.
                sleep=functools.partial(sleep_unless, self._wanted),
                before_sleep=_log_retry,
            )
            async for attempt in retrying:
                with attempt:
                    self._wanted.clear()
                    recount, self._recount = self._recount, False
                    result = await self.scan(recount)
                    if result is None:
                        await self.calls.until_clear()
                        self.request("a scan that hung", recount)  # still owed
                        break
                    self._publish(result)
                    if isinstance(result, NvmlFailed):
                        raise NvmlUnavailable(result.reason)

    async def stop(self) -> None:
        if self._running is not None:
            self._running.cancel()
            await asyncio.gather(self._running, return_exceptions=True)
        if self._stopped:
            return
        self._stopped = True
        if self._resubscribe is not None:
            self._resubscribe.cancel()
        try:
            await self.calls.run("stop of the event watch", None, self._release_watch)
        except NvmlHung as err:
            log.warning("stopping with the NVML event watch held: %s", err)
        self.calls.shutdown()

    def _release_watch(self) -> None:
        """On the worker, like every other use of the watch."""
        if self._watch is not None:
            self._watch.hand_over()
            self._watch = None

    def _scan_blocking(self, recount: bool) -> InventoryFound | NvmlFailed:
        started = time.monotonic()
        recount = recount or self._watch is None or not self._watch.subscribed
        held = None
        pump: list[EventPump] = []
        old: list[NvmlEventWatch] = []
        if recount:
            # Until the GPUs are counted: _watch_from_here lets the reads go on.
            held = self.sessions.take_alone()
            # The old watch's child listens on while the GPUs are counted, until the new one has subscribed.
            if self._watch is not None:
                self._watch.let_go()
                old.append(self._watch)
                self._watch = None
            # The new watch's child starts up while the scan counts the GPUs (else the watch starts one).
            with contextlib.suppress(PumpEnded):
                pump.append(EventPump())
        self.scans += 1
        try:
            scan = self._nvml.scan(
                functools.partial(self._watch_from_here, held, pump, old) if recount else self._watch_more
            )
        except NvmlUnavailable as err:
            return NvmlFailed(str(err))
        finally:
            self.sessions.release_alone(held)
            for unused in pump:
                unused.kill()
            for left in old:  # where no new watch took over
                left.hand_over()
        found = scan.discovery
        for note in found.absent:
            log.info("%s", note)
        for problem in found.problems:
            log.warning("%s", problem)
        log.info("scan %d: %d GPUs (driver %s)", self.scans, len(found.gpus), found.driver_version or "unknown")
        problems = unready(found.gpus, found.cap_minors, self._node_exists)
        return InventoryFound(
            found.gpus,
            scan.probes,
            found.topology,
            found.cap_minors,
            found.lost,
            found.driver_instance,
            problems,
            found.driver_version,
            found.cuda_version,
            started,
        )

    def _watch_from_here(
        self, held: object, pump: list[EventPump], old: list[NvmlEventWatch], gpus: Sequence[Enumerated]
    ) -> None:
        """The new watch, subscribed as soon as the scan has named the GPUs (it re-enumerated at init count
        zero): before the result is published, so no XID slips past an advertised GPU, and before any call
        that reads one GPU, so one whose calls hang leaves the others' events flowing while the scan waits.
        `held`: the scan's hold on NVML alone, let go here, now that the GPUs are counted; `pump`: the
        child started for the watch, and `old` the watch before, whose child listened until now: each taken
        from its list here."""
        self.sessions.release_alone(held)
        if gpus:
            watch = NvmlEventWatch(
                gpus, self._publish, self._wait_ms, self._double_bit, pump.pop() if pump else None, self._overlap
            )
            watch.start()
            self._watch = watch
            for before in old:
                before.hand_over()
            old.clear()
            self._catch_up(gpus)

    def _watch_more(self, gpus: Sequence[Enumerated]) -> None:
        """The GPUs the running watch lacks (it could not subscribe them before), subscribed to it."""
        assert self._watch is not None
        lacking = [gpu for gpu in gpus if gpu.uuid not in self._watch.subscriptions]
        if lacking and self._watch.add(lacking):
            self._catch_up(lacking)

    def _catch_up(self, gpus: Sequence[Enumerated]) -> None:
        """The errors that fired while no watch was subscribed, read with the scan's other calls."""
        assert self._watch is not None
        for gpu in gpus:
            self._nvml.reading = (gpu.index, gpu.uuid)
            self._watch.catch_up(gpu)

    def _node_exists(self, path: str) -> bool:
        return Path(host_path(self.dev_root, path)).exists()


def _log_retry(state: RetryCallState) -> None:
    delay = state.next_action.sleep if state.next_action is not None else 0.0
    log.info("NVML still unavailable; scan %d again in %.1fs (or at the next udev bind)", state.attempt_number, delay)
