"""The dispatcher: each sink is called for the fields it reads, and the list goes out before the sinks
no list waits for (the log, the state file, labels, the status line)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import pytest

from nvplug.config import Config
from nvplug.core.events import CdiChecked, Event, InventoryFound, XidOccurred
from nvplug.core.gpu import Gpu
from nvplug.core.latest_snapshot import LatestSnapshot
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import Snapshot
from nvplug.daemon.dispatch import Dispatcher
from nvplug.edges.edge_protocols import Sink, StateUpdate
from nvplug.kubelet.plugin_fleet import PluginFleet
from nvplug.sinks.cdi.cdi_publisher import CdiSink
from nvplug.sinks.health_state_sink import HealthStateSink
from nvplug.sinks.nfd_feature_file import label_reads
from nvplug.status.status_server import Metrics


def gpu(i: int) -> Gpu:
    return Gpu(uuid=f"GPU-{i:08d}", index=i, bus_id=f"0000:{0x18 + i:02x}:00.0", minor=i)


class Recording(Sink):
    def __init__(self, name: str, reads: frozenset[str] | None, before_list: bool, calls: list[str]) -> None:
        self.name = name
        self.reads = reads
        self.before_list = before_list
        self._calls = calls
        self.updates: list[StateUpdate] = []

    def update(self, update: StateUpdate) -> Sequence[Event]:
        self._calls.append(self.name)
        self.updates.append(update)
        return ()


class Listing(Recording):
    """As the device-plugin fleet: a sink the list needs, whose streams wait on the snapshots it is shown."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__("fleet", None, True, calls)
        self.shown = LatestSnapshot(Snapshot(revision=0))

    def update(self, update: StateUpdate) -> Sequence[Event]:
        self.shown.show(update.snapshot)
        return super().update(update)


class Failing(Sink):
    name = "broken"

    def update(self, update: StateUpdate) -> Sequence[Event]:
        raise ValueError("a sink's bug")


def dispatcher(state: NodeState, sinks: Sequence[Sink]) -> Dispatcher:
    # No part does work for these events: apply() is all they go through.
    d = Dispatcher(state, Metrics(list))
    d.sinks = sinks
    return d


def test_a_health_change_skips_the_cdi_spec_and_the_labels_and_an_inventory_change_runs_both() -> None:
    calls: list[str] = []
    plain = Config()
    counting = replace(plain, unhealthy_count_label=True)
    cdi = Recording("cdi", CdiSink.reads, True, calls)
    labels = Recording("labels", label_reads(plain), False, calls)
    counted = Recording("labels with unhealthyCount", label_reads(counting), False, calls)
    state_file = Recording("state file", HealthStateSink.reads, False, calls)

    async def scenario() -> None:
        state = NodeState()
        d = dispatcher(state, [cdi, labels, counted, state_file])
        d.apply(InventoryFound((gpu(0), gpu(1))))
        await asyncio.sleep(0)
        assert calls == ["cdi", "labels", "labels with unhealthyCount", "state file"]
        calls.clear()
        d.apply(XidOccurred("GPU-00000000", 79))
        await asyncio.sleep(0)
        assert calls == ["labels with unhealthyCount", "state file"]
        assert state_file.updates[-1].changed >= {"health"}

    asyncio.run(scenario())


def test_the_list_goes_out_before_the_sinks_after_it_which_see_the_updates_since_merged() -> None:
    calls: list[str] = []
    before = Recording("cdi", None, True, calls)
    after = Recording("state file", None, False, calls)

    async def scenario() -> None:
        state = NodeState()
        fleet = Listing(calls)
        # The wiring's order, and the list's sinks first all the same.
        d = dispatcher(state, [after, before, fleet])
        d.apply(InventoryFound((gpu(0), gpu(1))))
        await asyncio.sleep(0)
        calls.clear()

        async def stream() -> None:
            """As a ListAndWatch stream waits: on its fleet's snapshots, for the next revision."""
            await fleet.shown.next_revision()
            calls.append("list")

        waiting = asyncio.create_task(stream())
        await asyncio.sleep(0)
        d.apply(XidOccurred("GPU-00000000", 79))
        d.apply(XidOccurred("GPU-00000001", 79))
        assert calls == ["cdi", "fleet", "cdi", "fleet"]  # at once, within apply
        await waiting
        await asyncio.sleep(0)
        assert calls == ["cdi", "fleet", "cdi", "fleet", "list", "state file"]
        assert fleet.shown.current is state.current
        merged = after.updates[-1]
        assert [c.what for c in merged.changes] == ["unhealthy", "unhealthy"]
        assert merged.snapshot is state.current and merged.revised

    asyncio.run(scenario())


def test_a_sink_after_the_list_that_fails_fails_the_dispatcher() -> None:
    async def scenario() -> None:
        d = dispatcher(NodeState(), [Failing()])
        d.apply(InventoryFound((gpu(0),)))
        with pytest.raises(ValueError, match="a sink's bug"):
            await asyncio.wait_for(d.failed(), 5)

    asyncio.run(scenario())


def test_the_cdi_specs_optional_names_reach_the_fleet_with_no_new_revision() -> None:
    """Allocate adds them to every container; no list carries them, so no stream wakes for them."""
    calls: list[str] = []
    fleet = Recording("device plugins", PluginFleet.reads, True, calls)

    async def scenario() -> None:
        state = NodeState()
        d = dispatcher(state, [fleet])
        d.apply(InventoryFound((gpu(0),)))
        revision = state.current.revision
        calls.clear()
        d.apply(CdiChecked({}, ("k8s.device-plugin.nvidia.com/gds=all",)))
        assert calls == ["device plugins"] and state.current.revision == revision
        assert fleet.updates[-1].snapshot.cdi_extra == ("k8s.device-plugin.nvidia.com/gds=all",)
        assert not fleet.updates[-1].revised

    asyncio.run(scenario())
