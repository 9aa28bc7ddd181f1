#!/usr/bin/env python3
"""Event-to-kubelet latency, restarts, idle cost and memory of the real daemon.

Runs `nvplug run` against the fake NVML library and the kubelet stand-in
(as in the tests), injects events through the real interfaces (the fake's
control socket, udev netlink messages as root, the kubelet stand-in's
restart, deleting our socket) and times each until the stand-in receives the
ListAndWatch message that shows it. Prints figures and their ratio to the
targets; it asserts nothing.

    python bench/latency.py [--samples 50] [--idle-seconds 60]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# The stand-in's client side logs every GOAWAY of a restart at info level otherwise.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from nvplug.status import status_client as statusclient
from nvplug.testing.kubelet_standin import FakeKubelet, Update
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with
from nvplug.testing.udev_sender import UdevSender, pci_event

TIMEOUT = 15.0
# (target, unit, what NVIDIA's plugin does) per measure.
TARGETS = {
    "xid": (2.0, "ms", "1.7 ms"),
    "udev add": (20.0, "ms", "never"),
    "udev remove": (20.0, "ms", "never"),
    "kubelet restart": (10.0, "ms", "6.9 ms"),
    "own socket deleted": (10.0, "ms", "never"),
    "start": (500.0, "ms", "15 ms"),
}


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def first_update(
    node: SimulatedNode, since: float, shows: Callable[[Update], bool], resource: str = GPU_RESOURCE
) -> float:
    """Wait for the first ListAndWatch message of `resource` after `since` that shows the change; its arrival."""

    def arrived(k: FakeKubelet) -> bool:
        p = k.plugin(resource)
        return p is not None and any(u.at >= since and shows(u) for u in p.updates)

    node.kubelet.wait_for(arrived, TIMEOUT)
    plugin = node.kubelet.plugin(resource)
    assert plugin is not None
    return next(u.at for u in plugin.updates if u.at >= since and shows(u))


def unhealthy(uuid: str) -> Callable[[Update], bool]:
    return lambda u: any(d.id == uuid and not d.healthy for d in u.devices)


def count(n: int) -> Callable[[Update], bool]:
    return lambda u: len(u.devices) == n


def bench_xid(node: SimulatedNode, samples: int) -> list[float]:
    uuids = [g["uuid"] for g in node.scenario_gpus()]
    out = []
    for i in range(samples):
        gpu = i % len(uuids)
        t0 = time.monotonic()
        node.control.xid(gpu, 79)
        out.append(first_update(node, t0, unhealthy(uuids[gpu])) - t0)
        # XID 79 waits for evidence of a reset: the operator's word, then the probe it starts.
        body = f'{{"gpu": "{uuids[gpu]}", "operator": "bench"}}'.encode()
        statusclient.fetch(f"unix:{node.status_socket}", "/heal", TIMEOUT, body)
        node.kubelet.wait_for(device_health(uuids[gpu], healthy=True), TIMEOUT)
    return out


def bench_udev(node: SimulatedNode, samples: int) -> tuple[list[float], list[float]]:
    adds, removes = [], []
    with UdevSender() as udev:
        for i in range(samples):
            uuid = f"GPU-bench{i:03d}-0000-4000-8000-000000000000"
            # Domain 0001: clear of the scenario's GPUs.
            bus = f"0001:{i % 256:02x}:{i // 256:02x}.0"
            node.add_gpu(f"uuid={uuid} minor={100 + i % 100} bus={bus} numa=1")
            t0 = time.monotonic()
            udev.send(pci_event("add", bus, driver=None))
            adds.append(first_update(node, t0, count(9)) - t0)
            node.control.remove(uuid)
            t0 = time.monotonic()
            udev.send(pci_event("remove", bus, driver=None))
            removes.append(first_update(node, t0, count(8)) - t0)
            node.kubelet.wait_for(registered_with(8), TIMEOUT)
            # Let the rescan that follows the remove finish before the next add.
            node.wait_log(f"scan {2 * i + 3}: 8 GPUs")
    return adds, removes


def _registered_after(node: SimulatedNode, since: float) -> float:
    def back(k: FakeKubelet) -> bool:
        p = k.plugin(GPU_RESOURCE)
        return p is not None and p.registered_at >= since and len(p.updates) > 0 and p.updates[0].at >= since

    node.kubelet.wait_for(back, TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    return plugin.updates[0].at


def bench_kubelet_restart(node: SimulatedNode, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        node.kubelet.restart()
        # restart() returns once the new kubelet.sock exists.
        t0 = time.monotonic()
        out.append(_registered_after(node, t0) - t0)
    return out


def bench_socket_deleted(node: SimulatedNode, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t0 = time.monotonic()
        node.plugin_socket.unlink()
        out.append(_registered_after(node, t0) - t0)
    return out


def bench_start(node: SimulatedNode, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        node.stop_daemon()
        t0 = time.monotonic()
        node.start_daemon(log_level="info")
        out.append(_registered_after(node, t0) - t0)
    return out


# Threads that gRPC's core starts for itself (its timer, its event engine's pool).
GRPC_THREADS = ("grpc_global_tim", "event_engine", "lifeguard")


def proc_times(pid: int) -> tuple[float, float, int]:
    """CPU seconds of all threads, of gRPC's own threads, and context switches (wake-ups).

    From schedstat, in nanoseconds: /proc's tick counters are too coarse for an idle daemon.
    """
    cpu = grpc_cpu = 0.0
    switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ran = int((task / "schedstat").read_text().split()[0]) / 1e9
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text().splitlines()
        except FileNotFoundError:
            continue  # the thread ended
        cpu += ran
        if name.startswith(GRPC_THREADS):
            grpc_cpu += ran
        switches += sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)
    return cpu, grpc_cpu, switches


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def row(name: str, samples: list[float]) -> None:
    target, unit, nvidia = TARGETS[name]
    ms = [s * 1000 for s in samples]
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    print(
        f"{name:<20} n={len(ms):<4} p50 {p50:8.2f} ms  p99 {p99:8.2f} ms  "
        f"target p99 <= {target:g} {unit} (ratio {p99 / target:5.2f})  NVIDIA: {nvidia}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nvb-", dir="/tmp"))
    try:
        with SimulatedNode(root) as node:
            node.config.write_text(
                "version: v1\nnvplug:\n  health:\n    reprobeInitialSeconds: 0.02\n    reprobeMaxSeconds: 0.02\n"
            )
            node.kubelet.start()
            daemon = node.start_daemon(log_level="info")
            node.kubelet.wait_for(registered_with(8), TIMEOUT)
            pid = daemon.pid

            print(f"idle for {args.idle_seconds:g}s with 8 healthy GPUs ...", flush=True)
            time.sleep(1.0)
            node.control.reset_calls()
            cpu0, grpc0, sw0 = proc_times(pid)
            time.sleep(args.idle_seconds)
            cpu1, grpc1, sw1 = proc_times(pid)
            calls = node.control.calls()
            idle_cpu = (cpu1 - cpu0) / args.idle_seconds * 100
            idle_grpc = (grpc1 - grpc0) / args.idle_seconds * 100
            wakeups = (sw1 - sw0) / args.idle_seconds
            rss_idle = rss_mib(pid)

            row("xid", bench_xid(node, args.samples))
            if os.geteuid() == 0:
                adds, removes = bench_udev(node, args.samples)
                row("udev add", adds)
                row("udev remove", removes)
            else:
                print("udev add/remove: skipped (sending udev netlink messages needs root)")
            row("kubelet restart", bench_kubelet_restart(node, args.samples))
            row("own socket deleted", bench_socket_deleted(node, args.samples))
            rss_busy = rss_mib(pid)
            row("start", bench_start(node, max(5, args.samples // 10)))

            print(
                f"{'idle CPU':<20} {idle_cpu:.4f} % over {args.idle_seconds:g}s  "
                f"target <= 0.05 % (ratio {idle_cpu / 0.05:5.2f})  NVIDIA: 0.07 %"
            )
            print(f"{'  of which gRPC core':<20} {idle_grpc:.4f} %, nvplug's own threads {idle_cpu - idle_grpc:.4f} %")
            print(f"{'idle wake-ups':<20} {wakeups:.2f} per second (context switches, all threads)")
            others = {k: v for k, v in calls.items() if k != "nvmlEventSetWait_v2"}
            print(
                f"{'idle NVML calls':<20} nvmlEventSetWait_v2: {calls.get('nvmlEventSetWait_v2', 0)}, "
                f"any other: {sum(others.values())} {others or ''}"
            )
            print(
                f"{'RSS':<20} {rss_idle:.1f} MiB idle, {rss_busy:.1f} MiB after the runs  "
                f"target <= 55 MB (ratio {rss_busy / 55:5.2f})  NVIDIA: 25 MB"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
