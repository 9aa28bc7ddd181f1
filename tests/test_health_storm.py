"""The health state file under a storm of changes: far fewer writes than changes, the file at the
last state once the storm is over, and a SIGKILL in the middle loses no fault older than the bound."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from nvplug.sinks.health_state_file import FILE_NAME, LAG_BOUND, decode
from nvplug.testing.health_storm import Churn, lag_bound, seen_unhealthy, storm_status, write_scenario, xid_faults
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with

TIMEOUT = 30.0
GPUS = 64
CHURNED = range(8)  # recovery-action cycles
FAULTED = range(8, GPUS)  # XID 79s that stay
STORM_CHANGES = 300  # revisions the storm makes before its writes are counted
CONFIG = "version: v1\nnvplug:\n  health:\n    reprobeInitialSeconds: 0.02\n    reprobeMaxSeconds: 0.02\n"


def storm_node(root: Path, nvml_lib_dir: Path) -> tuple[SimulatedNode, list[str]]:
    scenario = root / "64.scenario"
    uuids = write_scenario(scenario, GPUS)
    node = SimulatedNode(root / "n", scenario=scenario, lib_dir=nvml_lib_dir)
    node.config.write_text(CONFIG)
    return node, uuids


def unhealthy_in_file(node: SimulatedNode) -> set[str]:
    return set(decode((node.state_dir / FILE_NAME).read_bytes())[1])


def test_a_storm_costs_few_writes_and_leaves_the_file_at_the_last_state(short_tmp: Path, nvml_lib_dir: Path) -> None:
    node, uuids = storm_node(short_tmp, nvml_lib_dir)
    with node:
        node.kubelet.start()
        node.start_daemon(log_level="info")
        node.kubelet.wait_for(registered_with(GPUS), TIMEOUT)
        before = storm_status(node)
        churn = Churn(node.control, CHURNED, pace=0.002)
        churn.start()
        faults = xid_faults(node.control, FAULTED[:20], pace=0.04)
        # A storm of STORM_CHANGES however slowly a busy machine churns: wait for them, not for a time.
        deadline = time.monotonic() + TIMEOUT
        while (made := storm_status(node).revision - before.revision) < STORM_CHANGES:
            assert time.monotonic() < deadline, f"the churn made only {made} changes"
            time.sleep(0.05)
        churn.stop()
        node.kubelet.wait_for(
            lambda k: all(seen_unhealthy(node.kubelet, uuids[g]) is not None for g in faults), TIMEOUT
        )
        time.sleep(LAG_BOUND * 3)  # the last probes, then the file within its bound
        after = storm_status(node)
        assert before.writes is not None and after.writes is not None
        changes, writes = after.revision - before.revision, after.writes - before.writes
        print(f"{changes} changes over {len(faults) * 0.04:.2f}s made {writes} writes")
        assert changes >= STORM_CHANGES
        assert 1 <= writes <= changes / 5
        plugin = node.kubelet.plugin(GPU_RESOURCE)
        assert plugin is not None
        at_kubelet = {d.id for d in plugin.updates[-1].devices if not d.healthy}
        assert at_kubelet >= {uuids[g] for g in faults}
        assert unhealthy_in_file(node) == at_kubelet


def test_a_sigkill_in_a_storm_loses_no_fault_older_than_the_bound(short_tmp: Path, nvml_lib_dir: Path) -> None:
    node, uuids = storm_node(short_tmp, nvml_lib_dir)
    with node:
        node.kubelet.start()
        daemon = node.start_daemon(log_level="info")
        node.kubelet.wait_for(registered_with(GPUS), TIMEOUT)
        churn = Churn(node.control, CHURNED, pace=0.002)
        churn.start()
        xid_faults(node.control, FAULTED[:40], pace=0.01)
        # Wait for the event, not for a time: the kubelet saw the first ten faults, and they are older
        # than the bound (which a busy machine's slow writes raise) when the kill comes.
        first = [uuids[g] for g in FAULTED[:10]]
        node.kubelet.wait_for(lambda _k: all(seen_unhealthy(node.kubelet, u) is not None for u in first), TIMEOUT)
        seen_at = max(seen_unhealthy(node.kubelet, u) or 0.0 for u in first)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() - seen_at <= (bound := lag_bound(storm_status(node).slowest)):
            assert time.monotonic() < deadline, f"the bound kept growing: {bound:g}s"
            time.sleep(0.05)
        churn.halt()
        killed = time.monotonic()
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(TIMEOUT)
        churn.stop()
        seen = {g: seen_unhealthy(node.kubelet, uuids[g]) for g in FAULTED[:40]}
        old = [g for g, at in seen.items() if at is not None and at < killed - bound]
        recent = [g for g, at in seen.items() if at is not None and at >= killed - bound]
        print(f"faults the kubelet saw more than {bound:g}s before the kill: {len(old)}; later: {len(recent)}")
        assert len(old) >= 10  # the storm kept up: most faults were seen well before the kill

        node.start_daemon(log_level="info")
        node.kubelet.wait_for(registered_with(GPUS), TIMEOUT)
        plugin = node.kubelet.plugin(GPU_RESOURCE)
        assert plugin is not None
        first = {d.id for d in plugin.updates[0].devices if not d.healthy}
        lost = [uuids[g] for g in old if uuids[g] not in first]
        assert lost == [], f"faults older than {bound:g}s lost by the SIGKILL: {lost}"
        # None of the later ones is lost either, unless its write was the one the kill cut short.
        print(f"of the {len(recent)} later faults, {sum(uuids[g] in first for g in recent)} are Unhealthy after it")
