#!/usr/bin/env python3
"""Event-to-kubelet latency, restarts, idle cost and memory of the real daemon.

Runs `nvplug run` against the fake NVML library and the kubelet stand-in
(as in the tests), injects events through the real interfaces (the fake's
control socket, udev netlink messages as root, the kubelet stand-in's
restart, deleting our socket) and times each until the stand-in receives the
ListAndWatch message that shows it. Prints figures and their ratio to the
targets; it asserts nothing.

    python bench/latency.py [--samples 50] [--idle-seconds 60]
    python bench/latency.py --profile xid|restart [--profile-seconds 10]

With --profile, py-spy (`pip install -e '.[bench]'`) samples the daemon at 500 Hz while the
benchmark drives XID-and-heal cycles or kubelet restarts, and the top frames are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# The stand-in's client side logs every GOAWAY of a restart at info level otherwise.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from nvplug.status import status_client as statusclient
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.kubelet_views import Update
from nvplug.testing.process_tree import child_pids
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with
from nvplug.testing.udev_sender import pci_event

TIMEOUT = 15.0
# (target, unit, what NVIDIA's plugin does) per measure.
TARGETS = {
    "xid": (0.93, "ms", "1.55, 0.93 ms"),
    "udev add": (20.0, "ms", "never"),
    "udev remove": (20.0, "ms", "never"),
    "kubelet restart": (4.37, "ms", "7.23, 4.37 ms"),
    "own socket deleted": (10.0, "ms", "never"),
    "start": (500.0, "ms", "15 ms"),
}


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A root for one run's simulated node, removed after it (kept with BENCH_KEEP=1, for its logs)."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield root
    finally:
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(root, ignore_errors=True)


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


def of_gpu(device: str, uuid: str) -> bool:
    """The GPU itself, or one of its time-sliced replicas."""
    return device == uuid or device.startswith(f"{uuid}::")


def unhealthy(uuid: str) -> Callable[[Update], bool]:
    return lambda u: any(of_gpu(d.id, uuid) and not d.healthy for d in u.devices)


def healthy_again(uuid: str) -> Callable[[FakeKubelet], bool]:
    def check(k: FakeKubelet) -> bool:
        p = k.plugin(GPU_RESOURCE)
        return p is not None and all(d.healthy for i, d in p.devices.items() if of_gpu(i, uuid))

    return check


def count(n: int) -> Callable[[Update], bool]:
    return lambda u: len(u.devices) == n


# The daemon's own histograms: from the event's publication on its bus (an XID: in the NVML thread, as
# nvmlEventSetWait returns) to the hand-off of the message to gRPC.
OWN_XID = "nvplug_event_to_list_and_watch_seconds"
OWN_REJOIN = "nvplug_kubelet_rejoin_to_list_and_watch_seconds"


def own_seconds(node: SimulatedNode, metric: str, resource: str = GPU_RESOURCE) -> tuple[float, float]:
    """One of the daemon's own histograms: (sum, count)."""
    _, text = statusclient.fetch(f"unix:{node.status_socket}", "/metrics", TIMEOUT)
    found = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for part in found:
            if line.startswith(f'{metric}_{part}{{resource="{resource}"}}'):
                found[part] = float(line.rsplit(" ", 1)[1])
    return found["sum"], found["count"]


def timed(node: SimulatedNode, metric: str, own: list[float], measure: Callable[[], float]) -> float:
    """`measure`'s end-to-end figure; the daemon's own part of it goes to `own` when one message carried it."""
    total0, count0 = own_seconds(node, metric)
    took = measure()
    total1, count1 = own_seconds(node, metric)
    if count1 == count0 + 1:
        own.append(total1 - total0)
    return took


def xid_and_heal(node: SimulatedNode, uuids: list[str], i: int, own: list[float] | None = None) -> float:
    """XID 79 on GPU `i` (modulo their count), to the first message that shows it (or its replicas)
    Unhealthy: end to end, the control socket to the stand-in's receipt, and the daemon's own part to
    `own` when given. Then the operator's heal, to every device of the GPU Healthy again."""
    gpu = i % len(uuids)

    def xid() -> float:
        t0 = time.monotonic()
        node.control.xid(gpu, 79)
        return first_update(node, t0, unhealthy(uuids[gpu])) - t0

    took = xid() if own is None else timed(node, OWN_XID, own, xid)
    heal(node, uuids[gpu])
    node.kubelet.wait_for(healthy_again(uuids[gpu]), TIMEOUT)
    return took


def bench_xid(node: SimulatedNode, samples: int) -> tuple[list[float], list[float]]:
    """End to end and the daemon's own part of each."""
    uuids = [g["uuid"] for g in node.scenario_gpus()]
    own: list[float] = []
    return [xid_and_heal(node, uuids, i, own) for i in range(samples)], own


def bench_udev(node: SimulatedNode, samples: int) -> tuple[list[float], list[float]]:
    adds, removes = [], []
    with node.udev() as udev:
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


