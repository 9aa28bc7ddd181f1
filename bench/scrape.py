#!/usr/bin/env python3
"""What a Prometheus scrape of GPU telemetry costs the real daemon.

Runs `nvplug run` on the simulated 8-GPU node (fake NVML through the real pynvml) and scrapes /metrics on
its status socket, each scrape a second apart so that each reads every GPU afresh:
- with no process on any GPU, and with `--processes` on each, each GPU its own (real `sleep`s, each in a
  kubelet-shaped pod cgroup with the kubelet's log records where this machine lets us make cgroups, each
  with a utilization sample per scrape), the two kinds taken in turn: p50 and p99 of each, and their
  ratio (targets: p99 <= 20 ms, <= 2x the first), after a first scrape with the processes, timed on its
  own (each process is new to the daemon then);
- the daemon's CPU over windows of `--idle-seconds` with no scrape and with a scrape every 15 s (target:
  <= 0.1 % of one core), `--idle-rounds` of each in turn, and the difference: the scrapes' own share; over
  the same windows, the CPU of bench/bare_plugin.py (a plugin on grpc.aio that does nothing) on a stand-in
  of its own: gRPC core's idle floor on this machine at that time, which moves with the machine's load from
  window to window (medians are printed, and each window);
- the XID to kubelet list latency (bench/latency.py's) over `--xids` XIDs, with no scrape and then with a
  scrape every second, in one run: no NVML call runs on the loop, so the two should not differ;
- scrapes with a driver that takes `--driver-ms` a GPU's read, as a real GPU's does (the fake's latency,
  spread over a read's calls): the scrape, the pass, how many threads shared it, and what the reads would
  take one after the other.

    python bench/scrape.py [--scrapes 30] [--processes 64] [--idle-seconds 30] [--idle-rounds 4] [--xids 100]
                           [--driver-ms 10]

It prints figures and ratios; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import bare_plugin as bare
import latency

from nvplug.status import status_client
from nvplug.testing.fakenvml_devices import GpuProcess
from nvplug.testing.pod_cgroups import CgroupsUnavailable, PodCgroups
from nvplug.testing.simulated_node import SimulatedNode, registered_with

TIMEOUT = 20.0


@contextlib.contextmanager
def serving() -> Iterator[SimulatedNode]:
    root = Path(tempfile.mkdtemp(prefix="nvs-", dir="/tmp"))
    try:
        with SimulatedNode(root) as node:
            node.build_library()
            node.kubelet.start()
            node.start_daemon(log_level="info")
            node.kubelet.wait_for(registered_with(8), TIMEOUT)
            yield node
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def bare_plugin() -> Iterator[int]:
    """bench/bare_plugin.py registered with a stand-in of its own, in a network namespace of its own: its PID."""
    root = Path(tempfile.mkdtemp(prefix="nvb-", dir="/tmp"))
    try:
        with SimulatedNode(root) as node, bare.serving(node, TIMEOUT) as pid:
            yield pid
    finally:
        shutil.rmtree(root, ignore_errors=True)


def scrape(node: SimulatedNode) -> tuple[float, int]:
    began = time.perf_counter()
    code, body = status_client.fetch(f"unix:{node.status_socket}", "/metrics", timeout=5)
    took = (time.perf_counter() - began) * 1000
    if code != 200:
        raise SystemExit(f"/metrics answered {code}")
    return took, body.count("\n")


def cpu_ns(pid: int) -> int:
    """The CPU time all of a process's threads have run, in ns (schedstat): time stolen from this machine's
    CPUs by others is not in it, where it is in a scrape's wall time."""
    return round(latency.proc_times(pid)[0] * 1e9)


class Timed(NamedTuple):
    wall_ms: dict[bool, list[float]]  # by busy
    cpu_ms: dict[bool, list[float]]  # the daemon's, during the scrape
    lines: dict[bool, int]


def timed(node: SimulatedNode, scrapes: int, pids: list[list[int]]) -> Timed:
    """Scrapes with no process on any GPU and with `pids[gpu]` on each, taken in turn: a busy spell of the
    machine slows both alike, so their ratio is the scrape's own."""
    assert node.daemon is not None
    out = Timed({False: [], True: []}, {False: [], True: []}, {})
    for _ in range(scrapes):
        for busy in (False, True):
            load(node, pids if busy else [[] for _ in pids])
            before = cpu_ns(node.daemon.pid)
            took, out.lines[busy] = scrape(node)
            out.cpu_ms[busy].append((cpu_ns(node.daemon.pid) - before) / 1e6)
            out.wall_ms[busy].append(took)
    return out


