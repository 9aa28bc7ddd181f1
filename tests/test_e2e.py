"""End to end: `nvplug run` as a child process, the real pynvml over the fake
libnvidia-ml.so.1, and the kubelet stand-in, all on real unix sockets."""

from __future__ import annotations

import signal
import stat
import time

import grpc
import pytest

from nvplug.base.linked_socket_server import LISTENERS
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with, remove_tree

TIMEOUT = 15.0


def test_registers_and_advertises_eight_healthy_gpus_with_numa(node: SimulatedNode) -> None:
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)

    reg = [r for r in node.kubelet.registrations if r.accepted]
    assert len(reg) == 1
    assert (reg[0].resource, reg[0].version, reg[0].endpoint) == (GPU_RESOURCE, "v1beta1", node.plugin_socket.name)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    assert plugin.options.get_preferred_allocation_available
    assert not plugin.options.pre_start_required

    expected = {g["uuid"]: (int(g["numa"]),) for g in node.scenario_gpus()}
    assert len(expected) == 8
    assert {d.id: d.numa_nodes for d in plugin.devices.values()} == expected
    assert all(d.healthy for d in plugin.devices.values())
    assert plugin.allocatable == 8
    # The first list is already the full one: discovery runs before serving.
    assert len(plugin.updates[0].devices) == 8

    mode = node.plugin_socket.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) & 0o077 == 0, oct(mode)


def test_allocate_one_and_two_gpus(node: SimulatedNode) -> None:
    (node.dev_root / "dev" / "nvidia-modeset").unlink()  # absent nodes are left out
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    gpus = node.scenario_gpus()
    dev = node.dev_root / "dev"

    one = node.kubelet.allocate(GPU_RESOURCE, [gpus[3]["uuid"]]).container_responses[0]
    assert dict(one.envs) == {"NVIDIA_VISIBLE_DEVICES": gpus[3]["uuid"]}
    assert [(d.container_path, d.host_path, d.permissions) for d in one.devices] == [
        (f"/dev/nvidia{gpus[3]['minor']}", f"{dev}/nvidia{gpus[3]['minor']}", "rw"),
        ("/dev/nvidiactl", f"{dev}/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", f"{dev}/nvidia-uvm", "rw"),
        ("/dev/nvidia-uvm-tools", f"{dev}/nvidia-uvm-tools", "rw"),
    ]

    pair = [gpus[5]["uuid"], gpus[1]["uuid"]]
    two = node.kubelet.allocate(GPU_RESOURCE, pair).container_responses[0]
    assert two.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(pair)
    assert [d.container_path for d in two.devices][:2] == [f"/dev/nvidia{gpus[i]['minor']}" for i in (5, 1)]
    log = node.wait_log(f"allocated gpu 5 {gpus[5]['uuid']}")
    assert gpus[5]["bus"].lower() in log

    # All pairs share the NVSwitch; GPUs 6 and 7 also share a PCIe switch, so 6 goes with 7.
    everyone = [g["uuid"] for g in gpus[::-1]]
    assert node.kubelet.preferred_allocation(GPU_RESOURCE, everyone, [gpus[6]["uuid"]], 2) == [
        gpus[6]["uuid"],
        gpus[7]["uuid"],
    ]
    assert node.kubelet.preferred_allocation(GPU_RESOURCE, everyone, [], 4) == [g["uuid"] for g in gpus[:4]]
    node.kubelet.pre_start(GPU_RESOURCE, pair, check_options=False)


