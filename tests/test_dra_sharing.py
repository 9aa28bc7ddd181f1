"""DRA sharing end to end: claims with NVIDIA's opaque GpuConfig, prepared by the daemon through the DRA
kubelet stand-in. Time-slicing sets the GPU's interval with nvidia-smi (the stand-in keeps it) and
unprepare sets Default again, also after a crash; MPS runs a supervised control daemon per claim with
the claim's limits, and a per-claim CDI spec carries its pipe and shm; claims that share a GPU agree
or are refused; a daemon that dies makes its devices Unhealthy; orphan specs go at start."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import podman
from test_cdi_podman import real_device_nodes
from test_doctor import doctor
from test_dra_e2e import DRIVER, NODE, Dra, serving_136
from test_mps import modes, wait
from test_mps_podman import CONNECTED, CONTAINER_BINARY, USER, ids_of, run_client

from nvplug.base.checkpoint import seal, write_checkpoint
from nvplug.status import status_client as statusclient
from nvplug.testing import fake_driver_root as driverroot
from nvplug.testing import mps_control_standin as mps_control
from nvplug.testing import nvidia_smi_standin as nvidia_smi
from nvplug.testing.simulated_node import SimulatedNode

API = "resource.nvidia.com/v1beta1"
EXCLUSIVE_PROCESS = 3
CLAIM_KIND = "k8s.gpu.nvidia.com/claim"
NODE_KIND = "k8s.device-plugin.nvidia.com/gpu"


@pytest.fixture
def dra(node: SimulatedNode) -> Iterator[Dra]:
    # 1.36: taints kept, resource health watched.
    yield from serving_136(node)
    # Whatever a test left: the claims' control daemons quit at SIGTERM (stop_daemon), none run on.


def mps_keys(node: SimulatedNode) -> str:
    """nvplug.mps with the stand-in control binary (no MPS resource of the device plugin)."""
    mps_control.install(node.bin_dir, build_dir=node.lib_dir / "mps-control")
    node.root.chmod(0o755)  # a server runs as its client's UID and must pass every parent of the root
    return f"  mps:\n    controlPath: {node.mps_control}\n"


def start(dra: Dra, extra: str = "") -> list[str]:
    dra.start(dra.config() + mps_keys(dra.node) + extra)
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    return [g["uuid"] for g in dra.node.scenario_gpus()]


def time_sliced(interval: str) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}}  # fmt: skip


def mps_shared(percentage: int, pinned: str | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"defaultActiveThreadPercentage": percentage}
    if pinned is not None:
        config["defaultPinnedDeviceMemoryLimit"] = pinned
    return {"apiVersion": API, "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mpsConfig": config}}


def claim(dra: Dra, name: str, devices: list[str], parameters: dict[str, Any] | None) -> tuple[str, str, str]:
    """An allocated claim of these devices, its config as the scheduler copies it (FromClaim)."""
    uid = f"uid-{name}"
    allocation: dict[str, Any] = {
        "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": d} for d in devices]}
    }
    if parameters is not None:
        allocation["devices"]["config"] = [
            {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}
        ]
    dra.api.add_claim({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": "ml", "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {"allocation": allocation},
    })  # fmt: skip
    return ("ml", name, uid)


def prepare(dra: Dra, ref: tuple[str, str, str]) -> tuple[str, list[str]]:
    """NodePrepareResources for one claim: its error and its devices' CDI names."""
    answer = dra.kubelet.prepare(DRIVER, [ref])[ref[2]]
    names = [n for device in answer.devices for n in device[3]]
    print(f"prepare {ref[1]}: error={answer.error!r} cdi={names}")
    return answer.error, names


def time_slices(node: SimulatedNode) -> dict[str, int]:
    return nvidia_smi.time_slices(node.nvidia_smi_log)


def smi_calls(node: SimulatedNode) -> list[list[str]]:
    return [c for c in nvidia_smi.calls(node.nvidia_smi_log) if c and c[0] == "compute-policy"]


