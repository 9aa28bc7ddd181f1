"""A hung GPU blinds no other: while a rescan waits on one GPU's hung call, the event watch of every other
GPU keeps delivering (an XID, an ECC double-bit error), before and after the hung GPU turns Unhealthy; a GPU
hot-added meanwhile is served when the hang ends. And the hand-over itself loses and doubles nothing: a
rescan that need not count the GPUs again keeps the watch, and what fires while a rescan that does has no
watch subscribed is reported once, from the driver's ECC count and from the kernel log."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator

import pytest
from support.waiting import wait_until
from test_faults import NEW_GPU, NEW_UUID
from test_telemetry import serving as serving_with

from nvplug.status import status_client
from nvplug.testing.process_tree import child_pids
from nvplug.testing.simulated_node import SimulatedNode, device_health
from nvplug.testing.udev_sender import pci_event

TIMEOUT = 15.0
HUNG = 3
# A call a rescan makes of every GPU (its probe), after the GPUs are named.
HUNG_CALL = "nvmlDeviceGetRetiredPagesPendingStatus"
MIG_CONFIG_CHANGE = 0x100  # an NVML event after which nvplug rescans
# The first call of a scan that counts the GPUs again: held, it holds the scan with no event set alive.
COUNT_CALL = "nvmlDeviceGetCount_v2"
HANG_SECONDS = 2.0


def serving(node: SimulatedNode) -> list[dict[str, str]]:
    """The daemon serving the node's GPUs, with short NVML deadlines."""
    return serving_with(
        node, f"nvplug:\n  health:\n    nvmlCallDeadlineSeconds: 0.5\n    driverHangSeconds: {HANG_SECONDS:g}\n"
    )


@contextlib.contextmanager
def rescan_hung(node: SimulatedNode, recount: bool = False) -> Iterator[None]:
    """A rescan started into GPU 3's hung probe call, held for the body; released at its end. It runs beside
    the watch (after a MIG layout change), or `recount`s the GPUs with a new watch (after a udev bind)."""
    with node.control.blocked(HUNG, HUNG_CALL):
        if recount:
            node.send_uevent(pci_event("bind", str(node.scenario_gpus()[0]["bus"]).lower()))
        else:
            node.control.event(0, MIG_CONFIG_CHANGE)
        node.control.wait_blocked(1)
        node.wait_log("NVML has not returned from scan")
        yield


@pytest.fixture(params=[False, True], ids=["beside-the-watch", "new-watch"])
def hung(node: SimulatedNode, request: pytest.FixtureRequest) -> Iterator[list[dict[str, object]]]:
    gpus = serving(node)
    with rescan_hung(node, recount=request.param):
        yield gpus


def arrives(node: SimulatedNode, uuid: str) -> float:
    """Seconds until the kubelet stand-in has `uuid` Unhealthy; the hang must still hold then."""
    began = time.monotonic()
    node.kubelet.wait_for(device_health(uuid, False), TIMEOUT)
    took = time.monotonic() - began
    assert node.control.blocked_waiting() == 1, "the hang ended first: this proves nothing"
    return took


def test_an_xid_of_another_gpu_reaches_the_kubelet_during_the_hang(node: SimulatedNode, hung: list) -> None:
    node.control.xid(5, 79)  # through NVML alone: no kernel-log line
    before = arrives(node, str(hung[5]["uuid"]))
    # Past driverHangSeconds: GPU 3 is Unhealthy for its hang, and the others' events still flow.
    node.kubelet.wait_for(device_health(str(hung[HUNG]["uuid"]), False), TIMEOUT)
    node.control.xid(6, 48)
    after = arrives(node, str(hung[6]["uuid"]))
    print(f"XID of GPU 5 during GPU 3's hang: {before * 1000:.0f} ms; of GPU 6 past the hang limit: "
          f"{after * 1000:.0f} ms")  # fmt: skip
    assert "NVML has not returned from scan" in node.log_text()


def test_an_ecc_double_bit_error_reaches_the_kubelet_during_the_hang(node: SimulatedNode, hung: list) -> None:
    node.control.ecc(6, "dbe")
    took = arrives(node, str(hung[6]["uuid"]))
    print(f"ECC double-bit error of GPU 6 during GPU 3's hang: {took * 1000:.0f} ms")


