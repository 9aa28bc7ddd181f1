"""The NFD feature file written by the running daemon: at start, on hotplug, MIG and reload,
never for a health change unless asked, and the same labels from `nvplug devices --labels`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from nvplug.testing.simulated_node import SimulatedNode, registered_with
from nvplug.testing.udev_sender import pci_event

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sending udev netlink messages needs root")

TIMEOUT = 15.0
NEW_GPU = (
    'uuid=GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08 name="NVIDIA H100 80GB HBM3" minor=8 '
    "bus=0000:CC:00.0 numa=1 memory_mib=81559 cc=9.0"
)


def read_labels(node: SimulatedNode) -> dict[str, str]:
    try:
        lines = node.feature_file.read_text().splitlines()
    except FileNotFoundError:
        return {}
    return dict(line.removeprefix("nvidia.com/").split("=", 1) for line in lines if not line.startswith("#"))


def wait_labels(node: SimulatedNode, check: Callable[[dict[str, str]], bool], what: str) -> dict[str, str]:
    deadline = time.monotonic() + TIMEOUT
    while not check(labels := read_labels(node)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {labels}"
        time.sleep(0.01)
    return labels


def start(node: SimulatedNode, config: str = "version: v1\n", whole_gpus: int = 8) -> subprocess.Popen[bytes]:
    node.features_dir.mkdir()
    node.config.write_text(config)
    node.kubelet.start()
    daemon = node.start_daemon()
    node.kubelet.wait_for(registered_with(whole_gpus), TIMEOUT)
    return daemon


def test_labels_at_start_and_after_a_hot_add(node: SimulatedNode) -> None:
    start(node)
    labels = wait_labels(node, lambda lb: lb.get("gpu.count") == "8", "8 GPUs")
    assert labels["gpu.product"] == "NVIDIA-H100-80GB-HBM3" and labels["gpu.family"] == "hopper"
    assert labels["gpu.machine"] == "NVIDIA-DGX-H100" and labels["gpu.mode"] == "compute"
    assert labels["cuda.driver-version.full"] == "550.54.15" and labels["cuda.runtime-version.full"] == "12.4"
    assert node.feature_file.stat().st_mode & 0o777 == 0o644
    node.add_gpu(NEW_GPU)
    sent = time.monotonic()
    node.send_uevent(pci_event("add", "0000:cc:00.0"))
    node.send_uevent(pci_event("bind", "0000:cc:00.0", driver="nvidia"))
    wait_labels(node, lambda lb: lb.get("gpu.count") == "9", "9 GPUs")
    assert time.monotonic() - sent < 5.0
    node.wait_log("node labels written to")


def test_a_health_change_leaves_the_file_alone_unless_the_health_label_is_on(node: SimulatedNode) -> None:
    daemon = start(node)
    wait_labels(node, lambda lb: lb.get("gpu.count") == "8", "8 GPUs")
    inode = node.feature_file.stat().st_ino
    uuid = node.scenario_gpus()[3]["uuid"]
    node.control.xid(3, 79)
    node.wait_log(f"{uuid} (0000:5d:00.0) unhealthy: XID 79")
    time.sleep(0.2)
    assert node.feature_file.stat().st_ino == inode  # not rewritten: nothing in it changed
    assert "gpu.unhealthy-count" not in read_labels(node)
    node.config.write_text("version: v1\nnvplug:\n  labels:\n    unhealthyCount: true\n")
    daemon.send_signal(signal.SIGHUP)
    wait_labels(node, lambda lb: lb.get("gpu.unhealthy-count") == "1", "the health label")


def test_reload_to_time_slicing_relabels(node: SimulatedNode) -> None:
    daemon = start(node)
    wait_labels(node, lambda lb: lb.get("gpu.replicas") == "1", "replicas 1")
    node.config.write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    daemon.send_signal(signal.SIGHUP)
    labels = wait_labels(node, lambda lb: lb.get("gpu.replicas") == "4", "replicas 4")
    assert labels["gpu.sharing-strategy"] == "time-slicing"
    assert labels["gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"


def test_mig_mixed_labels_from_the_fake_nvmls_attributes(node: SimulatedNode) -> None:
    gpus = node.scenario_gpus()
    lines = node.scenario.read_text().splitlines()
    lines = [f"{ln} mig=1" if f"uuid={gpus[1]['uuid']} " in ln else ln for ln in lines]
    lines += ["mig 1 3g.40gb gi=1 ci=0", "mig 1 1g.10gb gi=2 ci=0", "mig 1 1g.10gb gi=3 ci=0"]
    node.scenario.write_text("\n".join(lines) + "\n")
    start(node, "version: v1\nflags:\n  migStrategy: mixed\n", whole_gpus=7)
    labels = wait_labels(node, lambda lb: "mig-1g.10gb.count" in lb, "MIG labels")
    assert labels["mig.strategy"] == "mixed" and labels["mig-1g.10gb.count"] == "2"
    assert labels["mig-3g.40gb.product"] == "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb"
    assert labels["mig-3g.40gb.slices.gi"] == "3" and int(labels["mig-3g.40gb.multiprocessors"]) > 0
    assert labels["mig-1g.10gb.memory"].isdigit() and "mig-1g.10gb.engines.copy" in labels


def test_devices_labels_prints_what_the_file_holds(node: SimulatedNode) -> None:
    start(node)
    wait_labels(node, lambda lb: lb.get("gpu.count") == "8", "8 GPUs")
    argv = [sys.executable, "-m", "nvplug", "devices", "--labels", "--status-listen", f"unix:{node.status_socket}",
            "--config", str(node.config), "--sysfs-root", str(node.sysfs_root), "--proc-root",
            str(node.proc_root)]  # fmt: skip
    env = node.daemon_env()
    env["FAKE_NVML_CONTROL"] = str(node.root / "cli.ctl")
    from_daemon = subprocess.run(argv, env=env, capture_output=True, check=True, timeout=60).stdout
    assert from_daemon == node.feature_file.read_bytes()
    node.stop_daemon()
    direct = subprocess.run(argv, env=env, capture_output=True, check=True, timeout=60)
    assert direct.stdout == from_daemon and b"direct NVML read" in direct.stderr


def test_without_nfd_the_daemon_runs_and_says_so_once(node: SimulatedNode) -> None:
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    node.wait_log(f"cannot write the NFD feature file {node.feature_file}")
    assert "is Node Feature Discovery installed?" in node.log_text()
    node.control.xid(2, 79)
    node.wait_log("unhealthy: XID 79")
    assert node.log_text().count("cannot write the NFD feature file") == 1
