#!/usr/bin/env python3
"""The kubelet's directory removed and made again, to registered at the kubelet stand-in.

Runs `nvplug run` against the fake NVML library and the kubelet stand-in (as in the tests). Each
round removes the directory with shutil.rmtree under the running stand-in (the device-plugin
directory alone, or the whole kubelet root two levels up, as a reinstall that wipes /var/lib/kubelet
does), leaves it gone for a while (so that the daemon's bind is at varying points of its backoff),
makes it again (mkdir -p) and restarts the stand-in, which deletes every socket there and makes
kubelet.sock. It times the directory made again to the Register the stand-in accepts and to its
first ListAndWatch message, and kubelet.sock's creation to that Register. Prints figures and their
ratio to the target; it asserts nothing.

    python bench/dir_remade.py [--samples 20] [--gone-seconds 0.5]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

# The stand-in's client side logs every GOAWAY of a restart at info level otherwise.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.kubelet_thread import KubeletThread
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with, remove_tree

TIMEOUT = 15.0
# The bound: registered again within 1 s of the directory and kubelet.sock being back.
TARGET_MS = 1000.0


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def one_round(kubelet: KubeletThread, plugin_dir: Path, wiped: Path, gone: float) -> tuple[float, float, float]:
    """(made again -> Register accepted, made again -> first list, kubelet.sock -> Register accepted)."""
    # Wiped under the running kubelet, which restarts once its directory is back (a reinstall).
    remove_tree(wiped)
    time.sleep(gone)
    made = time.monotonic()
    plugin_dir.mkdir(parents=True)
    kubelet.restart()
    created = kubelet.socket_created_at
    assert created is not None

    def back(k: FakeKubelet) -> bool:
        fresh = any(r.accepted and r.resource == GPU_RESOURCE and r.received_at >= made for r in k.registrations)
        return fresh and registered_with(8)(k)

    kubelet.wait_for(back, TIMEOUT)
    record = next(r for r in kubelet.registrations if r.accepted and r.received_at >= made)
    plugin = kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.updates
    return record.at - made, plugin.updates[0].at - made, record.at - created


def row(name: str, samples: list[float]) -> None:
    ms = [s * 1000 for s in samples]
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    print(
        f"{name:<56} n={len(ms):<4} p50 {p50:8.2f} ms  p99 {p99:8.2f} ms  max {max(ms):8.2f} ms  "
        f"target p99 <= {TARGET_MS:g} ms (ratio {p99 / TARGET_MS:5.3f})"
    )


def bench(kubelet: KubeletThread, plugin_dir: Path, wiped: Path, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    to_register, to_list, from_socket = [], [], []
    for _ in range(args.samples):
        a, b, c = one_round(kubelet, plugin_dir, wiped, rng.uniform(0.0, args.gone_seconds))
        to_register.append(a)
        to_list.append(b)
        from_socket.append(c)
    what = "device-plugins" if wiped == plugin_dir else f"{wiped.name}/ (2 levels)"
    row(f"{what} made again -> Register accepted", to_register)
    row(f"{what} made again -> first ListAndWatch", to_list)
    row(f"{what}: kubelet.sock -> Register accepted", from_socket)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--gone-seconds", type=float, default=0.5, help="each round, gone for up to this long")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nvb-", dir="/tmp"))
    try:
        with SimulatedNode(root) as node:
            # The kubelet's root, as /var/lib/kubelet: its device-plugin directory two levels down.
            kubelet_root = root / "var-lib-kubelet"
            plugin_dir = kubelet_root / "device-plugins"
            plugin_dir.mkdir(parents=True)
            kubelet = KubeletThread(plugin_dir, pod_resources_socket=node.kubelet.pod_resources.socket_path)
            kubelet.start()
            try:
                node.start_daemon("--device-plugin-dir", str(plugin_dir), log_level="info")
                kubelet.wait_for(registered_with(8), TIMEOUT)
                bench(kubelet, plugin_dir, plugin_dir, args)  # the device-plugin directory alone
                bench(kubelet, plugin_dir, kubelet_root, args)  # the whole root, made again with mkdir -p
            finally:
                kubelet.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