def test_a_gpu_hot_added_during_the_hang_is_served_when_it_ends(node: SimulatedNode) -> None:
    gpus = serving(node)
    with rescan_hung(node):
        node.add_gpu(NEW_GPU)
        node.send_uevent(pci_event("add", "0000:cc:00.0"))
        # The others' events flow meanwhile.
        node.control.xid(5, 79)
        arrives(node, str(gpus[5]["uuid"]))
    # The hang ends: the scan completes, and the one owed for the hotplug serves the new GPU.
    node.kubelet.wait_for(device_health(NEW_UUID, True), TIMEOUT)
    node.kubelet.wait_for(device_health(str(gpus[HUNG]["uuid"]), True), TIMEOUT)


def event_process(node: SimulatedNode) -> int:
    """The daemon's NVML event process: its one child here."""
    assert node.daemon is not None
    (pid,) = child_pids(node.daemon.pid)
    return pid


def test_a_rescan_that_need_not_count_the_gpus_keeps_the_watch(node: SimulatedNode) -> None:
    gpus = serving(node)
    watching = event_process(node)
    node.control.event(0, MIG_CONFIG_CHANGE)  # MIG devices are read afresh in any session
    node.wait_log("scan 2:")
    assert event_process(node) == watching, "the rescan made a new watch"
    node.control.xid(5, 79)
    node.kubelet.wait_for(device_health(str(gpus[5]["uuid"]), False), TIMEOUT)


@contextlib.contextmanager
def no_watch(node: SimulatedNode, gpus: list[dict[str, str]]) -> Iterator[None]:
    """A rescan that counts the GPUs again (a udev bind), held before the new watch subscribes, while the
    old watch's child, which listens until then, has died: no process has an event set."""
    assert node.daemon is not None
    watching = event_process(node)
    with node.control.blocked("*", COUNT_CALL):
        node.send_uevent(pci_event("bind", str(gpus[0]["bus"]).lower()))
        node.control.wait_blocked(1)
        os.kill(watching, signal.SIGKILL)
        wait_until(lambda: watching not in child_pids(node.daemon.pid), TIMEOUT, "the old watch's child gone")
        yield


def test_an_ecc_error_while_no_watch_runs_is_reported_once_from_the_count(node: SimulatedNode) -> None:
    gpus = serving(node)
    with no_watch(node, gpus):
        node.control.ecc(4, "dbe", 2)
    node.kubelet.wait_for(device_health(str(gpus[4]["uuid"]), False), TIMEOUT)
    node.wait_log("2 double-bit ECC errors counted while no event watch ran")
    node.wait_log("scan 2:")
    # The catch-up reported them; the next rescan has nothing more to report, and the watch runs.
    with no_watch(node, gpus):
        pass
    node.wait_log("scan 3:")
    assert node.log_text().count("double-bit ECC errors counted while no event watch ran") == 1
    node.control.ecc(5, "dbe")  # the new watch's event
    node.kubelet.wait_for(device_health(str(gpus[5]["uuid"]), False), TIMEOUT)


def test_an_xid_while_a_rescan_counts_the_gpus_is_told_by_the_old_watch_s_child(node: SimulatedNode) -> None:
    """The old watch's child listens until the new watch has subscribed: an XID that only NVML tells (no
    kernel log line), while the rescan is held before it counts the GPUs, is not lost."""
    gpus = serving(node)
    assert node.daemon is not None
    uuid = str(gpus[5]["uuid"])
    watching = event_process(node)
    with node.control.blocked("*", COUNT_CALL):
        node.send_uevent(pci_event("bind", str(gpus[0]["bus"]).lower()))
        node.control.wait_blocked(1)
        node.control.xid(5, 79)
        node.kubelet.wait_for(device_health(uuid, False), TIMEOUT)
        assert watching in child_pids(node.daemon.pid), "not the old watch's child that told it"
    node.wait_log("scan 2:")
    assert watching not in child_pids(node.daemon.pid), "the old watch's child outlived the new watch"


def test_an_xid_while_no_watch_runs_counts_once_from_the_kernel_log(node: SimulatedNode) -> None:
    gpus = serving(node)
    uuid, bus = str(gpus[5]["uuid"]), str(gpus[5]["bus"]).lower()
    with no_watch(node, gpus):
        node.control.xid(5, 79)
        node.kernel_log(f"NVRM: Xid (PCI:{bus[:-2]}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
        node.kubelet.wait_for(device_health(uuid, False), TIMEOUT)
    node.wait_log("scan 2:")
    code, body = status_client.fetch(f"unix:{node.status_socket}", "/status", timeout=5)
    assert code == 200, body
    (gpu,) = [g for g in json.loads(body)["gpus"] if g["uuid"] == uuid]
    assert gpu["xids"] == 1, gpu
