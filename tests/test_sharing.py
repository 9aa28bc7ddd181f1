"""Time-slicing and the device-list strategies, configured through the YAML and seen at the kubelet."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
import pytest

from nvplug.cdi.cdi_spec import GPU_KIND
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with

TIMEOUT = 15.0


def start(node: SimulatedNode, cfg: str, resource: str, count: int) -> list[str]:
    node.config.write_text(cfg)
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(count, resource), TIMEOUT)
    return [g["uuid"] for g in node.scenario_gpus()]


def test_time_slicing_renamed_by_default(node: SimulatedNode) -> None:
    cfg = """version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""
    uuids = start(node, cfg, "nvidia.com/gpu.shared", 32)
    plugin = node.kubelet.plugin("nvidia.com/gpu.shared")
    assert plugin is not None
    assert sorted(plugin.devices)[:2] == sorted(f"{uuids[0]}::{n}" for n in range(4))[:2]
    assert node.kubelet.plugin(GPU_RESOURCE) is None  # every GPU is shared: no whole-GPU resource
    out = node.kubelet.allocate("nvidia.com/gpu.shared", [f"{uuids[3]}::2"]).container_responses[0]
    assert out.envs["NVIDIA_VISIBLE_DEVICES"] == uuids[3]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        node.kubelet.allocate("nvidia.com/gpu.shared", [f"{uuids[3]}::1", f"{uuids[4]}::1"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "failRequestsGreaterThanOne" in (info.value.details() or "")
    # Preferred replicas spread over GPUs rather than stacking on one.
    got = node.kubelet.preferred_allocation("nvidia.com/gpu.shared", sorted(plugin.devices), [], 3)
    assert len({g.split("::")[0] for g in got}) == 3


def test_sharing_some_gpus_leaves_the_rest_whole(node: SimulatedNode) -> None:
    cfg = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      rename: nvidia.com/gpu-small
      devices: [0, 1]
      replicas: 2
"""
    uuids = start(node, cfg, "nvidia.com/gpu-small", 4)
    node.kubelet.wait_for(registered_with(6, GPU_RESOURCE), TIMEOUT)
    whole = node.kubelet.plugin(GPU_RESOURCE)
    assert whole is not None and set(whole.devices) == set(uuids[2:])


def test_list_and_id_strategies_from_the_config(node: SimulatedNode) -> None:
    cfg = """version: v1
flags:
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: [volume-mounts, cdi-cri, cdi-annotations]
    deviceIDStrategy: index
    cdiAnnotationPrefix: cdi.example.com/
"""
    uuids = start(node, cfg, GPU_RESOURCE, 8)
    out = node.kubelet.allocate(GPU_RESOURCE, [uuids[5], uuids[2]]).container_responses[0]
    assert dict(out.envs) == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert [(m.container_path, m.host_path) for m in out.mounts] == [
        ("/var/run/nvidia-container-devices/5", "/dev/null"),
        ("/var/run/nvidia-container-devices/2", "/dev/null"),
    ]
    assert [c.name for c in out.cdi_devices] == [f"{GPU_KIND}=5", f"{GPU_KIND}=2"]
    ((key, value),) = out.annotations.items()
    assert key.startswith("cdi.example.com/nvplug_") and value == f"{GPU_KIND}=5,{GPU_KIND}=2"
    assert list(out.devices) == []


def test_what_nvplug_cannot_serve_is_refused_up_front(node: SimulatedNode) -> None:
    # NVIDIA forces one MPS replica per container; a file that says otherwise is refused, not overruled.
    node.config.write_text(
        "version: v1\nsharing:\n  mps:\n    failRequestsGreaterThanOne: false\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 2\n"
    )
    check = subprocess.run(
        [sys.executable, "-m", "nvplug", "config", "check", str(node.config)], capture_output=True, text=True
    )
    assert check.returncode == 2 and "failRequestsGreaterThanOne: must be true for MPS" in check.stderr
    daemon = node.start_daemon()
    assert daemon.wait(TIMEOUT) == 2
    assert "failRequestsGreaterThanOne: must be true for MPS" in node.log_text()


def test_reload_that_changes_resources_registers_them_without_a_restart(node: SimulatedNode) -> None:
    uuids = start(node, "version: v1\n", GPU_RESOURCE, 8)
    assert node.daemon is not None
    pid = node.daemon.pid
    node.config.write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
        "      rename: nvidia.com/gpu-small\n      devices: [0, 1]\n      replicas: 2\n"
    )
    node.daemon.send_signal(signal.SIGHUP)
    node.kubelet.wait_for(registered_with(4, "nvidia.com/gpu-small"), TIMEOUT)
    node.kubelet.wait_for(registered_with(6, GPU_RESOURCE), TIMEOUT)
    whole = node.kubelet.plugin(GPU_RESOURCE)
    assert whole is not None and set(whole.devices) == set(uuids[2:])
    # And back: the shared resource's server stops, the whole-GPU one offers all eight again.
    node.config.write_text("version: v1\n")
    node.daemon.send_signal(signal.SIGHUP)
    node.kubelet.wait_for(registered_with(8, GPU_RESOURCE), TIMEOUT)
    small = node.kubelet.plugin("nvidia.com/gpu-small")
    assert small is not None and not small.stream_open
    # Its last message was an empty list, so the kubelet dropped its capacity at once.
    assert [len(u.devices) for u in small.updates] == [4, 0] and small.stream_end == "EOF"
    assert node.daemon.pid == pid and node.daemon.poll() is None
    assert not (node.plugin_dir / "nvplug-nvidia.com-gpu-small.sock").exists()


def test_packed_and_distributed_through_grpc_and_a_reload(node: SimulatedNode) -> None:
    """GetPreferredAllocation at the stand-in: distributed spreads replicas over GPUs; a reload to
    packed (NVIDIA's flags.plugin.sharedDevicesAllocationPolicy) fills one GPU first."""
    base = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    node.config.write_text(base)
    node.kubelet.start()
    daemon = node.start_daemon()
    node.kubelet.wait_for(registered_with(32), TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    available = list(plugin.devices)
    gpus = [g["uuid"] for g in node.scenario_gpus()]
    spread = node.kubelet.preferred_allocation(GPU_RESOURCE, available, [], 3)
    assert [i.split("::")[0] for i in spread] == gpus[:3]
    node.config.write_text(base + "flags:\n  plugin:\n    sharedDevicesAllocationPolicy: packed\n")
    daemon.send_signal(signal.SIGHUP)
    node.wait_log("reloaded the config")
    packed = node.kubelet.preferred_allocation(GPU_RESOURCE, available, [], 3)
    assert packed == [f"{gpus[0]}::0", f"{gpus[0]}::1", f"{gpus[0]}::2"]