def test_unknown_id_is_invalid_argument_naming_it(node: SimulatedNode) -> None:
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        node.kubelet.allocate(GPU_RESOURCE, ["GPU-does-not-exist"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GPU-does-not-exist" in (info.value.details() or "")
    # The daemon is unharmed and still answers.
    uuid = node.scenario_gpus()[0]["uuid"]
    assert node.kubelet.allocate(GPU_RESOURCE, [uuid]).container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == uuid


def test_starts_before_the_kubelet_and_registers_within_a_second(node: SimulatedNode) -> None:
    node.start_daemon()
    node.wait_log("waiting for")
    assert node.plugin_socket.exists()
    time.sleep(0.3)
    # Like the kubelet, the stand-in wipes every socket (ours too), then creates kubelet.sock.
    # It stamps records with time.monotonic() in this process, so the clocks agree.
    before = time.monotonic()
    node.kubelet.start()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    first = next(r for r in node.kubelet.registrations if r.accepted)
    assert first.at - before < 1.0, node.kubelet.describe()
    assert node.plugin_socket.exists()
    node.wait_log("rebinding")


def test_sigterm_stops_cleanly_without_an_empty_list(node: SimulatedNode) -> None:
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    started = time.monotonic()
    assert node.stop_daemon(signal.SIGTERM) == 0
    assert time.monotonic() - started < 5
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    assert all(len(u.devices) == 8 for u in plugin.updates)
    assert not node.plugin_socket.exists()
    assert "nvplug stopped" in node.log_text()


def test_keeps_running_without_nvml_library(node: SimulatedNode) -> None:
    node.kubelet.start()
    node.start_daemon(nvml="none")
    log = node.wait_log("NVML unavailable: ")
    assert "NVML Shared Library Not Found" in log
    assert "ERROR" in next(line for line in log.splitlines() if "NVML unavailable: " in line)
    node.kubelet.wait_for(registered_with(0), TIMEOUT)
    time.sleep(0.5)
    assert node.daemon is not None and node.daemon.poll() is None
    assert node.stop_daemon() == 0


def test_nvml_init_failure_is_reported_with_the_library_text(node: SimulatedNode) -> None:
    node.scenario.write_text(node.scenario.read_text().replace("init_error 0", "init_error 9"))
    node.kubelet.start()
    node.start_daemon()
    log = node.wait_log("NVML unavailable: ")
    assert "Driver Not Loaded" in log, log
    assert node.daemon is not None and node.daemon.poll() is None


def test_degraded_optional_queries_keep_the_gpu(node: SimulatedNode) -> None:
    gpus = node.scenario_gpus()
    text = node.scenario.read_text().replace(
        f"uuid={gpus[2]['uuid']}", f"uuid={gpus[2]['uuid']} unsupported=numa,cc,memory,name"
    )
    node.scenario.write_text(text)
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    # No NUMA from NVML and none from sysfs: the device carries no topology.
    assert plugin.devices[gpus[2]["uuid"]].numa_nodes == ()
    assert plugin.devices[gpus[2]["uuid"]].healthy
    log = node.wait_log("not reported by the driver")
    line = next(ln for ln in log.splitlines() if "not reported by the driver" in ln)
    assert gpus[2]["uuid"] in line and "NUMA node" in line and "memory" in line


def test_numa_node_comes_from_sysfs_first(node: SimulatedNode) -> None:
    gpus = node.scenario_gpus()
    bus = gpus[0]["bus"].lower()
    sysfs = node.sysfs_root / "bus/pci/devices" / bus
    sysfs.mkdir(parents=True, exist_ok=True)  # the node made it, with the PCI class
    (sysfs / "numa_node").write_text("1\n")
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    assert gpus[0]["numa"] == "0"
    assert plugin.devices[gpus[0]["uuid"]].numa_nodes == (1,)


def test_bad_explicit_config_is_refused(node: SimulatedNode) -> None:
    node.config.write_text("version: v1\nbogus: 1\n")
    daemon = node.start_daemon()
    assert daemon.wait(TIMEOUT) == 2
    node.stop_daemon()
    assert "config.yaml, line 2: bogus: unknown key" in node.log_text()
    assert not node.plugin_socket.exists()


def test_retries_a_kubelet_socket_that_refuses_with_capped_backoff(node: SimulatedNode) -> None:
    # A socket file nobody accepts on: what a kubelet that is still starting looks like.
    import re
    import socket

    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(node.kubelet.socket_path))
    try:
        node.start_daemon()
        log = node.wait_log("; retry 6 in ")
        delays = [float(d) for d in re.findall(r"; retry \d+ in ([0-9.]+)s", log)]
        assert len(delays) >= 6 and max(delays) <= 2.0, delays
        assert "kubelet.sock failed: UNAVAILABLE" in log
    finally:
        dead.close()
    # The real kubelet replaces the socket; registration follows at once.
    before = time.monotonic()
    node.kubelet.start()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    first = next(r for r in node.kubelet.registrations if r.accepted)
    assert first.at - before < 1.0


def test_a_kubelet_restart_links_the_name_again_to_the_listener_that_never_stopped(node: SimulatedNode) -> None:
    """The kubelet removes the sockets of its directory, not its subdirectories: the listener under
    .nvplug lives on, and serving again is a hard link, not a new server."""
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    (listener,) = (node.plugin_dir / LISTENERS).iterdir()
    assert node.plugin_socket.samefile(listener) and oct(listener.stat().st_mode & 0o777) == "0o700"
    mark = len(node.log_text())
    node.kubelet.restart()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    assert node.plugin_socket.samefile(listener)
    after = node.log_text()[mark:]
    assert "serving on" in after and "again" in after and "stopped serving" not in after
    # The whole directory gone and made again: its listener went with it, and a new server serves the name.
    node.kubelet.stop()
    remove_tree(node.plugin_dir)  # the daemon links the name again as it goes: rmtree races it
    node.plugin_dir.mkdir()
    node.kubelet.start()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    (new,) = (node.plugin_dir / LISTENERS).iterdir()
    assert node.plugin_socket.samefile(new) and not listener.exists()
    node.stop_daemon()
    assert not node.plugin_socket.exists() and list((node.plugin_dir / LISTENERS).iterdir()) == []


def test_refuses_to_replace_what_is_not_its_socket(node: SimulatedNode) -> None:
    # A symlink where our socket goes (someone steering us into deleting another file): refuse, touch nothing.
    victim = node.root / "precious"
    victim.write_text("keep me")
    node.plugin_socket.symlink_to(victim)
    daemon = node.start_daemon()
    assert daemon.wait(TIMEOUT) != 0
    assert "exists and is not a unix socket; refusing to replace it" in node.log_text()
    assert node.plugin_socket.is_symlink() and victim.read_text() == "keep me"
