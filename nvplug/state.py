"""The node's state: inventory plus health per GPU, under one revision number.

Pure: events go in, a new immutable Snapshot comes out. Sinks wait for a
revision newer than the one they last acted on, so a burst of events costs
them one wake-up, not one per event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .event import Event, HealthReported, InventoryFound, NvmlFailed
from .gpu import Gpu
from .health import Health, HealthState


@dataclass(frozen=True)
class Snapshot:
    revision: int
    gpus: tuple[Gpu, ...] = ()
    health: Mapping[str, HealthState] = field(default_factory=lambda: MappingProxyType({}))
    # Why NVML cannot be used right now; None while it works.
    nvml_error: str | None = None

    def gpu(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


@dataclass(frozen=True)
class Change:
    """One thing an event changed, for the log and later for metrics."""

    what: str
    gpu: Gpu | None = None
    reason: str = ""


class NodeState:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._current = Snapshot(revision=0)
        # Replaced on every revision; waiters hold the one they saw.
        self._bumped = asyncio.Event()

    @property
    def current(self) -> Snapshot:
        return self._current

    def apply(self, event: Event) -> list[Change]:
        """Fold one event into the state; bump the revision only if something changed."""
        if isinstance(event, InventoryFound):
            changes, snap = self._inventory(event)
        elif isinstance(event, HealthReported):
            changes, snap = self._health(event)
        elif isinstance(event, NvmlFailed):
            changes, snap = self._nvml_failed(event)
        else:
            return []
        if changes:
            self._publish(snap)
        return changes

    async def wait_past(self, revision: int) -> Snapshot:
        """Return the first snapshot newer than `revision`, waiting if needed."""
        while self._current.revision <= revision:
            await self._bumped.wait()
        return self._current

    def _publish(self, snap: Snapshot) -> None:
        self._current = Snapshot(snap.revision + 1, snap.gpus, MappingProxyType(dict(snap.health)), snap.nvml_error)
        bumped, self._bumped = self._bumped, asyncio.Event()
        bumped.set()

    def _inventory(self, event: InventoryFound) -> tuple[list[Change], Snapshot]:
        old = self._current
        before = {g.uuid: g for g in old.gpus}
        after = {g.uuid: g for g in event.gpus}
        now = self._clock()
        changes: list[Change] = []
        health = {u: h for u, h in old.health.items() if u in after}
        for uuid, gpu in after.items():
            if uuid not in before:
                changes.append(Change("added", gpu))
                health[uuid] = HealthState(Health.HEALTHY, "discovered", now)
            elif before[uuid] != gpu:
                changes.append(Change("changed", gpu))
        changes += [Change("removed", gpu) for uuid, gpu in before.items() if uuid not in after]
        nvml_error = old.nvml_error
        if nvml_error is not None:
            changes.append(Change("nvml recovered", reason=nvml_error))
            nvml_error = None
        gpus = tuple(sorted(event.gpus, key=lambda g: g.index))
        return changes, Snapshot(old.revision, gpus, health, nvml_error)

    def _health(self, event: HealthReported) -> tuple[list[Change], Snapshot]:
        old = self._current
        gpu = old.gpu(event.uuid)
        current = old.health.get(event.uuid)
        if gpu is None or current is None or current.health is event.health:
            return [], old
        health = dict(old.health)
        health[event.uuid] = HealthState(event.health, event.reason, self._clock())
        return [Change(event.health.value.lower(), gpu, event.reason)], Snapshot(
            old.revision, old.gpus, health, old.nvml_error
        )

    def _nvml_failed(self, event: NvmlFailed) -> tuple[list[Change], Snapshot]:
        old = self._current
        if old.nvml_error == event.reason:
            return [], old
        return [Change("nvml failed", reason=event.reason)], Snapshot(old.revision, old.gpus, old.health, event.reason)
