#!/usr/bin/env python3
"""From a hotplug udev event to the rewritten NFD feature file, on the real daemon.

Runs `nvplug run` against the fake NVML library and the kubelet stand-in (as the
tests do), hot-adds and removes a GPU with real udev netlink messages (root), and
times each event until the feature file says the new GPU count; the ListAndWatch
message of the same event is timed beside it. GFD relabels every 60 s, so its
labels trail a hotplug by 30 s on average: the ratio is printed. Asserts nothing.

    python bench/labels.py [--samples 30]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from latency import count, first_update, percentile  # bench/ is on the path of a script run from it

from nvplug.testing.simulated_node import SimulatedNode, registered_with
from nvplug.testing.udev_sender import pci_event

TIMEOUT = 15.0
GFD_INTERVAL = 60.0  # seconds between GFD's relabels (--sleep-interval)
POLL = 0.0002


def wait_file(path: Path, holds: Callable[[str], bool]) -> float:
    """Poll (every 0.2 ms) until the file's content holds; the time it did."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            if holds(path.read_text()):
                return time.monotonic()
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never held the expected labels")
        time.sleep(POLL)


def run(samples: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="nvp-bench-", dir="/tmp"))
    try:
        with SimulatedNode(root) as node:
            node.features_dir.mkdir()
            node.kubelet.start()
            node.start_daemon(log_level="warning")
            node.kubelet.wait_for(registered_with(8), TIMEOUT)
            wait_file(node.feature_file, lambda t: "nvidia.com/gpu.count=8\n" in t)
            file_add, file_remove, list_add, list_remove = [], [], [], []
            with node.udev() as udev:
                for i in range(samples):
                    uuid = f"GPU-bench{i:03d}-0000-4000-8000-000000000000"
                    bus = f"0001:{i % 256:02x}:{i // 256:02x}.0"
                    node.add_gpu(f'uuid={uuid} name="NVIDIA H100 80GB HBM3" minor={100 + i % 100} bus={bus} numa=1')
                    t0 = time.monotonic()
                    udev.send(pci_event("add", bus, driver=None))
                    file_add.append(wait_file(node.feature_file, lambda t: "nvidia.com/gpu.count=9\n" in t) - t0)
                    list_add.append(first_update(node, t0, count(9)) - t0)
                    node.control.remove(uuid)
                    t0 = time.monotonic()
                    udev.send(pci_event("remove", bus, driver=None))
                    file_remove.append(wait_file(node.feature_file, lambda t: "nvidia.com/gpu.count=8\n" in t) - t0)
                    list_remove.append(first_update(node, t0, count(8)) - t0)
                    node.kubelet.wait_for(registered_with(8), TIMEOUT)
                    # The rescan that follows the remove must end before the next add.
                    time.sleep(0.2)
            node.stop_daemon()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"hotplug udev event -> NFD feature file rewritten, {samples} samples each (ms):")
    print(f"  {'measure':<34} {'p50':>7} {'p99':>7} {'max':>7}")
    rows = {"udev add -> file": file_add, "udev add -> ListAndWatch": list_add,
            "udev remove -> file": file_remove, "udev remove -> ListAndWatch": list_remove}  # fmt: skip
    for name, values in rows.items():
        ms = [v * 1000 for v in values]
        print(f"  {name:<34} {percentile(ms, 50):7.2f} {percentile(ms, 99):7.2f} {max(ms):7.2f}")
    p50 = percentile(file_add + file_remove, 50)
    average = GFD_INTERVAL / 2
    print(f"GFD relabels every {GFD_INTERVAL:.0f} s: a hotplug reaches its labels after {average:.0f} s on average,")
    print(f"  {average / p50:,.0f} times nvplug's p50 ({p50 * 1000:.2f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/labels.py sends udev netlink messages: run it as root")
    run(args.samples)


if __name__ == "__main__":
    main()
