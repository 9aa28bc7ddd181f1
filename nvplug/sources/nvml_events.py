"""NVML health events: a child process waits in nvmlEventSetWait_v2 (`nvml_event_pump`), and a thread
of ours reads what it tells, makes events of it and hands them to the loop.

Why a child: the driver's last nvmlShutdown waits for a wait in progress, and a rescan that must count
GPUs again (a hot-add, a reset) needs NVML's init count at zero. A wait in the daemon would hold that up
for the wait's length, and a short wait wakes the daemon all day. The child is killed at once, its NVML
with it, so a hand-over is immediate and the wait long. What an event means, and the reads it calls for
(the recovery action, the ECC count), stay here, on the daemon's NVML.

The watch holds one reference on the daemon's init count for those reads. A rescan that must count GPUs
again calls `let_go()`: the reference goes at once, and the child listens on until the new watch has
subscribed and `hand_over()` kills it, so that no event falls between the two; an event both children
tell in that overlap is reported once (`watch_overlap`). A reset, or a stop, calls
`hand_over()` alone. A rescan that need not count GPUs again keeps the watch, and `add()`s the GPUs it
lacks. A child that ends unasked is reported and started again, with backoff, so the daemon never stops
watching quietly.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import pynvml  # type: ignore[import-untyped]
from tenacity import RetryCallState, Retrying, retry_if_exception_type

from nvplug.base.backoff import Backoff
from nvplug.core.events import (
    Event,
    HealthReported,
    HealthWatchChanged,
    MigConfigChanged,
    RecoveryActionChanged,
    XidOccurred,
)
from nvplug.core.health import Clears, Fault
from nvplug.core.xid_policy import READS_RECOVERY_ACTION
from nvplug.sources.ecc_counts import DoubleBitCounts
from nvplug.sources.nvml_discovery import recovery_action
from nvplug.sources.watch_overlap import WatchOverlap

log = logging.getLogger(__name__)

XID = pynvml.nvmlEventTypeXidCriticalError
DOUBLE_BIT_ECC = pynvml.nvmlEventTypeDoubleBitEccError
FATAL_POISON = 0x2000
GPU_UNAVAILABLE = 0x4000
RECOVERY_ACTION = 0x8000
MIG_CONFIG_CHANGE = 0x100
# What makes a GPU unusable, and MIG layout changes; registered wherever the driver supports it.
WANTED = XID | DOUBLE_BIT_ECC | FATAL_POISON | GPU_UNAVAILABLE | RECOVERY_ACTION | MIG_CONFIG_CHANGE
NO_INSTANCE = 0xFFFFFFFF
# How often the child's wait wakes with nothing to do. Nothing waits for it: the child is killed.
DEFAULT_WAIT_MS = 60_000
PUMP_PROGRAM = Path(__file__).with_name("nvml_event_pump.py")

# Subscribing, and a failing nvmlEventSetWait: jittered, capped at 30 s.
SUBSCRIBE_BACKOFF = Backoff(first=0.5, maximum=30.0, jitter=True)
WAIT_BACKOFF = Backoff(first=0.1, maximum=30.0, jitter=True)


class Watched(Protocol):
    """What the watch needs of a GPU: a scan's first naming of it, or a whole Gpu."""

    @property
    def uuid(self) -> str: ...

    @property
    def label(self) -> str: ...


class PumpEnded(Exception):
    """The child process did not start, or ended (or was ended) before it answered."""


