"""The health state file as a sink: each new revision's Unhealthy devices, saved off the loop."""

from __future__ import annotations

from collections.abc import Sequence

from nvplug.core.events import Event
from nvplug.core.node_state import NodeState, Snapshot
from nvplug.edges.edge_protocols import Sink, StateUpdate
from nvplug.sinks.health_state_file import Saved, StateFile


class HealthStateSink(Sink):
    name = "health state file"

    def __init__(self, file: StateFile, state: NodeState) -> None:
        self.file = file
        self._state = state

    def update(self, update: StateUpdate) -> Sequence[Event]:
        if update.revised:
            # By the saver thread, after this loop turn: an fsync must not delay the kubelet's news.
            self.file.save_soon(lambda: saved(self._state.current))
        return ()

    async def close(self) -> None:
        self.file.close(saved(self._state.current))  # whatever a last event changed


def saved(snap: Snapshot) -> Saved:
    return Saved(snap.records(), snap.kernel_log_cursor, snap.auto_resets, snap.compute_modes)
