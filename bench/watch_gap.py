#!/usr/bin/env python3
"""The NVML event watch's hand-over gap on a rescan that does not hang.

A rescan that counts the GPUs again (a udev add, bind or remove) must drop every reference on NVML's init
count (only a count of zero enumerates GPUs again), so the old watch is handed over first and the new
one subscribes during the scan. The hand-over returns once the count is down, which (as with the
driver) waits for the old watch's wait in progress to return: an event ends it, or its timeout. Between
the hand-over's return and the new watch no event is waited for. This measures that gap: from the
hand-over done to the new watch subscribed to every GPU, and the hand-over's own wait, over `--rescans`
such rescans of the simulated 8-GPU node, with nvplug's own Scanner on the fake NVML library loaded
through the real pynvml.
Then as many rescans that need not count the GPUs (a MIG layout change, a resubscription): they keep the
watch, and the hand-overs they make are counted (0 expected). To compare two trees, run it with each on
PYTHONPATH (a tree without in-session rescans hands over on every one).

    python bench/watch_gap.py [--rescans 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD = "NVPLUG_WATCH_GAP_CHILD"


def child(rescans: int, sysfs_root: Path, proc_root: Path) -> tuple[list[float], list[float], int]:
    from nvplug.sources import nvml_events
    from nvplug.sources.nvml_discovery import Nvml
    from nvplug.sources.nvml_scanner import Scanner

    handed: list[float] = []
    waited: list[float] = []
    subscribed: list[float] = []
    hand_over, start = nvml_events.NvmlEventWatch.hand_over, nvml_events.NvmlEventWatch.start

    def timed_hand_over(self: Any) -> None:
        asked = time.perf_counter()
        hand_over(self)
        handed.append(time.perf_counter())
        waited.append((handed[-1] - asked) * 1000)

    def timed_start(self: Any) -> None:
        start(self)  # returns once every GPU is subscribed
        subscribed.append(time.perf_counter())

    nvml_events.NvmlEventWatch.hand_over = timed_hand_over  # type: ignore[method-assign]
    nvml_events.NvmlEventWatch.start = timed_start  # type: ignore[method-assign]

    kept_handovers = 0

    async def main() -> None:
        nonlocal kept_handovers
        scanner = Scanner(Nvml(sysfs_root, proc_root), lambda event: None)
        for _ in range(rescans + 1):  # the first scan has no watch to hand over
            await scanner.scan()
        before = len(handed)
        for _ in range(rescans):
            try:
                await scanner.scan(recount=False)
            except TypeError:  # a tree where every rescan counts the GPUs again
                await scanner.scan()
        kept_handovers = len(handed) - before
        await scanner.stop()

    asyncio.run(main())
    # Each hand-over is followed by the next scan's subscription.
    counted = handed[:rescans]
    gaps = [(s - h) * 1000 for h, s in zip(counted, subscribed[1:], strict=False)]
    return gaps, waited[:rescans], kept_handovers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rescans", type=int, default=50)
    parser.add_argument("--child", nargs=2, metavar=("SYSFS", "PROC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        gaps, waits, kept_handovers = child(args.rescans, Path(args.child[0]), Path(args.child[1]))
        print(kept_handovers, " ".join(f"{g:.4f}" for g in gaps), "|", " ".join(f"{w:.2f}" for w in waits))
        return 0
    from nvplug.testing.simulated_node import SimulatedNode

    root = Path(tempfile.mkdtemp(prefix="nvg-", dir="/tmp"))
    try:
        with SimulatedNode(root) as node:
            node.build_library()
            # The fake library must be on the loader's path before the process starts: a child of its own.
            env = node.daemon_env() | {CHILD: "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
            argv = [sys.executable, __file__, "--rescans", str(args.rescans), "--child"]
            out = subprocess.run(
                [*argv, str(node.sysfs_root), str(node.proc_root)], env=env, capture_output=True, text=True
            )
            if out.returncode != 0 or not out.stdout.split():
                print(f"the measuring child failed ({out.returncode}):\n{out.stderr[-3000:]}", file=sys.stderr)
                return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    kept, *rest = out.stdout.split()
    bar = rest.index("|")
    gaps, waits = sorted(float(g) for g in rest[:bar]), sorted(float(w) for w in rest[bar + 1 :])
    p95 = gaps[int(0.95 * (len(gaps) - 1))]
    print(
        f"rescans that count the GPUs again: hand-over gap over {len(gaps)} (8 GPUs; below 0: the old watch "
        f"was handed over after the new one subscribed, no gap): median {statistics.median(gaps):.2f} ms, "
        f"p95 {p95:.2f} ms, max {gaps[-1]:.2f} ms"
    )
    print(f"the hand-over itself: median {statistics.median(waits):.1f} ms, max {waits[-1]:.1f} ms")
    print(f"rescans that need not: {kept} hand-overs in {args.rescans} (no gap where 0)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
