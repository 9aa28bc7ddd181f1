"""NVML's calls from the loop's side, each with a deadline: a hung driver is reported, never waited on.

One worker thread runs the calls, one at a time, so that a rescan can take NVML's init count
to zero (only then does NVML enumerate GPUs again) without racing a probe that holds a reference.
A call past its deadline (a GPU wedged in the driver, a thread stuck in D state) is left behind
on its thread, and a fresh worker takes the calls after it: nothing queues behind a hung call.
Until it returns:
- a call for the same GPU is refused at once, so that no second thread hangs on it;
- a scan waits (it would touch the hung GPU), folded into one;
- the call is published as hung: at the deadline (reported), and again past the hang limit
  (its GPU turns Unhealthy); and once more when it returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from nvplug.core.events import NvmlCallHung
from nvplug.core.snapshot import HungCall
from nvplug.edges.edge_protocols import Publish
from nvplug.nvml.nvml_errors import NvmlHung

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Call:
    number: int
    name: str  # what nvplug asked: scan, probe, processes, reset
    uuid: str | None  # the GPU it is for; None for a scan, which names one through `where`
    started: float  # time.monotonic()
    since: float  # time.time(), for operators
    # Where a scan was when it hung: the index of the GPU it read, and its UUID once read.
    index: int | None = None
    found: str | None = None
    limit_timer: asyncio.TimerHandle | None = None

    @property
    def gpu(self) -> str | None:
        return self.uuid or self.found

    def event(self, past_limit: bool, returned: bool = False) -> NvmlCallHung:
        seconds = time.monotonic() - self.started
        return NvmlCallHung(self.number, self.name, self.gpu, self.index, self.since, seconds, past_limit, returned)

    def hung(self) -> HungCall:
        return HungCall(self.name, self.gpu, self.index, self.since)

    def describe(self) -> str:
        return self.hung().subject


class NvmlCalls:
    """The worker, the deadline of each call, and the calls left behind."""

    def __init__(
        self,
        publish: Publish,
        deadline: float,
        hang_limit: float,
        where: Callable[[], tuple[int | None, str | None]] = lambda: (None, None),
    ) -> None:
        self._publish = publish
        self.deadline = deadline
        self.hang_limit = hang_limit
        self._where = where
        self._worker = self._new_worker()
        self._numbers = itertools.count(1)
        # Calls past their deadline that have not returned, by number.
        self.hung: dict[int, _Call] = {}
        self._clear = asyncio.Event()
        self._clear.set()

    def set_limits(self, deadline: float, hang_limit: float) -> None:
        """From a reloaded config; calls already hung keep their timers."""
        self.deadline, self.hang_limit = deadline, hang_limit

    @staticmethod
    def _new_worker() -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")

    def hung_on(self, uuid: str | None) -> _Call | None:
        """A hung call that a call for `uuid` (None: every GPU, a scan) would hang behind."""
        return next((c for c in self.hung.values() if uuid is None or c.gpu in (uuid, None)), None)

    async def until_clear(self) -> None:
        """Until no call hangs."""
        await self._clear.wait()

    async def run(
        self, name: str, uuid: str | None, fn: Callable[..., T], *args: object, deadline: float | None = 0.0
    ) -> T:
        """`fn(*args)` on the worker. Raises NvmlHung past the deadline (0.0: the configured one;
        None: none, for a call with a timeout of its own), or at once while a call on its GPU hangs."""
        blocking = self.hung_on(uuid)
        if blocking is not None:
            raise NvmlHung(blocking.hung().describe())
        loop = asyncio.get_running_loop()
        call = _Call(next(self._numbers), name, uuid, time.monotonic(), time.time())
        began = threading.Event()

        def started() -> T:
            began.set()
            return fn(*args)

        future = loop.run_in_executor(self._worker, started)
        limit = self.deadline if deadline == 0.0 else deadline
        # asyncio.wait, not wait_for: before Python 3.12, wait_for swallows a cancel that lands just
        # as the call returns, and a task stopped at shutdown would go on running.
        done, _ = await asyncio.wait({future}, timeout=limit)
        if done:
            return future.result()
        if not began.is_set() and future.cancel():
            # Queued behind the call that hangs (left behind before this deadline): not hung itself.
            # Again on the fresh worker, unless that call is on this one's GPU.
            return await self.run(name, uuid, fn, *args, deadline=deadline)
        self._left_behind(call, future)
        raise NvmlHung(
            f"NVML has not returned from {call.describe()} for {limit:g} s (nvplug.health.nvmlCallDeadlineSeconds)"
        )

    def _left_behind(self, call: _Call, future: asyncio.Future[Any]) -> None:
        """The worker is stuck in this call: later calls get a new one, this one is watched."""
        stuck, self._worker = self._worker, self._new_worker()
        stuck.shutdown(wait=False)  # its thread ends once the call returns
        if call.uuid is None:
            call.index, call.found = self._where()
        self.hung[call.number] = call
        self._clear.clear()
        log.error(
            "NVML has not returned from %s for %.1f s: serving on from the state; %s",
            call.describe(),
            time.monotonic() - call.started,
            f"its GPU turns Unhealthy after {self.hang_limit:g} s"
            if call.gpu or call.index is not None
            else "rescans wait for it",
        )
        self._publish(call.event(past_limit=False))
        wait = max(0.0, self.hang_limit - (time.monotonic() - call.started))
        call.limit_timer = asyncio.get_running_loop().call_later(wait, self._past_limit, call)
        future.add_done_callback(functools.partial(self._returned, call))

    def _past_limit(self, call: _Call) -> None:
        if call.number in self.hung:
            log.error(
                "NVML has not returned from %s for %.1f s: its GPU is Unhealthy",
                call.describe(),
                time.monotonic() - call.started,
            )
            self._publish(call.event(past_limit=True))

    def _returned(self, call: _Call, future: asyncio.Future[Any]) -> None:
        if self.hung.pop(call.number, None) is None:
            return
        if call.limit_timer is not None:
            call.limit_timer.cancel()
        took = time.monotonic() - call.started
        outcome = "an error" if future.cancelled() or future.exception() is not None else "its answer"
        log.warning("NVML returned from %s after %.1f s, with %s", call.describe(), took, outcome)
        self._publish(call.event(past_limit=took >= self.hang_limit, returned=True))
        if not self.hung:
            self._clear.set()

    def shutdown(self) -> None:
        for call in self.hung.values():
            if call.limit_timer is not None:
                call.limit_timer.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)
