"""The journal's view of each change: one line per change, naming the GPU, the reason and what it waits for.

A GPU going Unhealthy is the operator's first question ("whose job broke?"), so that line waits
for the kubelet's PodResources answer, asked only after the kubelet has had the news.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

from nvplug.core.events import Event
from nvplug.core.snapshot import Change, Snapshot
from nvplug.edges.edge_protocols import Sink, StateUpdate
from nvplug.kubelet.podresources_client import PodView
from nvplug.pods.pod_holders import Holder, of_gpu
from nvplug.status.status_server import Metrics, reason_class

log = logging.getLogger("nvplug")

# How old a PodResources answer may be for the Unhealthy line, and how long after the change to ask:
# the question to the kubelet must not compete with the list it waits for.
PODS_FRESH_FOR_LOG = 1.0
PODS_LOG_DELAY = 0.05

# How each change that names no GPU reads in the log.
_NODE_CHANGES = {
    "nvml failed": (logging.ERROR, "NVML unavailable: {}; no GPUs can be discovered or checked until it works"),
    "nvml recovered": (logging.INFO, "NVML works again (it failed with: {})"),
    "health watch failed": (logging.ERROR, "NVML health events cannot be received: {}; GPU faults go unseen"),
    "health watch running": (logging.INFO, "NVML health events are being received{}"),
}
_GPU_WARNINGS = {
    "unhealthy",
    "fault while unhealthy",
    "restored unhealthy",
    "removed",
    "xid without catalog action",
    "auto-reset failed",
    "auto-reset budget spent",
    "kernel log disagrees with NVML",
    "mps daemon down",
}


def log_change(change: Change, snap: Snapshot, suffix: str = "") -> None:
    gpu = change.gpu
    if gpu is None:
        level, text = _NODE_CHANGES.get(change.what, (logging.INFO, change.what + ": {}"))
        log.log(level, text.format(change.reason))
        return
    reason = f": {change.reason}" if change.reason else ""
    level = logging.WARNING if change.what in _GPU_WARNINGS else logging.INFO
    waiting = ""
    if change.what in ("unhealthy", "fault while unhealthy", "restored unhealthy"):
        # The operator reads here what the GPU needs before it is offered again.
        needs = [s.waiting_for(gpu.bus_id, gpu.index) for _, s in snap.devices_of(gpu) if not s.healthy]
        waiting = f"; waiting for {needs[0]}" if needs and needs[0] else ""
    log.log(level, "%s %s%s%s%s", gpu.label, change.what, reason, waiting, suffix)


class ChangeLog(Sink):
    """Logs every change and counts the health transitions."""

    name = "log"

    def __init__(
        self, pods: PodView, holders: Callable[[], Mapping[str, list[Holder]] | None], metrics: Metrics
    ) -> None:
        self._pods = pods
        self._holders = holders
        self._metrics = metrics
        # Lines that wait for PodResources; awaited at close, so that none is lost at a stop.
        self._waiting: set[asyncio.Task[None]] = set()

    def update(self, update: StateUpdate) -> Sequence[Event]:
        snap = update.snapshot
        for change in update.changes:
            if change.what == "unhealthy" and change.gpu is not None and self._pods.client is not None:
                task = asyncio.create_task(self._log_with_pods(change, snap))
                self._waiting.add(task)
                task.add_done_callback(self._waiting.discard)
            else:
                log_change(change, snap)
            if change.what in ("healthy", "unhealthy"):
                self._metrics.transitions.labels(change.what, reason_class(change.reason)).inc()
        return ()

    async def close(self) -> None:
        await asyncio.gather(*self._waiting, return_exceptions=True)

    async def _log_with_pods(self, change: Change, snap: Snapshot) -> None:
        # After the kubelet has the news: the question to the kubelet must not compete with the list.
        await asyncio.sleep(PODS_LOG_DELAY)
        await self._pods.fresh(max_age=PODS_FRESH_FOR_LOG)
        gpu = change.gpu
        assert gpu is not None
        by_device = self._holders()
        if by_device is None:
            log_change(change, snap)  # why the pods are unknown was said once already
            return
        held = of_gpu(by_device, gpu)
        suffix = "; in use by " + ", ".join(h.text for h in held) if held else "; no pod holds it"
        log_change(change, snap, suffix)
