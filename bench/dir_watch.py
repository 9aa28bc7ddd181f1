"""From a socket bound in the device-plugin directory to its event read off the bus on the loop: the watch alone.

The watch runs as the daemon runs it (`KubeletDirWatch`, real inotify read on an event loop, in a thread
of this process), idle otherwise. A new kubelet.sock is the first step of every re-registration, so this
is the part of a kubelet restart that is inotify's.

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

from nvplug.core.events import KubeletSocketCreated
from nvplug.sources.event_bus import EventBus
from nvplug.sources.kubelet_dir_watch import KubeletDirWatch
from nvplug.testing.loop_thread import LoopThread


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    told: list[float] = []
    arrived = threading.Event()

    async def consume(bus: EventBus) -> None:
        while True:
            event, _ = await bus.next()
            if isinstance(event, KubeletSocketCreated):
                told.append(time.monotonic())
                arrived.set()

    with LoopThread(5.0) as on_loop, tempfile.TemporaryDirectory(prefix="nvb-", dir="/tmp") as scratch:
        plugin_dir = Path(scratch)
        kubelet_socket = plugin_dir / "kubelet.sock"

        async def start() -> tuple[KubeletDirWatch, asyncio.Task[None]]:
            # As the daemon wires it: the bus on the loop, the watch started there, a task reading the bus.
            bus = EventBus(asyncio.get_running_loop())
            watch = KubeletDirWatch(plugin_dir, [plugin_dir / "nvplug-nvidia.com-gpu.sock"], bus.publish)
            watch.start()
            return watch, asyncio.create_task(consume(bus))

        watch, consumer = on_loop.run(start())
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
            on_loop.call(consumer.cancel)
            on_loop.run(watch.stop())
    print(
        f"{'kubelet.sock bound -> loop':<28} n={len(took)}  p50 {percentile(took, 50):6.3f} ms  "
        f"p99 {percentile(took, 99):6.3f} ms  max {max(took):6.3f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