def mps_groups(node: SimulatedNode) -> dict[str, dict[str, Any]]:
    try:
        doc = statusclient.status(f"unix:{node.status_socket}", timeout=5)
    except statusclient.StatusUnavailable:
        return {}
    return {g["name"]: g for g in (doc.get("mps") or {}).get("groups", [])}


def test_a_time_sliced_claim_sets_the_interval_and_its_last_unprepare_sets_default(dra: Dra) -> None:
    uuids = start(dra)
    first = claim(dra, "ts-a", ["gpu-5"], time_sliced("Long"))
    error, names = prepare(dra, first)
    assert error == "" and names == [f"{NODE_KIND}={uuids[5]}"]  # no edits of its own: the node spec's name
    assert time_slices(dra.node) == {uuids[5]: 3}
    assert smi_calls(dra.node) == [["compute-policy", "-i", uuids[5], "--set-timeslice", "3"]]
    # A second claim on the same GPU with the same interval: shared, nothing set again.
    second = claim(dra, "ts-b", ["gpu-5"], time_sliced("Long"))
    assert prepare(dra, second)[0] == ""
    # A third with another interval: refused, naming both.
    third = claim(dra, "ts-c", ["gpu-5"], time_sliced("Short"))
    error, _ = prepare(dra, third)
    assert "device gpu-5" in error and "interval Short is asked for, and it is time-sliced at Long" in error, error
    assert "ResourceClaim ml/ts-a (uid-ts-a)" in error, error
    # MPS on a time-sliced GPU: refused too.
    error, _ = prepare(dra, claim(dra, "mps-on-ts", ["gpu-5"], mps_shared(50)))
    assert "MPS is asked for, and it is time-sliced" in error, error
    assert len(smi_calls(dra.node)) == 1

    # A crash: the checkpoint keeps both claims and what nvplug set; the restart sets it again.
    dra.node.stop_daemon(signal.SIGKILL)
    dra.node.start_daemon()
    dra.wait(lambda: len(smi_calls(dra.node)) == 2, "the interval set again after the restart")
    assert smi_calls(dra.node)[1] == ["compute-policy", "-i", uuids[5], "--set-timeslice", "3"]
    dra.wait(lambda: dra.kubelet.accepted(DRIVER) >= 2, "the registration after the restart")

    assert dra.kubelet.unprepare(DRIVER, [first]) == {first[2]: ""}
    assert time_slices(dra.node) == {uuids[5]: 3}  # the other claim still time-slices it
    assert dra.kubelet.unprepare(DRIVER, [second]) == {second[2]: ""}
    assert time_slices(dra.node) == {uuids[5]: 0}
    print(f"nvidia-smi calls: {smi_calls(dra.node)}")
    checkpoint = json.loads((dra.node.state_dir / "dra-claims.json").read_text())
    assert checkpoint["time_slices"] == {} and checkpoint["claims"] == []


def test_an_interval_set_before_a_crash_that_no_claim_holds_goes_back_to_default(dra: Dra) -> None:
    uuids = start(dra)
    ref = claim(dra, "ts", ["gpu-6"], time_sliced("Medium"))
    assert prepare(dra, ref)[0] == ""
    assert time_slices(dra.node) == {uuids[6]: 2}
    dra.node.stop_daemon(signal.SIGKILL)
    # What a crash between nvidia-smi and the claim's record leaves: the interval recorded, no claim.
    path = dra.node.state_dir / "dra-claims.json"
    doc = json.loads(path.read_text())
    body = {"claims": [], "time_slices": doc["time_slices"]}
    write_checkpoint(path, seal("nvplug.dra-claims", 2, body, doc.get("boot_id")))
    dra.node.start_daemon()
    dra.wait(lambda: time_slices(dra.node) == {uuids[6]: 0}, "Default set again at the start")
    dra.node.wait_log("time-slice interval back to Default: no prepared claim needs it now", 10)


