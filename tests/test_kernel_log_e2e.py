"""The kernel log as a fault source, end to end: the daemon reads the simulated node's record FIFO
(in /dev/kmsg's format) beside NVML's events, and from before its start."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nvplug.core.events import (
    DriverLoaded,
    EvidenceFound,
    GpuFellOffBus,
    InventoryFound,
    KernelXid,
    ProbeResult,
    XidOccurred,
)
from nvplug.core.gpu import Gpu
from nvplug.core.kernel_log_backlog import settle
from nvplug.core.node_state import NodeState
from nvplug.status import status_client
from nvplug.testing.simulated_node import SimulatedNode, device_health, registered_with

TIMEOUT = 15.0
LOAD = "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024"


def xid_line(bus_id: str, code: int, text: str = "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.") -> str:
    """The driver's line, with the address as it prints it: domain:bus:device, no function."""
    return f"NVRM: Xid (PCI:{bus_id.lower()[:-2]}): {code}, {text}"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimulatedNode]:
    with SimulatedNode(tmp_path) as n:
        yield n


def status(node: SimulatedNode) -> dict[str, Any]:
    return status_client.status(f"unix:{node.status_socket}", timeout=5)


def gpu_doc(node: SimulatedNode, uuid: str) -> dict[str, Any]:
    return next(g for g in status(node)["gpus"] if g["uuid"] == uuid)


def wait_xids(node: SimulatedNode, uuid: str, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while gpu_doc(node, uuid)["xids"] < count and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # and no more than that
    assert gpu_doc(node, uuid)["xids"] == count


def start(node: SimulatedNode) -> list[dict[str, str]]:
    gpus = node.scenario_gpus()
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(len(gpus)), TIMEOUT)
    return gpus


def first_list(node: SimulatedNode) -> dict[str, bool]:
    plugin = node.kubelet.plugin("nvidia.com/gpu")
    assert plugin is not None
    return {d.id: d.healthy for d in plugin.updates[0].devices}


def test_the_backlog_settles_on_the_last_driver_load_and_the_state_files_cursor() -> None:
    old = KernelXid("0000:18:00.0", 79, "Xid 79", 3, replayed=True)
    load = DriverLoaded("550.54.15", 5, replayed=True)
    new = GpuFellOffBus("0000:2a:00.0", 7, replayed=True)
    assert settle((old, load, new), None) == (load, new)
    assert settle((old, new), None) == (old, new)
    assert settle((old, new), 3) == (new,)  # an earlier nvplug took record 3 in already
    assert settle((old, new), 7) == ()


def test_an_xid_only_in_the_kernel_log_makes_its_gpu_unhealthy(node: SimulatedNode) -> None:
    gpus = start(node)
    victim = gpus[1]
    node.kernel_log(xid_line(victim["bus"], 79))
    node.kubelet.wait_for(device_health(victim["uuid"], False), TIMEOUT)
    doc = gpu_doc(node, victim["uuid"])
    assert doc["reason"] == "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM) (from the kernel log)"
    assert doc["clears"] == "reset" and doc["xids"] == 1
    # The fallen-off line alone (no Xid, no NVML event) is the same fault.
    other = gpus[2]
    node.kernel_log(f"NVRM: GPU {other['bus'].lower()}: GPU has fallen off the bus.")
    node.kubelet.wait_for(device_health(other["uuid"], False), TIMEOUT)
    assert "GPU has fallen off the bus (from the kernel log)" in gpu_doc(node, other["uuid"])["reason"]


def test_an_xid_from_before_the_start_counts_from_the_first_list(node: SimulatedNode) -> None:
    gpus = node.scenario_gpus()
    early, reloaded = gpus[4], gpus[5]
    node.kernel_log(xid_line(reloaded["bus"], 48, "An uncorrectable double bit error (DBE) has been detected"))
    node.kernel_log(LOAD)  # what came before belongs to the previous driver load
    node.kernel_log(f"NVRM: GPU at PCI:{early['bus'].lower()[:-2]}: {early['uuid']}")
    node.kernel_log(xid_line(early["bus"], 79))
    start(node)
    seen = first_list(node)
    assert seen[early["uuid"]] is False and seen[reloaded["uuid"]] is True
    assert gpu_doc(node, early["uuid"])["reason"].endswith("(in the kernel log before this start)")


def test_a_restart_does_not_undo_a_repair_the_state_file_knows(node: SimulatedNode) -> None:
    gpus = start(node)
    victim = gpus[3]
    node.kernel_log(xid_line(victim["bus"], 79))
    node.kubelet.wait_for(device_health(victim["uuid"], False), TIMEOUT)
    answer = status_client.fetch(f"unix:{node.status_socket}", "/heal", timeout=5, body=b'{"gpu": "3"}')
    assert answer[0] == 200, answer
    node.kubelet.wait_for(device_health(victim["uuid"], True), TIMEOUT)
    time.sleep(0.3)  # the state file is written off the loop
    node.stop_daemon()
    node.kubelet.stop()
    # The restarted daemon reads the whole log again, the repaired fault in it.
    start(node)
    assert first_list(node)[victim["uuid"]] is True
    assert gpu_doc(node, victim["uuid"])["health"] == "Healthy"


