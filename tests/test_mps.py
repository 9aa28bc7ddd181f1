"""MPS run by the daemon: the stand-in control binary as its child, the fake NVML's compute modes,
the kubelet stand-in's view of the groups' devices."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_mig_e2e import mig_node

from nvplug.status import status_client
from nvplug.testing import fakenvml_devices, fakenvml_library
from nvplug.testing import mps_control_standin as mps
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.simulated_node import SimulatedNode, registered_with

TIMEOUT = 15.0
MPS_RESOURCE = "nvidia.com/gpu.mps"
GROUP = "nvidia.com_gpu.mps"
FOUR_ON_TWO = f"    - name: nvidia.com/gpu\n      devices: [0, 1]\n      rename: {MPS_RESOURCE}\n      replicas: 4\n"
EXCLUSIVE_PROCESS = 3


def allocatable(count: int, resource: str = MPS_RESOURCE) -> Callable[[FakeKubelet], bool]:
    def check(k: FakeKubelet) -> bool:
        p = k.plugin(resource)
        return p is not None and p.stream_open and p.capacity > 0 and p.allocatable == count

    return check


def status(node: SimulatedNode) -> dict[str, Any]:
    doc = status_client.status(f"unix:{node.status_socket}", timeout=5)
    found: dict[str, Any] = doc["mps"]
    return found


def group(node: SimulatedNode, name: str = GROUP) -> dict[str, Any]:
    found: dict[str, Any] = next(g for g in status(node)["groups"] if g["name"] == name)
    return found


def log_dir(node: SimulatedNode, name: str = GROUP) -> Path:
    return node.mps_root / name / "log"


def pipe_dir(node: SimulatedNode, name: str = GROUP) -> Path:
    return node.mps_root / name / "pipe"


def start(node: SimulatedNode, resources: str = FOUR_ON_TWO, extra: str = "") -> list[str]:
    node.config.write_text(node.mps_config(resources, extra))
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(allocatable(8), TIMEOUT)
    return [g["uuid"] for g in node.scenario_gpus()]


def wait(predicate: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def modes(node: SimulatedNode) -> dict[str, int]:
    return fakenvml_library.persisted_compute_modes(node.root)


def test_a_group_starts_with_its_defaults_set_before_its_devices_turn_healthy(node: SimulatedNode) -> None:
    uuids = start(node)
    plugin = node.kubelet.plugin(MPS_RESOURCE)
    assert plugin is not None and plugin.capacity == 8
    assert sorted(plugin.devices) == sorted(f"{u}::{n}" for u in uuids[:2] for n in range(4))
    # GPUs 2-7 stay whole, and are not held back by MPS.
    assert node.kubelet.allocatable("nvidia.com/gpu") == 6
    sent = mps.commands(log_dir(node))
    sets = [c for c in sent if c["command"].startswith("set_default")]
    assert [c["command"] for c in sets] == [
        "set_default_active_thread_percentage 25",
        "set_default_device_pinned_mem_limit 0 20389M",  # 81559 MiB / 4
        "set_default_device_pinned_mem_limit 1 20389M",
    ]
    first_healthy = next(u for u in plugin.updates if any(d.healthy for d in u.devices))
    assert all(c["monotonic"] < first_healthy.at for c in sets)
    assert all(not d.healthy for u in plugin.updates[: plugin.updates.index(first_healthy)] for d in u.devices)
    found = group(node)
    assert found["up"] and found["pid"] > 0 and found["active_thread_percentage"] == 25
    assert found["devices"] == uuids[:2] and found["pinned_memory_mib"] == [20389, 20389]
    environ = Path(f"/proc/{found['pid']}/environ").read_bytes().split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={uuids[0]},{uuids[1]}".encode() in environ
    assert f"CUDA_MPS_PIPE_DIRECTORY={pipe_dir(node)}".encode() in environ
    # The pipe's parents are traversable by any UID; the root writable by root alone.
    for path in (node.mps_root, node.mps_root / GROUP, pipe_dir(node)):
        assert path.stat().st_mode & 0o777 == 0o755
    assert (node.mps_root / "shm").stat().st_mode & 0o7777 == 0o1777
    assert modes(node) == {uuids[0]: EXCLUSIVE_PROCESS, uuids[1]: EXCLUSIVE_PROCESS}


def test_a_crashed_daemon_leaves_its_devices_unhealthy_until_it_is_restarted(node: SimulatedNode) -> None:
    start(node)
    first = group(node)["pid"]
    began = time.monotonic()
    mps.client(pipe_dir(node), "fake_crash", binary=node.mps_control, timeout=5)
    node.kubelet.wait_for(allocatable(0), TIMEOUT)
    down = time.monotonic() - began
    node.kubelet.wait_for(allocatable(8), TIMEOUT)
    found = group(node)
    assert found["pid"] != first and found["restarts"] == 1 and found["up"]
    log = node.log_text()
    # Whichever comes first says why: the exit's status, or the control.log watch's probe finding it gone.
    down_why = ("is down: it was killed by SIGABRT", "Cannot find MPS control daemon process; starting it again in 1 s")
    assert any(why in log for why in down_why) and "starting it again in 1 s" in log
    assert down < 5.0


def test_a_hung_daemon_is_caught_by_the_probe_an_allocation_runs(node: SimulatedNode) -> None:
    uuids = start(node)
    first = group(node)["pid"]
    with pytest.raises(subprocess.TimeoutExpired):  # the client would wait for ever
        mps.client(pipe_dir(node), "fake_hang", binary=node.mps_control, timeout=1)
    assert Path(f"/proc/{first}").exists()
    node.kubelet.allocate(MPS_RESOURCE, [f"{uuids[0]}::0"])
    node.kubelet.wait_for(allocatable(0), TIMEOUT)
    assert "did not answer 'get_default_active_thread_percentage; get_server_list' within 5 s" in node.log_text()
    node.kubelet.wait_for(allocatable(8), TIMEOUT)
    assert group(node)["pid"] != first
    wait(lambda: not Path(f"/proc/{first}").exists() or _zombie(first), "the hung daemon to be killed")


def test_a_reload_that_changes_replicas_restarts_only_that_group(node: SimulatedNode) -> None:
    two = FOUR_ON_TWO + "    - name: nvidia.com/gpu\n      devices: [2]\n      rename: nvidia.com/gpu.b\n"
    two += "      replicas: 2\n"
    start(node, two)
    node.kubelet.wait_for(allocatable(2, "nvidia.com/gpu.b"), TIMEOUT)
    before = {g["name"]: g["pid"] for g in status(node)["groups"]}
    assert set(before) == {GROUP, "nvidia.com_gpu.b"}
    node.config.write_text(node.mps_config(two.replace("replicas: 4", "replicas: 2")))
    assert node.daemon is not None
    node.daemon.send_signal(signal.SIGHUP)
    node.kubelet.wait_for(allocatable(4), TIMEOUT)
    after = {g["name"]: g for g in status(node)["groups"]}
    assert after["nvidia.com_gpu.b"]["pid"] == before["nvidia.com_gpu.b"]
    assert after[GROUP]["pid"] != before[GROUP] and after[GROUP]["active_thread_percentage"] == 50
    # The new daemon held the GPUs before the old one let them go: no moment in DEFAULT.
    assert "compute mode back" not in node.log_text()


def test_a_reload_is_refused_while_the_group_has_clients(node: SimulatedNode) -> None:
    uuids = start(node)
    server = group(node)["pid"]
    node.control.procs(0, [fakenvml_devices.GpuProcess(server), fakenvml_devices.GpuProcess(4242, kinds=("mps",))])
    node.config.write_text(node.mps_config(FOUR_ON_TWO.replace("replicas: 4", "replicas: 2")))
    assert node.daemon is not None
    node.daemon.send_signal(signal.SIGHUP)
    text = node.wait_log("reload refused")
    assert f"cutting off the MPS clients on gpu 0 {uuids[0]}" in text and "(pids 4242)" in text
    assert group(node)["pid"] == server and node.kubelet.capacity(MPS_RESOURCE) == 8
    node.config.write_text(
        node.mps_config(FOUR_ON_TWO.replace("replicas: 4", "replicas: 2"), "    restartWithClients: true\n")
    )
    node.daemon.send_signal(signal.SIGHUP)
    node.kubelet.wait_for(allocatable(4), TIMEOUT)
    assert group(node)["pid"] != server


def lists(node: SimulatedNode, resource: str = MPS_RESOURCE) -> list[int]:
    """How many devices each list the kubelet got for the resource had, across registrations."""
    return [len(u.devices) for v in node.kubelet.views(resource) for u in v.updates]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_restart_of_nvplug_leaves_the_daemon_and_its_clients_alone(node: SimulatedNode, sig: signal.Signals) -> None:
    uuids = start(node)
    daemon = group(node)["pid"]
    shm = node.mps_root / "shm"
    client = mps.HeldClient(pipe_dir(node), shm / "cuda.segment", binary=node.mps_control)
    try:
        node.kubelet.allocate(MPS_RESOURCE, [f"{uuids[0]}::0"])  # an Allocate probes the daemon: its clients
        wait(lambda: group(node)["clients"] == 1, "the daemon to count its client")
        shm_dev = shm.stat().st_dev
        registered = node.kubelet.plugin(MPS_RESOURCE).serial  # type: ignore[union-attr]
        assert node.stop_daemon(sig) == (0 if sig == signal.SIGTERM else -sig)
        # Stopped is not torn down: the daemon, its client, the compute modes, the pipes and the shm stay.
        assert client.connected() and Path(f"/proc/{daemon}").exists() and not _zombie(daemon)
        assert modes(node) == {uuids[0]: EXCLUSIVE_PROCESS, uuids[1]: EXCLUSIVE_PROCESS}
        assert (pipe_dir(node) / mps.CONTROL_SOCKET).exists() and shm.stat().st_dev == shm_dev
        node.start_daemon()
        node.kubelet.wait_for(lambda k: allocatable(8)(k) and k.plugin(MPS_RESOURCE).serial > registered, TIMEOUT)  # type: ignore[union-attr]
        found = group(node)
        assert found["pid"] == daemon and found["up"] and found["adopted_at"] is not None
        assert found["restarts"] == 0 and found["clients"] == 1
        assert client.connected() and (shm / "cuda.segment").exists() and shm.stat().st_dev == shm_dev
        assert modes(node) == {uuids[0]: EXCLUSIVE_PROCESS, uuids[1]: EXCLUSIVE_PROCESS}
        # No list had fewer devices: the restart is no change to the kubelet.
        assert min(lists(node)) == 8, lists(node)
        node.wait_log(f"the control daemon pid {daemon} an earlier nvplug started adopted")
        # Operators see it: `nvplug devices` says since when this nvplug supervises the daemon.
        from test_doctor import nvplug

        listed = nvplug(node, "devices", "--status-listen", f"unix:{node.status_socket}", env=node.daemon_env("none"))
        line = next(ln for ln in listed.stdout.splitlines() if ln.startswith(f"  MPS group {GROUP}"))
        assert f"daemon pid {daemon} (adopted " in line and ", 1 clients " in line, line
        # Nothing was sent to it but the questions of a probe: its defaults are the ones it had.
        assert not [c for c in mps.commands(log_dir(node)) if c["command"].startswith(("set_", "quit"))][6:]
    finally:
        said = client.close()
    assert "went away" not in said, said


def test_a_daemon_that_died_while_nvplug_was_down_starts_again(node: SimulatedNode) -> None:
    uuids = start(node)
    leftover = group(node)["pid"]
    node.stop_daemon()
    os.kill(leftover, signal.SIGKILL)
    wait(lambda: not Path(f"/proc/{leftover}").exists() or _zombie(leftover), "the daemon to die")
    node.start_daemon()
    node.kubelet.wait_for(allocatable(8), TIMEOUT)
    found = group(node)
    assert found["pid"] != leftover and found["adopted_at"] is None
    assert modes(node) == {uuids[0]: EXCLUSIVE_PROCESS, uuids[1]: EXCLUSIVE_PROCESS}
    node.wait_log(f"the control daemon pid {leftover} an earlier nvplug started is gone: starting a new one")
    # No device was Healthy at the kubelet before the new daemon had its defaults set.
    plugin = node.kubelet.plugin(MPS_RESOURCE)
    assert plugin is not None
    first_healthy = next(u for u in plugin.updates if any(d.healthy for d in u.devices))
    sets = [c for c in mps.commands(log_dir(node)) if c["command"].startswith("set_default")]
    assert sets[-1]["monotonic"] < first_healthy.at and all(len(u.devices) == 8 for u in plugin.updates)


def test_a_daemon_no_config_asks_for_runs_on_while_it_has_clients(node: SimulatedNode) -> None:
    uuids = start(node)
    daemon = group(node)["pid"]
    client = mps.HeldClient(pipe_dir(node), binary=node.mps_control)
    node.stop_daemon()
    # Started again without MPS: the daemon has a client, so it runs on, said in the status line.
    node.config.write_text("version: v1\n")
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    wait(
        lambda: any(o["pid"] == daemon and o["clients"] == [client.pid] for o in status(node)["leftovers"]),
        "the leftover daemon to be reported",
    )
    assert client.connected() and modes(node) == {uuids[0]: EXCLUSIVE_PROCESS, uuids[1]: EXCLUSIVE_PROCESS}
    node.wait_log("runs on while its clients")
    # Its client gone, a reload asks again: it quits, and the compute modes go back.
    client.close()
    assert node.daemon is not None
    node.daemon.send_signal(signal.SIGHUP)
    wait(lambda: not Path(f"/proc/{daemon}").exists() or _zombie(daemon), "the leftover daemon to quit")
    wait(lambda: modes(node) == {uuids[0]: 0, uuids[1]: 0}, "the compute modes to be restored")
    # Nothing of MPS is left to report: the section goes.
    wait(lambda: "mps" not in status_client.status(f"unix:{node.status_socket}", timeout=5), "the leftover forgotten")
    node.wait_log("has no client: it quits")
    assert not pipe_dir(node).exists()


def test_a_daemon_whose_mps_root_moved_holds_its_group_while_it_has_clients(node: SimulatedNode) -> None:
    """The MPS root changed while nvplug was down: the recorded daemon serves the old pipe directory, and its
    servers hold the group's GPUs. It runs on while it has a client, and the group waits; once the client is
    gone, it quits and the group starts under the new root."""
    uuids = start(node)
    daemon = group(node)["pid"]
    client = mps.HeldClient(pipe_dir(node), binary=node.mps_control)
    node.stop_daemon()
    moved = node.root / "mps-moved"
    node.start_daemon("--mps-root", str(moved))
    node.wait_log(f"serves {pipe_dir(node)}, not {moved / GROUP / 'pipe'}, with clients (pids {client.pid})")
    assert client.connected() and modes(node) == {uuids[0]: EXCLUSIVE_PROCESS, uuids[1]: EXCLUSIVE_PROCESS}
    assert node.kubelet.allocatable(MPS_RESOURCE) == 0
    assert json.loads((node.state_dir / "mps-daemons.json").read_text())["groups"][GROUP]["pid"] == daemon
    # Its client gone, the next try (the shared backoff) ends it and starts the group where the config says.
    client.close()
    node.kubelet.wait_for(allocatable(8), 90)
    wait(lambda: not Path(f"/proc/{daemon}").exists() or _zombie(daemon), "the moved daemon to quit")
    record = json.loads((node.state_dir / "mps-daemons.json").read_text())["groups"][GROUP]
    assert record["pid"] == group(node)["pid"] != daemon and record["pipe_dir"] == str(moved / GROUP / "pipe")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def test_mps_on_mig_devices_runs_one_daemon_per_mig_device(node: SimulatedNode) -> None:
    gpus = mig_node(node, "mixed", {1: ["3g.40gb", "3g.40gb"]}, start=False)
    node.config.write_text(
        node.mps_config("    - name: nvidia.com/mig-3g.40gb\n      replicas: 2\n").replace(
            "version: v1\n", "version: v1\nflags:\n  migStrategy: mixed\n"
        )
    )
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(allocatable(4, "nvidia.com/mig-3g.40gb"), TIMEOUT)
    migs = [fakenvml_devices.mig_uuid(gpus[1]["uuid"], gi, 0) for gi in (1, 2)]
    groups = {g["name"]: g for g in status(node)["groups"]}
    assert sorted(groups) == sorted(migs)
    for uuid in migs:
        environ = Path(f"/proc/{groups[uuid]['pid']}/environ").read_bytes().split(b"\0")
        assert f"CUDA_VISIBLE_DEVICES={uuid}".encode() in environ
        assert groups[uuid]["active_thread_percentage"] == 50
    # No compute mode under MIG: NVML has none to set there.
    assert modes(node) == {}
    response = node.kubelet.allocate("nvidia.com/mig-3g.40gb", [f"{migs[1]}::1"])
    envs = response.container_responses[0].envs
    assert envs["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe_dir(node, migs[1]))


def test_time_slicing_and_mps_in_one_config_are_refused(node: SimulatedNode) -> None:
    node.config.write_text(
        node.mps_config(FOUR_ON_TWO).replace(
            "sharing:\n", "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n"
        )
    )
    daemon = node.start_daemon()
    assert daemon.wait(TIMEOUT) == 2
    assert "sharing.mps: time-slicing and MPS are mutually exclusive" in node.log_text()


def test_operators_see_each_group_in_devices_metrics_and_doctor(node: SimulatedNode) -> None:
    from test_doctor import Doctor, doctor_args, doctor_env, nvplug

    uuids = start(node)
    devices = nvplug(node, "devices", "--status-listen", f"unix:{node.status_socket}", env=node.daemon_env("none"))
    pid = group(node)["pid"]
    line = next(ln for ln in devices.stdout.splitlines() if ln.startswith(f"  MPS group {GROUP}"))
    assert f"({MPS_RESOURCE}, 2 devices): daemon pid {pid}, up " in line, devices.stdout
    assert "25% of the SMs per client, pinned memory 20389M per device; 0 servers, 0 clients" in line
    _, metrics = status_client.fetch(f"unix:{node.status_socket}", "/metrics", timeout=5)
    assert f'nvplug_mps_daemon_up{{group="{GROUP}",resource="{MPS_RESOURCE}"}} 1.0' in metrics
    assert f'nvplug_mps_exclusive_process{{uuid="{uuids[0]}"}} 1.0' in metrics
    env = doctor_env(node)
    checked = Doctor(nvplug(node, *doctor_args(node, f"unix:{node.status_socket}"), env=env))
    assert checked.verdict(13) == "PASS", checked
    assert f"MPS group {GROUP}: daemon pid {pid}, up " in checked.text(13)
    assert "answers, 25.0% of the SMs per client" in checked.text(13)
    # An operator's `nvidia-smi -c DEFAULT` behind nvplug's back: doctor says what it allows.
    node.control.set_compute_mode(1, 0)
    checked = Doctor(nvplug(node, *doctor_args(node, f"unix:{node.status_socket}"), env=env))
    assert checked.verdict(13) == "FAIL", checked
    assert f"{uuids[1]} of MPS group {GROUP} is in compute mode DEFAULT" in checked.out


def mps_stop(node: SimulatedNode, *more: str) -> subprocess.CompletedProcess[str]:
    """`nvplug mps stop` as an operator runs it on the node: its config, state directory and NVML."""
    args = ["--config", str(node.config), "--state-dir", str(node.state_dir)]
    args += ["--status-listen", f"unix:{node.status_socket}", "--sysfs-root", str(node.sysfs_root)]
    args += ["--proc-root", str(node.proc_root), "--pod-logs", str(node.root / "var/log/pods")]
    return subprocess.run(
        node.isolated([sys.executable, "-m", "nvplug", "mps", "stop", *args, *more]),
        env=node.daemon_env(),
        text=True,
        capture_output=True,
        timeout=60,
    )


def test_mps_stop_is_the_teardown_refused_while_nvplug_runs_or_clients_are_connected(node: SimulatedNode) -> None:
    uuids = start(node)
    daemon = group(node)["pid"]
    client = mps.HeldClient(pipe_dir(node), binary=node.mps_control)
    running = mps_stop(node)
    assert running.returncode == 1 and "nvplug runs" in running.stderr, running
    node.stop_daemon()
    # A client is connected: refused, naming its pod (from its cgroup path, in the node's /proc, and the
    # kubelet's log directory of the pod); the daemon and its modes stay.
    uid, container = "0b7c51f2-8d3e-4a6b-9c1d-2e4f6a8b0c3d", "9e2d" * 16
    proc = node.proc_root / str(client.pid)
    proc.mkdir(parents=True)
    slice_ = f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
    (proc / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-besteffort.slice/{slice_}/cri-containerd-{container}.scope\n"
    )
    (node.root / "var/log/pods" / f"team-a_train-0_{uid}").mkdir(parents=True)
    held = mps_stop(node)
    named = f"has clients (pid {client.pid}: pod team-a/train-0, container {container[:13]})"
    assert held.returncode == 1 and named in held.stderr, held
    assert client.connected() and modes(node) == {uuids[0]: EXCLUSIVE_PROCESS, uuids[1]: EXCLUSIVE_PROCESS}
    # --force: the daemon quits, its client fails as a CUDA process would, the modes go back.
    forced = mps_stop(node, "--force")
    assert forced.returncode == 0, forced
    assert f"control daemon pid {daemon} stopped" in forced.stdout
    wait(lambda: not client.connected(), "the client to lose its daemon")
    assert "cudaErrorMpsConnectionFailed: the MPS server went away" in client.close()
    wait(lambda: not Path(f"/proc/{daemon}").exists() or _zombie(daemon), "the daemon to quit")
    assert modes(node) == {uuids[0]: 0, uuids[1]: 0} and not pipe_dir(node).exists()
    assert "compute_modes" not in json.loads((node.state_dir / "health.json").read_text())
    assert json.loads((node.state_dir / "mps-daemons.json").read_text())["groups"] == {}
    # Nothing left: a second stop has nothing to do.
    assert mps_stop(node).returncode == 0


def test_a_daemon_with_clients_that_no_record_names_is_never_killed(node: SimulatedNode) -> None:
    """The record lost (or unreadable): the daemon found by its own pid file is replaced only once it has no
    client; meanwhile its group is down, and says why."""
    start(node)
    daemon = group(node)["pid"]
    client = mps.HeldClient(pipe_dir(node), binary=node.mps_control)
    node.stop_daemon()
    (node.state_dir / "mps-daemons.json").unlink()
    node.start_daemon()
    node.wait_log(f"a control daemon (pid {daemon}) that nvplug has no record of serves its pipe directory")
    assert client.connected() and Path(f"/proc/{daemon}").exists() and not _zombie(daemon)
    assert node.kubelet.allocatable(MPS_RESOURCE) == 0
    # Its client gone, the next try (the shared backoff) replaces it.
    client.close()
    node.kubelet.wait_for(allocatable(8), 90)
    assert group(node)["pid"] != daemon
    wait(lambda: not Path(f"/proc/{daemon}").exists() or _zombie(daemon), "the unrecorded daemon to be killed")
