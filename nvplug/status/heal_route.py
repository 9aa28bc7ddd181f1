"""`nvplug heal`: an operator's evidence that a GPU was repaired, or a reset nvplug runs for them.

A GPU whose fault needs a reset stays Unhealthy until evidence of one arrives.
Where none can arrive by itself (a reset done out of band, a repair nvplug
cannot see), the operator's word is that evidence; with `--reset`, nvplug
checks that no process uses the GPU, resets it with nvidia-smi and rescans.
Either way a probe must then pass. Served as POST /heal on the root-only
status socket; the daemon logs who asked and the outcome.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nvplug.core.events import Event, EvidenceFound, HealthReported, InventoryFound, NvmlFailed, ProbeResult
from nvplug.core.gpu import Gpu, normalize_bus_id
from nvplug.core.health import Clears
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import find_gpu
from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.status.status_server import Answer, Peer

log = logging.getLogger(__name__)

# nvidia-smi -r takes seconds, more on GPUs behind NVSwitches; past this it is stuck.
RESET_TIMEOUT = 120.0

# A check of a reset GPU: None when it passed, else what failed.
Validate = Callable[[Gpu], Awaitable[str | None]]


class HealCalls(Protocol):
    """The NVML calls a heal makes, through the scanner's worker and deadlines; `processes` and `reset`
    raise NvmlUnavailable (NvmlHung too). The NVML source's Scanner meets it, and daemon/wiring.py hands
    that in: status reads no source."""

    async def probe(self, uuid: str, evidence: str) -> ProbeResult: ...

    async def processes(self, uuid: str) -> tuple[int, ...]: ...

    async def reset(self, command: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]: ...

    async def scan(self) -> InventoryFound | NvmlFailed | None: ...


@dataclass(frozen=True)
class HealRequest:
    gpu: str  # an index, a UUID or a PCI bus id
    reset: bool = False
    operator: str = ""  # who the client says runs it (its login name), beside the kernel's uid

    @classmethod
    def parse(cls, body: bytes) -> HealRequest:
        try:
            doc = json.loads(body)
        except ValueError as err:
            raise ValueError(f"the request is not JSON: {err}") from err
        if not isinstance(doc, dict) or not isinstance(doc.get("gpu"), str) or not doc["gpu"].strip():
            raise ValueError('the request needs {"gpu": INDEX, UUID or BUS ID}')
        reset, operator = doc.get("reset", False), doc.get("operator", "")
        if not isinstance(reset, bool) or not isinstance(operator, str):
            raise ValueError('"reset" must be true or false and "operator" a string')
        return cls(doc["gpu"].strip(), reset, operator[:64])


def find(gpus: tuple[Gpu, ...], selector: str) -> Gpu | None:
    """The GPU named by index, UUID or PCI bus id (in any of NVML's and sysfs's spellings)."""
    if selector.isdecimal():
        return next((g for g in gpus if g.index == int(selector)), None)
    try:
        bus_id = normalize_bus_id(selector if selector.count(":") == 2 else f"0000:{selector}")
    except ValueError:
        bus_id = None
    return find_gpu(gpus, uuid=selector, bus_id=bus_id)


class Healer:
    def __init__(
        self,
        state: NodeState,
        scanner: HealCalls,
        handle: Callable[[Event], Awaitable[None]],
        nvidia_smi: str = "nvidia-smi",
    ) -> None:
        self._state = state
        self._scanner = scanner
        # The daemon's own handling of an event, as if a source had sent it.
        self._handle = handle
        self._nvidia_smi = nvidia_smi
        # One heal at a time: two resets of one GPU, or a reset racing a probe, help nobody.
        self._lock = asyncio.Lock()

    async def route(self, body: bytes, peer: Peer) -> Answer:
        try:
            request = HealRequest.parse(body)
        except ValueError as err:
            return _answer(400, outcome="refused", message=str(err))
        gpu = find(self._state.current.gpus, request.gpu)
        if gpu is None:
            known = ", ".join(str(g.index) for g in self._state.current.gpus) or "none"
            return _answer(404, outcome="refused", message=f"no GPU {request.gpu!r} on this node (indices: {known})")
        who = f"{peer}" + (f", {request.operator}" if request.operator else "")
        log.warning("%s: heal%s asked by %s", gpu.label, " with a reset" if request.reset else "", who)
        async with self._lock:
            status, doc = await (self._reset(gpu, who) if request.reset else self._heal(gpu, who))
        log.log(
            logging.INFO if doc["outcome"] == "healthy" else logging.WARNING,
            "%s: heal asked by %s: %s",
            gpu.label,
            who,
            doc["message"],
        )
        return _answer(status, **doc)

    async def _heal(self, gpu: Gpu, who: str) -> tuple[int, dict[str, Any]]:
        snap = self._state.current
        if all(s.healthy for _, s in snap.devices_of(gpu)):
            return 200, self._outcome(gpu, f"{gpu.label} is Healthy; nothing to heal")
        await self._handle(EvidenceFound(gpu.uuid, f"the operator's word (nvplug heal by {who})"))
        if any(s.clears is Clears.CHECK for _, s in self._state.current.devices_of(gpu)):
            # What Allocate needs is checked by a scan, not a probe.
            await self._scan()
        else:
            await self._handle(await self._scanner.probe(gpu.uuid, "the operator's heal"))
        return 200, self._outcome(gpu)

    async def reset(self, gpu: Gpu, who: str, validate: Validate | None = None) -> tuple[int, dict[str, Any]]:
        """nvplug's own reset (nvplug.health.autoReset), through the same path as an operator's,
        one at a time with theirs. `validate` runs after a reset that worked: the evidence of the
        reset counts only once it passes, so the GPU is Healthy only then."""
        async with self._lock:
            return await self._reset(gpu, who, validate)

    async def _reset(self, gpu: Gpu, who: str, validate: Validate | None = None) -> tuple[int, dict[str, Any]]:
        command = shutil.which(self._nvidia_smi)
        if command is None:
            return 503, self._outcome(gpu, f"not reset: {self._nvidia_smi} is not on PATH", "failed")
        try:
            pids = await self._scanner.processes(gpu.uuid)
        except NvmlUnavailable as err:
            return 503, self._outcome(gpu, f"not reset: {err}", "failed")
        if pids:
            listed = ", ".join(str(p) for p in pids)
            return 409, self._outcome(gpu, f"not reset: processes use it (pids {listed})", "refused")
        # Never offered while the reset runs, nor after one that failed.
        await self._handle(HealthReported(gpu.uuid, f"being reset at the request of {who}"))
        argv = [command, "-r", "-i", gpu.bus_id]
        try:
            done = await self._scanner.reset(argv, RESET_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired, NvmlUnavailable) as err:
            failure: str | None = f"{' '.join(argv)} failed: {err}"
        else:
            output = " ".join((done.stdout + done.stderr).split())[:500]
            failure = f"{' '.join(argv)} exited {done.returncode}: {output}" if done.returncode else None
        evidence = f"GPU reset by nvidia-smi at the request of {who}"
        if failure is None and validate is not None:
            await self._scan()  # events subscribed again while the check runs; no evidence yet, so no heal
            failure = await validate(gpu)
            if failure is not None:
                return 500, self._outcome(gpu, f"reset, then the check failed: {failure}", "failed")
            evidence += ", and checked"
        if failure is None:
            await self._handle(EvidenceFound(gpu.uuid, evidence))
        if validate is not None and failure is None:
            # Subscribed again before the check already: the probe its evidence waits for is all.
            await self._handle(await self._scanner.probe(gpu.uuid, "the check after the reset"))
        else:
            # The reset dropped our NVML events: a scan subscribes again, and probes the reset GPU.
            await self._scan()
        if failure is not None:
            return 500, self._outcome(gpu, failure, "failed")
        return 200, self._outcome(gpu)

    async def _scan(self) -> None:
        found = await self._scanner.scan()
        if found is not None:  # None: it waits for a hung NVML call, which the status says
            await self._handle(found)

    def _outcome(self, gpu: Gpu, message: str | None = None, outcome: str | None = None) -> dict[str, Any]:
        """The GPU's health now, and what it still waits for."""
        snap = self._state.current
        sick = [(u, s) for u, s in snap.devices_of(gpu) if not s.healthy]
        present = snap.gpu(gpu.uuid) is not None
        state = snap.health.get(gpu.uuid)
        if message is None:
            if not present:
                message = f"{gpu.label} is no longer enumerated by NVML"
            elif not sick:
                message = f"{gpu.label} is Healthy: {state.reason if state else ''}"
            else:
                uuid, worst = sick[0]
                message = f"{uuid} is still Unhealthy: {worst.reason}; waiting for " + (
                    worst.waiting_for(gpu.bus_id, gpu.index) or "?"
                )
        return {
            "gpu": gpu.label,
            "outcome": outcome or ("healthy" if present and not sick else "unhealthy"),
            "message": message,
            "health": state.health.value if state else None,
            "reason": state.reason if state else None,
        }


def _answer(status: int, **doc: Any) -> Answer:
    return status, "application/json", json.dumps(doc).encode() + b"\n"
