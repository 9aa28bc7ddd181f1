"""NVML health events: one thread blocks in nvmlEventSetWait_v2 and hands events to the loop.

The watcher holds one reference on NVML's init count for as long as it runs.
A rescan that must enumerate GPUs again needs that count at zero, so the
watcher does not release its reference itself: `hand_over()`, called on the
thread that will rescan, drops it. The driver's last nvmlShutdown waits for
the wait in progress to return (an event or its timeout), so a hand-over takes
up to the wait's length. A stop need not wait: `stop()` leaves the reference
to the watch's own thread, dropped when its wait returns. A rescan that need
not enumerate keeps the watch, and `add()`s the GPUs it lacks.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

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
# The longest a hand-over (a rescan that counts GPUs again, a reset) waits for the wait in progress, and
# how often the wait wakes with nothing to do: 40-220 µs of CPU each, by machine (bench/README.md).
DEFAULT_WAIT_MS = 1000


def _address(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


# Subscribing, and a failing nvmlEventSetWait: jittered, capped at 30 s.
SUBSCRIBE_BACKOFF = Backoff(first=0.5, maximum=30.0, jitter=True)
WAIT_BACKOFF = Backoff(first=0.1, maximum=30.0, jitter=True)


class Watched(Protocol):
    """What the watch needs of a GPU: a scan's first naming of it, or a whole Gpu."""

    @property
    def uuid(self) -> str: ...

    @property
    def label(self) -> str: ...


