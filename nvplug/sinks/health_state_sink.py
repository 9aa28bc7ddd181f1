"""The health state file as a sink: each new revision's Unhealthy devices, saved off the loop."""

from __future__ import annotations

from collections.abc import Sequence

from nvplug.core.events import Event
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import Sink, StateUpdate
from nvplug.sinks.health_state_file import LAG_BOUND, Saved, StateFile


class HealthStateSink(Sink):
    name = "health state file"
    # What `saved` takes; kernel_log_seq alone (a counter) is saved with the next change, and at stop.
    reads = frozenset({"gpus", "health", "restored", "logged", "auto_resets", "compute_modes"})
    # At once, though no list needs it: a compute mode's record must be in what `written` writes as
    # soon as it is applied. Cheap: the write itself is the saver thread's, taken later.
    before_list = True

    def __init__(self, file: StateFile, first: Snapshot) -> None:
        self.file = file
        # The newest snapshot it was handed: what the next write takes.
        self._snapshot = first
        file.follow(self._saved)  # what `written` writes, before any change came

    def update(self, update: StateUpdate) -> Sequence[Event]:
        self._snapshot = update.snapshot
        # By the saver thread, paced under a storm: an fsync must not delay the kubelet's news.
        self.file.save_soon(self._saved)
        return ()

    def _saved(self) -> Saved:
        return saved(self._snapshot)

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


def saved(snap: Snapshot) -> Saved:
    return Saved(snap.records(), snap.kernel_log_cursor, snap.auto_resets, snap.compute_modes)
