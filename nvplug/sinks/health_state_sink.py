"""The health state file as a sink: each new revision's Unhealthy devices, saved off the loop."""

from __future__ import annotations

from collections.abc import Sequence

from nvplug.core.events import Event
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import Sink, StateUpdate
from nvplug.sinks.health_state_file import LAG_BOUND, Saved, StateFile


class HealthStateSink(Sink):
    name = "health state file"
    # What `saved` takes; kernel_log_seq alone (a counter) is saved with the next change.
    reads = frozenset({"gpus", "health", "restored", "logged", "auto_resets", "compute_modes"})

    def __init__(self, file: StateFile, state: NodeState) -> None:
        self.file = file
        self._state = state
        self._records = lambda: saved(state.current)
        file.follow(self._records)  # what `written` writes, before any change came

    def update(self, update: StateUpdate) -> Sequence[Event]:
        # By the saver thread, paced under a storm: an fsync must not delay the kubelet's news.
        self.file.save_soon(self._records)
        return ()

    def status(self) -> dict[str, object]:
        f = self.file
        return {
            "file": str(f.path),
            "changes": f.changes,
            "writes": f.writes,
            "slowest_write_seconds": round(f.slowest, 6),
            "lag_bound_seconds": LAG_BOUND,
            "error": f.failing,
        }

    async def close(self) -> None:
        self.file.close(saved(self._state.current))  # whatever a last event changed


def saved(snap: Snapshot) -> Saved:
    return Saved(snap.records(), snap.kernel_log_cursor, snap.auto_resets, snap.compute_modes)
