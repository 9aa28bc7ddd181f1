#!/usr/bin/env python3
"""The health state file under a storm: 1,000 health changes in about a second on a 64-GPU node.

The storm is NVML recovery-action cycles on 8 GPUs (a fault, then the evidence and the probe that
may heal it: each command a change of the file's content) and XID 79s that stay on others, all through the fake
library's control socket, to the real daemon and the kubelet stand-in. Printed:

- the changes (the daemon's revisions), the state file's writes (renames onto it, as inotify sees
  them) and their ratio to the target of 50;
- whether the file holds, at the end, what the kubelet was last told;
- a second storm cut short by SIGKILL: of the faults the kubelet saw more than the lag bound before
  the kill, how many are Unhealthy after the restart (all, or the bound does not hold).

Asserts nothing.

    python bench/storm.py [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import os
import signal
import time

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from latency import scratch  # bench/ is on the path of a script run from it

from nvplug.sinks.health_state_file import FILE_NAME, LAG_BOUND, decode
from nvplug.testing.health_storm import (
    Churn,
    RenameCounter,
    lag_bound,
    seen_unhealthy,
    storm_status,
    write_scenario,
    xid_faults,
)
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with

TIMEOUT = 30.0
GPUS = 64
FAULTED = range(8, GPUS)
CONFIG = "version: v1\nnvplug:\n  health:\n    reprobeInitialSeconds: 0.02\n    reprobeMaxSeconds: 0.02\n"
TARGET_CHANGES, TARGET_WRITES = 1000, 50


# Two churns of four GPUs, a command every 0.8 ms each: some change nothing (a second fault before
# the probe healed the first), and over 1,000 a second do.
PACE = 0.0008
CHURNS = (range(4), range(4, 8))


def storm(node: SimulatedNode, seconds: float) -> tuple[float, list[int]]:
    """Churn paced for TARGET_CHANGES a second, and faults through it: (seconds taken, the faulted GPUs)."""
    churns = [Churn(node.control, gpus, pace=PACE) for gpus in CHURNS]
    t0 = time.monotonic()
    for churn in churns:
        churn.start()
    faults = list(xid_faults(node.control, FAULTED, pace=seconds / len(FAULTED)))
    for churn in churns:
        churn.stop()
    return time.monotonic() - t0, faults


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    with scratch("nvs-") as root:
        scenario = root / "64.scenario"
        uuids = write_scenario(scenario, GPUS)
        with SimulatedNode(root / "n", scenario=scenario) as node:
            node.config.write_text(CONFIG)
            node.kubelet.start()
            daemon = node.start_daemon(log_level="info")
            node.kubelet.wait_for(registered_with(GPUS), TIMEOUT)

            revision = storm_status(node).revision
            with RenameCounter(node.state_dir / FILE_NAME) as renames:
                took, faults = storm(node, args.seconds)
                behind = time.monotonic()
                node.kubelet.wait_for(lambda k: all(seen_unhealthy(node.kubelet, uuids[g]) for g in faults), TIMEOUT)
                behind = time.monotonic() - behind
                time.sleep(LAG_BOUND * 3)
            changes, writes = storm_status(node).revision - revision, renames.count
            print(
                f"{'storm':<16} {changes} changes (the daemon's revisions) in {took:.2f}s ({changes / took:.0f}/s); "
                f"the kubelet told of the last fault {behind * 1000:.0f} ms after the storm"
            )
            print(
                f"{'state file':<16} {writes} writes ({writes / changes:.3f} per change)  target <= {TARGET_WRITES} "
                f"per {TARGET_CHANGES} (ratio {writes * TARGET_CHANGES / changes / TARGET_WRITES:.2f})"
            )
            plugin = node.kubelet.plugin(GPU_RESOURCE)
            assert plugin is not None
            told = {d.id for d in plugin.updates[-1].devices if not d.healthy}
            on_disk = set(decode((node.state_dir / FILE_NAME).read_bytes())[1])
            print(f"{'file at the end':<16} {'the same as' if on_disk == told else 'DIFFERENT from'} the kubelet's "
                  f"last list ({len(on_disk)} Unhealthy)")  # fmt: skip

            # The same storm again, from a clean start (the fake library starts afresh with its process),
            # cut short by SIGKILL half way through the faults.
            node.stop_daemon()
            (node.state_dir / FILE_NAME).unlink()
            daemon = node.start_daemon(log_level="info")
            node.kubelet.wait_for(registered_with(GPUS), TIMEOUT)
            node.kubelet.wait_for(lambda k: not any(seen_unhealthy(node.kubelet, u) for u in uuids), TIMEOUT)
            churns = [Churn(node.control, gpus, pace=PACE) for gpus in CHURNS]
            for churn in churns:
                churn.start()
            half = list(FAULTED)[: len(FAULTED) // 2]
            xid_faults(node.control, half, pace=args.seconds / len(FAULTED))
            slowest = storm_status(node).slowest or 0.0
            bound = lag_bound(slowest)
            for churn in churns:
                churn.halt()
            killed = time.monotonic()
            daemon.send_signal(signal.SIGKILL)
            daemon.wait(TIMEOUT)
            for churn in churns:
                churn.stop()
            seen = {g: seen_unhealthy(node.kubelet, uuids[g]) for g in half}
            old = [g for g, at in seen.items() if at is not None and at < killed - bound]
            node.start_daemon(log_level="info")
            node.kubelet.wait_for(registered_with(GPUS), TIMEOUT)
            plugin = node.kubelet.plugin(GPU_RESOURCE)
            assert plugin is not None
            after = {d.id for d in plugin.updates[0].devices if not d.healthy}
            kept = sum(uuids[g] in after for g in old)
            ages = sorted(
                round((killed - at) * 1000) for g, at in seen.items() if at is not None and uuids[g] not in after
            )
            recent = [g for g, at in seen.items() if at is not None and at >= killed - bound]
            print(
                f"{'SIGKILL':<16} of {len(old)} faults the kubelet saw over {bound * 1000:.0f} ms before the kill "
                f"(the bound, with writes of up to {slowest * 1000:.1f} ms so far), "
                f"{kept} Unhealthy after the restart ({len(old) - kept} lost); of {len(recent)} within the bound, "
                f"{sum(uuids[g] in after for g in recent)} kept; ages of those lost at the kill: {ages} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