class EventPump:
    """The child process that waits on NVML events, and its pipes; spawned at once, so that it starts up
    while the scan that will need it runs."""

    def __init__(self) -> None:
        """Raises PumpEnded where it cannot start."""
        try:
            # -S: it needs the standard library alone, and starts faster without site's; -P: its own
            # directory is not put on its path, where a module could shadow the stdlib's.
            self._process = subprocess.Popen(
                [sys.executable, "-S", "-P", str(PUMP_PROGRAM)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
        except OSError as err:
            raise PumpEnded(f"cannot start the NVML event process: {err}") from err
        assert self._process.stdin is not None and self._process.stdout is not None
        self._stdin: IO[bytes] = self._process.stdin
        self._stdout: IO[bytes] = self._process.stdout
        self._write_lock = threading.Lock()
        # Its lines stamped, for `watch_overlap`: asked, so that the program stays the one a daemon from
        # before the stamps understands, while an upgrade has replaced it and not yet restarted that daemon.
        self.send("stamp")

    @property
    def pid(self) -> int:
        return self._process.pid

    def send(self, line: str) -> None:
        """Raises PumpEnded."""
        try:
            with self._write_lock:
                self._stdin.write(line.encode() + b"\n")
                self._stdin.flush()
        except (OSError, ValueError) as err:  # ValueError: killed, its pipes closed
            raise PumpEnded(f"the NVML event process ({self.pid}) is gone") from err

    def read(self) -> list[str]:
        """Its next line, split; raises PumpEnded at its end."""
        try:
            line = self._stdout.readline()
        except (OSError, ValueError) as err:
            raise PumpEnded(f"the NVML event process ({self.pid}) is gone") from err
        if not line:
            self._stdout.close()
            raise PumpEnded(f"the NVML event process ({self.pid}) ended: {self._ended()}")
        return line.decode().split()

    def _ended(self) -> str:
        try:
            code = self._process.wait(1.0)
        except subprocess.TimeoutExpired:
            return "closed its output"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def kill(self) -> None:
        """At once: its NVML, and its wait in progress, end with it. What it wrote before stays to be
        read, to the end of its output."""
        self._process.kill()
        self._process.wait()
        with contextlib.suppress(OSError):
            self._stdin.close()


# The lines of the child's answer to a subscribe.
_ANSWERS = frozenset({"subscribed", "lost", "failed", "done", "error"})


class NvmlEventWatch:
    def __init__(
        self,
        gpus: Sequence[Watched],
        emit: Callable[[Event], None],
        wait_ms: int = DEFAULT_WAIT_MS,
        double_bit: DoubleBitCounts | None = None,
        pump: EventPump | None = None,
        overlap: WatchOverlap | None = None,
    ) -> None:
        self._gpus = tuple(gpus)
        self._emit = emit
        self._wait_ms = wait_ms
        self._double_bit = double_bit or DoubleBitCounts()
        self._pump = pump
        self._overlap = overlap
        # The answers to add()'s subscribes, handed over by the thread that reads the child; None: it ended.
        self._answers: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        self._reading = False
        self._stopping = threading.Event()
        # let_go(): our reference is dropped, the child listens on until hand_over(), none replaces it.
        self._retiring = threading.Event()
        self._subscribed = threading.Event()
        self._lock = threading.Lock()
        self._holds_ref = False
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self.subscriptions: dict[str, int] = {}
        # When its child registered each GPU's events (ns, the monotonic clock's).
        self.subscribed_at: dict[str, int] = {}

    def start(self) -> None:
        """Blocks until every GPU is subscribed, so no event is lost before registration."""
        self._thread.start()
        self._subscribed.wait()

    @property
    def subscribed(self) -> bool:
        """Its child waits on its events: add() can take more GPUs. (A watch that subscribed no GPU has
        ended.)"""
        return self._reading and not self._retiring.is_set() and not self._stopping.is_set() and self._thread.is_alive()

    def add(self, gpus: Sequence[Watched]) -> bool:
        """Subscribe more GPUs to the running watch; on the thread that uses NVML. False: it is not subscribed
        (it failed, or was handed over), so only a new watch can take them."""
        pump = self._pump
        if not self.subscribed or pump is None:
            return False
        try:
            pump.send(self._subscribe_line(gpus))
        except PumpEnded:
            return False
        answers: list[list[str]] = []
        while not answers or answers[-1][0] not in ("done", "error"):
            answer = self._answers.get()
            if answer is None:
                return False
            answers.append(answer)
        self._gpus += tuple(gpus)
        self._take(answers, gpus)
        return True

    def catch_up(self, gpu: Watched) -> None:
        """Report the double-bit ECC errors of `gpu` that no event told of (they fired while no watch was
        subscribed); on the thread that uses NVML, once this watch is subscribed."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
        except pynvml.NVMLError as err:
            log.debug("%s: no ECC count to catch up on: %s", gpu.label, err)
            return
        missed = self._double_bit.catch_up(handle, gpu.uuid)
        if missed:
            log.warning("%s: %d double-bit ECC errors counted while no event watch ran", gpu.label, missed)
            self._emit(HealthReported(gpu.uuid, f"double-bit ECC error ({missed} counted while no event watch ran)"))

    def let_go(self) -> None:
        """Drop our NVML reference, so that NVML can count the GPUs again, and keep the child listening
        until hand_over(), once the next watch has subscribed: no event falls between the two (one that
        both tell is reported once, where they share a WatchOverlap). Our reads for an event meanwhile may
        find NVML's count at zero; the event is reported without them. Call on the thread that uses NVML
        next."""
        with self._lock:
            self._retiring.set()  # with the swap: no child, and no reference, is taken after this
            holds, self._holds_ref = self._holds_ref, False
        if self._overlap is not None:
            self._overlap.retire(self)
        self._shutdown(holds)

    def hand_over(self) -> None:
        """Stop watching: kill the child and drop our NVML reference, at once; what the child told before
        its end is still reported. Call on the thread that uses NVML next (a stop too: the reads of an
        event in progress are the only other use)."""
        with self._lock:
            self._stopping.set()
            holds, self._holds_ref = self._holds_ref, False
            pump, self._pump = self._pump, None
        if pump is not None:
            pump.kill()
            if self._overlap is not None:
                self._overlap.ended(self, time.monotonic_ns())
        self._shutdown(holds)

    @staticmethod
    def _shutdown(holds: bool) -> None:
        if holds:
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as err:
                log.warning("nvmlShutdown on behalf of the event watch failed: %s", err)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._run_watch()
        except Exception as err:
            # A bug must not end health checking quietly.
            log.exception("the NVML event watch failed")
            self._emit(HealthWatchChanged(f"the NVML event watch failed: {err!r}"))
        finally:
            self._reading = False
            self._answers.put(None)
            self._subscribed.set()
            if self._overlap is not None:
                self._overlap.ended(self)

    def _run_watch(self) -> None:
        """Subscribe, then read the child; a child that ends unasked is reported, and another subscribed."""
        again = False
        while True:
            retrying = Retrying(
                wait=SUBSCRIBE_BACKOFF.wait(),
                retry=retry_if_exception_type((pynvml.NVMLError, PumpEnded)),
                sleep=self._sleep,
                before_sleep=self._subscribe_failed,
            )
            for attempt in retrying:
                with attempt:
                    pump = self._open()
            if pump is None:
                return
            if self._overlap is not None:
                self._overlap.subscribed(self, dict(self.subscribed_at))
            self._subscribed.set()
            if not self.subscriptions:  # the watch has ended: nothing for its child to wait on
                self._end(pump)
                return
            self._emit(HealthWatchChanged(None))
            if again:
                for gpu in self._gpus:  # what the ended child missed
                    self.catch_up(gpu)
            # What the ended child left (its end, an answer cut short) is no answer of this one's. No add()
            # waits now: it asks only while reading is on.
            while not self._answers.empty():
                self._answers.get_nowait()
            self._reading = True
            try:
                self._read(pump)
            except PumpEnded as err:
                if self._stopping.is_set() or self._retiring.is_set():
                    return
                log.error("%s", err)
                self._emit(HealthWatchChanged(f"{err}; starting another"))
            finally:
                self._reading = False
                self._answers.put(None)
            self._end(pump)
            again = True

    def _open(self) -> EventPump | None:
        """The child, subscribed to our GPUs. None: stopped. The reference, and the child, are taken under
        the lock with the check, so a hand-over never returns before what was taken here."""
        with self._lock:
            if self._stopping.is_set() or self._retiring.is_set():
                return None
            if not self._holds_ref:
                pynvml.nvmlInit()
                self._holds_ref = True
            if self._pump is None:
                self._pump = EventPump()
            pump = self._pump
        self.subscriptions.clear()
        self.subscribed_at.clear()
        try:
            pump.send(self._subscribe_line(self._gpus))
            answers = [pump.read()]
            while answers[-1][0] not in ("done", "error"):
                answers.append(pump.read())
        except PumpEnded:
            if self._stopping.is_set():
                return None
            self._end(pump)
            raise
        self._take(answers, self._gpus)
        return pump

    def _end(self, pump: EventPump) -> None:
        """A child of ours that is no use any more; a hand-over may have taken it already."""
        with self._lock:
            if self._pump is pump:
                self._pump = None
        pump.kill()

    def _subscribe_line(self, gpus: Sequence[Watched]) -> str:
        return f"subscribe {WANTED:x} {self._wait_ms} " + " ".join(gpu.uuid for gpu in gpus)

    def _take(self, answers: list[list[str]], gpus: Sequence[Watched]) -> None:
        """The child's answer to a subscribe of `gpus`; raises NVMLError where NVML did not come up there."""
        labels = {gpu.uuid: gpu.label for gpu in gpus}
        for answer in answers:
            match answer:
                case ["error", code]:
                    raise pynvml.NVMLError(int(code))
                case ["subscribed", uuid, mask, *stamp] if len(stamp) <= 1:
                    self.subscriptions[uuid] = int(mask, 16)
                    if stamp:  # none: a child's program from before the stamps (a downgrade's)
                        self.subscribed_at[uuid] = int(stamp[0])
                    if not int(mask, 16) & XID:
                        log.warning("%s: the driver reports no XID events for it; its faults go unseen", labels[uuid])
                    log.debug("%s: subscribed to NVML events 0x%s", labels[uuid], mask)
                case ["lost", uuid, code]:
                    err = pynvml.NVMLError(int(code))
                    self._emit(HealthReported(uuid, f"GPU is lost: {err}", Clears.PROBE, Fault.LOST))
                case ["failed", uuid, code]:
                    log.error("%s: cannot subscribe to health events: %s", labels[uuid], pynvml.NVMLError(int(code)))
                case _:
                    pass

    def _subscribe_failed(self, state: RetryCallState) -> None:
        """Say so, and let start() return: the retries go on in the background."""
        outcome = state.outcome
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        err = outcome.exception() if outcome is not None else None
        self._emit(HealthWatchChanged(f"cannot subscribe to NVML events: {err}; retry in {delay:.1f}s"))
        self._subscribed.set()

    def _read(self, pump: EventPump) -> None:
        """What the child tells, until it ends (killed too: what it told before is told on); raises
        PumpEnded."""
        while True:
            line = self._next(pump)
            match line:
                case ["event", uuid, kind, data, gi, ci, *stamp] if len(stamp) <= 1:
                    told = (uuid, int(kind, 16), int(data), int(gi), int(ci))
                    if self._overlap is None or not stamp or self._overlap.first_telling(self, told, int(stamp[0])):
                        self._dispatch(*told)
                    else:
                        log.debug("NVML event %s told by the watch before this one as well", " ".join(line[1:]))
                case ["wait_error", code]:
                    self._recover(pump, int(code))
                case _:
                    log.warning("the NVML event process said %r", " ".join(line))

    def _next(self, pump: EventPump) -> list[str]:
        """The child's next line but the answers to add(), which go to add()."""
        while True:
            line = pump.read()
            if line and line[0] in _ANSWERS:
                self._answers.put(line)
            elif line:
                return line

    def _recover(self, pump: EventPump, first: int) -> None:
        """The wait itself fails: report it, and have the child retry with backoff until it works again."""
        self._emit(HealthWatchChanged(f"nvmlEventSetWait failed: {pynvml.NVMLError(first)}; retrying with backoff"))
        retrying = Retrying(
            wait=WAIT_BACKOFF.wait(),
            retry=retry_if_exception_type(pynvml.NVMLError),
            sleep=self._sleep,
            before_sleep=_log_retry,
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    if self._stopping.is_set():
                        return
                    pump.send("resume")
                    match self._next(pump):
                        case ["wait_error", code]:
                            raise pynvml.NVMLError(int(code))
                        case _:
                            pass
        except pynvml.NVMLError:
            return
        self._emit(HealthWatchChanged(None))

    def _sleep(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    def _dispatch(self, uuid: str, kind: int, payload: int, gi: int, ci: int) -> None:
        if uuid not in self.subscriptions:
            log.warning("NVML event 0x%x for a device we did not subscribe", kind)
            return
        if kind & XID:
            self._emit(XidOccurred(uuid, payload, None if gi == NO_INSTANCE else gi, None if ci == NO_INSTANCE else ci))
            if payload in READS_RECOVERY_ACTION:
                self._emit_recovery_action(uuid, None)
        elif kind & DOUBLE_BIT_ECC:
            handle = _handle(uuid)
            if handle is None or self._double_bit.confirm(handle, uuid):
                self._emit(HealthReported(uuid, "double-bit ECC error"))
            else:
                log.info("%s: double-bit ECC event already reported from its count", uuid)
        elif kind & FATAL_POISON:
            self._emit(HealthReported(uuid, "fatal poison error"))
        elif kind & GPU_UNAVAILABLE:
            self._emit(HealthReported(uuid, "GPU unavailable (NVML event)", Clears.PROBE, Fault.LOST))
        elif kind & RECOVERY_ACTION:
            self._emit_recovery_action(uuid, payload)
        elif kind & MIG_CONFIG_CHANGE:
            self._emit(MigConfigChanged(uuid))

    def _emit_recovery_action(self, uuid: str, fallback: int | None) -> None:
        action: int | None
        try:
            action = recovery_action(pynvml.nvmlDeviceGetHandleByUUID(uuid))
        except pynvml.NVMLError as err:
            log.warning("%s: recovery action unreadable: %s", uuid, err)
            action = fallback
        if action is not None:
            self._emit(RecoveryActionChanged(uuid, action))


def _handle(uuid: str) -> Any:
    """Our own handle of the GPU an event named; None where NVML cannot give it (a lost GPU)."""
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except pynvml.NVMLError as err:
        log.warning("%s: no handle for its event's reads: %s", uuid, err)
        return None


def _log_retry(state: RetryCallState) -> None:
    outcome = state.outcome
    delay = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning(
        "nvmlEventSetWait still failing (%s); retry %d in %.2fs",
        outcome.exception() if outcome is not None else "?",
        state.attempt_number,
        delay,
    )