class NvmlEventWatch:
    def __init__(
        self,
        gpus: Sequence[Watched],
        emit: Callable[[Event], None],
        wait_ms: int = DEFAULT_WAIT_MS,
        double_bit: DoubleBitCounts | None = None,
    ) -> None:
        self._gpus = tuple(gpus)
        self._emit = emit
        self._wait_ms = wait_ms
        self._double_bit = double_bit or DoubleBitCounts()
        # Set once subscribed; add() replaces the map whole, so the waiting thread reads one or the other.
        self._event_set: Any = None
        self._handles: dict[int, str] = {}
        self._stopping = threading.Event()
        self._subscribed = threading.Event()
        self._lock = threading.Lock()
        self._holds_ref = False
        self._exited = False
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self.subscriptions: dict[str, int] = {}

    def start(self) -> None:
        """Blocks until every GPU is subscribed, so no event is lost before registration."""
        self._thread.start()
        self._subscribed.wait()

    @property
    def subscribed(self) -> bool:
        """It has its event set and waits on it: add() can take more GPUs. (A watch that subscribed no GPU
        has ended: nothing waits on its set.)"""
        return self._event_set is not None and not self._stopping.is_set() and self._thread.is_alive()

    def add(self, gpus: Sequence[Watched]) -> bool:
        """Subscribe more GPUs to the running watch; on the thread that uses NVML. False: it is not subscribed
        (it failed, or was handed over), so only a new watch can take them."""
        if not self.subscribed:
            return False
        added = self._subscribe(self._event_set, gpus)
        self._gpus += tuple(gpus)
        self._handles = {**self._handles, **added}
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

    def hand_over(self) -> None:
        """Stop watching and drop our NVML reference; call on the thread that uses NVML next. Returns once
        the reference is dropped: up to the wait's length, for the wait in progress to return."""
        self._drop_reference()

    def stop(self) -> None:
        """Stop watching without waiting: the watch's thread drops its reference when its wait returns
        (at once, if the thread has ended). For a stop, where nothing uses NVML next."""
        with self._lock:
            self._stopping.set()
            exited = self._exited
        if exited:
            self._drop_reference()

    def _drop_reference(self) -> None:
        with self._lock:
            self._stopping.set()  # with the swap: the watch's thread never drops a reference taken here
            holds, self._holds_ref = self._holds_ref, False
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
            self._subscribed.set()
            with self._lock:
                self._exited = True
                stopped = self._stopping.is_set()
            if stopped:
                self._drop_reference()

    def _run_watch(self) -> None:
        retrying = Retrying(
            wait=SUBSCRIBE_BACKOFF.wait(),
            retry=retry_if_exception_type(pynvml.NVMLError),
            sleep=self._sleep,
            before_sleep=self._subscribe_failed,
        )
        for attempt in retrying:
            with attempt:
                opened = self._open()
                if opened is None:
                    return
                event_set, handles = opened
        self._handles = handles
        self._event_set = event_set
        self._subscribed.set()
        if not handles:
            return
        self._emit(HealthWatchChanged(None))
        self._watch(event_set)

    def _open(self) -> tuple[Any, dict[int, str]] | None:
        """None: stopped. Checked with the init, so a hand-over never returns before a reference taken here."""
        with self._lock:
            if self._stopping.is_set():
                return None
            if not self._holds_ref:
                pynvml.nvmlInit()
                self._holds_ref = True
        event_set = pynvml.nvmlEventSetCreate()
        try:
            return event_set, self._subscribe(event_set, self._gpus)
        except pynvml.NVMLError:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(event_set)
            raise

    def _subscribe_failed(self, state: RetryCallState) -> None:
        """Say so, and let start() return: the retries go on in the background."""
        outcome = state.outcome
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        err = outcome.exception() if outcome is not None else None
        self._emit(HealthWatchChanged(f"cannot subscribe to NVML events: {err}; retry in {delay:.1f}s"))
        self._subscribed.set()

    def _subscribe(self, event_set: Any, gpus: Sequence[Watched]) -> dict[int, str]:
        handles: dict[int, str] = {}
        for gpu in gpus:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                supported = self._supported(handle)
                mask = supported & WANTED
                if mask:
                    pynvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
            except pynvml.NVMLError as err:
                if err.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                    self._emit(HealthReported(gpu.uuid, f"GPU is lost: {err}", Clears.PROBE, Fault.LOST))
                else:
                    log.error("%s: cannot subscribe to health events: %s", gpu.label, err)
                continue
            self.subscriptions[gpu.uuid] = mask
            handles[_address(handle)] = gpu.uuid
            if not mask & XID:
                log.warning("%s: the driver reports no XID events for it; its faults go unseen", gpu.label)
            log.debug("%s: subscribed to NVML events 0x%x", gpu.label, mask)
        return handles

    @staticmethod
    def _supported(handle: Any) -> int:
        try:
            return int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
        except pynvml.NVMLError as err:
            if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                return 0
            raise

    def _watch(self, event_set: Any) -> None:
        while not self._stopping.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, self._wait_ms)
            except pynvml.NVMLError as err:
                if self._stopping.is_set():
                    return  # hand_over() shut NVML down under us, as intended
                if err.value != pynvml.NVML_ERROR_TIMEOUT:
                    self._recover(event_set, err)
                continue
            self._dispatch(data)

    def _recover(self, event_set: Any, first: Exception) -> None:
        """The wait itself fails: report it, and retry with backoff until it works again."""
        self._emit(HealthWatchChanged(f"nvmlEventSetWait failed: {first}; retrying with backoff"))
        retrying = Retrying(
            wait=WAIT_BACKOFF.wait(),
            retry=retry_if_exception_type(pynvml.NVMLError),
            sleep=self._sleep,
            before_sleep=_log_retry,
            reraise=True,
        )
        data = None
        try:
            for attempt in retrying:
                with attempt:
                    if self._stopping.is_set():
                        return
                    data = self._wait_once(event_set)
        except pynvml.NVMLError:
            return
        self._emit(HealthWatchChanged(None))
        if data is not None:
            self._dispatch(data)

    def _sleep(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    @staticmethod
    def _wait_once(event_set: Any) -> Any:
        """A zero-timeout wait: an event, or None when the wait works but nothing came."""
        try:
            return pynvml.nvmlEventSetWait_v2(event_set, 0)
        except pynvml.NVMLError as err:
            if err.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            raise

    def _dispatch(self, data: Any) -> None:
        uuid = self._handles.get(_address(data.device))
        if uuid is None:
            log.warning("NVML event 0x%x for a device we did not subscribe", data.eventType)
            return
        kind, payload = int(data.eventType), int(data.eventData)
        if kind & XID:
            gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
            self._emit(XidOccurred(uuid, payload, None if gi == NO_INSTANCE else gi, None if ci == NO_INSTANCE else ci))
            if payload in READS_RECOVERY_ACTION:
                self._emit_recovery_action(data.device, uuid, None)
        elif kind & DOUBLE_BIT_ECC:
            if self._double_bit.confirm(data.device, uuid):
                self._emit(HealthReported(uuid, "double-bit ECC error"))
            else:
                log.info("%s: double-bit ECC event already reported from its count", uuid)
        elif kind & FATAL_POISON:
            self._emit(HealthReported(uuid, "fatal poison error"))
        elif kind & GPU_UNAVAILABLE:
            self._emit(HealthReported(uuid, "GPU unavailable (NVML event)", Clears.PROBE, Fault.LOST))
        elif kind & RECOVERY_ACTION:
            self._emit_recovery_action(data.device, uuid, payload)
        elif kind & MIG_CONFIG_CHANGE:
            self._emit(MigConfigChanged(uuid))

    def _emit_recovery_action(self, handle: Any, uuid: str, fallback: int | None) -> None:
        try:
            action = recovery_action(handle)
        except pynvml.NVMLError as err:
            log.warning("%s: recovery action unreadable: %s", uuid, err)
            action = fallback
        if action is not None:
            self._emit(RecoveryActionChanged(uuid, action))


def _log_retry(state: RetryCallState) -> None:
    outcome = state.outcome
    delay = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning(
        "nvmlEventSetWait still failing (%s); retry %d in %.2fs",
        outcome.exception() if outcome is not None else "?",
        state.attempt_number,
        delay,
    )
