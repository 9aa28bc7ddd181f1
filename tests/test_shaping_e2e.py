"""Resource shaping end to end: a node with two GPU models, device filters and MIG time-slicing,
through the fake NVML, the daemon and the kubelet stand-in; reloads that change each of them."""

from __future__ import annotations

import json
import os
import signal

import grpc
import pytest
from test_devices import devices
from test_mig_e2e import mig_node, streaming

from nvplug.cdi.cdi_spec import GPU_KIND
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with
from nvplug.testing.udev_sender import pci_event

TIMEOUT = 15.0
A100 = "NVIDIA A100-SXM4-80GB"
H100_AND_A100 = """version: v1
resources:
  gpus:
  - pattern: H100
    name: nvidia.com/h100
  - pattern: A100
    name: nvidia.com/a100
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/a100
      replicas: 4
flags:
  plugin:
    deviceListStrategy: [envvar, cdi-cri]
"""
EXCLUDE_GPU_2 = "nvplug:\n  devices:\n    exclude: [2]\n"


def two_models(node: SimulatedNode) -> list[str]:
    """GPUs 0-3 stay H100s, 4-7 become A100s; their UUIDs in index order."""
    gpus = node.scenario_gpus()
    lines = node.scenario.read_text().splitlines()
    a100s = {g["uuid"] for g in gpus[4:]}
    for n, line in enumerate(lines):
        if any(f"uuid={u} " in line for u in a100s):
            lines[n] = line.replace('name="NVIDIA H100 80GB HBM3"', f'name="{A100}"')
    node.scenario.write_text("\n".join(lines) + "\n")
    return [g["uuid"] for g in gpus]


def start(node: SimulatedNode, cfg: str) -> list[str]:
    uuids = two_models(node)
    node.config.write_text(cfg)
    node.kubelet.start()
    node.start_daemon()
    return uuids


def reload(node: SimulatedNode, cfg: str) -> str:
    """SIGHUP with this config; the daemon's log lines from then until the reload is done."""
    assert node.daemon is not None
    mark = len(node.log_text())
    node.config.write_text(cfg)
    node.daemon.send_signal(signal.SIGHUP)
    return node.wait_log("reload", TIMEOUT, after=mark)[mark:]


