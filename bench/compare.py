#!/usr/bin/env python3
"""XID and kubelet restart, this tree's daemon beside another tree's, sample by sample.

Two simulated 8-GPU nodes, each with its own kubelet stand-in, one daemon from this checkout and one
from `--against` (another checkout of nvplug, e.g. `git worktree add /tmp/before <commit>`). The
samples alternate between the two, the order flipped every pair, so that a busy second on this
machine falls on both alike: the ratios are of one run, as bench/README.md asks. Measured as
bench/latency.py measures them; it asserts nothing.

    .venv/bin/python bench/compare.py --against /tmp/before [--samples 300]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from latency import (
    OWN_REJOIN,
    OWN_XID,
    TIMEOUT,
    _registered_after,
    first_update,
    heal,
    new_kubelet,
    percentile,
    scratch,
    timed,
    unhealthy,
)

from nvplug.testing.simulated_node import SimulatedNode, device_health, registered_with

HERE = Path(__file__).resolve().parent.parent
CONFIG = "version: v1\nnvplug:\n  health:\n    reprobeInitialSeconds: 0.02\n    reprobeMaxSeconds: 0.02\n"


class Side:
    """One daemon, its node, and what was measured of it."""

    def __init__(self, name: str, tree: Path, node: SimulatedNode) -> None:
        self.name = name
        self.tree = tree
        self.node = node
        self.uuids: list[str] = []
        self.figures: dict[str, list[float]] = {}

    def start(self) -> None:
        self.node.config.write_text(CONFIG)
        self.node.kubelet.start()
        # The tree on PYTHONPATH decides which nvplug runs: the working directory is neither tree.
        self.node.start_daemon(log_level="info", env={"PYTHONPATH": str(self.tree)})
        self.node.kubelet.wait_for(registered_with(8), TIMEOUT)
        self.uuids = [g["uuid"] for g in self.node.scenario_gpus()]

    def record(self, measure: str, seconds: float) -> None:
        self.figures.setdefault(measure, []).append(seconds * 1000)

    def xid(self, i: int) -> None:
        uuid, own = self.uuids[i % len(self.uuids)], []

        def measure() -> float:
            t0 = time.monotonic()
            self.node.control.xid(i % len(self.uuids), 79)
            return first_update(self.node, t0, unhealthy(uuid)) - t0

        self.record("xid", timed(self.node, OWN_XID, own, measure))
        for seconds in own:
            self.record("  xid, own part", seconds)
        heal(self.node, uuid)
        self.node.kubelet.wait_for(device_health(uuid, healthy=True), TIMEOUT)

    def restart(self, i: int) -> None:
        own: list[float] = []

        def measure() -> float:
            t0 = new_kubelet(self.node)
            return _registered_after(self.node, t0) - t0

        self.record("kubelet restart", timed(self.node, OWN_REJOIN, own, measure))
        for seconds in own:
            self.record("  restart, own part", seconds)


def alternate(sides: tuple[Side, Side], samples: int, step: Callable[[Side, int], None]) -> None:
    for i in range(samples):
        for side in sides if i % 2 == 0 else sides[::-1]:
            step(side, i)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, required=True, help="another checkout of nvplug")
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    other = args.against.resolve()
    if not (other / "nvplug" / "__main__.py").is_file():
        parser.error(f"{other} is not a checkout of nvplug (no nvplug/__main__.py)")
    with ExitStack() as stack:
        roots = [stack.enter_context(scratch(f"nvc{n}-")) for n in range(2)]
        os.chdir(roots[0])
        sides = (
            Side("this tree", HERE, stack.enter_context(SimulatedNode(roots[0]))),
            Side(f"{other.name}", other, stack.enter_context(SimulatedNode(roots[1]))),
        )
        for side in sides:
            side.start()
        time.sleep(1.0)
        alternate(sides, args.samples, Side.xid)
        alternate(sides, args.samples, Side.restart)
    ours, theirs = sides
    print(f"{'':<20} {ours.name + ' p50 / p99':>22} {theirs.name + ' p50 / p99':>26}   ratio p50 / p99")
    for measure, mine in ours.figures.items():
        base = theirs.figures.get(measure, [])
        if not mine or not base:
            continue
        a50, a99, b50, b99 = (percentile(s, p) for s in (mine, base) for p in (50, 99))
        print(
            f"{measure:<20} {a50:9.2f} / {a99:6.2f} ms {b50:13.2f} / {b99:6.2f} ms"
            f"   {a50 / b50:5.2f} / {a99 / b99:5.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
