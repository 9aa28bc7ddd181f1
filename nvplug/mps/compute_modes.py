"""The compute modes MPS needs: EXCLUSIVE_PROCESS while a group's daemon runs, the old mode back after.

The old mode is in the node state, and so in the health state file, before the new one is set: an
nvplug killed in between restores it at its next start. A GPU several groups would use gets its old
mode back when the last of them stops. A GPU in MIG mode has no compute
mode to set (NVML: NOT_SUPPORTED); its MIG devices' daemons run without one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Protocol, TypeVar

from nvplug.core.events import ComputeModeRecorded, Event
from nvplug.core.gpu import Gpu
from nvplug.mps.control_daemon import ComputeModeError
from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.shaping.mps_groups import MpsGroup

log = logging.getLogger("nvplug.mps")
T = TypeVar("T")

EXCLUSIVE_PROCESS = 3
MODE_NAMES = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}


class ModeCalls(Protocol):
    """The NVML calls, through the scanner's worker and deadlines."""

    async def compute_mode(self, uuid: str) -> int: ...

    async def set_compute_mode(self, uuid: str, mode: int) -> None: ...


def mode_name(mode: int) -> str:
    return MODE_NAMES.get(mode, str(mode))


class ComputeModes:
    def __init__(
        self,
        nvml: ModeCalls,
        recorded: Callable[[], Mapping[str, int]],
        apply: Callable[[Event], object],
        written: Callable[[], Awaitable[str | None]],
    ) -> None:
        self._nvml = nvml
        # The old modes the state holds, as the supervisor was last handed them.
        self._recorded = recorded
        self._apply = apply
        self._written = written
        # Which daemons hold each GPU in EXCLUSIVE_PROCESS now, or will: a group restarted for a
        # new config holds its GPUs before its old daemon lets them go, so the mode stays.
        self._users: dict[str, set[object]] = {}

    def hold(self, group: MpsGroup, holder: object) -> None:
        self.hold_uuids([gpu.uuid for gpu in group.exclusive_gpus], holder)

    def hold_uuids(self, uuids: Iterable[str], holder: object) -> None:
        for uuid in uuids:
            self._users.setdefault(uuid, set()).add(holder)

    def let_go(self, uuids: Iterable[str], holder: object) -> list[str]:
        """The holder no longer holds these GPUs: those nobody holds now, whose old mode may go back."""
        free = []
        for uuid in uuids:
            users = self._users.get(uuid, set())
            users.discard(holder)
            if not users:
                self._users.pop(uuid, None)
                free.append(uuid)
        return free

    async def exclusive(self, group: MpsGroup) -> None:
        """Every GPU of the group in EXCLUSIVE_PROCESS, its old mode recorded first. Raises ComputeModeError."""
        for gpu in group.exclusive_gpus:
            mode = await self._call(gpu, "read", self._nvml.compute_mode(gpu.uuid))
            if mode == EXCLUSIVE_PROCESS:
                continue  # ours from before a restart (recorded), or the operator's (nothing to undo)
            if gpu.uuid not in self._recorded():
                self._apply(ComputeModeRecorded(gpu.uuid, mode))
                failing = await self._written()
                if failing is not None:
                    self._apply(ComputeModeRecorded(gpu.uuid, None))
                    raise ComputeModeError(
                        f"{gpu.label}: its compute mode is not changed, since the change could "
                        f"not be undone after a crash: {failing}"
                    )
            await self._call(gpu, "set", self._nvml.set_compute_mode(gpu.uuid, EXCLUSIVE_PROCESS))
            log.info("%s: compute mode %s -> EXCLUSIVE_PROCESS for %s", gpu.label, mode_name(mode), group.describe())

    async def release(self, group: MpsGroup, holder: object) -> None:
        """The holder's daemon is stopped: its GPUs that no other daemon holds get their old mode back."""
        free = self.let_go([gpu.uuid for gpu in group.exclusive_gpus], holder)
        for gpu in group.exclusive_gpus:
            if gpu.uuid in free:
                await self.restore(gpu)

    async def restore_unused(self, gpus: Iterable[Gpu]) -> None:
        """At start: modes an earlier nvplug recorded for GPUs no group holds now (it crashed, or the
        config changed meanwhile). A GPU not present keeps its record until it is."""
        for gpu in gpus:
            if gpu.uuid not in self._users and gpu.uuid in self._recorded():
                try:
                    await self.restore(gpu)
                except ComputeModeError as err:
                    log.error("%s", err)

    async def restore(self, gpu: Gpu) -> None:
        original = self._recorded().get(gpu.uuid)
        if original is None:
            return
        await self._call(gpu, "restore", self._nvml.set_compute_mode(gpu.uuid, original))
        self._apply(ComputeModeRecorded(gpu.uuid, None))
        log.info("%s: compute mode back to %s", gpu.label, mode_name(original))

    async def _call(self, gpu: Gpu, what: str, call: Awaitable[T]) -> T:
        try:
            return await call
        except NvmlUnavailable as err:
            raise ComputeModeError(f"{gpu.label}: cannot {what} its compute mode: {err}") from err
