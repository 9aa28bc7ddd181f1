"""GPUs that heal themselves when idle (nvplug.health.autoReset: idle, opt-in).

A GPU whose faults ask only for a GPU reset (the XID catalog's RESET_GPU, NVML's recovery action
"GPU reset"), and that nothing uses, is reset by nvplug through the same path as
`nvplug heal --reset`. Each condition is checked, and each step taken or refused is logged,
counted (nvplug_auto_reset_steps_total) and shown in /status:
- no pod holds it (the kubelet's PodResources; unknown counts as held) and no process runs on it
  (NVML), at the start and again after the quiet period;
- no NVLink to another GPU, unless allowFabricReset: behind NVSwitches a reset needs Fabric Manager;
- at most resetsPerHour of nvplug's resets of the GPU (kept across restarts in the state file).
After the reset a probe must pass, and so must validateCommand where one is set: only then is
the reset's evidence given, and only then can the GPU be Healthy.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from nvplug.base.child_process import run_child
from nvplug.config import Config, HealthConfig
from nvplug.core.events import AutoResetStep, Event
from nvplug.core.gpu import Gpu
from nvplug.core.snapshot import HEALTH, INVENTORY, Snapshot
from nvplug.edges.edge_protocols import Commit, Sink, StateUpdate
from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.pods.pod_holders import Holder
from nvplug.status.heal_route import Validate

WHO = "nvplug's auto-reset (nvplug.health.autoReset)"
HOUR = 3600.0
BUDGET_SPENT = "reset budget spent: needs a reboot or an operator"

Reset = Callable[[Gpu, str, Validate | None], Awaitable[tuple[int, dict[str, object]]]]
Holders = Callable[[], Awaitable[Mapping[str, list[Holder]] | None]]
Processes = Callable[[str], Awaitable[tuple[int, ...]]]
Handle = Callable[[Event], Awaitable[None]]


def candidate(snap: Snapshot, gpu: Gpu) -> bool:
    """Unhealthy, and every fault of the GPU and its MIG devices asks for a GPU reset and nothing more."""
    faults = [s for _, s in snap.devices_of(gpu) if not s.healthy]
    return bool(faults) and all(s.resettable for s in faults)


def nvlinked(snap: Snapshot, gpu: Gpu) -> bool:
    return any(snap.topology.link(gpu.uuid, other.uuid).nvlinks for other in snap.gpus if other.uuid != gpu.uuid)


class AutoReset(Sink):
    """One task per candidate GPU: it waits for the GPU to be idle, then resets and checks it."""

    name = "auto-reset"
    reads = INVENTORY | HEALTH

    def __init__(self, cfg: HealthConfig, reset: Reset, holders: Holders, processes: Processes, handle: Handle) -> None:
        self._cfg = cfg
        self._reset = reset
        self._holders = holders
        self._processes = processes
        self._handle = handle
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # GPUs being reset now: their own reset's steps (its evidence) must not cancel it halfway.
        self._resetting: set[str] = set()
        self._snapshot: Snapshot | None = None

    def update(self, update: StateUpdate) -> Sequence[Event]:
        if not update.revised:
            return ()
        snap = self._snapshot = update.snapshot
        wanted = {g.uuid: g for g in snap.gpus if candidate(snap, g)} if self._cfg.auto_reset == "idle" else {}
        for uuid in [u for u in self._tasks if u not in wanted and u not in self._resetting]:
            self._tasks.pop(uuid).cancel()
        for uuid, gpu in wanted.items():
            if uuid not in self._tasks:
                self._tasks[uuid] = asyncio.create_task(self._follow(gpu), name=f"auto-reset {uuid}")
        return ()

    def prepare(self, cfg: Config) -> Commit:
        async def commit(snapshot: Snapshot) -> None:
            self._cfg = cfg.health
            if cfg.health.auto_reset == "off":
                await self.close()

        return commit

    async def close(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _step(self, gpu: Gpu, step: str, detail: str) -> None:
        """Into the state, which logs it (the change log) and counts it (the dispatcher)."""
        await self._handle(AutoResetStep(gpu.uuid, step, detail, time.time()))

    async def _follow(self, gpu: Gpu) -> None:
        try:
            await self._until_reset(gpu)
        finally:
            if self._tasks.get(gpu.uuid) is asyncio.current_task():
                del self._tasks[gpu.uuid]

    async def _until_reset(self, gpu: Gpu) -> None:
        cfg = self._cfg
        snap = self._snapshot
        if snap is not None and nvlinked(snap, gpu) and not cfg.allow_fabric_reset:
            await self._step(gpu, "refused", "it has NVLinks: a reset may need Fabric Manager (allowFabricReset)")
            return
        quiet = cfg.auto_reset_quiet_seconds
        await self._step(gpu, "waiting", f"for {quiet:g} s with no pod and no process on it")
        said = ""
        while True:
            busy = await self._busy(gpu)
            if busy is None:
                await asyncio.sleep(quiet)
                busy = await self._busy(gpu)  # and still idle after the quiet period
                if busy is None:
                    break
            if busy != said:
                await self._step(gpu, "refused", busy)
                said = busy
            await asyncio.sleep(quiet)
        snap = self._snapshot
        now = time.time()
        recent = [t for t in (snap.auto_resets.get(gpu.uuid, ()) if snap else ()) if now - t < HOUR]
        if len(recent) >= cfg.resets_per_hour:
            await self._step(gpu, "budget spent", BUDGET_SPENT)
            return
        self._resetting.add(gpu.uuid)
        try:
            await self._step(gpu, "reset", f"reset {len(recent) + 1} of at most {cfg.resets_per_hour} an hour")
            status, doc = await self._reset(gpu, WHO, self._validate if cfg.validate_command else None)
        finally:
            self._resetting.discard(gpu.uuid)
        outcome = str(doc.get("message", ""))
        if status == 200 and doc.get("outcome") == "healthy":
            checked = f"`{shlex.join(cfg.validate_command)}` passed" if cfg.validate_command else "a probe passed"
            await self._step(gpu, "checked", f"{checked}: {outcome}")
        else:
            await self._step(gpu, "failed", f"not Healthy after nvplug's reset: {outcome}")

    async def _busy(self, gpu: Gpu) -> str | None:
        """What uses the GPU now (or why that is unknown); None when nothing does."""
        devices = {gpu.uuid, *(m.uuid for m in gpu.mig)}
        holders = await self._holders()
        if holders is None:
            return "who holds it is unknown (no PodResources answer)"
        pods = sorted({f"{h.namespace}/{h.pod}" for uuid in devices for h in holders.get(uuid, [])})
        if pods:
            return f"pod {', '.join(pods)} holds it"
        try:
            pids = await self._processes(gpu.uuid)
        except NvmlUnavailable as err:
            return f"its processes cannot be listed: {err}"
        if pids:
            return f"processes use it (pids {', '.join(str(p) for p in pids)})"
        return None

    async def _validate(self, gpu: Gpu) -> str | None:
        """validateCommand for the reset GPU, told which one by its environment; None when it passed."""
        argv = self._cfg.validate_command
        env = dict(os.environ)
        env.update(
            CUDA_VISIBLE_DEVICES=gpu.uuid,
            NVIDIA_VISIBLE_DEVICES=gpu.uuid,
            NVPLUG_GPU_UUID=gpu.uuid,
            NVPLUG_GPU_BUS_ID=gpu.bus_id,
        )
        try:
            ran = await run_child(argv, self._cfg.validate_timeout_seconds, env)
        except OSError as err:
            return f"`{shlex.join(argv)}` cannot run: {err}"
        if ran.returncode is None:
            return f"`{shlex.join(argv)}` ran past {self._cfg.validate_timeout_seconds:g} s (validateTimeoutSeconds)"
        if ran.returncode:
            tail = " ".join(ran.output.split())[-300:]
            return f"`{shlex.join(argv)}` exited {ran.returncode}: {tail}"
        return None
