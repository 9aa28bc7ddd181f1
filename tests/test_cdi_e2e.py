"""The CDI spec written by the running daemon: before the list that needs it, kept current by
events, and a spec directory that cannot be written refusing names rather than handing out
ones that would not resolve."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from support.waiting import wait_until

from nvplug.cdi.cdi_spec import GPU_KIND
from nvplug.status import status_client as statusclient
from nvplug.testing import fake_driver_root as driverroot
from nvplug.testing.kubelet_thread import KubeletThread
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with
from nvplug.testing.udev_sender import pci_event

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sending udev netlink messages needs root")

TIMEOUT = 15.0
SPEC = "k8s.device-plugin.nvidia.com-gpu.json"
NEW_GPU = (
    'uuid=GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08 name="NVIDIA H100 80GB HBM3" minor=8 '
    "bus=0000:CC:00.0 numa=1 memory_mib=81559 cc=9.0"
)
CDI_CONFIG = "version: v1\nflags:\n  plugin:\n    deviceListStrategy: cdi-cri\n"


def spec_names(directory: Path) -> set[str]:
    try:
        return {d["name"] for d in json.loads((directory / SPEC).read_text())["devices"]}
    except (OSError, ValueError):
        return set()


class ListRecorder:
    """At each list the kubelet stand-in receives: which of its devices the spec on disk lacks, then."""

    def __init__(self, spec_dir: Path) -> None:
        self.spec_dir = spec_dir
        self.lists: list[tuple[set[str], set[str]]] = []  # (device IDs, IDs without a spec entry)
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        if not line.startswith(f"update {GPU_RESOURCE}:"):
            return
        ids = set(re.findall(r"(\S+?)=(?:Healthy|Unhealthy)", line.split("[", 1)[1]))
        missing = ids - spec_names(self.spec_dir)
        with self._lock:
            self.lists.append((ids, missing))


def recording_node(node: SimulatedNode) -> ListRecorder:
    recorder = ListRecorder(node.cdi_dir)
    node.kubelet = KubeletThread(node.plugin_dir, on_event=recorder)
    node.config.write_text(CDI_CONFIG)
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    return recorder


def udev(node: SimulatedNode, action: str, bus_id: str) -> None:
    node.send_uevent(pci_event(action, bus_id, driver="nvidia" if action == "bind" else None))


def test_a_hot_added_gpu_is_in_the_spec_before_it_is_in_the_list(node: SimulatedNode) -> None:
    recorder = recording_node(node)
    new = "GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08"
    assert new not in spec_names(node.cdi_dir)
    node.add_gpu(NEW_GPU)
    udev(node, "add", "0000:cc:00.0")
    udev(node, "bind", "0000:cc:00.0")
    node.kubelet.wait_for(registered_with(9), TIMEOUT)
    assert any(new in ids for ids, _ in recorder.lists)
    # Every list, the first included, found each of its devices already in the spec.
    assert all(not missing for _, missing in recorder.lists), recorder.lists
    # Allocate hands out exactly the name the spec defines.
    response = node.kubelet.allocate(GPU_RESOURCE, [new]).container_responses[0]
    assert [d.name for d in response.cdi_devices] == [f"{GPU_KIND}={new}"]


def test_a_removed_gpu_leaves_the_spec_after_it_leaves_the_list(node: SimulatedNode) -> None:
    recorder = recording_node(node)
    gpus = node.scenario_gpus()
    gone = gpus[7]["uuid"]
    node.control.remove(7)
    udev(node, "remove", gpus[7]["bus"])
    node.kubelet.wait_for(registered_with(7), TIMEOUT)
    wait_until(lambda: gone not in spec_names(node.cdi_dir), TIMEOUT, "the removed GPU to leave the spec")
    # Each list that still held it found its entry in the spec.
    held = [missing for ids, missing in recorder.lists if gone in ids]
    assert held and all(gone not in missing for missing in held)
    assert spec_names(node.cdi_dir) == {g["uuid"] for g in gpus[:7]} | {"all"}


def test_a_spec_directory_that_cannot_be_written(node: SimulatedNode) -> None:
    """Logged, /healthz says so, the devices are not offered and Allocate refuses; fixed, all come back."""
    blocked = node.root / "blocked"
    blocked.write_text("a file where the spec directory should be\n")
    node.config.write_text(CDI_CONFIG)
    node.kubelet.start()
    node.start_daemon("--cdi-spec-dir", str(blocked / "cdi"))
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    uuid = node.scenario_gpus()[0]["uuid"]
    node.kubelet.wait_for(device_health(uuid, healthy=False), TIMEOUT)
    node.wait_log(f"cannot write the CDI spec {blocked}/cdi/{SPEC}")
    code, text = statusclient.fetch(f"unix:{node.status_socket}", "/healthz", timeout=5)
    assert code == 503 and "CDI spec not written" in text, text
    cdi = statusclient.status(f"unix:{node.status_socket}")["cdi"]
    assert cdi["spec_dir"] == str(blocked / "cdi") and "Not a directory" in cdi["error"] and cdi["devices"] == 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        node.kubelet.allocate(GPU_RESOURCE, [uuid])
    assert "no CDI device k8s.device-plugin.nvidia.com/gpu=" in (info.value.details() or "")
    # The operator fixes it; the retry (backing off from a second) writes the spec, and the GPUs are offered again.
    blocked.unlink()
    blocked.mkdir()
    node.kubelet.wait_for(device_health(uuid, healthy=True), 20.0)
    assert uuid in spec_names(blocked / "cdi")
    node.wait_log("the CDI spec is written again")
    assert statusclient.fetch(f"unix:{node.status_socket}", "/healthz", timeout=5)[0] == 200
    cdi = statusclient.status(f"unix:{node.status_socket}")["cdi"]
    assert cdi["error"] is None and cdi["devices"] == 9  # 8 GPUs and `all`
    names = [d.name for d in node.kubelet.allocate(GPU_RESOURCE, [uuid]).container_responses[0].cdi_devices]
    assert names == [f"{GPU_KIND}={uuid}"]


@pytest.mark.parametrize("where", ["spec dir", "runtime dir"])
def test_a_foreign_spec_of_our_kind_is_reported(node: SimulatedNode, where: str) -> None:
    # Beside ours, or in one of the node's runtime directories (its /var/run/cdi): the conflict is the feature.
    directory = node.cdi_dir if where == "spec dir" else node.cdi_runtime_dirs[1]
    directory.mkdir(parents=True)
    foreign = directory / "old-plugin.yaml"
    uuid = node.scenario_gpus()[0]["uuid"]
    foreign.write_text(f"cdiVersion: 0.5.0\nkind: {GPU_KIND}\ndevices:\n- name: {uuid}\n  containerEdits: {{}}\n")
    node.config.write_text(CDI_CONFIG)
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    line = node.wait_log("CDI conflict:")
    assert f"{foreign} also defines CDI kind {GPU_KIND}" in line and uuid in line


def test_reload_renames_in_the_spec_before_allocate_hands_out_the_new_names(node: SimulatedNode) -> None:
    node.config.write_text(CDI_CONFIG)
    node.kubelet.start()
    daemon = node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    gpus = node.scenario_gpus()
    assert gpus[2]["uuid"] in spec_names(node.cdi_dir)
    node.config.write_text(CDI_CONFIG + "    deviceIDStrategy: index\n")
    daemon.send_signal(1)  # SIGHUP
    node.wait_log("reloaded the config")
    assert spec_names(node.cdi_dir) == {str(i) for i in range(8)} | {"all"}
    response = node.kubelet.allocate(GPU_RESOURCE, [gpus[2]["uuid"]]).container_responses[0]
    assert [d.name for d in response.cdi_devices] == [f"{GPU_KIND}=2"]


def test_cdi_generate_prints_the_spec_the_daemon_writes(node: SimulatedNode, short_tmp: Path) -> None:
    drv = driverroot.build(short_tmp / "drv")
    node.config.write_text(CDI_CONFIG.replace("flags:\n", f"flags:\n  nvidiaDriverRoot: {drv.root}\n"))
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    argv = [sys.executable, "-m", "nvplug", "cdi", "generate", "--config", str(node.config), "--dev-root",
            str(node.dev_root), "--sysfs-root", str(node.sysfs_root), "--proc-root", str(node.proc_root)]  # fmt: skip
    out = subprocess.run(argv, env=node.daemon_env(), capture_output=True, check=True, timeout=60)
    assert json.loads(out.stdout) == json.loads((node.cdi_dir / SPEC).read_text())
    mounts = {m["containerPath"] for m in json.loads(out.stdout)["containerEdits"]["mounts"]}
    assert f"/{driverroot.LIB_DIR}/libcuda.so.1" in mounts and "/usr/bin/nvidia-smi" in mounts
    written = short_tmp / "out/spec.json"
    subprocess.run([*argv, "--output", str(written)], env=node.daemon_env(), check=True, timeout=60)
    assert written.read_bytes() == out.stdout and written.stat().st_mode & 0o777 == 0o644


def test_the_runtime_dirs_on_the_command_line_are_absolute() -> None:
    argv = [sys.executable, "-m", "nvplug", "doctor", "--cdi-runtime-dirs", "/etc/cdi,var/run/cdi"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "var/run/cdi: not an absolute path" in done.stderr, done.stderr


def host_paths(spec_dir: Path, name: str) -> list[str]:
    """The host paths of one device's nodes in the spec on disk."""
    devices = json.loads((spec_dir / SPEC).read_text())["devices"]
    device = next(d for d in devices if d["name"] == name)
    return [n["hostPath"] for n in device["containerEdits"]["deviceNodes"]]


