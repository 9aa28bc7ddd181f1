"""`nvplug doctor --brief` as a Node Problem Detector custom plugin, and the shipped NPD config.

The exit statuses are made for real: the real daemon on a simulated node, with the
kubelet stand-in, an injected XID, no kubelet, and no daemon at all. The line's
shapes (waiting_for, MIG, long lists) are checked against a status endpoint stand-in.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_doctor import FakeStatusServer, nvplug, prepare, status_doc

from nvplug.cli.doctor.npd_brief import BRIEF_MAX, BRIEF_TIMEOUT
from nvplug.status import status_client as statusclient
from nvplug.testing.simulated_node import SimulatedNode, device_health, registered_with

ROOT = Path(__file__).resolve().parent.parent
NPD_CONFIG = ROOT / "packaging" / "npd" / "nvplug-gpu-health.json"


class Brief:
    def __init__(self, proc: subprocess.CompletedProcess[str], seconds: float) -> None:
        self.rc = proc.returncode
        self.lines = proc.stdout.splitlines()
        self.err = proc.stderr
        self.seconds = seconds

    @property
    def line(self) -> str:
        return self.lines[0] if self.lines else ""

    def __repr__(self) -> str:
        return f"rc={self.rc} in {self.seconds:.1f} s\n{self.lines}\n{self.err}"


def brief(node: SimulatedNode, listen: str | None = None) -> Brief:
    """`nvplug doctor --brief` as NPD runs it, without any NVML library: it must not need one."""
    started = time.monotonic()
    proc = nvplug(
        node,
        "doctor", "--brief",
        "--status-listen", listen or f"unix:{node.status_socket}",
        "--config", str(node.config),
        env=node.daemon_env("none"),
    )  # fmt: skip
    result = Brief(proc, time.monotonic() - started)
    # NPD's protocol: one line, nothing on stderr, always within the plugin's timeout.
    assert len(result.lines) == 1, result
    assert result.err == "", result
    assert len(result.line) <= BRIEF_MAX, result
    return result


def wait_status(node: SimulatedNode, timeout: float = 30.0) -> dict[str, Any]:
    """The daemon's /status, once it answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return statusclient.status(f"unix:{node.status_socket}")
        except statusclient.StatusUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# --- the real daemon ---------------------------------------------------------------------------


def test_healthy_then_xid_79_then_daemon_stopped(node: SimulatedNode) -> None:
    prepare(node)  # the device nodes Allocate needs
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), 30)
    b = brief(node)
    assert b.rc == 0, b
    assert b.line == "ok: 8 GPUs healthy, nvidia.com/gpu registered", b

    gpu = node.scenario_gpus()[3]
    node.control.xid(3, 79)
    node.kubelet.wait_for(device_health(gpu["uuid"], False), 30)
    b = brief(node)
    assert b.rc == 1, b
    short = gpu["uuid"][:12] + "..."  # GPU- and 8 hex digits
    assert b.line.startswith(f"NVPLUG_GPU_UNHEALTHY: gpu 3 {short} ({gpu['bus'].lower()}): XID 79"), b
    assert "gpu 0 " not in b.line and "NVPLUG_NOT_REGISTERED" not in b.line, b
    waiting = wait_status(node)["gpus"][3].get("waiting_for")
    if waiting:  # a daemon that says what the GPU waits for: the line says it too
        assert b.line.endswith(f"; waiting for {waiting}"), b

    node.stop_daemon()
    b = brief(node)
    assert b.rc == 2, b
    assert b.line == (
        f"NVPLUG_STATUS_UNKNOWN: the nvplug daemon does not answer: "
        f"no status socket at unix:{node.status_socket} (is nvplug running?)"
    ), b


def test_daemon_up_but_not_registered(node: SimulatedNode) -> None:
    prepare(node)
    node.start_daemon()  # no kubelet: nothing to register with
    doc = wait_status(node)
    assert not doc["resources"][0]["registered"], doc
    b = brief(node)
    assert b.rc == 1, b
    assert b.line == "NVPLUG_NOT_REGISTERED: nvidia.com/gpu is not registered with the kubelet", b


# --- the line's shapes, against the status endpoint stand-in ------------------------------------


@pytest.fixture
def server(node: SimulatedNode) -> Iterator[FakeStatusServer]:
    srv = FakeStatusServer(node.status_socket, status_doc(node))
    yield srv
    srv.close()


def test_waiting_for_is_shown_when_the_daemon_says_it(node: SimulatedNode, server: FakeStatusServer) -> None:
    doc = status_doc(node, {0: "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM)"})
    doc["gpus"][0]["waiting_for"] = "a GPU reset (nvidia-smi -r -i 0000:18:00.0), or `nvplug heal 0`"
    for g in doc["gpus"][1:]:
        g["waiting_for"] = None  # Healthy GPUs: null
    server.doc = doc
    b = brief(node, server.listen)
    assert b.rc == 1, b
    uuid = node.scenario_gpus()[0]["uuid"]
    assert b.line == (
        f"NVPLUG_GPU_UNHEALTHY: gpu 0 {uuid[:12]}... (0000:18:00.0): XID 79 "
        "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM); "
        "waiting for a GPU reset (nvidia-smi -r -i 0000:18:00.0), or `nvplug heal 0`"
    ), b


