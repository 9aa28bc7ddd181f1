"""From a socket bound in the device-plugin directory to its event at the bus: the kubelet dir watch alone.

The watch runs as the daemon runs it (`KubeletDirWatch`, real inotify, in this process), idle otherwise.
A new kubelet.sock is the first step of every re-registration, so this is the part of a kubelet restart
that is inotify's and watchdog's.

    .venv/bin/python bench/dir_watch.py [--samples 300]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import tempfile
import threading
import time
from pathlib import Path

from nvplug.core.events import Event, KubeletSocketCreated
from nvplug.sources.kubelet_dir_watch import KubeletDirWatch


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nvb-", dir="/tmp") as scratch:
        plugin_dir = Path(scratch)
        kubelet_socket = plugin_dir / "kubelet.sock"
        told: list[float] = []
        arrived = threading.Event()

        def publish(event: Event) -> None:
            if isinstance(event, KubeletSocketCreated):
                told.append(time.monotonic())
                arrived.set()

        watch = KubeletDirWatch(plugin_dir, [plugin_dir / "nvplug-nvidia.com-gpu.sock"], publish)
        watch.start()
        took: list[float] = []
        try:
            for _ in range(args.samples):
                arrived.clear()
                told.clear()
                with socket.socket(socket.AF_UNIX) as kubelet:
                    bound = time.monotonic()
                    kubelet.bind(str(kubelet_socket))
                    if not arrived.wait(5):
                        raise SystemExit("no event for kubelet.sock within 5 s")
                    took.append((told[0] - bound) * 1000)
                kubelet_socket.unlink()
                time.sleep(0.003)
        finally:
            asyncio.run(watch.stop())
    print(
        f"{'kubelet.sock bound -> bus':<28} n={len(took)}  p50 {percentile(took, 50):6.3f} ms  "
        f"p99 {percentile(took, 99):6.3f} ms  max {max(took):6.3f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