def load(node: SimulatedNode, pids: list[list[int]]) -> None:
    """`pids[gpu]` on each GPU, each with a busy window since the last read, then past the once-a-second
    bound: the next scrape reads every GPU."""
    for gpu, on in enumerate(pids):
        node.control.procs(gpu, [GpuProcess(pid, 512) for pid in on])
        if on:
            node.control.samples(gpu, [(pid, 30, 10) for pid in on])
    time.sleep(1.05)


def report(what: str, times: list[float], lines: int) -> float:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    print(f"{what}: p50 {statistics.median(ordered):.1f} ms, p99 {p99:.1f} ms, {lines} lines")
    return p99


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrapes", type=int, default=50, help="of each kind")
    parser.add_argument("--processes", type=int, default=64)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--idle-rounds", type=int, default=4)
    parser.add_argument("--xids", type=int, default=100)
    parser.add_argument("--driver-ms", type=float, default=10.0, help="a GPU's read on a slow driver; 0: skip")
    args = parser.parse_args()
    with serving() as node:
        scrape(node)  # the first read of each GPU, and the reader's threads
        cgroups = None
        try:
            cgroups = PodCgroups(node.pod_log_root)
            pids = [[cgroups.start("bench", f"pod-{g}-{i}").pid for i in range(args.processes)] for g in range(8)]
            placed = "in pod cgroups"
        except CgroupsUnavailable as err:
            print(f"(no pod cgroups here: {err}; host PIDs instead)", file=sys.stderr)
            pids = [list(range(100000 + g * args.processes, 100000 + (g + 1) * args.processes)) for g in range(8)]
            placed = "not in pods"
        try:
            load(node, pids)  # each process placed, and its series' labels made, for the first time
            first, _ = scrape(node)
            got = timed(node, args.scrapes, pids)
        finally:
            if cgroups is not None:
                cgroups.close()
        p99_bare = report("8 GPUs, no processes", got.wall_ms[False], got.lines[False])
        p99_busy = report(f"8 GPUs, {args.processes} processes each ({placed})", got.wall_ms[True], got.lines[True])
        print(f"the first scrape with them (each process new to the daemon): {first:.1f} ms")
        part = telemetry_status(node)
        print(f"the last pass: a GPU's read {part['read_ms']:.2f} ms, {part['lanes']} thread(s)")
        p50_ratio = statistics.median(got.wall_ms[True]) / statistics.median(got.wall_ms[False])
        print(f"p99 with processes: {p99_busy:.1f} ms, target <= 20 ms: ratio {p99_busy / 20:.2f}")
        print(f"p99 with / without: {p99_busy / p99_bare:.2f}x, target <= 2x: ratio {p99_busy / p99_bare / 2:.2f}")
        print(f"p50 with / without: {p50_ratio:.2f}x")
        cpu = {busy: statistics.median(got.cpu_ms[busy]) for busy in (False, True)}
        print(
            f"the daemon's CPU a scrape, p50: {cpu[False]:.1f} ms with no processes, {cpu[True]:.1f} ms with them: "
            f"{cpu[True] / cpu[False]:.2f}x"
        )
        for gpu in range(8):
            node.control.procs(gpu, [])
        assert node.daemon is not None
        with bare_plugin() as floor_pid:
            watched = (node.daemon.pid, floor_pid)
            rounds = [
                {each: idle_share(node, watched, args.idle_seconds, each) for each in (False, True)}
                for _ in range(args.idle_rounds)
            ]
        quiet, floor = _median_idle([r[False] for r in rounds])
        scraped, floor_scraped = _median_idle([r[True] for r in rounds])
        print(
            f"idle CPU, medians of {args.idle_rounds} windows of {args.idle_seconds:.0f} s each: {quiet.cpu:.3f} % "
            f"of one core with no scrape, {scraped.cpu:.3f} % with a scrape every 15 s (target <= 0.1 %: ratio "
            f"{scraped.cpu / 0.1:.2f}); the scrapes' own share: {scraped.cpu - quiet.cpu:.3f} %; wake-ups "
            f"{quiet.wakeups:.1f} and {scraped.wakeups:.1f} a second"
        )
        print(
            f"a bare grpc.aio plugin over the same windows: {floor.cpu:.3f} % and {floor_scraped.cpu:.3f} %, "
            f"wake-ups {floor.wakeups:.1f} and {floor_scraped.wakeups:.1f} a second; nvplug with a scrape every "
            f"15 s / the bare plugin: {scraped.cpu / floor_scraped.cpu:.2f}x"
        )
        for n, r in enumerate(rounds, 1):
            (q, qb), (s, sb) = r[False], r[True]
            print(
                f"  window pair {n}: nvplug {q.cpu:.3f} / {s.cpu:.3f} %, the bare plugin {qb.cpu:.3f} / {sb.cpu:.3f} % "
                "(no scrape / scraped)"
            )
        if args.xids:
            quiet = xid_latency(node, args.xids, scraping=False)
            busy = xid_latency(node, args.xids, scraping=True)
            print(f"XID to the kubelet's list, scraped every second / not: p50 {busy / quiet:.2f}x (target: 1.00x)")
        if args.driver_ms:
            slow_driver(node, args.driver_ms, args.scrapes)
    return 0