def test_a_failing_nvidia_smi_fails_the_claim_alone_and_leaves_nothing_recorded(dra: Dra) -> None:
    start(dra)
    Path(f"{dra.node.nvidia_smi_log}.fail-timeslice").touch()
    error, _ = prepare(dra, claim(dra, "ts", ["gpu-4"], time_sliced("Short")))
    assert "nvidia-smi compute-policy" in error and "is not supported" in error, error
    Path(f"{dra.node.nvidia_smi_log}.fail-timeslice").unlink()
    assert prepare(dra, claim(dra, "plain", ["gpu-4"], None))[0] == ""


def test_an_mps_claim_runs_its_own_daemon_and_spec_until_its_last_claim_goes(dra: Dra) -> None:
    uuids = start(dra)
    ref = claim(dra, "mps-a", ["gpu-6"], mps_shared(40, "10Gi"))
    error, names = prepare(dra, ref)
    group = f"claim-{ref[2]}"
    assert error == "", error
    assert names == [f"{NODE_KIND}={uuids[6]}", f"{CLAIM_KIND}={ref[2]}-gpu-6"]
    running = mps_groups(dra.node)[group]
    print(f"the claim's MPS group: {json.dumps(running)}")
    assert running["up"] and running["devices"] == [uuids[6]] and running["pid"]
    assert (running["active_thread_percentage"], running["pinned_memory_mib"]) == (40, [10240])
    assert modes(dra.node)[uuids[6]] == EXCLUSIVE_PROCESS
    # The daemon answers with the claim's limits, as a client in the container would ask.
    pipe = dra.node.mps_root / group / "pipe"
    asked = mps_control.client(pipe, "get_default_active_thread_percentage", binary=dra.node.mps_control, timeout=5)
    assert asked.stdout.strip() == "40.0", asked
    spec_path = dra.node.cdi_dir / f"k8s.gpu.nvidia.com-claim_{ref[2]}.json"
    spec = json.loads(spec_path.read_text())
    print(f"{spec_path}:\n{spec_path.read_text()}")
    assert spec["kind"] == CLAIM_KIND
    ((device,),) = [spec["devices"]]
    assert device["name"] == f"{ref[2]}-gpu-6"
    assert device["containerEdits"]["env"] == [f"CUDA_MPS_PIPE_DIRECTORY={pipe}"]
    mounts = {m["containerPath"]: m["hostPath"] for m in device["containerEdits"]["mounts"]}
    assert mounts == {str(pipe): str(pipe), "/dev/shm": str(dra.node.mps_root / "shm")}
    # doctor: every prepared claim's names resolve; a spec gone is a FAIL that names the claim.
    d = doctor(dra.node, f"unix:{dra.node.status_socket}")
    # WARN for the stand-in's admin token alone (it may write any node's slices), not for the claims.
    assert d.verdict(12) == "WARN" and "may write other nodes' ResourceSlices" in d.text(12), d
    assert "does not resolve" not in d.text(12)
    kept = spec_path.read_bytes()
    spec_path.unlink()
    d = doctor(dra.node, f"unix:{dra.node.status_socket}")
    print(d.text(12))
    assert d.verdict(12) == "FAIL", d
    assert f"claim ml/mps-a: its CDI name {CLAIM_KIND}={ref[2]}-gpu-6 does not resolve" in d.text(12), d
    spec_path.write_bytes(kept)
    # The node spec holds none of the claim's edits.
    node_spec = json.loads((dra.node.cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json").read_text())
    entry = next(d for d in node_spec["devices"] if d["name"] == uuids[6])["containerEdits"]
    assert "env" not in entry, entry

    # A claim with the same devices and limits joins the group; other limits on the GPU are refused.
    joined = claim(dra, "mps-b", ["gpu-6"], mps_shared(40, "10Gi"))
    error, names = prepare(dra, joined)
    assert error == "" and names[1] == f"{CLAIM_KIND}={joined[2]}-gpu-6", error
    error, _ = prepare(dra, claim(dra, "mps-c", ["gpu-6"], mps_shared(60)))
    assert "differ from those of ResourceClaim ml/mps-a" in error and group in error, error
    error, _ = prepare(dra, claim(dra, "ts-on-mps", ["gpu-6"], time_sliced("Short")))
    assert "time-slicing is asked for, and it is shared through MPS" in error, error
    assert list(mps_groups(dra.node)) == [group]

    assert dra.kubelet.unprepare(DRIVER, [ref]) == {ref[2]: ""}
    assert not spec_path.exists() and mps_groups(dra.node)[group]["up"]
    pid = mps_groups(dra.node)[group]["pid"]
    assert dra.kubelet.unprepare(DRIVER, [joined]) == {joined[2]: ""}
    assert group not in mps_groups(dra.node)
    assert not (dra.node.cdi_dir / f"k8s.gpu.nvidia.com-claim_{joined[2]}.json").exists()
    assert uuids[6] not in modes(dra.node) or modes(dra.node)[uuids[6]] == 0
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    dra.wait(lambda: "taints" not in dra.pool()["gpu-6"], "gpu-6 untainted after its group went")


def test_a_dead_claim_daemon_taints_its_device_and_tells_the_kubelet_until_it_is_back(dra: Dra) -> None:
    start(dra)
    ref = claim(dra, "mps", ["gpu-7"], mps_shared(50))
    assert prepare(dra, ref)[0] == ""
    group = f"claim-{ref[2]}"
    pid = mps_groups(dra.node)[group]["pid"]
    assert "taints" not in dra.pool()["gpu-7"]
    os.killpg(pid, signal.SIGKILL)
    dra.wait(lambda: bool(dra.pool()["gpu-7"].get("taints")), "gpu-7 tainted")
    (taint,) = dra.pool()["gpu-7"]["taints"]
    print(f"the taint of gpu-7 with its claim's daemon dead: {taint}")
    assert (taint["key"], taint["value"], taint["effect"]) == ("gpu.nvidia.com/unhealthy", "probe", "NoSchedule")
    wait(lambda: any(dict(u.devices).get("gpu-7", ("",))[0] == "UNHEALTHY" for u in dra.kubelet.health),
         "the kubelet told gpu-7 is Unhealthy")  # fmt: skip
    # Started again with the shared backoff (1 s): Healthy, untainted.
    dra.wait(lambda: "taints" not in dra.pool()["gpu-7"], "gpu-7 untainted with its daemon back")
    back = mps_groups(dra.node)[group]
    assert back["up"] and back["pid"] != pid and back["restarts"] == 1


def slice_writes(dra: Dra) -> list[tuple[str, str, int]]:
    """The API server's writes of ResourceSlices so far (create, update, delete). A dry run (the taints probe)
    stores nothing and reaches no watcher: not a write."""
    writes = ("POST", "PUT", "PATCH", "DELETE")
    return [r for r in dra.api.requests if r[0] in writes and "resourceslices" in r[1] and "dryRun" not in r[1]]


def test_orphan_claim_specs_go_at_start_and_a_prepared_claims_daemon_is_adopted(dra: Dra) -> None:
    uuids = start(dra)
    ref = claim(dra, "mps", ["gpu-4"], mps_shared(25))
    assert prepare(dra, ref)[0] == ""
    group = f"claim-{ref[2]}"
    old_pid = mps_groups(dra.node)[group]["pid"]
    registered = dra.kubelet.accepted(DRIVER)
    dra.wait(lambda: "taints" not in dra.pool()["gpu-4"], "gpu-4 published untainted")
    before = slice_writes(dra)
    dra.node.stop_daemon(signal.SIGKILL)
    orphan = dra.node.cdi_dir / "k8s.gpu.nvidia.com-claim_uid-gone.json"
    orphan.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": CLAIM_KIND, "devices": [
        {"name": "uid-gone-gpu-5", "containerEdits": {"env": ["CUDA_MPS_PIPE_DIRECTORY=/nowhere"]}}]}))  # fmt: skip
    other = dra.node.cdi_dir / "example.com-thing.json"
    other.write_text("{}")
    dra.node.start_daemon()
    wait(lambda: mps_groups(dra.node).get(group, {}).get("up") is True, "the claim's group up again")
    assert not orphan.exists() and other.exists()
    assert (dra.node.cdi_dir / f"k8s.gpu.nvidia.com-claim_{ref[2]}.json").exists()
    # The claim's daemon ran on through nvplug's death, with its clients: adopted, not started again.
    back = mps_groups(dra.node)[group]
    assert back["pid"] == old_pid and back["adopted_at"] is not None and back["restarts"] == 0
    assert modes(dra.node)[uuids[4]] == EXCLUSIVE_PROCESS
    log = dra.node.log_text()
    assert f"removing the CDI spec {orphan}: no prepared claim owns it" in log
    # The group is restored from the checkpoint, whether or not the kubelet has the plugin back yet.
    wait(lambda: dra.kubelet.accepted(DRIVER) > registered, "the plugin registered again")
    # The publisher has listed what the API server holds, and found it the pool.
    wait(lambda: statusclient.status(f"unix:{dra.node.status_socket}", timeout=5)["dra"]["published"], "published")
    # Nothing in the slices changed: the restart wrote none (no new generation for every slice watcher).
    written = slice_writes(dra)[len(before) :]
    print(f"ResourceSlice writes caused by a SIGKILL and restart of nvplug: {len(written)} {written}")
    assert written == [], written
    assert dra.kubelet.unprepare(DRIVER, [ref]) == {ref[2]: ""}
    assert group not in mps_groups(dra.node)


