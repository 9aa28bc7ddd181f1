#!/usr/bin/env python3
"""MPS run by the daemon, timed against the stand-in control binary and the kubelet stand-in:

- **group start -> Healthy**: a reload that changes the group's replicas (4 <-> 2) to the first
  ListAndWatch message with all its devices Healthy: the old daemon's `quit`, the compute modes
  kept, the new daemon started with `-f`, its defaults set and read back.
- **crash -> Unhealthy**: the daemon aborts (the stand-in's `fake_crash`) to the first message
  that shows its devices Unhealthy (the child's exit, seen by the loop at once).
- **start -> Healthy**: `nvplug run` to the first message with the MPS devices Healthy, against
  the same for the plain GPUs of that start: what running MPS adds to a start.

Prints p50 and p99 per measure and their ratios to the targets; it asserts nothing.

    python bench/mps.py [--samples 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from latency import first_update, percentile

from nvplug.testing import mps_control_standin as mps
from nvplug.testing.kubelet_views import Update
from nvplug.testing.simulated_node import SimulatedNode

TIMEOUT = 15.0
RESOURCE = "nvidia.com/gpu.mps"
ENTRY = "    - name: nvidia.com/gpu\n      devices: [0, 1]\n      rename: nvidia.com/gpu.mps\n      replicas: {n}\n"
# Targets: a group up within one second of being asked for, its loss seen within 100 ms.
START_TARGET_MS = 1000.0
CRASH_TARGET_MS = 100.0


def all_healthy(count: int) -> Callable[[Update], bool]:
    return lambda u: len(u.devices) == count and all(d.healthy for d in u.devices)


def none_healthy(u: Update) -> bool:
    return bool(u.devices) and not any(d.healthy for d in u.devices)


def bench(node: SimulatedNode, samples: int) -> tuple[list[float], list[float], int]:
    starts, crashes = [], []
    pipe = node.mps_root / "nvidia.com_gpu.mps" / "pipe"
    assert node.daemon is not None
    replicas = 4
    for _ in range(samples):
        t0 = time.monotonic()
        mps.client(pipe, "fake_crash", binary=node.mps_control, timeout=5)
        crashes.append(first_update(node, t0, none_healthy, RESOURCE) - t0)
        # A new config makes a new daemon at once (a crashed one waits out its backoff).
        replicas = 2 if replicas == 4 else 4
        node.config.write_text(node.mps_config(ENTRY.format(n=replicas)))
        t0 = time.monotonic()
        node.daemon.send_signal(signal.SIGHUP)
        starts.append(first_update(node, t0, all_healthy(2 * replicas), RESOURCE) - t0)
    return starts, crashes, replicas


def bench_start(node: SimulatedNode, replicas: int) -> tuple[float, float]:
    """(process start -> plain GPUs Healthy, -> MPS devices Healthy), in seconds."""
    node.stop_daemon()
    node.kubelet.restart()
    t0 = time.monotonic()
    node.start_daemon(log_level="warning")
    plain = first_update(node, t0, all_healthy(6)) - t0
    shared = first_update(node, t0, all_healthy(2 * replicas), RESOURCE) - t0
    return plain, shared


def report(name: str, samples: list[float], target_ms: float) -> None:
    p50, p99 = percentile(samples, 50) * 1000, percentile(samples, 99) * 1000
    print(f"  {name:<24} p50 {p50:8.2f} ms   p99 {p99:8.2f} ms   target {target_ms:6.0f} ms   "
          f"ratio {p99 / target_ms:.2f}   ({len(samples)} samples)")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nvp-mps-", dir="/tmp"))
    try:
        with SimulatedNode(root) as node:
            node.config.write_text(node.mps_config(ENTRY.format(n=4)))
            node.kubelet.start()
            node.start_daemon(log_level="warning")
            node.kubelet.wait_for(lambda k: k.allocatable(RESOURCE) == 8, TIMEOUT)
            print("MPS groups run by nvplug, 2 of 8 simulated GPUs in one group (stand-in control daemon):")
            starts, crashes, replicas = bench(node, args.samples)
            report("group start -> Healthy", starts, START_TARGET_MS)
            report("crash -> Unhealthy", crashes, CRASH_TARGET_MS)
            plain, shared = bench_start(node, replicas)
            print(f"  nvplug start -> Healthy:  plain GPUs {plain * 1000:.1f} ms, MPS devices {shared * 1000:.1f} ms "
                  f"(x{shared / plain:.2f})")  # fmt: skip
            node.stop_daemon()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
