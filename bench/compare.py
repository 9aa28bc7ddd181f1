#!/usr/bin/env python3
"""XID and kubelet restart, this tree's daemon beside another tree's, sample by sample.

Two simulated 8-GPU nodes, each with its own kubelet stand-in, one daemon from this checkout and one
from `--against` (another checkout of nvplug, e.g. `git worktree add /tmp/before <commit>`). The
samples alternate between the two, the order flipped every pair, so that a busy second on this
machine falls on both alike: the ratios are of one run, as bench/README.md asks. Measured as
bench/latency.py measures them; it asserts nothing.

With `--bare` instead, the other side is bench/bare_plugin.py, a plugin that does nothing but what a
kubelet restart asks: the restart alone is compared, against the floor that gRPC between two Python
processes and the stand-in set.

    .venv/bin/python bench/compare.py --against /tmp/before [--samples 300]
    .venv/bin/python bench/compare.py --bare [--samples 300]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import bare_plugin
from latency import TIMEOUT, RestartFigures, percentile, scratch, xid_and_heal

from nvplug.testing.simulated_node import SimulatedNode, registered_with

HERE = Path(__file__).resolve().parent.parent
CONFIG = "version: v1\nnvplug:\n  health:\n    reprobeInitialSeconds: 0.02\n    reprobeMaxSeconds: 0.02\n"


class Side:
    """One daemon, its node, and what was measured of it."""

    def __init__(self, name: str, tree: Path, node: SimulatedNode) -> None:
        self.name = name
        self.tree = tree
        self.node = node
        self.uuids: list[str] = []
        self.xid: list[float] = []
        self.xid_own: list[float] = []
        self.restart = RestartFigures()

    def start(self) -> None:
        self.node.config.write_text(CONFIG)
        self.node.kubelet.start()
        # The tree on PYTHONPATH decides which nvplug runs: the working directory is neither tree.
        self.node.start_daemon(log_level="info", env={"PYTHONPATH": str(self.tree)})
        self.node.kubelet.wait_for(registered_with(8), TIMEOUT)
        self.uuids = [g["uuid"] for g in self.node.scenario_gpus()]

    def xid_sample(self, i: int) -> None:
        self.xid.append(xid_and_heal(self.node, self.uuids, i, self.xid_own))

    def restart_sample(self, i: int) -> None:
        self.restart.sample(self.node)

    def figures(self) -> dict[str, list[float]]:
        """By measure, in milliseconds."""
        r = self.restart
        rows = {
            "xid": self.xid,
            "  xid, own part": self.xid_own,
            "kubelet restart": r.total,
            "  restart, own part": r.own,
            "  to Register": r.to_register,
            "  its dial-back": r.dial_back,
        }
        return {measure: [s * 1000 for s in samples] for measure, samples in rows.items()}


class BareSide(Side):
    """bench/bare_plugin.py on its node's stand-in: kubelet restarts only, and no own part to read."""

    def __init__(self, node: SimulatedNode, stack: ExitStack) -> None:
        super().__init__("bare plugin", HERE, node)
        self._stack = stack

    def start(self) -> None:
        self._stack.enter_context(bare_plugin.serving(self.node, TIMEOUT))

    def restart_sample(self, i: int) -> None:
        self.restart.sample(self.node, own=False)


def alternate(sides: tuple[Side, Side], samples: int, step: Callable[[Side, int], None]) -> None:
    for i in range(samples):
        for side in sides if i % 2 == 0 else sides[::-1]:
            step(side, i)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    against = parser.add_mutually_exclusive_group(required=True)
    against.add_argument("--against", type=Path, help="another checkout of nvplug")
    against.add_argument("--bare", action="store_true", help="bench/bare_plugin.py, for the kubelet restart")
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    other = None if args.bare else args.against.resolve()
    if other is not None and not (other / "nvplug" / "__main__.py").is_file():
        parser.error(f"{other} is not a checkout of nvplug (no nvplug/__main__.py)")
    with ExitStack() as stack:
        roots = [stack.enter_context(scratch(f"nvc{n}-")) for n in range(2)]
        os.chdir(roots[0])
        nodes = [stack.enter_context(SimulatedNode(root)) for root in roots]
        sides = (
            Side("this tree", HERE, nodes[0]),
            BareSide(nodes[1], stack) if other is None else Side(other.name, other, nodes[1]),
        )
        for side in sides:
            side.start()
        time.sleep(1.0)
        if other is not None:  # the bare plugin has no NVML behind it
            alternate(sides, args.samples, lambda side, i: side.xid_sample(i))
        alternate(sides, args.samples, lambda side, i: side.restart_sample(i))
    ours, theirs = (side.figures() for side in sides)
    print(f"{'':<20} {sides[0].name + ' p50 / p99':>22} {sides[1].name + ' p50 / p99':>26}   ratio p50 / p99")
    for measure, mine in ours.items():
        base = theirs.get(measure, [])
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
