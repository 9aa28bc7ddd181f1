#!/usr/bin/env python3
"""Health beyond NVML's events, timed against the real daemon and the kubelet stand-in:

- **kernel-log xid**: an `NVRM: Xid ... 79` record written to the simulated node's kernel log
  FIFO (/dev/kmsg's format), to the ListAndWatch message that shows the GPU Unhealthy. NVML's
  event for it never fires: this is the path of an Xid that NVML drops. A driver load line after
  each sample is the evidence that heals it for the next one.
- **late node**: `/dev/nvidiaN` removed, then made again, to the message that shows the GPU
  Healthy (inotify on the dev root; no NVML call on the way).
- **xid (NVML)**, for the ratio: the same fault through NVML's event.

Prints p50 and p99 per measure and the kernel log's ratio to NVML's; it asserts nothing.

    python bench/beyond_nvml.py [--samples 50]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from latency import first_update, percentile, unhealthy

from nvplug.testing.kubelet_views import Update
from nvplug.testing.simulated_node import SimulatedNode, device_health, registered_with

TIMEOUT = 15.0
LOAD = "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024"


def bench_kernel_xid(node: SimulatedNode, gpus: list[dict[str, str]], samples: int) -> list[float]:
    out = []
    for i in range(samples):
        gpu = gpus[i % len(gpus)]
        t0 = time.monotonic()
        address = gpu["bus"].lower()[:-2]  # the driver prints no function
        node.kernel_log(f"NVRM: Xid (PCI:{address}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
        out.append(first_update(node, t0, unhealthy(gpu["uuid"])) - t0)
        node.kernel_log(LOAD)
        node.kubelet.wait_for(device_health(gpu["uuid"], healthy=True), TIMEOUT)
    return out


def bench_nvml_xid(node: SimulatedNode, gpus: list[dict[str, str]], samples: int) -> list[float]:
    out = []
    for i in range(samples):
        index = i % len(gpus)
        t0 = time.monotonic()
        node.control.xid(index, 79)
        out.append(first_update(node, t0, unhealthy(gpus[index]["uuid"])) - t0)
        node.kernel_log(LOAD)
        node.kubelet.wait_for(device_health(gpus[index]["uuid"], healthy=True), TIMEOUT)
    return out


def bench_late_node(node: SimulatedNode, gpus: list[dict[str, str]], samples: int) -> list[float]:
    out = []
    for i in range(samples):
        gpu = gpus[i % len(gpus)]
        path = node.dev_root / "dev" / f"nvidia{gpu['minor']}"
        path.unlink()
        node.kubelet.wait_for(device_health(gpu["uuid"], healthy=False), TIMEOUT)
        t0 = time.monotonic()
        path.touch()

        def shows(u: Update, uuid: str = gpu["uuid"]) -> bool:
            return any(d.id == uuid and d.healthy for d in u.devices)

        out.append(first_update(node, t0, shows) - t0)
    return out


def report(name: str, samples: list[float]) -> tuple[float, float]:
    p50, p99 = percentile(samples, 50) * 1000, percentile(samples, 99) * 1000
    print(f"  {name:<22} p50 {p50:7.2f} ms   p99 {p99:7.2f} ms   ({len(samples)} samples)")
    return p50, p99


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nvp-beyond-", dir="/tmp"))
    try:
        with SimulatedNode(root) as node:
            # Re-probes that heal at once, so each sample starts from eight Healthy GPUs.
            node.config.write_text("version: v1\nnvplug:\n  health:\n    reprobeInitialSeconds: 0.02\n")
            gpus = node.scenario_gpus()
            node.kubelet.start()
            node.start_daemon(log_level="warning")
            node.kubelet.wait_for(registered_with(len(gpus)), TIMEOUT)
            print(f"health beyond NVML's events, {len(gpus)} simulated GPUs:")
            kernel = report("kernel-log xid", bench_kernel_xid(node, gpus, args.samples))
            nvml = report("xid (NVML event)", bench_nvml_xid(node, gpus, args.samples))
            report("late node -> Healthy", bench_late_node(node, gpus, args.samples))
            print(f"  kernel log / NVML: p50 x{kernel[0] / nvml[0]:.2f}, p99 x{kernel[1] / nvml[1]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