def new_kubelet(node: SimulatedNode) -> float:
    """The stand-in restarted: when its new kubelet.sock was made (just before the bind). nvplug may have
    registered again before restart() returns, so that is no time to measure from."""
    node.kubelet.restart()
    created = node.kubelet.socket_created_at
    assert created is not None
    return created


def _registered_after(node: SimulatedNode, since: float) -> float:
    """When the first message of a registration after `since` arrived: read off the view that showed it,
    since a later registration (a plugin that registers twice) replaces the view with an empty one."""
    arrived: list[float] = []

    def back(k: FakeKubelet) -> bool:
        p = k.plugin(GPU_RESOURCE)
        if p is None or p.registered_at < since or not p.updates or p.updates[0].at < since:
            return False
        arrived.append(p.updates[0].at)
        return True

    node.kubelet.wait_for(back, TIMEOUT)
    return arrived[-1]


@dataclass
class RestartFigures:
    """Per kubelet restart: end to end (the new kubelet.sock to the first message); the daemon's own part
    (from the last of its socket gone and the new kubelet.sock, as its inotify thread saw them, to the
    message's hand-off); and the split at the stand-in: the new kubelet.sock to our Register's arrival,
    and that Register's dial-back (the kubelet dials the plugin and asks its options before it answers)."""

    total: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)
    to_register: list[float] = field(default_factory=list)
    dial_back: list[float] = field(default_factory=list)

    def sample(self, node: SimulatedNode, own: bool = True) -> None:
        """One restart; `own`: read the daemon's own part from its /metrics (a plugin that is no nvplug has none)."""

        def restart() -> float:
            t0 = new_kubelet(node)
            took = _registered_after(node, t0) - t0
            record = next(r for r in reversed(node.kubelet.registrations) if r.accepted)
            self.to_register.append(record.received_at - t0)
            self.dial_back.append(record.at - record.received_at)
            return took

        self.total.append(timed(node, OWN_REJOIN, self.own, restart) if own else restart())


def bench_kubelet_restart(node: SimulatedNode, samples: int) -> RestartFigures:
    figures = RestartFigures()
    for _ in range(samples):
        figures.sample(node)
    return figures


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


def heal(node: SimulatedNode, uuid: str) -> None:
    """XID 79 waits for evidence of a reset: the operator's word, then the probe it starts."""
    body = f'{{"gpu": "{uuid}", "operator": "bench"}}'.encode()
    statusclient.fetch(f"unix:{node.status_socket}", "/heal", TIMEOUT, body)


def xid_cycles(node: SimulatedNode, seconds: float) -> int:
    """XID 79 then the operator's heal, GPU after GPU, for `seconds`: two health changes a cycle."""
    uuids = [g["uuid"] for g in node.scenario_gpus()]
    cycles, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        xid_and_heal(node, uuids, cycles)
        cycles += 1
    return cycles


def restart_cycles(node: SimulatedNode, seconds: float) -> int:
    cycles, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        _registered_after(node, new_kubelet(node))
        cycles += 1
    return cycles


PROFILED: dict[str, Callable[[SimulatedNode, float], int]] = {"xid": xid_cycles, "restart": restart_cycles}
TOP_FRAMES = 25
# Frames where a thread waits, although py-spy saw it run: counted apart, not among the work.
WAITING = ("EpollSelector.select", "Condition.wait", "nvmlEventSetWait")


