"""Hotplug and restarts through real interfaces: netlink udev messages sent as root,
the fake library's add/remove, and the kubelet stand-in restarting under inotify."""

from __future__ import annotations

import os
import re
import time

import pytest

from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.net_namespace import NetNamespace
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with
from nvplug.testing.udev_sender import pci_event, send_uevent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sending udev netlink messages needs root")

TIMEOUT = 15.0
# From a udev bind to the GPUs registered: ten times what it takes, and less than the backoff then due.
BIND_BOUND = 3.0
NEW_GPU = (
    'uuid=GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08 name="NVIDIA H100 80GB HBM3" minor=8 '
    "bus=0000:CC:00.0 numa=1 memory_mib=81559 cc=9.0"
)


def start(node: SimulatedNode) -> list[dict[str, str]]:
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    return node.scenario_gpus()


def udev(node: SimulatedNode, action: str, bus_id: str) -> None:
    node.send_uevent(pci_event(action, bus_id, driver="nvidia" if action == "bind" else None))


def test_hot_added_gpu_appears_on_udev_add_and_bind(node: SimulatedNode) -> None:
    start(node)
    node.add_gpu(NEW_GPU)
    udev(node, "add", "0000:cc:00.0")
    udev(node, "bind", "0000:cc:00.0")
    node.kubelet.wait_for(registered_with(9), TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    new = plugin.devices["GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08"]
    assert new.healthy and new.numa_nodes == (1,)
    node.wait_log("GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08 (0000:cc:00.0) added")


def test_removed_gpu_leaves_the_list(node: SimulatedNode) -> None:
    gpus = start(node)
    node.control.remove(7)
    udev(node, "remove", gpus[7]["bus"])
    node.kubelet.wait_for(registered_with(7), TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and gpus[7]["uuid"] not in plugin.devices
    # The rescan that follows agrees: NVML no longer enumerates it.
    node.wait_log("scan 2: 7 GPUs")


def test_a_scan_under_way_when_udev_removes_a_gpu_does_not_bring_it_back(node: SimulatedNode) -> None:
    """A scan that read the GPU before it went publishes after udev said it went: the GPU stays out of
    the kubelet's list (where it could be allocated), and the rescan the removal asked for agrees."""
    gpus = start(node)
    gone = gpus[7]["uuid"]
    with node.control.blocked(7, "nvmlDeviceGetNvLinkState"):
        udev(node, "change", gpus[0]["bus"].lower())  # a rescan, held in GPU 7's links once its identity is read
        node.control.wait_blocked(timeout=TIMEOUT)
        node.control.remove(7)
        udev(node, "remove", gpus[7]["bus"])
        node.kubelet.wait_for(registered_with(7), TIMEOUT)
        removed = node.kubelet.plugin(GPU_RESOURCE)
        assert removed is not None
        left = len(removed.updates)
    node.wait_log("scan 2: 8 GPUs")  # what it read before the removal: GPU 7 too
    node.wait_log("scan 3: 7 GPUs")
    time.sleep(0.2)  # any list the scans' results made is out by now
    after = node.kubelet.plugin(GPU_RESOURCE)
    assert after is not None and gone not in after.devices
    assert not [u.ids for u in after.updates[left - 1 :] if gone in u.ids], after.updates[left - 1 :]


def test_unbind_marks_unhealthy_and_bind_with_a_good_probe_heals(node: SimulatedNode) -> None:
    gpus = start(node)
    uuid = gpus[3]["uuid"]
    # Unbound, the GPU is out of NVML's reach, as on a real node: the probe the unbind's evidence starts at
    # once fails. (A fake still answering would heal it within milliseconds, before any check could see it.)
    node.control.lose(3)
    udev(node, "unbind", gpus[3]["bus"])
    node.wait_log("unhealthy: driver unbound from the PCI device")
    node.kubelet.wait_for(device_health(uuid, healthy=False), TIMEOUT)
    node.control.restore(uuid)
    udev(node, "bind", gpus[3]["bus"])
    node.kubelet.wait_for(device_health(uuid, healthy=True), TIMEOUT)
    node.wait_log("healthy: recovered: driver unbound and re-bound, probe passed")


def test_the_daemon_hears_only_its_own_namespace(node: SimulatedNode, netns: NetNamespace) -> None:
    """An unbind sent outside the node's network namespace (as another suite's, or a real udevd's,
    would be) never reaches its daemon; the one sent inside, after it, does."""
    gpus = start(node)
    send_uevent(netns, pci_event("unbind", gpus[3]["bus"]))
    udev(node, "unbind", gpus[4]["bus"])
    # The log, not the kubelet's view: the fake still answers for an unbound GPU, so the probe the unbind
    # starts heals it within milliseconds, and a look at the view may come after both.
    node.wait_log(f"{gpus[4]['uuid']} ({gpus[4]['bus'].lower()}) unhealthy: driver unbound")
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.devices[gpus[3]["uuid"]].healthy
    assert f"{gpus[3]['uuid']} ({gpus[3]['bus'].lower()}) unhealthy" not in node.log_text()


def test_xid_79_then_remove_and_add_brings_the_gpu_back_healthy(node: SimulatedNode) -> None:
    gpus = start(node)
    uuid, bus = gpus[2]["uuid"], gpus[2]["bus"]
    node.control.xid(2, 79)
    node.kubelet.wait_for(device_health(uuid, healthy=False), TIMEOUT)
    node.control.remove(2)
    udev(node, "remove", bus)
    node.kubelet.wait_for(registered_with(7), TIMEOUT)
    node.control.restore(uuid)  # the GPU is back on the bus after a reset
    udev(node, "add", bus)
    udev(node, "bind", bus)
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    node.kubelet.wait_for(device_health(uuid, healthy=True), TIMEOUT)


def test_a_scan_alone_does_not_heal_an_xid(node: SimulatedNode) -> None:
    gpus = start(node)
    node.control.xid(1, 79)
    node.kubelet.wait_for(device_health(gpus[1]["uuid"], healthy=False), TIMEOUT)
    # Another GPU's hotplug rescans everything; GPU 1 has shown no evidence of a reset.
    node.add_gpu(NEW_GPU)
    udev(node, "add", "0000:cc:00.0")
    node.kubelet.wait_for(registered_with(9), TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and not plugin.devices[gpus[1]["uuid"]].healthy


def test_started_before_the_driver_comes_alive_on_bind(node: SimulatedNode) -> None:
    node.scenario.write_text(node.scenario.read_text().replace("init_error 0", "init_error 9"))
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(0), TIMEOUT)
    node.wait_log("Driver Not Loaded")
    # Wait for a backoff long enough that only the bind event can explain a recovery within the bound.
    deadline = time.monotonic() + 120
    while True:
        delays = [float(d) for d in re.findall(r"again in ([0-9.]+)s", node.log_text())]
        if delays and delays[-1] >= BIND_BOUND + 1.0:
            break
        assert time.monotonic() < deadline, node.log_text()
        time.sleep(0.05)
    node.control.init_error(0)  # the driver finished loading
    bound = time.monotonic()
    udev(node, "bind", node.scenario_gpus()[0]["bus"])
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    assert time.monotonic() - bound < BIND_BOUND
    node.wait_log("NVML works again")


def test_kubelet_restarts_repeatedly_and_we_re_register_each_time(node: SimulatedNode) -> None:
    start(node)
    for n in range(1, 21):
        node.kubelet.restart()

        def back(k: FakeKubelet, n: int = n) -> bool:
            # One registration at start, one more per restart.
            return k.accepted_registrations(GPU_RESOURCE) == n + 1 and registered_with(8)(k)

        node.kubelet.wait_for(back, TIMEOUT)
    assert node.kubelet.restarts == 20
    time.sleep(0.3)
    # Debounced: the new kubelet.sock and our wiped socket led to one Register each time.
    assert node.kubelet.accepted_registrations(GPU_RESOURCE) == 21
    assert node.plugin_socket.exists()
    assert node.daemon is not None and node.daemon.poll() is None


def test_a_gpu_lost_during_a_rescan_is_subscribed_again_once_it_answers(node: SimulatedNode) -> None:
    node.config.write_text(
        "version: v1\nnvplug:\n  health:\n    reprobeInitialSeconds: 0.2\n    reprobeMaxSeconds: 0.4\n"
    )
    gpus = start(node)
    uuid = gpus[3]["uuid"]
    node.control.lose(3)
    node.kubelet.wait_for(device_health(uuid, healthy=False), TIMEOUT)
    # A rescan while it is lost: NVML cannot read it, so the new event watch has no subscription for it.
    udev(node, "change", gpus[0]["bus"].lower())
    node.wait_log("scan 2: 7 GPUs")
    node.wait_log("no NVML events from 1 that NVML cannot read: rescanning in 1 s to subscribe them")
    node.control.restore(3)
    node.kubelet.wait_for(device_health(uuid, healthy=True), TIMEOUT)
    node.wait_log("every GPU is subscribed to NVML events again")
    # Its faults are seen again.
    node.control.xid(3, 79)
    node.kubelet.wait_for(device_health(uuid, healthy=False), TIMEOUT)