def allocated_nodes(node: SimulatedNode, uuid: str, dev_root: Path) -> bool:
    """Whether Allocate hands out the GPU's node and the driver's control nodes, all under `dev_root`."""
    response = node.kubelet.allocate(GPU_RESOURCE, [uuid]).container_responses[0]
    paths = [d.host_path for d in response.devices]
    assert f"{dev_root}/dev/nvidia2" in paths and f"{dev_root}/dev/nvidiactl" in paths
    return all(p.startswith(f"{dev_root}/dev/") for p in paths)


def test_a_reload_that_moves_the_dev_root_reaches_the_spec_and_allocate(node: SimulatedNode) -> None:
    """Without --dev-root, flags.nvidiaDevRoot says where the device nodes are: a reload that moves it
    moves the spec's device nodes and Allocate's device specs, with no restart."""
    cfg = "version: v1\nflags:\n  nvidiaDevRoot: {root}\n  plugin:\n    deviceListStrategy: cdi-cri\n"
    node.config.write_text(cfg.format(root=node.dev_root))
    node.kubelet.start()
    daemon = node.start_daemon(dev_root_flag=False)
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    uuid = node.scenario_gpus()[2]["uuid"]
    assert host_paths(node.cdi_dir, uuid) == [f"{node.dev_root}/dev/nvidia2"]
    assert allocated_nodes(node, uuid, node.dev_root)

    moved = node.root / "dev-moved"
    shutil.copytree(node.dev_root, moved)
    node.config.write_text(cfg.format(root=moved))
    daemon.send_signal(1)  # SIGHUP
    node.wait_log("reloaded the config")
    assert host_paths(node.cdi_dir, uuid) == [f"{moved}/dev/nvidia2"]
    assert allocated_nodes(node, uuid, moved)
    # doctor reads the node where the daemon does, and the device nodes' watch lists the new root.
    assert statusclient.status(f"unix:{node.status_socket}")["roots"]["dev_root"] == str(moved)
    node.wait_log(f"watching {moved}/dev for NVIDIA device nodes")
