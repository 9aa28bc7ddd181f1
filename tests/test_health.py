"""Health end to end: NVML events from the fake library through the daemon to the kubelet stand-in."""

from __future__ import annotations

import time

import grpc
import pytest

from nvplug.testing.node import GPU_RESOURCE, SimulatedNode, device_health, registered_with

TIMEOUT = 15.0


def start(node: SimulatedNode, health: str = "") -> list[str]:
    if health:
        node.config.write_text(f"version: v1\nnvplug:\n  health:\n{health}")
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    return [g["uuid"] for g in node.scenario_gpus()]


def allocatable(node: SimulatedNode) -> int:
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    return plugin.allocatable


def test_xid_79_makes_the_gpu_unhealthy_and_xid_13_does_not(node: SimulatedNode) -> None:
    uuids = start(node)
    node.control.xid(0, 13)
    node.wait_log("xid, stays healthy: XID 13 ")
    node.control.xid(1, 79)
    node.kubelet.wait_for(device_health(uuids[1], healthy=False), TIMEOUT)
    log = node.wait_log("unhealthy: XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS")
    assert uuids[1] in log and "0000:2a:00.0" in log
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    assert plugin.devices[uuids[0]].healthy and allocatable(node) == 7
    with pytest.raises(grpc.aio.AioRpcError) as info:
        node.kubelet.allocate(GPU_RESOURCE, [uuids[1]])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Unhealthy: XID 79" in (info.value.details() or "")


def test_config_overrides_the_catalog(node: SimulatedNode) -> None:
    uuids = start(node, "    fatalXids: [13]\n    ignoreXids: [79]\n")
    node.control.xid(2, 79)
    node.wait_log("XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (ignored by config)")
    node.control.xid(3, 13)
    node.kubelet.wait_for(device_health(uuids[3], healthy=False), TIMEOUT)
    node.wait_log("(fatal by config)")
    assert allocatable(node) == 7


def test_double_bit_ecc_makes_the_gpu_unhealthy(node: SimulatedNode) -> None:
    uuids = start(node)
    node.control.ecc(4, "dbe")
    node.kubelet.wait_for(device_health(uuids[4], healthy=False), TIMEOUT)
    node.wait_log("unhealthy: double-bit ECC error")


def test_lost_gpu_recovers_only_when_a_re_probe_passes(node: SimulatedNode) -> None:
    uuids = start(node, "    reprobeInitialSeconds: 0.2\n    reprobeMaxSeconds: 0.4\n")
    node.control.lose(5)
    node.kubelet.wait_for(device_health(uuids[5], healthy=False), TIMEOUT)
    node.wait_log("unhealthy: GPU unavailable")
    # While lost, re-probes run and fail; the GPU stays out.
    node.wait_log("re-probe 2 failed")
    assert allocatable(node) == 7
    # Allocation never asks NVML: a lost GPU does not get in the way of the others.
    pair = [uuids[4], uuids[6]]
    assert node.kubelet.allocate(GPU_RESOURCE, pair).container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(
        pair
    )
    assert node.kubelet.preferred_allocation(GPU_RESOURCE, [u for u in uuids if u != uuids[5]], [], 2) == uuids[:2]
    node.control.restore(5)
    node.kubelet.wait_for(device_health(uuids[5], healthy=True), TIMEOUT)
    node.wait_log("healthy: recovered: re-probe")
    assert allocatable(node) == 8


def test_only_unhealthy_gpus_are_re_probed(node: SimulatedNode) -> None:
    uuids = start(node, "    reprobeInitialSeconds: 0.1\n    reprobeMaxSeconds: 0.2\n")
    node.control.pending_pages(6, True)
    node.control.xid(6, 48)
    node.kubelet.wait_for(device_health(uuids[6], healthy=False), TIMEOUT)
    node.wait_log("re-probe 3 failed: page retirement pending")
    log = node.log_text()
    # Nobody else was probed: every re-probe line names GPU 6.
    reprobes = [line for line in log.splitlines() if "re-probe" in line]
    assert reprobes and all(uuids[6] in line for line in reprobes)
    node.control.pending_pages(6, False)
    node.kubelet.wait_for(device_health(uuids[6], healthy=True), TIMEOUT)


def test_recovery_action_marks_and_its_return_to_none_heals_at_once(node: SimulatedNode) -> None:
    # Re-probes are far away: only the recovery-action evidence can heal the GPU in time.
    uuids = start(node, "    reprobeInitialSeconds: 600\n    reprobeMaxSeconds: 600\n")
    node.control.recovery_action(3, 1)
    node.kubelet.wait_for(device_health(uuids[3], healthy=False), TIMEOUT)
    node.wait_log("unhealthy: NVML recovery action: GPU reset")
    node.control.recovery_action(3, 0)
    node.kubelet.wait_for(device_health(uuids[3], healthy=True), TIMEOUT)
    node.wait_log("healthy: recovered: NVML recovery action back to none, probe passed")


def test_xid_154_reads_the_recovery_action(node: SimulatedNode) -> None:
    # GPU 2's driver has no recovery-action event: XID 154 is the only announcement.
    uuid = node.scenario_gpus()[2]["uuid"]
    node.scenario.write_text(node.scenario.read_text().replace(f"uuid={uuid}", f"uuid={uuid} events=0x600B"))
    uuids = start(node)
    node.control.recovery_action(2, 2)
    node.control.xid(2, 154)
    node.kubelet.wait_for(device_health(uuids[2], healthy=False), TIMEOUT)
    node.wait_log("XID 154 GPU_RECOVERY_ACTION_CHANGED")
    node.wait_log("unhealthy: NVML recovery action: node reboot")


def test_a_gpu_broken_at_start_is_never_advertised_healthy(node: SimulatedNode) -> None:
    uuid = node.scenario_gpus()[4]["uuid"]
    node.scenario.write_text(node.scenario.read_text().replace(f"uuid={uuid}", f"uuid={uuid} pending_pages=1"))
    start(node)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    # Every message the kubelet ever saw had it Unhealthy, the first one included.
    assert all(not next(d for d in u.devices if d.id == uuid).healthy for u in plugin.updates)
    node.wait_log("unhealthy: probe failed: page retirement pending")


def test_healthy_gpus_are_never_polled(node: SimulatedNode) -> None:
    start(node)
    node.control.reset_calls()
    time.sleep(3)
    calls = node.control.calls()
    # The blocked event wait is all; it re-enters at most once per wait timeout.
    assert set(calls) <= {"nvmlEventSetWait_v2"}, calls
    assert calls.get("nvmlEventSetWait_v2", 0) <= 1


def test_event_wait_failures_are_reported_and_retried_with_backoff(node: SimulatedNode) -> None:
    uuids = start(node)
    node.control.reset_calls()
    node.control.wait_error(999, -1)
    node.wait_log("ERROR   nvplug: NVML health events cannot be received: nvmlEventSetWait failed: Unknown Error")
    time.sleep(2)
    waits = node.control.calls().get("nvmlEventSetWait_v2", 0)
    # Backoff, not a busy loop: a handful of attempts in two seconds.
    assert 2 <= waits <= 15, waits
    node.control.wait_error(0, 0)
    node.wait_log("NVML health events are being received")
    node.control.xid(0, 79)
    node.kubelet.wait_for(device_health(uuids[0], healthy=False), TIMEOUT)
