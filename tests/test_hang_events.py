"""A hung GPU blinds no other: while a rescan waits on one GPU's hung call, the event watch of every other
GPU keeps delivering (an XID, an ECC double-bit error), before and after the hung GPU turns Unhealthy; a GPU
hot-added meanwhile is served when the hang ends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
from test_faults import NEW_GPU, NEW_UUID

from nvplug.testing.simulated_node import SimulatedNode, device_health, registered_with
from nvplug.testing.udev_sender import pci_event

TIMEOUT = 15.0
HUNG = 3
# A call a rescan makes of every GPU (its probe), after the GPUs are named.
HUNG_CALL = "nvmlDeviceGetRetiredPagesPendingStatus"
MIG_CONFIG_CHANGE = 0x100  # an NVML event after which nvplug rescans
HANG_SECONDS = 2.0


def serving(node: SimulatedNode) -> list[dict[str, object]]:
    """The daemon serving the node's GPUs, with short NVML deadlines."""
    node.config.write_text(
        f"version: v1\nnvplug:\n  health:\n    nvmlCallDeadlineSeconds: 0.5\n    driverHangSeconds: {HANG_SECONDS:g}\n"
    )
    gpus = node.scenario_gpus()
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(len(gpus)), TIMEOUT)
    return gpus


@contextlib.contextmanager
def rescan_hung(node: SimulatedNode) -> Iterator[None]:
    """A rescan started into GPU 3's hung probe call, held for the body; released at its end."""
    with node.control.blocked(HUNG, HUNG_CALL):
        node.control.event(0, MIG_CONFIG_CHANGE)
        node.control.wait_blocked(1)
        node.wait_log("NVML has not returned from scan")
        yield


@pytest.fixture
def hung(node: SimulatedNode) -> Iterator[list[dict[str, object]]]:
    gpus = serving(node)
    with rescan_hung(node):
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
