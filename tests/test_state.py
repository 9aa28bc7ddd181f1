"""The core state: pure folding of events into snapshots."""

from __future__ import annotations

import asyncio

from nvplug.core.events import (
    HealthReported,
    InventoryFound,
    KubeletSocketCreated,
    NvmlFailed,
    PciChanged,
    ProbeResult,
    RecoveryActionChanged,
    XidOccurred,
)
from nvplug.core.gpu import Gpu, normalize_bus_id
from nvplug.core.health import Clears, Health
from nvplug.core.latest_snapshot import LatestSnapshot
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import NODE_FIELDS
from nvplug.core.snapshot_draft import SnapshotDraft
from nvplug.core.xid_policy import XidPolicy
from nvplug.shaping.resource_plan import ResourceSpec


def gpu(i: int, numa: int = 0) -> Gpu:
    return Gpu(uuid=f"GPU-{i:08d}", index=i, bus_id=f"0000:{0x18 + i:02x}:00.0", minor=i, numa_node=numa)


def test_inventory_adds_healthy_gpus_and_bumps_revision_once() -> None:
    state = NodeState(clock=lambda: 100.0)
    changes = state.apply(InventoryFound((gpu(1), gpu(0))))
    snap = state.current
    assert snap.revision == 1
    assert [g.index for g in snap.gpus] == [0, 1]
    assert [c.what for c in changes] == ["added", "added"]
    assert all(h.health is Health.HEALTHY and h.since == 100.0 for h in snap.health.values())


def test_same_inventory_again_changes_nothing() -> None:
    state = NodeState()
    state.apply(InventoryFound((gpu(0),)))
    assert state.apply(InventoryFound((gpu(0),))) == []
    assert state.current.revision == 1


def test_removed_gpu_leaves_inventory_and_health() -> None:
    state = NodeState()
    state.apply(InventoryFound((gpu(0), gpu(1))))
    changes = state.apply(InventoryFound((gpu(0),)))
    assert [(c.what, c.gpu) for c in changes] == [("removed", gpu(1))]
    assert set(state.current.health) == {"GPU-00000000"}


def test_health_transition_keeps_reason_and_time() -> None:
    now = [10.0]
    state = NodeState(clock=lambda: now[0])
    state.apply(InventoryFound((gpu(0),)))
    now[0] = 20.0
    changes = state.apply(HealthReported("GPU-00000000", "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS"))
    h = state.current.health["GPU-00000000"]
    assert (h.health, h.reason, h.since) == (Health.UNHEALTHY, "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS", 20.0)
    assert [c.what for c in changes] == ["unhealthy"]
    # The same verdict again is no news.
    assert state.apply(HealthReported("GPU-00000000", "again")) == []
    assert state.current.revision == 2


def test_health_for_unknown_gpu_is_ignored() -> None:
    state = NodeState()
    assert state.apply(HealthReported("GPU-nope", "x")) == []
    assert state.current.revision == 0


def test_nvml_failure_is_recorded_and_cleared_by_a_discovery() -> None:
    state = NodeState()
    state.apply(NvmlFailed("NVML Shared Library Not Found"))
    assert state.current.nvml_error == "NVML Shared Library Not Found"
    assert state.apply(NvmlFailed("NVML Shared Library Not Found")) == []
    changes = state.apply(InventoryFound((gpu(0),)))
    assert state.current.nvml_error is None
    assert "nvml recovered" in [c.what for c in changes]


def test_non_state_events_do_not_touch_state() -> None:
    state = NodeState()
    assert state.apply(KubeletSocketCreated()) == []
    assert state.current.revision == 0


def test_the_draft_types_only_fields_a_snapshot_has() -> None:
    # The draft copies and builds every field from the Snapshot's own list; its annotations only
    # type them for the fold, so a renamed field must not live on there.
    assert set(SnapshotDraft.__annotations__) <= set(NODE_FIELDS)


def test_waiters_see_one_wakeup_for_a_burst() -> None:
    async def scenario() -> tuple[list[int], int]:
        state = NodeState()
        shown = LatestSnapshot(state.current)
        woke = []

        async def watcher() -> None:
            await shown.next_revision()
            woke.append(shown.current.revision)

        task = asyncio.create_task(watcher())
        await asyncio.sleep(0)
        for event in (
            InventoryFound((gpu(0),)),
            HealthReported("GPU-00000000", "x", Clears.PROBE),
            ProbeResult("GPU-00000000", None, "re-probe 1"),
        ):
            state.apply(event)
            shown.show(state.current)
        await task
        return woke, state.current.revision

    seen, final = asyncio.run(scenario())
    # The watcher was woken once and already sees the latest revision.
    assert seen == [final] and final == 3