def profile(node: SimulatedNode, pid: int, what: str, seconds: float, out: Path) -> None:
    """py-spy samples the daemon (without pausing it) while `what` is driven; the top frames, printed."""
    spy_bin = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    spy = subprocess.Popen(
        [spy_bin, "record", "--pid", str(pid), "--rate", "500", "--format", "raw", "--nonblocking",
         "--threads", "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    time.sleep(1.0)  # py-spy attaches
    cycles = PROFILED[what](node, seconds)
    spy.send_signal(signal.SIGINT)
    _, err = spy.communicate(timeout=30)
    if not out.exists():
        print(f"py-spy wrote no profile: {err.decode(errors='replace').strip()}")
        return
    print_profile(out, what, cycles, seconds)


def print_profile(path: Path, what: str, cycles: int, seconds: float) -> None:
    """From py-spy's collapsed stacks: samples per thread, then the frames most often on top and most
    often anywhere in a stack (by function and file, lines merged)."""
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = waiting = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        thread, *frames = stack.split(";")
        names = [f.rsplit(":", 1)[0] + ")" if ":" in f else f for f in frames]
        if names and names[-1].startswith(WAITING):
            waiting += count
            continue
        total += count
        threads[re.sub(r"[-_]\d+", "", thread.partition("): ")[2]) or thread] += count
        if names:
            own[names[-1]] += count
        for name in set(names):
            if "(nvplug/" in name:
                anywhere[name] += count
    print(
        f"profile of {what}: {cycles} cycles in {seconds:g}s; {total} samples of work at 500 Hz "
        f"({total / 500 / seconds * 100:.0f} % of one core), {waiting} more in a wait"
    )
    for title, counts in (
        ("threads", threads),
        ("on top (self)", own),
        ("nvplug's frames in the stack (total)", anywhere),
    ):
        print(f"  {title}:")
        for name, count in counts.most_common(len(threads) if title == "threads" else TOP_FRAMES):
            print(f"    {count / max(total, 1) * 100:5.1f} %  {name}")


# Threads that gRPC's core starts for itself (its timer, its event engine's pool).
GRPC_THREADS = ("grpc_global_tim", "event_engine", "lifeguard")


def proc_times(pid: int) -> tuple[float, float, int]:
    """CPU seconds of all threads, the daemon's children's included, of gRPC's own threads, and context
    switches (wake-ups).

    From schedstat, in nanoseconds: /proc's tick counters are too coarse for an idle daemon.
    """
    cpu = grpc_cpu = 0.0
    switches = 0
    # The daemon's children (its NVML event process) are the daemon's CPU too.
    tasks = [task for one in (pid, *child_pids(pid)) for task in Path(f"/proc/{one}/task").iterdir()]
    for task in tasks:
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


def row(name: str, samples: list[float], target_of: str | None = None) -> None:
    target, unit, nvidia = TARGETS[target_of or name]
    if not samples:
        print(f"{name:<20} n=0    (this daemon does not time it)")
        return
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
    parser.add_argument("--profile", choices=sorted(PROFILED), help="print a sampling profile of this instead")
    parser.add_argument("--profile-seconds", type=float, default=10.0)
    parser.add_argument("--only", action="store_true", help="the XID and kubelet restart measures alone")
    parser.add_argument("--replicas", type=int, default=1, help="time-slice each GPU to this many devices")
    args = parser.parse_args()
    with scratch("nvb-") as root, SimulatedNode(root) as node:
        config = "version: v1\nnvplug:\n  health:\n    reprobeInitialSeconds: 0.02\n    reprobeMaxSeconds: 0.02\n"
        if args.replicas > 1:
            config += f"sharing:\n  timeSlicing:\n    resources:\n    - name: {GPU_RESOURCE}\n"
            config += f"      replicas: {args.replicas}\n"
        node.config.write_text(config)
        node.kubelet.start()
        daemon = node.start_daemon(log_level="info")
        node.kubelet.wait_for(registered_with(8 * args.replicas), TIMEOUT)
        pid = daemon.pid
        if args.profile:
            profile(node, pid, args.profile, args.profile_seconds, root / "profile.txt")
            return 0

        if args.only:
            args.idle_seconds = 0.1
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
        rss_child = sum(rss_mib(child) for child in child_pids(pid))

        xid, own = bench_xid(node, args.samples)
        row("xid", xid)
        row("  own", own, "xid")
        if os.geteuid() == 0 and not args.only:
            adds, removes = bench_udev(node, args.samples)
            row("udev add", adds)
            row("udev remove", removes)
        elif not args.only:
            print("udev add/remove: skipped (sending udev netlink messages needs root)")
        restart = bench_kubelet_restart(node, args.samples)
        row("kubelet restart", restart.total)
        row("  own", restart.own, "kubelet restart")
        row("  to Register", restart.to_register, "kubelet restart")
        row("  its dial-back", restart.dial_back, "kubelet restart")
        if args.only:
            return 0
        row("own socket deleted", bench_socket_deleted(node, args.samples))
        rss_busy = rss_mib(pid)
        row("start", bench_start(node, max(5, args.samples // 10)))

        print(
            f"{'idle CPU':<20} {idle_cpu:.4f} % over {args.idle_seconds:g}s  "
            f"target <= 0.05 % (ratio {idle_cpu / 0.05:5.2f})  NVIDIA: 0.07 %"
        )
        print(
            f"{'  of which gRPC core':<20} {idle_grpc:.4f} %, nvplug's own threads and its NVML event process "
            f"{idle_cpu - idle_grpc:.4f} %"
        )
        print(f"{'idle wake-ups':<20} {wakeups:.2f} per second (context switches, all threads)")
        others = {k: v for k, v in calls.items() if k != "nvmlEventSetWait_v2"}
        print(
            f"{'idle NVML calls':<20} (the daemon's; its event process's wait is its own) "
            f"nvmlEventSetWait_v2: {calls.get('nvmlEventSetWait_v2', 0)}, "
            f"any other: {sum(others.values())} {others or ''}"
        )
        print(
            f"{'RSS':<20} {rss_idle:.1f} MiB idle, {rss_busy:.1f} MiB after the runs  "
            f"target <= 55 MB (ratio {rss_busy / 55:5.2f})  NVIDIA: 25 MB"
        )
        print(f"{'  its event process':<20} {rss_child:.1f} MiB more (an interpreter, its NVML through ctypes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