def test_an_xid_reported_by_nvml_and_the_kernel_log_counts_once(node: SimulatedNode) -> None:
    gpus = start(node)
    victim = gpus[6]
    for n in (1, 2):  # a real repeat, reported by both each time, counts twice
        node.control.xid(6, 48)
        node.kernel_log(xid_line(victim["bus"], 48, "An uncorrectable double bit error (DBE) has been detected"))
        wait_xids(node, victim["uuid"], n)
    deadline = time.monotonic() + TIMEOUT
    while node.log_text().count("xid reported by NVML and the kernel log") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert node.log_text().count("xid reported by NVML and the kernel log") == 2
    assert gpu_doc(node, victim["uuid"])["xids"] == 2
    # Reported by one source only (NVML's events lost in a rescan, say): each counts.
    node.control.xid(6, 48)
    node.control.xid(6, 48)
    wait_xids(node, victim["uuid"], 4)


def test_lost_records_and_nvswitch_sxids_are_counted_not_faults(node: SimulatedNode) -> None:
    start(node)
    node.kernel_log("usb 1-1: new high-speed USB device number 2 using xhci_hcd")
    node.kernel_log_gap(5)  # after a record the reader saw: five it never will
    node.kernel_log("nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 12028, Non-fatal, Link 44 egress non-posted PRIV error")
    deadline = time.monotonic() + TIMEOUT
    while not status(node)["nvswitches"] and time.monotonic() < deadline:
        time.sleep(0.05)
    doc = status(node)
    assert doc["kernel_log"]["lost"] == 5 and doc["kernel_log"]["error"] is None
    assert doc["nvswitches"] == [
        {
            "bus_id": "0000:c5:00.0",
            "switch": "nvidia-nvswitch3",
            "sxids": 1,
            "last_code": 12028,
            "last": "SXid (PCI:0000:c5:00.0): 12028, Non-fatal, Link 44 egress non-posted PRIV error",
        }
    ]
    assert all(g["health"] == "Healthy" for g in doc["gpus"])
    _, metrics = status_client.fetch(f"unix:{node.status_socket}", "/metrics", timeout=5)
    assert 'nvplug_nvswitch_sxids_total{bus_id="0000:c5:00.0",switch="nvidia-nvswitch3"} 1.0' in metrics
    assert "nvplug_kernel_log_records_lost_total 5.0" in metrics


def test_an_unreadable_kernel_log_is_said_once_and_the_daemon_runs_on(node: SimulatedNode) -> None:
    gpus = node.scenario_gpus()
    node.kubelet.start()
    node.start_daemon("--kernel-log", str(node.root / "no-such-kmsg"))
    node.kubelet.wait_for(registered_with(len(gpus)), TIMEOUT)
    doc = status(node)
    assert "no-such-kmsg" in doc["kernel_log"]["error"]
    assert node.log_text().count("no-such-kmsg") >= 1


def test_a_report_from_before_a_repair_is_not_the_same_fault_as_one_after() -> None:
    gpu = Gpu("GPU-1", 1, "0000:2a:00.0")
    state = NodeState(clock=lambda: 100.0)  # every report within the window
    state.apply(InventoryFound((gpu,)))
    state.apply(KernelXid(gpu.bus_id, 79, "Xid 79", 1))
    state.apply(EvidenceFound(gpu.uuid, "the operator's word"))
    state.apply(ProbeResult(gpu.uuid, None, "probe"))
    assert state.current.health[gpu.uuid].healthy
    state.apply(XidOccurred(gpu.uuid, 79))  # NVML's word on a new fault, not on the old one
    assert not state.current.health[gpu.uuid].healthy and state.current.xids[gpu.uuid] == 2
    state.apply(KernelXid(gpu.bus_id, 79, "Xid 79", 2))  # and the kernel's word on that same new one
    assert state.current.xids[gpu.uuid] == 2


def test_a_gpu_hot_added_where_another_was_does_not_match_that_ones_reports() -> None:
    old, new = Gpu("GPU-old", 0, "0002:05:00.0"), Gpu("GPU-new", 0, "0002:05:00.0")
    state = NodeState(clock=lambda: 100.0)
    state.apply(InventoryFound((old,)))
    state.apply(XidOccurred(old.uuid, 48))  # NVML's report, whose kernel copy never came
    state.apply(InventoryFound((new,)))  # removed, and another GPU in its slot
    state.apply(KernelXid(new.bus_id, 48, "Xid 48", 1))
    assert not state.current.health[new.uuid].healthy and state.current.xids_matched == 0
