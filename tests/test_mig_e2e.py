"""MIG end to end: the fake library's MIG devices, through the daemon, at the kubelet stand-in."""

from __future__ import annotations

import grpc
import pytest

from nvplug.status import status_client as statusclient
from nvplug.testing import fakenvml_devices
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.kubelet_thread import KubeletThread
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with

TIMEOUT = 15.0
MIXED_LAYOUT = ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]


def mig_node(
    node: SimulatedNode, strategy: str, layouts: dict[int, list[str]], minors: bool = True, start: bool = True
) -> list[dict[str, str]]:
    """GPUs in `layouts` get MIG mode and those MIG devices; the minors table, if any, lists them all.
    With `start`, the config names the strategy and the kubelet stand-in and the daemon start."""
    gpus = node.scenario_gpus()
    lines = node.scenario.read_text().splitlines()
    for index, profiles in layouts.items():
        uuid = gpus[index]["uuid"]
        lines = [f"{ln} mig=1" if f"uuid={uuid} " in ln else ln for ln in lines]
        lines += [f"mig {index} {p} gi={n + 1} ci=0" for n, p in enumerate(profiles)]
    node.scenario.write_text("\n".join(lines) + "\n")
    # The driver's table lists every possible instance; list gi 1-7 on every GPU.
    table = {int(g["minor"]): [(gi, 0) for gi in range(1, 8)] for g in gpus}
    if minors:
        fakenvml_devices.write_mig_minors(node.proc_root / "driver/nvidia-caps/mig-minors", table)
    if start:
        node.config.write_text(f"version: v1\nflags:\n  migStrategy: {strategy}\n")
        node.kubelet.start()
        node.start_daemon()
    return gpus


def streaming(kubelet: FakeKubelet | KubeletThread) -> dict[str, int]:
    """Capacity per resource whose ListAndWatch stream is open and has sent its list."""
    return {name: p.capacity for name, p in kubelet.plugins.items() if p.stream_open and p.updates}


def counts(node: SimulatedNode) -> dict[str, int]:
    return streaming(node.kubelet)


def test_none_serves_whole_gpus_whatever_their_mode(node: SimulatedNode) -> None:
    mig_node(node, "none", {0: ["1g.10gb"] * 7, 1: MIXED_LAYOUT})
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    assert counts(node) == {GPU_RESOURCE: 8}


def test_mixed_serves_one_resource_per_profile_and_whole_gpus_without_mig(node: SimulatedNode) -> None:
    gpus = mig_node(node, "mixed", {0: ["1g.10gb"] * 7, 1: MIXED_LAYOUT})
    node.kubelet.wait_for(lambda k: len(streaming(k)) == 4, TIMEOUT)
    assert counts(node) == {
        GPU_RESOURCE: 6,
        "nvidia.com/mig-1g.10gb": 9,
        "nvidia.com/mig-2g.20gb": 1,
        "nvidia.com/mig-3g.40gb": 1,
    }
    whole = node.kubelet.plugin(GPU_RESOURCE)
    assert whole is not None and set(whole.devices) == {g["uuid"] for g in gpus[2:]}
    # Allocate hands out the MIG device with its parent's node and its two capability nodes.
    small = node.kubelet.plugin("nvidia.com/mig-3g.40gb")
    assert small is not None
    (mig_uuid,) = small.devices
    assert mig_uuid == fakenvml_devices.mig_uuid(gpus[1]["uuid"], 1, 0)
    out = node.kubelet.allocate("nvidia.com/mig-3g.40gb", [mig_uuid]).container_responses[0]
    assert out.envs["NVIDIA_VISIBLE_DEVICES"] == mig_uuid
    minor = int(gpus[1]["minor"])
    assert [d.container_path for d in out.devices][:3] == [
        f"/dev/nvidia{minor}",
        f"/dev/nvidia-caps/nvidia-cap{fakenvml_devices.mig_minor(minor, 1)}",
        f"/dev/nvidia-caps/nvidia-cap{fakenvml_devices.mig_minor(minor, 1, 0)}",
    ]


def test_single_serves_mig_devices_as_the_gpu_resource(node: SimulatedNode) -> None:
    mig_node(node, "single", {i: ["1g.10gb"] * 7 for i in range(8)})
    node.kubelet.wait_for(registered_with(56), TIMEOUT)
    assert counts(node) == {GPU_RESOURCE: 56}


