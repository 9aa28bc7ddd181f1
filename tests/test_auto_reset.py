"""GPUs that heal themselves when idle: nvplug's own reset, taken, refused, checked and budgeted."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nvplug.core.events import AutoResetStep, InventoryFound, XidOccurred
from nvplug.core.gpu import Gpu
from nvplug.core.health import RESET_GPU
from nvplug.core.node_state import NodeState
from nvplug.daemon.auto_reset import BUDGET_SPENT, candidate
from nvplug.status import status_client
from nvplug.testing import nvidia_smi_standin as nvidia_smi
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with

TIMEOUT = 15.0
RESET_ONLY = 109  # CTXSW_TIMEOUT: the catalog's RESET_GPU
NEEDS_REBOOT = 79  # the catalog's RESTART_BM


def config(**extra: object) -> str:
    health = {
        "autoReset": "idle",
        "autoResetQuietSeconds": 0.3,
        "allowFabricReset": "true",  # the default scenario's GPUs are NVLinked
        "reprobeInitialSeconds": 0.05,
        **extra,
    }
    return "version: v1\nnvplug:\n  health:\n" + "".join(f"    {k}: {v}\n" for k, v in health.items())


def start(node: SimulatedNode, text: str) -> list[dict[str, str]]:
    node.config.write_text(text)
    gpus = node.scenario_gpus()
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(len(gpus)), TIMEOUT)
    return gpus


def gpu_doc(node: SimulatedNode, uuid: str) -> dict[str, Any]:
    doc = status_client.status(f"unix:{node.status_socket}", timeout=5)
    return next(g for g in doc["gpus"] if g["uuid"] == uuid)


def resets(node: SimulatedNode) -> list[str]:
    return [argv[2].upper() for argv in nvidia_smi.calls(node.nvidia_smi_log) if argv[:2] == ["-r", "-i"]]


def steps(node: SimulatedNode, step: str) -> float:
    _, text = status_client.fetch(f"unix:{node.status_socket}", "/metrics", timeout=5)
    line = next(
        (ln for ln in text.splitlines() if ln.startswith(f'nvplug_auto_reset_steps_total{{step="{step}"}}')), ""
    )
    return float(line.split()[-1]) if line else 0.0


def test_only_faults_that_ask_for_a_reset_alone_are_candidates() -> None:
    state = NodeState()
    gpu = Gpu("GPU-1", 1, "0000:2a:00.0")
    state.apply(InventoryFound((gpu,)))
    state.apply(XidOccurred(gpu.uuid, RESET_ONLY))
    assert state.current.health[gpu.uuid].remedy == RESET_GPU and candidate(state.current, gpu)
    state.apply(XidOccurred(gpu.uuid, NEEDS_REBOOT))  # a second fault that asks for more
    assert state.current.health[gpu.uuid].remedy == "RESTART_BM" and not candidate(state.current, gpu)
    # A spent budget leaves it to a person: the reason says so, and it is no candidate any more.
    other = NodeState()
    other.apply(InventoryFound((gpu,)))
    other.apply(XidOccurred(gpu.uuid, RESET_ONLY))
    other.apply(AutoResetStep(gpu.uuid, "budget spent", BUDGET_SPENT, 1.0))
    assert other.current.health[gpu.uuid].reason.startswith(f"{BUDGET_SPENT}; XID 109")
    assert not candidate(other.current, gpu)


def test_an_idle_gpu_is_reset_once_and_then_the_budget_holds_it(tmp_path: Path) -> None:
    with SimulatedNode(tmp_path) as node:
        gpus = start(node, config(resetsPerHour=1))
        victim, rebooting = gpus[1], gpus[4]
        node.control.xid(1, RESET_ONLY)
        node.control.xid(4, NEEDS_REBOOT)
        node.kubelet.wait_for(device_health(victim["uuid"], False), TIMEOUT)
        node.kubelet.wait_for(device_health(victim["uuid"], True), TIMEOUT)
        assert resets(node) == [victim["bus"]]  # never the GPU whose fault needs a reboot
        doc = gpu_doc(node, victim["uuid"])
        assert doc["auto_resets"] == 1 and doc["auto_reset"].startswith("checked: a probe passed")
        assert "recovered: GPU reset by nvidia-smi at the request of nvplug's auto-reset" in doc["reason"]
        log = node.wait_log("auto-reset checked")
        assert "auto-reset waiting: for 0.3 s with no pod and no process on it" in log
        assert gpu_doc(node, rebooting["uuid"])["health"] == "Unhealthy"
        # The same fault again within the hour: the budget is spent, and a person must look.
        node.control.xid(1, RESET_ONLY)
        node.wait_log("auto-reset budget spent")
        doc = gpu_doc(node, victim["uuid"])
        assert doc["health"] == "Unhealthy" and doc["reason"].startswith(f"{BUDGET_SPENT}; XID 109")
        # What Node Problem Detector's line (and doctor) tells the operator.
        brief = subprocess.run(
            [sys.executable, "-m", "nvplug", "doctor", "--brief", "--status-listen", f"unix:{node.status_socket}"],
            capture_output=True, text=True, check=False, timeout=30,
        )  # fmt: skip
        assert brief.returncode == 1 and "gpu 1 " in brief.stdout and BUDGET_SPENT in brief.stdout, brief
        assert resets(node) == [victim["bus"]]
        assert (steps(node, "reset"), steps(node, "budget spent")) == (1.0, 1.0)
        # The budget holds across a restart: it is in the state file.
        node.stop_daemon()
        node.kubelet.stop()
        start(node, config(resetsPerHour=1))
        assert gpu_doc(node, victim["uuid"])["auto_resets"] == 1


def test_a_pod_or_a_process_on_the_gpu_refuses_the_reset_until_it_is_gone(tmp_path: Path) -> None:
    with SimulatedNode(tmp_path) as node:
        gpus = start(node, config())
        held, busy = gpus[2], gpus[3]
        node.kubelet.admit("ml", "trainer-0", "main", GPU_RESOURCE, [held["uuid"]])
        node.control.procs(3, [4242])
        node.control.xid(2, RESET_ONLY)
        node.control.xid(3, RESET_ONLY)
        log = node.wait_log("auto-reset refused: pod ml/trainer-0 holds it")
        log = node.wait_log("auto-reset refused: processes use it (pids 4242)")
        time.sleep(1.0)  # three quiet periods: still refused, never reset
        assert resets(node) == [] and steps(node, "refused") == 2.0
        node.kubelet.delete_pod("ml", "trainer-0")
        node.kubelet.wait_for(device_health(held["uuid"], True), TIMEOUT)
        assert resets(node) == [held["bus"]]
        node.control.procs(3, [])
        node.kubelet.wait_for(device_health(busy["uuid"], True), TIMEOUT)
        assert resets(node) == [held["bus"], busy["bus"]]
        assert log.count("auto-reset refused") == 2  # each said once, not at every look


def test_a_failing_check_after_the_reset_keeps_the_gpu_out(tmp_path: Path) -> None:
    check = tmp_path / "check.sh"
    check.write_text('#!/bin/sh\necho "dcgm stand-in: $NVPLUG_GPU_BUS_ID failed the memory test"\nexit 3\n')
    check.chmod(0o755)
    with SimulatedNode(tmp_path) as node:
        gpus = start(node, config(validateCommand=f"[{check}]"))
        victim = gpus[5]
        node.control.xid(5, RESET_ONLY)
        node.wait_log("auto-reset failed")
        assert resets(node) == [victim["bus"]]
        doc = gpu_doc(node, victim["uuid"])
        assert doc["health"] == "Unhealthy"
        assert f"the check failed: `{check}` exited 3: dcgm stand-in: {victim['bus'].lower()} failed" in doc["reason"]
        assert steps(node, "failed") == 1.0
        time.sleep(1.0)
        assert resets(node) == [victim["bus"]]  # not tried again: a person must look


def test_a_gpu_with_nvlinks_is_not_reset_without_allow_fabric_reset(tmp_path: Path) -> None:
    with SimulatedNode(tmp_path) as node:
        gpus = start(node, config(allowFabricReset="false"))
        node.control.xid(6, RESET_ONLY)
        node.wait_log("auto-reset refused: it has NVLinks: a reset may need Fabric Manager")
        time.sleep(0.8)
        assert resets(node) == [] and gpu_doc(node, gpus[6]["uuid"])["health"] == "Unhealthy"


def test_a_passing_check_gives_the_evidence_and_the_gpu_is_healthy(tmp_path: Path) -> None:
    check = tmp_path / "check.sh"
    check.write_text(f'#!/bin/sh\necho "$NVPLUG_GPU_UUID" >> {tmp_path}/checked\n')
    check.chmod(0o755)
    with SimulatedNode(tmp_path) as node:
        gpus = start(node, config(validateCommand=str(check)))
        victim = gpus[7]
        node.control.xid(7, RESET_ONLY)
        node.kubelet.wait_for(device_health(victim["uuid"], False), TIMEOUT)
        node.kubelet.wait_for(device_health(victim["uuid"], True), TIMEOUT)
        assert (tmp_path / "checked").read_text().split() == [victim["uuid"]]
        doc = gpu_doc(node, victim["uuid"])
        assert "at the request of nvplug's auto-reset (nvplug.health.autoReset), and checked" in doc["reason"]
        assert doc["auto_reset"].startswith(f"checked: `{check}` passed")
        assert resets(node) == [victim["bus"]]