def test_many_problems_fit_in_one_line(node: SimulatedNode, server: FakeStatusServer) -> None:
    reason = "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM)\nsecond line of a reason"
    doc = status_doc(node, dict.fromkeys(range(8), reason), registered=False)
    for g in doc["gpus"]:
        g["waiting_for"] = f"a GPU reset (nvidia-smi -r -i {g['bus_id']}), or `nvplug heal {g['index']}`"
    server.doc = doc
    b = brief(node, server.listen)
    assert b.rc == 1, b
    # The node-wide problem first, then as many GPUs as fit, then the count of the rest.
    assert b.line.startswith(
        "NVPLUG_NOT_REGISTERED: nvidia.com/gpu is not registered with the kubelet | NVPLUG_GPU_UNHEALTHY: gpu 0 "
    ), b
    assert "(RESTART_BM) second line of a reason" in b.line, b  # one line, whatever the reason holds
    shown = len(re.findall(r"gpu \d GPU-", b.line))
    assert 1 <= shown < 8, b
    assert b.line.endswith(f" | +{8 - shown} more"), b


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"nvml_error": "NVML initialisation failed: Driver Not Loaded", "resources": [], "gpus": []},
         "NVPLUG_NVML_ERROR: NVML: NVML initialisation failed: Driver Not Loaded | "
         "NVPLUG_NO_RESOURCE: no resource is advertised"),
        ({"health_watch_error": "nvmlEventSetCreate: Not Supported"},
         "NVPLUG_HEALTH_EVENTS_UNAVAILABLE: nvmlEventSetCreate: Not Supported"),
        ({"plan_error": "nvidia.com/gpu: no device matches"},
         "NVPLUG_PLAN_ERROR: resource plan: nvidia.com/gpu: no device matches"),
    ],
)  # fmt: skip
def test_node_wide_problems(
    node: SimulatedNode, server: FakeStatusServer, change: dict[str, Any], expected: str
) -> None:
    doc = status_doc(node)
    doc.update(change)
    server.doc = doc
    b = brief(node, server.listen)
    assert b.rc == 1, b
    assert b.line == expected, b


def test_unhealthy_mig_device(node: SimulatedNode, server: FakeStatusServer) -> None:
    doc = status_doc(node)
    doc["gpus"][1]["mig"] = [
        {"uuid": "MIG-0f6e5a51-5e2c-5d4b-9a7e-2f1c3b4a5d6e", "profile": "1g.10gb", "gpu_instance": 7,
         "compute_instance": 0, "health": "Unhealthy", "reason": "XID 95 UNCONTAINED_ECC_ERROR (RESET_GPU)"},
        {"uuid": "MIG-1a2b3c4d-5e2c-5d4b-9a7e-2f1c3b4a5d6e", "profile": "1g.10gb", "gpu_instance": 8,
         "compute_instance": 0, "health": "Healthy", "reason": "discovered"},
    ]  # fmt: skip
    server.doc = doc
    b = brief(node, server.listen)
    assert b.rc == 1, b
    assert b.line == (
        "NVPLUG_MIG_UNHEALTHY: MIG 1g.10gb MIG-0f6e5a51... on gpu 1: XID 95 UNCONTAINED_ECC_ERROR (RESET_GPU)"
    ), b

    doc["gpus"][1]["mig"][0]["health"] = "Healthy"
    b = brief(node, server.listen)
    assert b.rc == 0, b
    assert b.line == "ok: 8 GPUs and 2 MIG devices healthy, nvidia.com/gpu registered", b


def test_unreadable_status_is_unknown(node: SimulatedNode, server: FakeStatusServer) -> None:
    server.doc = {**status_doc(node), "gpus": "eight"}
    b = brief(node, server.listen)
    assert b.rc == 2, b
    assert b.line == f"NVPLUG_STATUS_UNKNOWN: {server.listen}: /status has no readable gpus list", b


def test_a_hung_daemon_is_unknown_within_npd_timeout(node: SimulatedNode) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.bind(str(node.status_socket))
        hung.listen(1)  # connects, never answers
        b = brief(node)
    assert b.rc == 2, b
    assert b.line.startswith("NVPLUG_STATUS_UNKNOWN: the nvplug daemon does not answer: "), b
    assert f"within {BRIEF_TIMEOUT:g} s" in b.line, b
    assert b.seconds < npd_timeout_seconds(), b


# --- the NPD config ----------------------------------------------------------------------------


def npd_config() -> dict[str, Any]:
    data = json.loads(NPD_CONFIG.read_text())
    assert isinstance(data, dict)
    return data


def npd_timeout_seconds() -> float:
    timeout = npd_config()["pluginConfig"]["timeout"]
    assert timeout.endswith("s") and timeout[:-1].isdigit(), timeout
    return float(timeout[:-1])


def test_npd_config_holds_the_rule_npd_needs() -> None:
    cfg = npd_config()
    assert cfg["plugin"] == "custom"
    plugin = cfg["pluginConfig"]
    assert plugin["concurrency"] == 1
    assert plugin["max_output_length"] >= BRIEF_MAX  # NPD would cut the line
    assert plugin["invoke_interval"].endswith("s")
    assert npd_timeout_seconds() > BRIEF_TIMEOUT
    assert isinstance(cfg["source"], str) and cfg["source"]
    assert isinstance(cfg["metricsReporting"], bool)
    (default,) = cfg["conditions"]
    assert set(default) == {"type", "reason", "message"}
    (rule,) = cfg["rules"]
    assert rule["type"] == "permanent"
    # NPD refuses a permanent rule without a default condition of its type.
    assert rule["condition"] == default["type"] == "NvplugGPUUnhealthy"
    assert rule["reason"] and rule["reason"] != default["reason"]
    assert rule["path"] == "/usr/bin/nvplug"
    assert rule["args"] == ["doctor", "--brief"]
    # NPD refuses a rule timeout above the global one.
    assert rule.get("timeout", plugin["timeout"]) == plugin["timeout"]
