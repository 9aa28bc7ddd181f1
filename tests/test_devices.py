"""`nvplug devices`: from the daemon's status endpoint, else from a direct NVML read."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_doctor import FakeStatusServer, nvplug, prepare, status_doc

from nvplug.cli.devices_command import duration, render, since_text
from nvplug.status import status_client as statusclient
from nvplug.testing.simulated_node import SimulatedNode, device_health, registered_with


def devices(node: SimulatedNode, *extra: str, listen: str | None = None) -> tuple[int, str, str]:
    proc = nvplug(
        node,
        "devices",
        "--status-listen", listen or f"unix:{node.root}/status.sock",
        "--config", str(node.config),
        "--sysfs-root", str(node.sysfs_root),
        "--proc-root", str(node.proc_root),
        *extra,
    )  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def served(node: SimulatedNode) -> Iterator[FakeStatusServer]:
    prepare(node)
    server = FakeStatusServer(node.root / "status.sock", status_doc(node, {3: "XID 79 (GPU has fallen off the bus)"}))
    yield server
    server.close()


def test_from_the_daemon(node: SimulatedNode, served: FakeStatusServer) -> None:
    rc, out, err = devices(node, listen=served.listen)
    assert rc == 0, err
    assert "from the daemon" in out
    assert "nvidia.com/gpu: registered, 8 devices, 7 healthy" in out
    assert "direct NVML read" not in out
    gpus = node.scenario_gpus()
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert len(rows) == 8
    assert rows[3].split()[:3] == ["3", gpus[3]["uuid"], "0000:5d:00.0"]
    assert "Unhealthy" in rows[3] and "XID 79 (GPU has fallen off the bus)" in rows[3]
    # Healthy since 192 s before the fixture's document was made; the command reads its own clock later,
    # after the fixture's build, which a busy machine makes slow.
    shown = re.search(r"\(for (\d+)m(\d+)s\)", rows[0])
    assert shown is not None, rows[0]
    assert 192 <= int(shown[1]) * 60 + int(shown[2]) <= 192 + 120, rows[0]
    assert "81559 MiB" in rows[0] and "NVIDIA H100 80GB HBM3" in rows[0]
    assert f"advertised: nvidia.com/gpu {gpus[0]['uuid']}" in out
    assert "nvlink peers: 1, 2, 3, 4, 5, 6, 7 (18 links each)" in out


def test_json_from_the_daemon(node: SimulatedNode, served: FakeStatusServer) -> None:
    rc, out, err = devices(node, "--json", listen=served.listen)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["source"] == "daemon"
    assert doc["gpus"] == served.doc["gpus"]


def test_direct_nvml_read_when_the_daemon_is_not_running(node: SimulatedNode) -> None:
    prepare(node)
    rc, out, err = devices(node)
    assert rc == 0, err
    assert out.splitlines()[0] == "(direct NVML read; the daemon is not running)"
    gpus = node.scenario_gpus()
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert [r.split()[1] for r in rows] == [g["uuid"] for g in gpus]
    assert all("Healthy" in r and "discovered" in r for r in rows)
    # NUMA from the scenario: GPUs 0-3 on node 0, 4-7 on node 1.
    assert [r.split()[9] for r in rows] == ["0"] * 4 + ["1"] * 4
    assert "nvlink peers: 0, 1, 2, 3, 4, 5, 6 (18 links each)" in out


def test_direct_json_with_a_probe_failure(node: SimulatedNode) -> None:
    prepare(node)
    text = node.scenario.read_text()
    uuid = node.scenario_gpus()[5]["uuid"]
    node.scenario.write_text(text.replace(f"uuid={uuid} ", f"uuid={uuid} pending_pages=1 "))
    rc, out, err = devices(node, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["source"] == "nvml"
    assert "no status socket" in doc["daemon_error"]
    assert len(doc["gpus"]) == 8
    five = doc["gpus"][5]
    assert five["uuid"] == uuid
    assert (five["health"], five["reason"]) == ("Unhealthy", "probe failed: page retirement pending")
    assert five["advertised"] == {"nvidia.com/gpu": [uuid]}
    assert five["bus_id"] == "0000:ab:00.0"
    assert len(five["nvlink_peers"]) == 7
    assert set(five) >= {"index", "name", "memory_mib", "numa_node", "since", "mig"}
    assert all(g["health"] == "Healthy" for i, g in enumerate(doc["gpus"]) if i != 5)


def test_direct_read_shows_time_sliced_replicas(node: SimulatedNode) -> None:
    prepare(node)
    node.config.write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    )
    rc, out, err = devices(node)
    assert rc == 0, err
    uuid = node.scenario_gpus()[0]["uuid"]
    assert f"advertised: nvidia.com/gpu x4 ({uuid}::0..::3)" in out


def test_neither_daemon_nor_nvml(node: SimulatedNode) -> None:
    proc = nvplug(node, "devices", "--status-listen", f"unix:{node.root}/status.sock", env=node.daemon_env("none"))
    if proc.returncode == 0:
        pytest.skip("this host has an NVML library of its own")
    assert proc.returncode == 1
    assert "the daemon does not answer" in proc.stderr
    assert "NVML cannot be read directly" in proc.stderr


def test_statusclient_errors(short_tmp: Path) -> None:
    with pytest.raises(statusclient.StatusUnavailable, match="no status socket"):
        statusclient.fetch(f"unix:{short_tmp}/none.sock", "/status")
    with pytest.raises(statusclient.StatusUnavailable, match="turned off"):
        statusclient.fetch("off", "/status")
    with pytest.raises(ValueError, match="neither"):
        statusclient.fetch("nonsense", "/status")


def test_statusclient_over_a_unix_socket(short_tmp: Path) -> None:
    server = FakeStatusServer(short_tmp / "s.sock", {"gpus": [], "resources": []})
    try:
        assert statusclient.fetch(server.listen, "/healthz") == (200, "ok")
        assert statusclient.status(server.listen) == {"gpus": [], "resources": []}
        assert statusclient.fetch(server.listen, "/nope")[0] == 404
    finally:
        server.close()


def test_listen_address_precedence(short_tmp: Path) -> None:
    cfg = short_tmp / "c.yaml"
    cfg.write_text("version: v1\n")
    assert statusclient.listen_address("127.0.0.1:9400", cfg) == "127.0.0.1:9400"
    assert statusclient.listen_address(None, cfg) == statusclient.DEFAULT_LISTEN
    assert statusclient.listen_address(None, short_tmp / "missing.yaml") == statusclient.DEFAULT_LISTEN


def test_durations() -> None:
    assert duration(5) == "5s"
    assert duration(192) == "3m12s"
    assert duration(3 * 3600 + 125) == "3h2m"
    assert duration(2 * 86400 + 3600) == "2d1h"
    now = time.time()
    assert since_text(now - 192, now).endswith("(for 3m12s)")
    assert since_text(None, now) == "-"
    assert render([], now) == "no GPUs"


def test_end_to_end_with_the_daemon(node: SimulatedNode) -> None:
    prepare(node)
    node.kubelet.start()
    listen = f"unix:{node.root}/status.sock"
    node.start_daemon("--status-listen", listen)
    node.kubelet.wait_for(registered_with(8), 30)
    uuid = node.scenario_gpus()[3]["uuid"]
    node.control.xid(3, 79)
    node.kubelet.wait_for(device_health(uuid, False), 30)
    rc, out, err = devices(node, "--json", listen=listen)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["source"] == "daemon"
    assert [g["health"] for g in doc["gpus"]] == ["Healthy"] * 3 + ["Unhealthy"] + ["Healthy"] * 4
    assert "XID 79" in doc["gpus"][3]["reason"]
    assert doc["gpus"][3]["advertised"] == {"nvidia.com/gpu": [uuid]}
    rc, out, err = devices(node, listen=listen)
    assert rc == 0, err
    assert "nvidia.com/gpu: registered, 8 devices, 7 healthy" in out
    row = next(line for line in out.splitlines() if line.startswith("3 "))
    assert "Unhealthy" in row and "XID 79" in row