def test_counters_alone_wake_no_waiter() -> None:
    async def scenario() -> bool:
        state = NodeState()
        state.apply(InventoryFound((gpu(0),)))
        shown = LatestSnapshot(state.current)
        waiting = asyncio.create_task(shown.next_revision())
        await asyncio.sleep(0)
        state.apply(XidOccurred("GPU-00000000", 31))  # an application's fault: counted, no new revision
        assert state.current is not shown.current
        shown.show(state.current)
        await asyncio.sleep(0)
        woke = waiting.done()
        waiting.cancel()
        return woke

    assert asyncio.run(scenario()) is False


def test_snapshot_is_immutable_for_readers() -> None:
    state = NodeState()
    state.apply(InventoryFound((gpu(0),)))
    snap = state.current
    state.apply(HealthReported("GPU-00000000", "x"))
    assert snap.health["GPU-00000000"].health is Health.HEALTHY


def test_whole_gpus_projection_carries_numa_and_health() -> None:
    state = NodeState()
    state.apply(InventoryFound((gpu(0, numa=0), gpu(1, numa=1), Gpu("GPU-x", 2, "0000:99:00.0"))))
    resource = ResourceSpec().project(state.current)
    assert [(d.id, d.numa_node) for d in resource.devices] == [
        ("GPU-00000000", 0),
        ("GPU-00000001", 1),
        ("GPU-x", None),
    ]
    assert resource.healthy_count == 3


def test_normalize_bus_id() -> None:
    assert normalize_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert normalize_bus_id("0000:AB:00.0") == "0000:ab:00.0"


# --- health rules ------------------------------------------------------------------


def eight() -> NodeState:
    state = NodeState(XidPolicy.with_overrides(fatal=[13]))
    state.apply(InventoryFound(tuple(gpu(i) for i in range(8))))
    return state


def health_of(state: NodeState, i: int) -> tuple[Health, str]:
    h = state.current.health[f"GPU-{i:08d}"]
    return h.health, h.reason


def test_xid_policy_decides_and_healthy_xids_are_noted_without_a_revision() -> None:
    state = eight()
    changes = state.apply(XidOccurred("GPU-00000000", 31))
    assert [c.what for c in changes] == ["xid, stays healthy"]
    assert state.current.revision == 1
    state.apply(XidOccurred("GPU-00000001", 79))
    assert health_of(state, 1) == (Health.UNHEALTHY, "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM)")
    state.apply(XidOccurred("GPU-00000002", 13))
    assert health_of(state, 2)[0] is Health.UNHEALTHY


def test_scan_probe_heals_only_with_reset_evidence() -> None:
    state = eight()
    state.apply(XidOccurred("GPU-00000001", 79))
    gpus = state.current.gpus
    ok = (ProbeResult("GPU-00000001", None, "scan"),)
    state.apply(InventoryFound(gpus, ok))
    assert health_of(state, 1)[0] is Health.UNHEALTHY  # a scan alone is no evidence
    state.apply(PciChanged("unbind", "0000:19:00.0"))
    assert health_of(state, 1) == (Health.UNHEALTHY, "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM)")
    state.apply(InventoryFound(gpus, ok))
    assert health_of(state, 1) == (Health.HEALTHY, "recovered: driver unbound and re-bound, probe passed")


def test_unbind_marks_unhealthy_and_remove_drops_the_gpu() -> None:
    state = eight()
    state.apply(PciChanged("unbind", "0000:1a:00.0"))
    assert health_of(state, 2) == (Health.UNHEALTHY, "driver unbound from the PCI device")
    changes = state.apply(PciChanged("remove", "0000:1b:00.0"))
    assert [(c.what, c.reason) for c in changes] == [("removed", "PCI device removed")]
    assert "GPU-00000003" not in state.current.health and len(state.current.gpus) == 7
    # Unknown bus ids and other actions change nothing.
    assert state.apply(PciChanged("remove", "0000:99:00.0")) == []
    assert state.apply(PciChanged("change", "0000:18:00.0")) == []


def test_a_scan_begun_before_a_pci_remove_does_not_bring_the_gpu_back() -> None:
    """It read the GPU before udev said it went; a scan begun after the removal says what is there now."""
    state = NodeState()
    state.apply(InventoryFound((gpu(0), gpu(1)), started=1.0), arrived=2.0)
    state.apply(PciChanged("remove", gpu(1).bus_id), arrived=5.0)
    assert state.apply(InventoryFound((gpu(0), gpu(1)), started=4.0), arrived=6.0) == []
    assert [g.uuid for g in state.current.gpus] == ["GPU-00000000"] and "GPU-00000001" not in state.current.health
    # Another GPU in the same slot, read by the same old scan: not there either.
    newcomer = Gpu(uuid="GPU-99999999", index=1, bus_id=gpu(1).bus_id, minor=9)
    assert state.apply(InventoryFound((gpu(0), newcomer), started=4.5), arrived=7.0) == []
    # A scan begun after the removal: the device came back (a remove and an add), and so does the GPU.
    changes = state.apply(InventoryFound((gpu(0), newcomer), started=8.0), arrived=9.0)
    assert [(c.what, c.gpu) for c in changes] == [("added", newcomer)]