def test_single_misconfigured_advertises_nothing_and_says_why(node: SimulatedNode) -> None:
    mig_node(node, "single", {0: ["1g.10gb"] * 7, 1: MIXED_LAYOUT})
    log = node.wait_log("advertising nothing: migStrategy single needs every GPU in MIG mode with one profile")
    assert "ERROR" in next(ln for ln in log.splitlines() if "advertising nothing" in ln)
    assert counts(node) == {}


def test_instance_scoped_xid_marks_only_that_mig_device(node: SimulatedNode) -> None:
    gpus = mig_node(node, "mixed", {0: ["1g.10gb"] * 7})
    node.kubelet.wait_for(registered_with(7, "nvidia.com/mig-1g.10gb"), TIMEOUT)
    victim = fakenvml_devices.mig_uuid(gpus[0]["uuid"], 3, 0)
    node.control.xid(0, 79, 3, 0)
    node.kubelet.wait_for(device_health(victim, healthy=False, resource="nvidia.com/mig-1g.10gb"), TIMEOUT)
    plugin = node.kubelet.plugin("nvidia.com/mig-1g.10gb")
    assert plugin is not None and plugin.allocatable == 6
    with pytest.raises(grpc.aio.AioRpcError) as info:
        node.kubelet.allocate("nvidia.com/mig-1g.10gb", [victim])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A whole-GPU XID takes all seven.
    node.control.xid(0, 48)
    node.kubelet.wait_for(lambda k: k.allocatable("nvidia.com/mig-1g.10gb") == 0, TIMEOUT)


def test_layout_change_adds_and_removes_resources(node: SimulatedNode) -> None:
    mig_node(node, "mixed", {1: MIXED_LAYOUT})
    node.kubelet.wait_for(registered_with(1, "nvidia.com/mig-3g.40gb"), TIMEOUT)
    node.control.mig_layout(1, ["7g.80gb"])
    node.kubelet.wait_for(registered_with(1, "nvidia.com/mig-7g.80gb"), TIMEOUT)
    node.kubelet.wait_for(lambda k: "nvidia.com/mig-3g.40gb" not in streaming(k), TIMEOUT)
    assert counts(node) == {GPU_RESOURCE: 7, "nvidia.com/mig-7g.80gb": 1}
    # A resource that stops being served says so with an empty list, or the kubelet would keep
    # its capacity for the endpoint's grace period; then its stream ends cleanly.
    gone = node.kubelet.plugin("nvidia.com/mig-3g.40gb")
    # (Here the layout change already emptied it; the empty list is not sent twice.)
    assert gone is not None and [len(u.devices) for u in gone.updates] == [1, 0]
    assert gone.stream_end == "EOF" and gone.capacity == 0


def test_mig_devices_without_capability_minors_are_advertised_unhealthy(node: SimulatedNode) -> None:
    # A driver without /proc/driver/nvidia-caps/mig-minors: Allocate could not hand the devices out.
    gpus = mig_node(node, "mixed", {1: ["3g.40gb", "3g.40gb"]}, minors=False)
    node.kubelet.wait_for(registered_with(2, "nvidia.com/mig-3g.40gb"), TIMEOUT)
    plugin = node.kubelet.plugin("nvidia.com/mig-3g.40gb")
    assert plugin is not None
    # Unhealthy from the first list on, never offered.
    assert all(not d.healthy for u in plugin.updates for d in u.devices)
    log = node.wait_log("cannot be allocated: no capability device minors listed for gpu 1 gi 1 ci 0")
    assert gpus[1]["uuid"] in log
    status = statusclient.status(f"unix:{node.status_socket}")
    mig = status["gpus"][1]["mig"][0]
    assert mig["health"] == "Unhealthy" and "no capability device minors listed" in mig["reason"]
    assert "what Allocate needs" in mig["waiting_for"]
    _, body = statusclient.fetch(f"unix:{node.status_socket}", "/healthz")
    assert "2 devices cannot be allocated: " in body and "no capability device minors listed" in body
    # The table appears (a driver that has it): the next scan finds it, and they are offered.
    fakenvml_devices.write_mig_minors(node.proc_root / "driver/nvidia-caps/mig-minors", {1: [(1, 0), (2, 0)]})
    node.control.mig_layout(1, ["3g.40gb", "3g.40gb"])
    node.kubelet.wait_for(lambda k: k.allocatable("nvidia.com/mig-3g.40gb") == 2, TIMEOUT)
    node.wait_log("healthy: MIG 3g.40gb gi 1 ci 0")
