"""Re-probes of Unhealthy GPUs that a passing probe could heal, with exponential backoff.

Healthy GPUs are never polled: their faults arrive as NVML events. Nor is a GPU
whose fault needs a reset and has no evidence of one yet: a probe proves
nothing for it. Its evidence (udev, NVML, an operator) starts the probes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence

from tenacity import AsyncRetrying, retry_if_exception_type

from nvplug.base.backoff import Backoff, sleep_unless
from nvplug.config import Config
from nvplug.core.events import Event, ProbeResult
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import BlockingRunsOn, Commit, Publish, Sink, StateUpdate

log = logging.getLogger(__name__)

Probe = Callable[[str, str], Awaitable[ProbeResult]]


class _StillDue(Exception):
    """Probe again after the backoff, unless a snapshot shows the GPU no longer due (`follow`)."""


class Reprober(Sink):
    """A source of probe results, and a sink of snapshots: it follows which GPUs a probe could heal."""

    name = "reprober"
    blocking: BlockingRunsOn = "nothing blocks"  # each probe runs on the scanner's NVML thread
    without: str | None = None

    def __init__(self, probe: Probe, publish: Publish, initial: float, maximum: float) -> None:
        self._probe = probe
        self._publish = publish
        self._initial = initial
        self._maximum = maximum
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}

    def follow(self, snapshot: Snapshot) -> None:
        """Start re-probing GPUs a probe could heal now; stop for those healthy again, gone or waiting."""
        unhealthy = {g.uuid for g in snapshot.reprobe_due()}
        for uuid in list(self._tasks):
            if uuid not in unhealthy:
                self._tasks.pop(uuid).cancel()
                self._wake.pop(uuid, None)
        for uuid in unhealthy - set(self._tasks):
            self._wake[uuid] = asyncio.Event()
            self._tasks[uuid] = asyncio.create_task(self._reprobe(uuid), name=f"reprobe {uuid}")

    def set_backoff(self, initial: float, maximum: float) -> None:
        """From a reloaded config; GPUs already being re-probed keep their schedule."""
        self._initial, self._maximum = initial, maximum

    def now(self, uuid: str) -> None:
        """New evidence for this GPU: probe it without waiting out the backoff."""
        wake = self._wake.get(uuid)
        if wake is not None:
            wake.set()

    def start(self) -> None:
        """Nothing to open: re-probes start as snapshots come (`update`)."""

    def update(self, update: StateUpdate) -> Sequence[Event]:
        if not update.changes:
            return ()
        # Evidence starts re-probes of a GPU, and a probe at once.
        self.follow(update.snapshot)
        for change in update.changes:
            if change.what in ("recovery evidence", "nvml answered again") and change.gpu is not None:
                self.now(change.gpu.uuid)
        return ()

    def prepare(self, cfg: Config) -> Commit:
        health = cfg.health

        async def commit(snapshot: Snapshot) -> None:
            self.set_backoff(health.reprobe_initial_seconds, health.reprobe_max_seconds)

        return commit

    async def stop(self) -> None:
        """As a source: no more probes. (As a sink, `close` does the same.)"""
        await self.close()

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._wake.clear()

    async def _reprobe(self, uuid: str) -> None:
        wake = self._wake[uuid]
        retrying = AsyncRetrying(
            wait=Backoff(self._initial, self._maximum).wait(),
            retry=retry_if_exception_type(_StillDue),
            sleep=functools.partial(sleep_unless, wake),
        )
        # The first probe waits too: whatever made the GPU Unhealthy has only just happened.
        await sleep_unless(wake, self._initial)
        async for attempt in retrying:
            with attempt:
                wake.clear()
                number = attempt.retry_state.attempt_number
                result = await self._probe(uuid, f"re-probe {number} of the Unhealthy GPU")
                self._publish(result)
                if not result.passed:
                    log.info("%s: re-probe %d failed: %s", uuid, number, result.failure)
                # Even a pass: the state may not count it (newer word on the GPU came in while it
                # read). A pass it counts heals the GPU, and `follow` then ends this task.
                raise _StillDue(result.failure)
