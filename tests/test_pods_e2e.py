"""Which pod holds which GPU, through the kubelet stand-in's PodResources on a real unix socket."""

from __future__ import annotations

import subprocess
import sys
import time

from support.waiting import wait_until

from nvplug.kubelet.podresources_client import TIMEOUT as PODS_TIMEOUT
from nvplug.status import status_client as statusclient
from nvplug.status.status_report import PODS_READER_WAIT
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with

TIMEOUT = 15.0
TIME_SLICED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"


def start(node: SimulatedNode, config: str = "version: v1\n") -> list[dict[str, str]]:
    node.config.write_text(config)
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(lambda k: (p := k.plugin(GPU_RESOURCE)) is not None and bool(p.updates), TIMEOUT)
    return node.scenario_gpus()


def line_of(node: SimulatedNode, text: str) -> str:
    """The daemon's log line that says `text`, once it is there."""
    return next(line for line in node.wait_log(text).splitlines() if text in line)


def status(node: SimulatedNode) -> dict[str, object]:
    return statusclient.status(f"unix:{node.status_socket}", timeout=5)


def devices(node: SimulatedNode, *extra: str) -> str:
    argv = [sys.executable, "-m", "nvplug", "devices", "--status-listen", f"unix:{node.status_socket}", *extra]
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout


def test_two_pods_show_in_devices_status_and_metrics(node: SimulatedNode) -> None:
    gpus = start(node)
    node.kubelet.admit("ml", "trainer-0", "main", GPU_RESOURCE, [gpus[3]["uuid"]])
    node.kubelet.admit("ml", "eval-1", "worker", GPU_RESOURCE, [gpus[5]["uuid"], gpus[6]["uuid"]])
    doc = status(node)
    by_index = {g["index"]: g for g in doc["gpus"]}  # type: ignore[attr-defined]
    assert [(p["namespace"], p["pod"], p["container"]) for p in by_index[3]["pods"]] == [("ml", "trainer-0", "main")]
    assert [p["pod"] for p in by_index[6]["pods"]] == ["eval-1"] and by_index[0]["pods"] == []
    assert doc["pods_error"] is None
    out = devices(node)
    assert "PODS" in out.splitlines()[2]
    assert "pods: ml/trainer-0 (container main)" in out and "ml/eval-1" in out
    _, metrics = statusclient.fetch(f"unix:{node.status_socket}", "/metrics", timeout=5)
    labels = f'container="main",namespace="ml",pod="trainer-0",resource="nvidia.com/gpu",uuid="{gpus[3]["uuid"]}"'
    line = f"nvplug_device_allocated{{{labels}}} 1.0"
    assert line in metrics
    assert metrics.count("nvplug_device_allocated{") == 3


def test_the_unhealthy_line_names_the_pods_that_hold_the_gpu(node: SimulatedNode) -> None:
    gpus = start(node)
    node.kubelet.admit("ml", "trainer-0", "main", GPU_RESOURCE, [gpus[3]["uuid"]])
    node.control.xid(3, 79)
    node.kubelet.wait_for(device_health(gpus[3]["uuid"], healthy=False), TIMEOUT)
    assert line_of(node, f"{gpus[3]['uuid']} (0000:5d:00.0) unhealthy: XID 79").endswith(
        "`nvplug heal 3`; in use by ml/trainer-0 (container main)"
    )
    node.control.xid(4, 79)
    assert line_of(node, f"{gpus[4]['uuid']} (0000:9a:00.0) unhealthy: XID 79").endswith("; no pod holds it")


def test_replicas_are_mapped_to_their_gpu(node: SimulatedNode) -> None:
    gpus = start(node, TIME_SLICED)
    uuid = gpus[2]["uuid"]
    node.kubelet.admit("team-a", "nb-0", "jupyter", GPU_RESOURCE, [f"{uuid}::1"])
    node.kubelet.admit("team-b", "nb-1", "jupyter", GPU_RESOURCE, [f"{uuid}::3"])
    gpu = next(g for g in status(node)["gpus"] if g["index"] == 2)  # type: ignore[attr-defined]
    assert [(p["pod"], p["replica"], p["device_id"]) for p in gpu["pods"]] == [
        ("nb-0", 1, f"{uuid}::1"),
        ("nb-1", 3, f"{uuid}::3"),
    ]
    out = devices(node)
    row = next(line for line in out.splitlines() if line.startswith("2 "))
    assert "2 pods" in row
    assert "team-a/nb-0 (container jupyter, replica 1), team-b/nb-1 (container jupyter, replica 3)" in out