def test_two_models_renamed_one_gpu_excluded_a100s_time_sliced(node: SimulatedNode) -> None:
    uuids = start(node, H100_AND_A100 + EXCLUDE_GPU_2)
    node.kubelet.wait_for(registered_with(3, "nvidia.com/h100"), TIMEOUT)
    node.kubelet.wait_for(registered_with(16, "nvidia.com/a100"), TIMEOUT)
    h100, a100 = node.kubelet.plugin("nvidia.com/h100"), node.kubelet.plugin("nvidia.com/a100")
    assert h100 is not None and a100 is not None
    assert sorted(h100.devices) == sorted(uuids[i] for i in (0, 1, 3))
    assert sorted(a100.devices) == sorted(f"{u}::{n}" for u in uuids[4:] for n in range(4))
    assert node.kubelet.plugin(GPU_RESOURCE) is None  # every GPU has a model's name
    # The excluded GPU: in no list, no CDI spec, and refused by Allocate.
    spec = json.loads((node.cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json").read_text())
    names = {d["name"] for d in spec["devices"]}
    assert uuids[2] not in names and set(uuids) - {uuids[2]} <= names
    with pytest.raises(grpc.aio.AioRpcError, match="unknown device ID"):
        node.kubelet.allocate("nvidia.com/h100", [uuids[2]])
    out = node.kubelet.allocate("nvidia.com/a100", [f"{uuids[5]}::3"]).container_responses[0]
    assert out.envs["NVIDIA_VISIBLE_DEVICES"] == uuids[5]
    assert [c.name for c in out.cdi_devices] == [f"{GPU_KIND}={uuids[5]}"]
    # Still health-watched: an XID on it is seen, and shown.
    node.control.xid(2, 79)
    node.wait_log(f"gpu 2 {uuids[2]}", TIMEOUT)
    rc, text, err = devices(node, listen=f"unix:{node.status_socket}")
    print(text)
    assert rc == 0, err
    row = next(line for line in text.splitlines() if line.startswith("2 "))
    assert "Unhealthy, excluded" in row and "XID 79" in row
    assert "advertised: excluded (nvplug.devices.exclude: index 2); health still watched" in text
    assert f"advertised: nvidia.com/a100 x4 ({uuids[4]}::0..::3)" in text
    assert f"advertised: nvidia.com/h100 {uuids[0]}" in text
    assert h100.updates[-1].devices == h100.updates[0].devices  # the fault changed no list
    doc = json.loads(devices(node, "--json", listen=f"unix:{node.status_socket}")[1])
    assert [g["excluded"] for g in doc["gpus"]] == [None, None, "nvplug.devices.exclude: index 2", *[None] * 5]


def test_a_reload_re_registers_only_the_resources_whose_list_changed(node: SimulatedNode) -> None:
    uuids = start(node, H100_AND_A100)
    node.kubelet.wait_for(registered_with(4, "nvidia.com/h100"), TIMEOUT)
    node.kubelet.wait_for(registered_with(16, "nvidia.com/a100"), TIMEOUT)
    regs = node.kubelet.accepted_registrations
    # Exclude an A100: only nvidia.com/a100 registers again.
    reload(node, H100_AND_A100 + "nvplug:\n  devices:\n    exclude: [5]\n")
    node.kubelet.wait_for(registered_with(12, "nvidia.com/a100"), TIMEOUT)
    assert (regs("nvidia.com/h100"), regs("nvidia.com/a100")) == (1, 2)
    # A filter that picks no GPU here (another model) changes no list: nothing registers.
    log = reload(node, H100_AND_A100 + "nvplug:\n  devices:\n    exclude: [5, L40S]\n")
    assert "nvidia.com/a100: advertised devices unchanged, no re-registration" in log
    assert (regs("nvidia.com/h100"), regs("nvidia.com/a100")) == (1, 2)
    # include by PCI bus id and UUID: the H100 list changes, the A100 list not.
    bus_ids = [g["bus"] for g in node.scenario_gpus()]
    include = f"nvplug:\n  devices:\n    include: ['{bus_ids[0]}', {uuids[1]}, A100]\n    exclude: [5]\n"
    reload(node, H100_AND_A100 + include)
    node.kubelet.wait_for(registered_with(2, "nvidia.com/h100"), TIMEOUT)
    assert (regs("nvidia.com/h100"), regs("nvidia.com/a100")) == (2, 2)
    # A rename: the old name's server sends an empty list and stops, the new one registers.
    reload(node, (H100_AND_A100 + include).replace("nvidia.com/h100", "nvidia.com/hopper"))
    node.kubelet.wait_for(registered_with(2, "nvidia.com/hopper"), TIMEOUT)
    old = node.kubelet.plugin("nvidia.com/h100")
    assert old is not None and [len(u.devices) for u in old.updates][-1] == 0 and not old.stream_open
    assert regs("nvidia.com/a100") == 2
    # Time-slicing the H100s too, by their new name.
    sliced = (H100_AND_A100 + include).replace("nvidia.com/h100", "nvidia.com/hopper")
    hopper_entry = "    - name: nvidia.com/hopper\n      replicas: 2\n"
    sliced = sliced.replace("      replicas: 4\n", "      replicas: 4\n" + hopper_entry)
    reload(node, sliced)
    node.kubelet.wait_for(registered_with(4, "nvidia.com/hopper"), TIMEOUT)
    hopper = node.kubelet.plugin("nvidia.com/hopper")
    assert hopper is not None and sorted(hopper.devices) == sorted(f"{u}::{n}" for u in uuids[:2] for n in range(2))
    assert regs("nvidia.com/a100") == 2


def test_a_reload_with_a_device_shared_twice_is_refused(node: SimulatedNode) -> None:
    uuids = start(node, H100_AND_A100)
    node.kubelet.wait_for(registered_with(16, "nvidia.com/a100"), TIMEOUT)
    # GPU 4 by index in one entry and by UUID in the other: the file cannot tell, the GPUs can.
    twice = H100_AND_A100.replace(
        "      replicas: 4\n",
        f"      devices: [4, 5]\n      replicas: 4\n    - name: nvidia.com/a100\n      devices: [{uuids[4]}]\n"
        "      rename: nvidia.com/a100-big\n      replicas: 2\n",
    )
    line = next(ln for ln in reload(node, twice).splitlines() if "reload refused" in ln)
    assert f"gpu 4 {uuids[4]}" in line and "picked by two sharing entries" in line
    a100 = node.kubelet.plugin("nvidia.com/a100")
    assert a100 is not None and a100.stream_open and a100.capacity == 16
    assert node.kubelet.plugin("nvidia.com/a100-big") is None


def test_mig_devices_time_sliced_through_the_kubelet(node: SimulatedNode) -> None:
    gpus = mig_node(node, "mixed", {0: ["1g.10gb"] * 7, 1: ["3g.40gb", "3g.40gb"]})
    node.kubelet.wait_for(lambda k: len(streaming(k)) == 3, TIMEOUT)
    assert node.daemon is not None
    node.config.write_text(
        "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/mig-1g.10gb\n      replicas: 3\n"
    )
    node.daemon.send_signal(signal.SIGHUP)
    node.kubelet.wait_for(registered_with(21, "nvidia.com/mig-1g.10gb"), TIMEOUT)
    assert streaming(node.kubelet) == {GPU_RESOURCE: 6, "nvidia.com/mig-1g.10gb": 21, "nvidia.com/mig-3g.40gb": 2}
    plugin = node.kubelet.plugin("nvidia.com/mig-1g.10gb")
    assert plugin is not None
    mig = sorted({i.split("::")[0] for i in plugin.devices})
    assert len(mig) == 7 and all(m.startswith("MIG-") for m in mig)
    # Three replicas asked for: spread over three MIG devices of GPU 0.
    picked = node.kubelet.preferred_allocation("nvidia.com/mig-1g.10gb", sorted(plugin.devices), [], 3)
    assert len({i.split("::")[0] for i in picked}) == 3
    out = node.kubelet.allocate("nvidia.com/mig-1g.10gb", [f"{mig[2]}::0", f"{mig[2]}::2"]).container_responses[0]
    assert out.envs["NVIDIA_VISIBLE_DEVICES"] == mig[2]
    assert f"/dev/nvidia{gpus[0]['minor']}" in [d.container_path for d in out.devices]
    # A fault of GPU 0 marks every replica of its MIG devices; GPU 1's stay healthy.
    node.control.xid(0, 79)
    for m in mig:
        node.kubelet.wait_for(device_health(f"{m}::2", False, "nvidia.com/mig-1g.10gb"), TIMEOUT)
    other = node.kubelet.plugin("nvidia.com/mig-3g.40gb")
    assert other is not None and other.allocatable == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="sending udev netlink messages needs root")
def test_a_hot_added_gpu_of_a_new_model_brings_its_resource_up(node: SimulatedNode) -> None:
    start(node, H100_AND_A100 + EXCLUDE_GPU_2)
    node.kubelet.wait_for(registered_with(16, "nvidia.com/a100"), TIMEOUT)
    l40s = "GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08"
    node.add_gpu(f'uuid={l40s} name="NVIDIA L40S" minor=8 bus=0000:CC:00.0 numa=1 memory_mib=46068 cc=8.9')
    node.send_uevent(pci_event("add", "0000:cc:00.0"))
    node.send_uevent(pci_event("bind", "0000:cc:00.0", driver="nvidia"))
    # No pattern names an L40S: it is nvidia.com/gpu, served now that a GPU has that name.
    node.kubelet.wait_for(registered_with(1, GPU_RESOURCE), TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and list(plugin.devices) == [l40s]
    assert node.kubelet.accepted_registrations("nvidia.com/a100") == 1
    # Gone again: the resource retires with an empty list; the others stay registered.
    node.control.remove(8)
    node.send_uevent(pci_event("remove", "0000:cc:00.0"))
    node.kubelet.wait_for(lambda k: (p := k.plugin(GPU_RESOURCE)) is not None and not p.stream_open, TIMEOUT)
    gone = node.kubelet.plugin(GPU_RESOURCE)
    assert gone is not None and gone.updates[-1].devices == () and gone.stream_end == "EOF"
    assert node.kubelet.accepted_registrations("nvidia.com/h100") == 1