def telemetry_status(node: SimulatedNode) -> dict[str, float]:
    doc = status_client.status(f"unix:{node.status_socket}", timeout=5)
    part: dict[str, float] = doc["GPU telemetry"]
    return part


def slow_driver(node: SimulatedNode, driver_ms: float, scrapes: int) -> None:
    """Scrapes of 8 GPUs whose reads take `driver_ms` each in the driver (a real GPU's: about 10 ms)."""
    node.control.reset_calls()
    time.sleep(1.05)
    scrape(node)
    per_gpu = sum(node.control.calls().values()) / 8
    node.control.latency("*", round(driver_ms * 1000 / per_gpu))
    try:
        walls, passes, lanes, reads = [], [], [], []
        for n in range(scrapes + 2):
            time.sleep(1.05)
            took, _ = scrape(node)
            part = telemetry_status(node)
            if n >= 2:  # past the pass that measured the slow reads, and the one that shared them out
                walls.append(took)
                passes.append(part["last_pass_ms"])
                lanes.append(part["lanes"])
                reads.append(part["read_ms"])
    finally:
        node.control.latency("*", 0)
    read_ms = statistics.median(reads)
    print(
        f"a driver of {driver_ms:.0f} ms a GPU's read ({per_gpu:.0f} calls, measured {read_ms:.1f} ms): scrape "
        f"p50 {statistics.median(walls):.1f} ms; the pass p50 {statistics.median(passes):.1f} ms on "
        f"{statistics.median(lanes):.0f} threads, where one after the other would take {8 * read_ms:.1f} ms: "
        f"{statistics.median(passes) / (8 * read_ms):.2f}x"
    )


class Idle(NamedTuple):
    cpu: float  # % of one core
    wakeups: float  # context switches a second, all threads


def idle_share(node: SimulatedNode, pids: tuple[int, int], seconds: float, scraped: bool) -> tuple[Idle, Idle]:
    """The daemon's idle and the bare plugin's (`pids`) over the same `seconds`, with a scrape of the
    daemon every 15 s from the start or none."""
    before, began = [latency.proc_times(pid) for pid in pids], time.monotonic()
    while (left := seconds - (time.monotonic() - began)) > 0:
        if scraped:
            scrape(node)
        time.sleep(min(15.0, max(0.0, left)))
    took = time.monotonic() - began
    after = [latency.proc_times(pid) for pid in pids]
    daemon, bare = (Idle((a[0] - b[0]) / took * 100, (a[2] - b[2]) / took) for a, b in zip(after, before, strict=True))
    return daemon, bare


def _median_idle(windows: list[tuple[Idle, Idle]]) -> tuple[Idle, Idle]:
    """The median of each figure over the windows, the daemon's and the bare plugin's."""
    return (
        Idle(statistics.median(w[0].cpu for w in windows), statistics.median(w[0].wakeups for w in windows)),
        Idle(statistics.median(w[1].cpu for w in windows), statistics.median(w[1].wakeups for w in windows)),
    )


def xid_latency(node: SimulatedNode, samples: int, scraping: bool) -> float:
    """The p50 of nvplug's own part of XID to list, with a scrape every second meanwhile or none."""
    stop = threading.Event()

    def scraper() -> None:
        while not stop.wait(1.0):
            scrape(node)

    thread = threading.Thread(target=scraper, daemon=True)
    if scraping:
        thread.start()
    try:
        total, own = latency.bench_xid(node, samples)
    finally:
        stop.set()
        if scraping:
            thread.join()
    figures = own or total
    p50 = statistics.median(figures) * 1000
    what = "with a scrape every second" if scraping else "no scrape"
    print(f"XID to the kubelet's list, {what}: p50 {p50:.2f} ms (nvplug's own part), {len(figures)} samples")
    return p50


if __name__ == "__main__":
    raise SystemExit(main())