def test_no_podresources_call_while_idle_and_one_after_an_allocate(node: SimulatedNode) -> None:
    gpus = start(node)
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    time.sleep(3.0)
    assert sum(node.kubelet.pod_resources.calls.values()) == 0, node.kubelet.pod_resources.calls
    node.kubelet.admit("ml", "trainer-0", "main", GPU_RESOURCE, [gpus[0]["uuid"]])
    deadline = time.monotonic() + TIMEOUT
    while sum(node.kubelet.pod_resources.calls.values()) == 0:
        assert time.monotonic() < deadline, "no PodResources call after Allocate"
        time.sleep(0.05)
    time.sleep(3.0)  # and then nothing more, idle again
    assert node.kubelet.pod_resources.calls == {"List": 1}


def test_readers_share_answers_and_a_refusal_is_honoured(node: SimulatedNode) -> None:
    start(node)
    for _ in range(50):
        status(node)
    assert node.kubelet.pod_resources.calls["List"] <= 2, node.kubelet.pod_resources.calls
    node.kubelet.pod_resources.set_limit(0.001, 0)  # everything refused: ResourceExhausted
    time.sleep(2.5)  # past the cache
    doc = status(node)
    assert "RESOURCE_EXHAUSTED" in str(doc["pods_error"]) and doc["gpus"][0]["pods"] is None  # type: ignore[index]
    assert "unknown" in devices(node).splitlines()[3]
    refused = node.kubelet.pod_resources.refused
    for _ in range(20):
        status(node)
    assert node.kubelet.pod_resources.refused == refused  # nvplug backs off instead of hammering
    assert node.log_text().count("which pod holds which GPU is unknown") == 1


def test_without_the_socket_everything_works_and_says_unknown_once(node: SimulatedNode) -> None:
    node.config.write_text("version: v1\n")
    node.kubelet.start()
    node.start_daemon("--pod-resources-socket", str(node.root / "no-such.sock"))
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    for _ in range(3):
        doc = status(node)
        time.sleep(0.1)
    assert "no PodResources socket" in str(doc["pods_error"])
    assert all(g["pods"] is None for g in doc["gpus"])  # type: ignore[attr-defined]
    assert "unknown" in devices(node)
    time.sleep(2.2)
    status(node)
    assert node.log_text().count("which pod holds which GPU is unknown") == 1
    uuid = node.scenario_gpus()[0]["uuid"]
    response = node.kubelet.allocate(GPU_RESOURCE, [uuid])
    assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == uuid


def test_mig_devices_map_to_their_gpu(node: SimulatedNode) -> None:
    from test_mig_e2e import mig_node

    gpus = mig_node(node, "mixed", {1: ["3g.40gb", "1g.10gb"]})
    node.kubelet.wait_for(lambda k: (p := k.plugin("nvidia.com/mig-1g.10gb")) is not None and bool(p.updates), 15)
    plugin = node.kubelet.plugin("nvidia.com/mig-1g.10gb")
    assert plugin is not None
    (mig,) = plugin.devices
    node.kubelet.admit("ml", "small", "main", "nvidia.com/mig-1g.10gb", [mig])
    gpu = next(g for g in status(node)["gpus"] if g["uuid"] == gpus[1]["uuid"])  # type: ignore[attr-defined]
    assert [p["pod"] for p in gpu["pods"]] == ["small"]
    assert [p["pod"] for m in gpu["mig"] for p in m["pods"]] == ["small"]


def test_a_slow_kubelet_does_not_stall_status(node: SimulatedNode) -> None:
    gpus = start(node)
    node.kubelet.admit("ml", "trainer-0", "main", GPU_RESOURCE, [gpus[1]["uuid"]])
    assert status(node)["pods_error"] is None
    # Slower than the bound below by far, which is ten times what the daemon waits for the kubelet.
    node.kubelet.pod_resources.delay = 30.0
    time.sleep(2.2)  # past the cache
    began = time.monotonic()
    doc = statusclient.status(f"unix:{node.status_socket}", timeout=30)
    assert time.monotonic() - began < 10 * PODS_READER_WAIT
    # The last answer serves while the kubelet is slow.
    assert [p["pod"] for p in doc["gpus"][1]["pods"]] == ["trainer-0"]  # type: ignore[index]
    # The question itself ends at the client's own bound (no gRPC deadline), and says so.
    wait_until(lambda: status(node)["pods_error"] is not None, 60, "/status to say the List got no answer")
    said = status(node)["pods_error"]
    assert said == f"List on {node.kubelet.pod_resources.socket_path}: no answer within {PODS_TIMEOUT:g} s"
    # The client dials again after it, and the next prompt answer is used.
    node.kubelet.pod_resources.delay = 0.0
    wait_until(lambda: status(node)["pods_error"] is None, 60, "/status's pods_error cleared")
    assert [p["pod"] for p in status(node)["gpus"][1]["pods"]] == ["trainer-0"]  # type: ignore[index]