def test_re_probe_heals_and_failing_probe_marks() -> None:
    state = eight()
    state.apply(ProbeResult("GPU-00000004", "GPU is lost", "re-probe 1"))
    assert health_of(state, 4) == (Health.UNHEALTHY, "probe failed: GPU is lost")
    state.apply(ProbeResult("GPU-00000004", None, "re-probe 2 of the Unhealthy GPU"))
    assert health_of(state, 4) == (Health.HEALTHY, "recovered: re-probe 2 of the Unhealthy GPU, probe passed")


def test_recovery_action_marks_and_its_return_to_none_is_evidence() -> None:
    state = eight()
    state.apply(RecoveryActionChanged("GPU-00000005", 4))
    assert health_of(state, 5) == (Health.UNHEALTHY, "NVML recovery action: drain and reset")
    changes = state.apply(RecoveryActionChanged("GPU-00000005", 0))
    assert [c.what for c in changes] == ["recovery evidence"]
    assert health_of(state, 5)[0] is Health.UNHEALTHY  # a probe must still confirm it
    state.apply(InventoryFound(state.current.gpus, (ProbeResult("GPU-00000005", None, "scan"),)))
    assert health_of(state, 5) == (Health.HEALTHY, "recovered: NVML recovery action back to none, probe passed")


def test_a_new_gpu_that_fails_its_first_probe_is_unhealthy_in_the_same_revision() -> None:
    state = NodeState()
    state.apply(InventoryFound((gpu(0), gpu(1)), (ProbeResult("GPU-00000001", "row remap pending", "scan"),)))
    assert state.current.revision == 1
    assert health_of(state, 1) == (Health.UNHEALTHY, "probe failed: row remap pending")


def test_nvml_lost_after_working_makes_gpus_unhealthy_until_a_scan_probes_them() -> None:
    state = eight()
    state.apply(XidOccurred("GPU-00000007", 79))
    state.apply(NvmlFailed("Driver Not Loaded"))
    assert all(not h.healthy for h in state.current.health.values())
    assert health_of(state, 0) == (Health.UNHEALTHY, "NVML unavailable: Driver Not Loaded")
    passed = tuple(ProbeResult(g.uuid, None, "scan") for g in state.current.gpus)
    state.apply(InventoryFound(state.current.gpus, passed))
    assert health_of(state, 0) == (Health.HEALTHY, "recovered: scan, probe passed")
    # The GPU that was already Unhealthy for its own reason still needs its own evidence.
    assert health_of(state, 7)[0] is Health.UNHEALTHY


def test_a_faulted_gpu_out_of_a_scan_keeps_its_fault_when_it_comes_back() -> None:
    """Two GPUs vanish in one scan and NVML counts one lost: the state cannot tell which, and keeps
    one. The other's fault must not go with it: were it dropped and found again, it would come back
    Healthy with no evidence of a repair."""
    state = eight()
    state.apply(XidOccurred("GPU-00000001", 79))
    state.apply(XidOccurred("GPU-00000002", 48))
    every = state.current.gpus
    changes = state.apply(InventoryFound(tuple(g for g in every if g.index not in (1, 2)), lost=1))
    dropped = next(c.gpu for c in changes if c.what == "removed")
    assert dropped is not None and dropped.uuid not in state.current.health
    changes = state.apply(InventoryFound(every, tuple(ProbeResult(g.uuid, None, "scan") for g in every)))
    assert health_of(state, dropped.index)[0] is Health.UNHEALTHY
    assert [c.what for c in changes if c.gpu == dropped] == ["added", "restored unhealthy"]
    # It is in the state file meanwhile, and its PCI device's removal or reset ends the fault.
    state.apply(InventoryFound(tuple(g for g in every if g != dropped)))
    assert dropped.uuid in state.current.records()
    state.apply(PciChanged("remove", dropped.bus_id))
    assert dropped.uuid not in state.current.records()
    state.apply(InventoryFound(every))
    assert health_of(state, dropped.index)[0] is Health.HEALTHY


def test_a_healthy_gpu_out_of_a_scan_comes_back_healthy() -> None:
    state = eight()
    every = state.current.gpus
    state.apply(InventoryFound(every[1:]))
    assert state.current.records() == {}
    state.apply(InventoryFound(every))
    assert health_of(state, 0)[0] is Health.HEALTHY
