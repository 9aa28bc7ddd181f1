"""Faults, end to end against the real daemon process: kubelet restart storms, NVML
failing under us, event floods, SIGKILL and a ListAndWatch client that vanishes.

Leaks are measured from the outside, in /proc/<pid> of the daemon: open file
descriptors, threads, RSS and CPU time. /status has no count of asyncio tasks,
so tasks are not checked here (fds and threads are what a leaked task would hold).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from support.waiting import wait_until

from nvplug.status import status_client as statusclient
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.kubelet_thread import KubeletThread
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with
from nvplug.testing.udev_sender import pci_event

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sending udev netlink messages needs root")

TIMEOUT = 15.0
NEW_UUID = "GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08"
NEW_GPU = f'uuid={NEW_UUID} name="NVIDIA H100 80GB HBM3" minor=8 bus=0000:CC:00.0 numa=1 memory_mib=81559 cc=9.0'
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def start(node: SimulatedNode) -> list[dict[str, str]]:
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    return node.scenario_gpus()


def pid(node: SimulatedNode) -> int:
    assert node.daemon is not None and node.daemon.poll() is None, node.log_text()[-4000:]
    return node.daemon.pid


def fds(node: SimulatedNode) -> int:
    return sum(1 for _ in Path(f"/proc/{pid(node)}/fd").iterdir())


# gRPC core's own threads: its event engine's pool grows while it is busy (a storm of kubelet restarts)
# and shrinks in its own time. A leak of ours shows in the others (and a leaked channel or server in fds).
GRPC_CORE_THREADS = frozenset({"event_engine", "lifeguard", "grpc_global_tim"})


def threads(node: SimulatedNode) -> int:
    """The daemon's threads but gRPC core's."""
    return sum(1 for name in thread_names(node) if name not in GRPC_CORE_THREADS)


def thread_names(node: SimulatedNode) -> list[str]:
    """Each thread's name (comm), sorted."""
    names = []
    for task in Path(f"/proc/{pid(node)}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            names.append((task / "comm").read_text().strip())
    return sorted(names)


def fd_kinds(node: SimulatedNode) -> dict[str, int]:
    """What the fds point at, by kind (socket, pipe, anon_inode:[eventpoll], a path...): for messages."""
    kinds: dict[str, int] = {}
    for entry in Path(f"/proc/{pid(node)}/fd").iterdir():
        try:
            target = str(entry.readlink())
        except FileNotFoundError:
            continue
        kind = target.split(":[", 1)[0] if ":[" in target else target
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def rss_kib(node: SimulatedNode) -> int:
    with open(f"/proc/{pid(node)}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def cpu_seconds(node: SimulatedNode) -> float:
    """utime + stime of the whole process (every thread), from /proc/<pid>/stat."""
    with open(f"/proc/{pid(node)}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def settle_counts(node: SimulatedNode, settle: float = 1.0, tries: int = 6) -> tuple[int, int]:
    """(fds, threads) once two readings `settle` apart agree: short-lived helpers have ended."""
    last = (fds(node), threads(node))
    for _ in range(tries):
        time.sleep(settle)
        now = (fds(node), threads(node))
        if now == last:
            return now
        last = now
    return last


def no_more_than(node: SimulatedNode, fds_before: int, threads_before: int, timeout: float = 30.0) -> tuple[int, int]:
    """(fds, threads) once they are back to what they were, waited for: a channel the daemon closed may
    let its socket go a while later on a busy machine. A leak never comes back: it fails at the deadline."""
    deadline = time.monotonic() + timeout
    while (now := (fds(node), threads(node)))[0] > fds_before or now[1] > threads_before:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return now


def stream_balance(node: SimulatedNode) -> int:
    """ListAndWatch streams the daemon opened minus those it closed, from its own log."""
    log = node.log_text()
    return log.count("kubelet opened ListAndWatch") - log.count("ListAndWatch stream closed")


def http_get(node: SimulatedNode, path: str) -> tuple[int, str]:
    return statusclient.fetch(f"unix:{node.status_socket}", path, timeout=5)


def updates(node: SimulatedNode) -> int:
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    return 0 if plugin is None else len(plugin.updates)


def health_is(expected: dict[str, bool]) -> Callable[[FakeKubelet], bool]:
    def check(k: FakeKubelet) -> bool:
        p = k.plugin(GPU_RESOURCE)
        return (
            p is not None
            and p.stream_open
            and set(p.devices) == set(expected)
            and all(p.devices[u].healthy is h for u, h in expected.items())
        )

    return check


def report(text: str) -> None:
    # Shown with -s, or in the captured output of a failing test.
    print(f"[faults] {text}")


# ---------------------------------------------------------------------------
# 1. kubelet restart storm
# ---------------------------------------------------------------------------


def test_kubelet_restart_storm_ends_registered_without_leaks(node: SimulatedNode) -> None:
    start(node)
    fds_before, threads_before = settle_counts(node)
    kinds_before, names_before = fd_kinds(node), thread_names(node)
    registrations_before = node.kubelet.accepted_registrations(GPU_RESOURCE)

    began = time.monotonic()
    for i in range(200):
        node.kubelet.restart()  # no waiting for the daemon to register again
        # Paced to about 20 s, at varying phases of the daemon's rebind and Register.
        time.sleep(0.02 + 0.16 * ((i * 7) % 11) / 10)
    storm_s = time.monotonic() - began
    assert storm_s < 40, f"200 restarts took {storm_s:.1f}s"
    assert node.kubelet.restarts == 200

    ended = time.monotonic()
    # Generous: a Register cut off by a restart may only fail at the daemon's 15 s REGISTER_TIMEOUT.
    wait_until(lambda: node.plugin_socket.exists(), 5.0, "the plugin socket exists (see the burst test)")
    node.kubelet.wait_for(registered_with(8), 40.0)
    back_s = time.monotonic() - ended
    fds_after, threads_after = no_more_than(node, fds_before, threads_before)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.stream_open
    assert sorted(plugin.devices) == sorted(g["uuid"] for g in node.scenario_gpus())
    assert all(d.healthy for d in plugin.devices.values())
    # Exactly one stream open on the daemon's side as well.
    wait_until(lambda: stream_balance(node) == 1, TIMEOUT, f"one open stream (balance {stream_balance(node)})")
    registrations = node.kubelet.accepted_registrations(GPU_RESOURCE) - registrations_before
    report(
        f"restart storm: 200 restarts in {storm_s:.1f}s, registered again {back_s:.1f}s later, "
        f"{registrations} registrations accepted; "
        f"fds {fds_before}->{fds_after}, threads {threads_before}->{threads_after}"
    )
    assert node.plugin_socket.exists()
    assert fds_after <= fds_before, f"fds {kinds_before} -> {fd_kinds(node)}"
    assert threads_after <= threads_before, f"threads {names_before} -> {thread_names(node)}"


# 7,500 restarts: a fixed amount of work, which a busy machine takes several times as long over.
@pytest.mark.timeout(900)
def test_back_to_back_kubelet_restarts_never_strand_the_socket(node: SimulatedNode) -> None:
    # Unpaced bursts hit the window often; 150 of them make a miss very unlikely. The socket, not the
    # registration, is checked: a Register cut off mid-flight may take the daemon's 15 s REGISTER_TIMEOUT.
    start(node)
    for burst in range(150):
        for _ in range(50):
            node.kubelet.restart()
        # A stranded socket never comes back: the deadline only has to be generous.
        deadline = time.monotonic() + 15.0
        while not node.plugin_socket.exists():
            assert time.monotonic() < deadline, (
                f"burst {burst}: the daemon never re-created {node.plugin_socket.name} after the kubelet deleted it"
            )
            time.sleep(0.02)
        time.sleep(0.1)  # whatever the daemon still had queued for this burst


# ---------------------------------------------------------------------------
# 2. NVML faults mid-flight
# ---------------------------------------------------------------------------


def test_gpu_lost_right_before_allocate(node: SimulatedNode) -> None:
    gpus = start(node)
    lost, other = gpus[2]["uuid"], gpus[3]["uuid"]
    node.control.lose(2)
    # The other GPU is untouched, whatever the daemon has seen of the loss yet.
    resp = node.kubelet.allocate(GPU_RESOURCE, [other], timeout=5)
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == other
    # Both at once may still pass (the daemon may not have seen the event yet), or be refused.
    try:
        node.kubelet.allocate(GPU_RESOURCE, [lost, other], timeout=5)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    node.kubelet.wait_for(device_health(lost, healthy=False), TIMEOUT)
    for ids in ([lost], [lost, other]):
        with pytest.raises(grpc.RpcError) as refused:
            node.kubelet.allocate(GPU_RESOURCE, ids, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert lost in (refused.value.details() or "")
    resp = node.kubelet.allocate(GPU_RESOURCE, [other], timeout=5)
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == other
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.healthy_ids == tuple(g["uuid"] for g in gpus if g["uuid"] != lost)


def test_gpu_lost_during_a_rescan(node: SimulatedNode) -> None:
    gpus = start(node)
    lost = gpus[5]["uuid"]
    node.add_gpu(NEW_GPU)
    # At the same moment: the hotplug that rescans, and another GPU falling off the bus.
    node.send_uevent(pci_event("add", "0000:cc:00.0"))
    node.control.lose(5)
    expected = {g["uuid"]: g["uuid"] != lost for g in gpus} | {NEW_UUID: True}
    node.kubelet.wait_for(health_is(expected), TIMEOUT)
    # And it stays so once every rescan is done.
    time.sleep(1.0)
    assert health_is(expected)(node.kubelet._kubelet)


def test_failing_event_wait_does_not_spin_and_recovers(node: SimulatedNode) -> None:
    gpus = start(node)
    node.wait_log("subscribed to NVML events")
    time.sleep(0.5)
    cpu0, t0 = cpu_seconds(node), time.monotonic()
    node.control.wait_error(999, -1)
    time.sleep(5.0)
    cpu1, t1 = cpu_seconds(node), time.monotonic()
    share = (cpu1 - cpu0) / (t1 - t0)
    log = node.wait_log("NVML health events cannot be received")
    failed_waits = log.count("nvmlEventSetWait still failing")
    report(f"wait_error for {t1 - t0:.1f}s: CPU {share:.2%} of one core, {failed_waits} retries logged")
    assert share < 0.05
    # Still served from state meanwhile.
    assert http_get(node, "/healthz")[0] == 200

    node.control.wait_error(0, 0)
    cleared = time.monotonic()
    node.control.xid(6, 79)
    node.kubelet.wait_for(device_health(gpus[6]["uuid"], healthy=False), 40.0)
    report(f"event delivered {time.monotonic() - cleared:.1f}s after the wait error cleared")
    node.wait_log("NVML health events are being received", after=len(log))


def test_nvml_init_failing_at_start_comes_alive_on_bind(node: SimulatedNode) -> None:
    node.scenario.write_text(node.scenario.read_text().replace("init_error 0", "init_error 9"))
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(0), TIMEOUT)
    node.wait_log("Driver Not Loaded")
    node.control.init_error(0)
    bound = time.monotonic()
    node.send_uevent(pci_event("bind", node.scenario_gpus()[0]["bus"], driver="nvidia"))
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    report(f"alive {time.monotonic() - bound:.2f}s after the bind")
    node.wait_log("NVML works again")
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.allocatable == 8
    wait_until(lambda: http_get(node, "/healthz")[0] == 200, TIMEOUT, "/healthz 200")


# ---------------------------------------------------------------------------
# 3. event floods
# ---------------------------------------------------------------------------


def test_udev_and_xid_floods(node: SimulatedNode) -> None:
    gpus = start(node)
    node.wait_log("subscribed to NVML events")
    time.sleep(0.5)
    rss0 = rss_kib(node)
    updates0 = updates(node)
    scans0 = node.log_text().count("GPUs (driver")

    # 10,000 udev messages: a bus id no scenario GPU has, and each GPU's "change".
    buses = ["0000:ee:00.0"] + [g["bus"] for g in gpus]
    began = time.monotonic()
    with node.udev() as sender:
        for i in range(10_000):
            sender.send(pci_event("change", buses[i % len(buses)], driver="nvidia"))
    udev_s = time.monotonic() - began

    # 3,000 XIDs: harmless 13 on every GPU, fatal 79 on GPUs 1 and 4 only.
    fatal = {1, 4}
    began = time.monotonic()
    for i in range(3_000):
        if i % 2:
            node.control.xid(sorted(fatal)[(i // 2) % 2], 79)
        else:
            node.control.xid((i // 2) % 8, 13)
    xid_s = time.monotonic() - began

    expected = {g["uuid"]: i not in fatal for i, g in enumerate(gpus)}
    node.kubelet.wait_for(health_is(expected), 60.0)
    # The daemon has worked through the flood once the udev events are all logged.
    wait_until(lambda: node.log_text().count("udev: change") >= 10_000, 60.0, "10,000 udev events handled")
    time.sleep(1.0)
    rss1 = rss_kib(node)
    sent = updates(node) - updates0
    scans = node.log_text().count("GPUs (driver") - scans0
    report(
        f"floods: 10,000 udev in {udev_s:.1f}s, 3,000 XIDs in {xid_s:.1f}s; {sent} ListAndWatch updates, "
        f"{scans} rescans; RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB"
    )
    assert health_is(expected)(node.kubelet._kubelet)
    # Coalesced: a handful of messages (the two XID 79s, rescans that change nothing send nothing).
    assert sent <= 20
    assert scans < 1_000
    # Bounded: 13,000 events held anywhere would be well over this; allocator slack stays under it.
    assert rss1 - rss0 < 32 * 1024

    healthy = [g["uuid"] for i, g in enumerate(gpus) if i not in fatal]
    resp = node.kubelet.allocate(GPU_RESOURCE, healthy[:2], timeout=5)
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(healthy[:2])
    assert http_get(node, "/healthz") == (200, "ok\n")


# ---------------------------------------------------------------------------
# 4. crash and restart
# ---------------------------------------------------------------------------


def test_sigkill_then_restart_registers_again(node: SimulatedNode) -> None:
    gpus = start(node)
    first = node.kubelet.plugin(GPU_RESOURCE)
    assert first is not None
    node.stop_daemon(signal.SIGKILL)
    # SIGKILL leaves the socket file behind, bound to nobody.
    assert node.plugin_socket.exists()
    node.kubelet.wait_for(lambda k: not registered_with(8)(k), TIMEOUT)

    node.start_daemon()

    def again(k: FakeKubelet) -> bool:
        p = k.plugin(GPU_RESOURCE)
        return p is not None and p.serial > first.serial and registered_with(8)(k)

    node.kubelet.wait_for(again, TIMEOUT)
    assert node.kubelet.accepted_registrations(GPU_RESOURCE) == 2
    node.control.xid(0, 79)
    node.kubelet.wait_for(device_health(gpus[0]["uuid"], healthy=False), TIMEOUT)
    resp = node.kubelet.allocate(GPU_RESOURCE, [gpus[1]["uuid"]], timeout=5)
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == gpus[1]["uuid"]


# ---------------------------------------------------------------------------
# 5. the ListAndWatch client vanishes
# ---------------------------------------------------------------------------


def test_list_and_watch_client_vanishes(node: SimulatedNode) -> None:
    gpus = start(node)
    fds_before, threads_before = settle_counts(node)
    node.kubelet.stop()
    wait_until(lambda: stream_balance(node) == 0, TIMEOUT, "the daemon closed its stream")
    fds_gone, threads_gone = no_more_than(node, fds_before, threads_before)
    report(f"client gone: fds {fds_before}->{fds_gone}, threads {threads_before}->{threads_gone}")
    assert fds_gone <= fds_before and threads_gone <= threads_before

    fresh = KubeletThread(node.plugin_dir)
    node.kubelet = fresh  # the fixture stops it
    fresh.start()
    fresh.wait_for(registered_with(8), TIMEOUT)
    plugin = fresh.plugin(GPU_RESOURCE)
    assert plugin is not None
    # The first message is the whole list, all healthy.
    assert sorted(plugin.updates[0].ids) == sorted(g["uuid"] for g in gpus)
    assert len(plugin.updates[0].healthy_ids) == 8
    fds_after, threads_after = no_more_than(node, fds_before, threads_before)
    report(f"new client: fds {fds_after}, threads {threads_after}")
    assert fds_after <= fds_before and threads_after <= threads_before