@pytest.mark.skipif(podman.podman_available() is not None, reason=f"cannot run containers: {podman.podman_available()}")
def test_a_uid_1001_container_reaches_its_claims_daemon_through_the_claims_cdi_names(dra: Dra, short_tmp: Path) -> None:
    node = dra.node
    drv = driverroot.build(short_tmp / "drv")
    # The stand-in as the driver's binary: nvplug runs it (no controlPath), the node spec mounts it.
    mps_control.install(drv.root / "usr" / "bin", build_dir=node.lib_dir / "mps-control")
    real_device_nodes(node)
    node.root.chmod(0o755)
    dra.start(dra.config(extra=f"  nvidiaDriverRoot: {drv.root}\n"))
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    ref = claim(dra, "mps", ["gpu-5"], mps_shared(40, "10Gi"))
    error, names = prepare(dra, ref)
    assert error == "", error
    group = f"claim-{ref[2]}"
    pipe = node.mps_root / group / "pipe"
    with podman.PodmanStore(short_tmp / "pm") as store:
        found, context = run_client(store, node, devices=names, label=f"--device {' '.join(names)}")
    assert found["id"] == [str(USER), str(USER)], context
    assert found["env"] == [f"CUDA_MPS_PIPE_DIRECTORY={pipe}"], context
    assert found["binary"] == [CONTAINER_BINARY], context
    assert found["percentage"] == ["40.0", "rc=0"], context
    assert found["pipe"] == [f"{pipe}/control socket 666"], context
    connected, rc = found["cuda"]
    match = CONNECTED.match(connected)
    assert rc == "rc=0" and match is not None, context
    server = int(match[1])
    assert (int(match[2]), float(match[3]), match[4]) == (USER, 40.0, "0=10240M"), context
    assert found["shm"] == ["written on the host", "rc=0", "/dev/shm tmpfs"], context
    listed = mps_control.client(pipe, "get_server_list", binary=drv.root / CONTAINER_BINARY.lstrip("/"), timeout=5)
    assert listed.stdout.split() == [str(server)], listed
    assert ids_of(server)[0] == [USER] * 4
    assert dra.kubelet.unprepare(DRIVER, [ref]) == {ref[2]: ""}
    assert group not in mps_groups(node)
