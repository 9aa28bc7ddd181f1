#!/usr/bin/env python3
"""Request costs against the number of advertised devices: 8 GPUs time-sliced to 8, 1,024 and 8,192 devices.

For each size, on the real daemon through the real gRPC socket (the kubelet stand-in
times each call): Allocate of one replica, GetPreferredAllocation with half the devices
available (sizes 1 to 4), XID -> every replica of that GPU Unhealthy at the kubelet,
the ListAndWatch message's size, and the daemon's RSS. Every figure is also given as a
ratio to the 8-device figure of the same run. Then the kubelet's 4 MiB message limit:
the largest list nvplug would send, found on a 64-GPU node. Asserts nothing.

    python bench/scale.py [--samples 300]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from latency import OWN_XID, percentile, rss_mib, timed  # bench/ is on the path of a script run from it

from nvplug.kubelet.device_plugin import MAX_MESSAGE, device_size
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health

Check = Callable[[FakeKubelet], bool]

TIMEOUT = 30.0
SIZES = (1, 128, 1024)  # replicas per GPU: 8, 1,024 and 8,192 devices
# NVIDIA v0.20.0 on this kind of machine (the table), at 8,192 devices.
NVIDIA_PREFERRED_P99_MS = 20.7


def sharing(replicas: int) -> str:
    if replicas == 1:
        return "version: v1\n"
    entry = f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n"
    return "version: v1\nsharing:\n  timeSlicing:\n    resources:\n" + entry


def measure(root: Path, replicas: int, samples: int) -> dict[str, float]:
    with SimulatedNode(root) as node:
        node.config.write_text(sharing(replicas))
        node.kubelet.start()
        daemon = node.start_daemon(log_level="warning")
        devices = 8 * replicas
        node.kubelet.wait_for(lambda k: (p := k.plugin(GPU_RESOURCE)) is not None and p.capacity == devices, TIMEOUT)
        plugin = node.kubelet.plugin(GPU_RESOURCE)
        assert plugin is not None
        ids = list(plugin.devices)
        rng = random.Random(1)
        allocate = []
        for _ in range(samples):
            t0 = time.perf_counter()
            node.kubelet.allocate(GPU_RESOURCE, [rng.choice(ids)])
            allocate.append(time.perf_counter() - t0)
        preferred = []
        for i in range(samples):
            available = rng.sample(ids, len(ids) // 2) if len(ids) > 8 else ids
            t0 = time.perf_counter()
            node.kubelet.preferred_allocation(GPU_RESOURCE, available, [], 1 + i % 4)
            preferred.append(time.perf_counter() - t0)
        xid: list[float] = []
        own: list[float] = []
        gpus = node.scenario_gpus()
        for n, gpu in enumerate(gpus):  # once per GPU: each stays Unhealthy (an XID 79 needs a reset)
            uuid = gpu["uuid"]
            check = device_health(f"{uuid}::{replicas - 1}" if replicas > 1 else uuid, healthy=False)

            def one(n: int = n, uuid: str = uuid, check: Check = check) -> float:
                t0 = time.monotonic()
                node.control.xid(n, 79)
                node.kubelet.wait_for(check, TIMEOUT)
                arrived = node.kubelet.plugin(GPU_RESOURCE)
                assert arrived is not None
                at = next(u.at for u in arrived.updates if u.at >= t0 and not any(
                    d.healthy for d in u.devices if d.id.startswith(uuid)))  # fmt: skip
                return at - t0

            xid.append(timed(node, OWN_XID, own, one))
        last = node.kubelet.plugin(GPU_RESOURCE)
        assert last is not None
        rss = rss_mib(daemon.pid)
        node.stop_daemon()
    ms = {name: [v * 1000 for v in values] for name, values in
          (("allocate", allocate), ("preferred", preferred), ("xid", xid), ("own", own))}  # fmt: skip
    return {
        "devices": devices,
        "allocate p50": percentile(ms["allocate"], 50),
        "allocate p99": percentile(ms["allocate"], 99),
        "preferred p50": percentile(ms["preferred"], 50),
        "preferred p99": percentile(ms["preferred"], 99),
        "xid p50": percentile(ms["xid"], 50),
        "xid max": max(ms["xid"]),
        "  own p50": percentile(ms["own"], 50),
        "list MiB": sum(device_size(d.id, d.health, (d.numa_nodes or (None,))[0]) for d in last.devices.values())
        / (1 << 20),
        "rss MiB": rss,
    }


def boundary() -> tuple[int, int]:
    """How many replicas of real (40-character) UUIDs fit the kubelet's 4 MiB, by nvplug's own count."""
    uuid = "GPU-5eb1a1d2-0c1e-4b7a-9e36-3d0c2a1f9b08"
    size = sum(device_size(f"{uuid}::{r}", "Healthy", 1) for r in range(1024))
    return MAX_MESSAGE * 1024 // size, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nvp-scale-", dir="/tmp"))
    try:
        rows = [measure(root / str(r), r, args.samples) for r in SIZES]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = rows[0]
    names = [
        "allocate p50",
        "allocate p99",
        "preferred p50",
        "preferred p99",
        "xid p50",
        "xid max",
        "  own p50",
        "list MiB",
        "rss MiB",
    ]
    print(f"{'measure (ms, MiB)':<18}" + "".join(f"{int(r['devices']):>22,}" for r in rows))
    for name in names:
        cells = "".join(f"{r[name]:>12.2f} (x{r[name] / base[name]:5.2f})" for r in rows)
        print(f"{name:<18}{cells}")
    big = rows[-1]
    print("targets at 8,192 devices:")
    print(f"  Allocate p99 <= 1.2 x 8-device p99: ratio {big['allocate p99'] / base['allocate p99']:.2f}")
    print(f"  XID -> ListAndWatch p50 <= 4 ms: {big['xid p50']:.2f} ms (ratio {big['xid p50'] / 4:.2f}), "
          f"the daemon's own part {big['  own p50']:.2f} ms")  # fmt: skip
    half = NVIDIA_PREFERRED_P99_MS / 2
    print(f"  GetPreferredAllocation p99 <= {half:.2f} ms (half NVIDIA's): {big['preferred p99']:.2f} ms "
          f"(ratio {big['preferred p99'] / half:.2f})")  # fmt: skip
    print(f"  RSS <= 8-device RSS + 10 MB: +{big['rss MiB'] - base['rss MiB']:.1f} MiB")
    devices, per_gpu = boundary()
    print(f"4 MiB limit: a GPU's 1,024 replicas (40-character UUIDs) encode to {per_gpu:,} bytes, so "
          f"{devices:,} devices fit in the kubelet's {MAX_MESSAGE:,}; the config's most, 64 GPUs x 1,024 "
          f"replicas, is {64 * per_gpu:,} bytes: longer IDs pass it (tests/test_scale.py finds it)")  # fmt: skip


if __name__ == "__main__":
    main()
