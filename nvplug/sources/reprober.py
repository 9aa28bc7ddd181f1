"""Re-probes of Unhealthy GPUs that a passing probe could heal, with exponential backoff.

Healthy GPUs are never polled: their faults arrive as NVML events. Nor is a GPU
whose fault needs a reset and has no evidence of one yet: a probe proves
nothing for it. Its evidence (udev, NVML, an operator) starts the probes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from nvplug.base.backoff import sleep_unless
from nvplug.core.events import Event, ProbeResult
from nvplug.core.node_state import Snapshot

# The name it had before the layout by role: it is part of every log line.
log = logging.getLogger("nvplug.recovery")

Probe = Callable[[str, str], Awaitable[ProbeResult]]


class _StillUnhealthy(Exception):
    pass


class Reprober:
    def __init__(self, probe: Probe, publish: Callable[[Event], None], initial: float, maximum: float) -> None:
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

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._wake.clear()

    async def _reprobe(self, uuid: str) -> None:
        wake = self._wake[uuid]
        retrying = AsyncRetrying(
            wait=wait_exponential(multiplier=self._initial, min=self._initial, max=self._maximum),
            retry=retry_if_exception_type(_StillUnhealthy),
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
                    raise _StillUnhealthy(result.failure)
