"""Health end to end: NVML events from the fake library through the daemon to the kubelet stand-in."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from support.scraped_metrics import scrape, value
from support.waiting import wait_until

from nvplug.status import status_client as statusclient
from nvplug.testing import nvidia_smi_standin as nvidia_smi
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with
from nvplug.testing.udev_sender import pci_event

TIMEOUT = 15.0


def start(node: SimulatedNode, health: str = "") -> list[str]:
    if health:
        node.config.write_text(f"version: v1\nnvplug:\n  health:\n{health}")
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    return [g["uuid"] for g in node.scenario_gpus()]


def allocatable(node: SimulatedNode) -> int:
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    return plugin.allocatable


def test_xid_79_makes_the_gpu_unhealthy_and_xid_13_does_not(node: SimulatedNode) -> None:
    uuids = start(node)
    node.control.xid(0, 13)
    node.wait_log("xid, stays healthy: XID 13 ")
    node.control.xid(1, 79)
    node.kubelet.wait_for(device_health(uuids[1], healthy=False), TIMEOUT)
    log = node.wait_log("unhealthy: XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS")
    assert uuids[1] in log and "0000:2a:00.0" in log
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    assert plugin.devices[uuids[0]].healthy and allocatable(node) == 7
    with pytest.raises(grpc.aio.AioRpcError) as info:
        node.kubelet.allocate(GPU_RESOURCE, [uuids[1]])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Unhealthy: XID 79" in (info.value.details() or "")


def test_config_overrides_the_catalog(node: SimulatedNode) -> None:
    uuids = start(node, "    fatalXids: [13]\n    ignoreXids: [79]\n")
    node.control.xid(2, 79)
    node.wait_log("XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (ignored by config)")
    node.control.xid(3, 13)
    node.kubelet.wait_for(device_health(uuids[3], healthy=False), TIMEOUT)
    node.wait_log("(fatal by config)")
    assert allocatable(node) == 7


def test_double_bit_ecc_makes_the_gpu_unhealthy(node: SimulatedNode) -> None:
    uuids = start(node)
    node.control.ecc(4, "dbe")
    node.kubelet.wait_for(device_health(uuids[4], healthy=False), TIMEOUT)
    node.wait_log("unhealthy: double-bit ECC error")


def test_lost_gpu_recovers_only_when_a_re_probe_passes(node: SimulatedNode) -> None:
    uuids = start(node, "    reprobeInitialSeconds: 0.2\n    reprobeMaxSeconds: 0.4\n")
    node.control.lose(5)
    node.kubelet.wait_for(device_health(uuids[5], healthy=False), TIMEOUT)
    node.wait_log("unhealthy: GPU unavailable")
    # While lost, re-probes run and fail; the GPU stays out.
    node.wait_log("re-probe 2 failed")
    assert allocatable(node) == 7
    # Allocation never asks NVML: a lost GPU does not get in the way of the others.
    pair = [uuids[4], uuids[6]]
    assert node.kubelet.allocate(GPU_RESOURCE, pair).container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(
        pair
    )
    assert node.kubelet.preferred_allocation(GPU_RESOURCE, [u for u in uuids if u != uuids[5]], [], 2) == uuids[:2]
    node.control.restore(5)
    node.kubelet.wait_for(device_health(uuids[5], healthy=True), TIMEOUT)
    node.wait_log("healthy: recovered: re-probe")
    assert allocatable(node) == 8


def test_recovery_action_marks_and_its_return_to_none_heals_at_once(node: SimulatedNode) -> None:
    # Re-probes are far away: only the recovery-action evidence can heal the GPU in time.
    uuids = start(node, "    reprobeInitialSeconds: 600\n    reprobeMaxSeconds: 600\n")
    node.control.recovery_action(3, 1)
    node.kubelet.wait_for(device_health(uuids[3], healthy=False), TIMEOUT)
    node.wait_log("unhealthy: NVML recovery action: GPU reset")
    node.control.recovery_action(3, 0)
    node.kubelet.wait_for(device_health(uuids[3], healthy=True), TIMEOUT)
    node.wait_log("healthy: recovered: NVML recovery action back to none, probe passed")


def test_xid_154_reads_the_recovery_action(node: SimulatedNode) -> None:
    # GPU 2's driver has no recovery-action event: XID 154 is the only announcement.
    uuid = node.scenario_gpus()[2]["uuid"]
    node.scenario.write_text(node.scenario.read_text().replace(f"uuid={uuid}", f"uuid={uuid} events=0x600B"))
    uuids = start(node)
    node.control.recovery_action(2, 2)
    node.control.xid(2, 154)
    node.kubelet.wait_for(device_health(uuids[2], healthy=False), TIMEOUT)
    node.wait_log("XID 154 GPU_RECOVERY_ACTION_CHANGED")
    node.wait_log("unhealthy: NVML recovery action: node reboot")


def test_xid_94_keeps_the_gpu_but_reads_the_recovery_action(node: SimulatedNode) -> None:
    # A contained error: the GPU stays, unless the driver asks for a reset behind it.
    gpus = node.scenario_gpus()
    text = node.scenario.read_text()
    for g in gpus[1:3]:
        text = text.replace(f"uuid={g['uuid']}", f"uuid={g['uuid']} events=0x600B")  # no recovery-action event
    node.scenario.write_text(text)
    uuids = start(node)
    node.control.xid(1, 94)
    node.wait_log(f"{uuids[1]} (0000:2a:00.0) xid, stays healthy: XID 94 ROBUST_CHANNEL_CONTAINED_ERROR (RESTART_APP)")
    node.control.recovery_action(2, 4)
    node.control.xid(2, 94)
    node.kubelet.wait_for(device_health(uuids[2], healthy=False), TIMEOUT)
    node.wait_log("unhealthy: NVML recovery action: drain and reset")
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.devices[uuids[1]].healthy and plugin.allocatable == 7


def test_xid_109_needs_a_reset(node: SimulatedNode) -> None:
    # The catalog says RESET_GPU; NVIDIA's plugin ignores it. nvplug follows the catalog (docs/health.md).
    uuids = start(node)
    node.control.xid(4, 109)
    node.kubelet.wait_for(device_health(uuids[4], healthy=False), TIMEOUT)
    node.wait_log("unhealthy: XID 109 ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR (RESET_GPU); waiting for a GPU reset")


def test_a_gpu_broken_at_start_is_never_advertised_healthy(node: SimulatedNode) -> None:
    uuid = node.scenario_gpus()[4]["uuid"]
    node.scenario.write_text(node.scenario.read_text().replace(f"uuid={uuid}", f"uuid={uuid} pending_pages=1"))
    start(node)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    # Every message the kubelet ever saw had it Unhealthy, the first one included.
    assert all(not next(d for d in u.devices if d.id == uuid).healthy for u in plugin.updates)
    node.wait_log("unhealthy: probe failed: page retirement pending")


def test_healthy_gpus_are_never_polled(node: SimulatedNode) -> None:
    start(node)
    node.control.reset_calls()
    time.sleep(3)
    # None at all: the event wait is the daemon's child's, whose calls are its own.
    assert node.control.calls() == {}


def test_event_wait_failures_are_reported_and_retried_with_backoff(node: SimulatedNode) -> None:
    uuids = start(node)
    node.control.reset_calls()
    node.control.wait_error(999, -1)
    node.wait_log("ERROR   nvplug: NVML health events cannot be received: nvmlEventSetWait failed: Unknown Error")
    time.sleep(2)
    # Backoff, not a busy loop: a handful of attempts in two seconds, each logged.
    retries = node.log_text().count("nvmlEventSetWait still failing (Unknown Error)")
    assert 2 <= retries <= 15, retries
    node.control.wait_error(0, 0)
    node.wait_log("NVML health events are being received")
    node.control.xid(0, 79)
    node.kubelet.wait_for(device_health(uuids[0], healthy=False), TIMEOUT)


def status_of(node: SimulatedNode, uuid: str) -> dict[str, object]:
    gpus: list[dict[str, object]] = statusclient.status(f"unix:{node.status_socket}")["gpus"]
    return next(g for g in gpus if g["uuid"] == uuid)


def heal(node: SimulatedNode, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "nvplug", "heal", *args, "--status-listen", f"unix:{node.status_socket}"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_only_gpus_a_probe_could_heal_are_re_probed(node: SimulatedNode) -> None:
    uuids = start(node, "    reprobeInitialSeconds: 0.1\n    reprobeMaxSeconds: 0.2\n")
    node.control.lose(6)  # unreachable: answering again is the evidence
    node.control.xid(5, 46)  # needs a reset: a probe proves nothing
    node.kubelet.wait_for(device_health(uuids[6], healthy=False), TIMEOUT)
    node.kubelet.wait_for(device_health(uuids[5], healthy=False), TIMEOUT)
    node.wait_log("re-probe 3 failed")
    reprobes = [line for line in node.log_text().splitlines() if "re-probe" in line]
    assert reprobes and all(uuids[6] in line for line in reprobes)
    node.control.restore(6)
    node.kubelet.wait_for(device_health(uuids[6], healthy=True), TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and not plugin.devices[uuids[5]].healthy


def test_pending_retirement_needs_a_reset_even_once_it_reads_clear(node: SimulatedNode) -> None:
    uuids = start(node, "    reprobeInitialSeconds: 0.1\n    reprobeMaxSeconds: 0.2\n")
    node.control.pending_pages(6, True)
    node.control.xid(6, 48)
    node.kubelet.wait_for(device_health(uuids[6], healthy=False), TIMEOUT)
    node.control.pending_pages(6, False)
    time.sleep(1.0)  # five re-probe periods: none runs, and none would be evidence
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and not plugin.devices[uuids[6]].healthy
    assert "re-probe" not in node.log_text()
    result = heal(node, uuids[6])
    assert result.returncode == 0, result.stdout + result.stderr
    node.kubelet.wait_for(device_health(uuids[6], healthy=True), TIMEOUT)
    node.wait_log("healthy: recovered: the operator's word (nvplug heal by uid 0")


@pytest.mark.skipif(os.geteuid() != 0, reason="sending udev netlink messages needs root")
def test_reset_class_xids_stay_unhealthy_while_probes_pass_and_heal_on_their_evidence(node: SimulatedNode) -> None:
    uuids = start(node, "    reprobeInitialSeconds: 0.2\n    reprobeMaxSeconds: 0.4\n")
    gpus = node.scenario_gpus()
    for index, xid in ((0, 46), (1, 79), (2, 119), (3, 46)):
        node.control.xid(index, xid)
        node.kubelet.wait_for(device_health(uuids[index], healthy=False), TIMEOUT)
    # Probes would pass (the fake's GPUs answer), and no amount of waiting makes them evidence.
    time.sleep(2.0)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.allocatable == 4
    log = node.log_text()
    assert "recovered" not in log and "re-probe" not in log
    assert "waiting for a GPU reset (nvidia-smi -r -i 0000:18:00.0) or a reboot, or `nvplug heal 0`" in log
    devices = {g["uuid"]: g for g in statusclient.status(f"unix:{node.status_socket}")["gpus"]}
    assert (
        devices[uuids[1]]["waiting_for"]
        == "a GPU reset (nvidia-smi -r -i 0000:2a:00.0) or a reboot, or `nvplug heal 1`"
    )
    assert devices[uuids[1]]["clears"] == "reset"

    def only(healthy: set[int]) -> None:
        for index in range(4):
            node.kubelet.wait_for(device_health(uuids[index], healthy=index in healthy), TIMEOUT)

    # GPU 0: the driver unbound and re-bound (a reset through sysfs, or nvidia-smi -r).
    node.send_uevent(pci_event("unbind", gpus[0]["bus"].lower()))
    node.send_uevent(pci_event("bind", gpus[0]["bus"].lower(), driver="nvidia"))
    only({0})
    node.wait_log("healthy: recovered: driver unbound and re-bound, probe passed")
    # GPU 1: NVML's recovery action asks for a reset, then reads NONE.
    node.control.recovery_action(1, 1)
    # Read once the event comes; only then may it go back to none (each event has the field read).
    wait_until(lambda: status_of(node, uuids[1])["recovery_action"] == 1, TIMEOUT, "recovery action 1 read")
    node.control.recovery_action(1, 0)
    only({0, 1})
    node.wait_log("healthy: recovered: NVML recovery action back to none, probe passed")
    # GPU 3: the operator's word.
    result = heal(node, "3")
    assert result.returncode == 0 and "is Healthy: recovered: the operator's word" in result.stdout, result.stderr
    only({0, 1, 3})
    # GPU 2: the driver was reloaded (a new /sys/module/nvidia), and re-bound the GPUs.
    node.reload_driver()
    node.send_uevent(pci_event("bind", gpus[2]["bus"].lower(), driver="nvidia"))
    only({0, 1, 2, 3})
    node.wait_log("healthy: recovered: the NVIDIA driver was reloaded, probe passed")


def test_a_scan_s_read_from_before_the_recovery_action_went_back_to_none_does_not_undo_it(node: SimulatedNode) -> None:
    """A scan read GPU 1's recovery action, the driver then set it back to none and its event came in,
    and only then the scan's result: that older read must not take the evidence away and leave the
    GPU withheld. (A clean-clone run once hit this by chance; here the fake holds the scan there.)"""
    uuids = start(node, "    reprobeInitialSeconds: 0.2\n    reprobeMaxSeconds: 0.4\n")
    gpus = node.scenario_gpus()
    node.control.xid(1, 79)
    node.kubelet.wait_for(device_health(uuids[1], healthy=False), TIMEOUT)
    node.control.recovery_action(1, 1)
    wait_until(lambda: status_of(node, uuids[1])["recovery_action"] == 1, TIMEOUT, "recovery action 1 read")
    mark = len(node.log_text())
    # A rescan (GPU 0 re-bound) probes GPU 1: it reads the action, then waits in its next call.
    with node.control.blocked(1, "nvmlDeviceGetRetiredPagesPendingStatus"):
        node.send_uevent(pci_event("bind", gpus[0]["bus"].lower(), driver="nvidia"))
        node.control.wait_blocked(1, TIMEOUT)
        node.control.recovery_action(1, 0)
        node.wait_log("recovery evidence: NVML recovery action back to none", after=mark)
    node.wait_log(": 8 GPUs (driver", after=mark)  # the rescan done
    node.kubelet.wait_for(device_health(uuids[1], healthy=True), TIMEOUT)
    log = node.wait_log("healthy: recovered: NVML recovery action back to none, probe passed", after=mark)
    assert "probe failed" not in log[mark:], log[mark:]
    assert status_of(node, uuids[1])["health"] == "Healthy"


def test_a_re_probe_that_passed_on_reads_older_than_a_fault_is_not_counted_and_the_re_probes_go_on(
    node: SimulatedNode,
) -> None:
    uuids = start(node, "    reprobeInitialSeconds: 0.2\n    reprobeMaxSeconds: 0.4\n")
    node.control.lose(5)
    node.kubelet.wait_for(device_health(uuids[5], healthy=False), TIMEOUT)
    node.wait_log("re-probe 1 failed")
    mark = len(node.log_text())
    with node.control.blocked(5, "nvmlDeviceGetRetiredPagesPendingStatus"):
        node.control.restore(5)
        # A re-probe has read the GPU back, and waits in its last calls: the GPU is reported lost again.
        node.control.wait_blocked(1, TIMEOUT)
        blocked = 1 + max(int(n) for n in re.findall(r"re-probe (\d+) failed", node.log_text()))

        def reports() -> float:
            return value(scrape(node), "nvplug_events_total", kind="HealthReported")

        before = reports()
        node.control.event(5, 0x4000)  # GPU unavailable
        wait_until(lambda: reports() > before, TIMEOUT, "the GPU unavailable event taken in")
    # That pass is older than the report: not counted. A later re-probe's is, and heals the GPU.
    log = node.wait_log("healthy: recovered: re-probe", after=mark)
    healed_by = re.findall(r"healthy: recovered: re-probe (\d+) of", log[mark:])
    assert healed_by and int(healed_by[0]) > blocked, (blocked, log[mark:])
    node.kubelet.wait_for(device_health(uuids[5], healthy=True), TIMEOUT)


def test_a_restart_keeps_an_unhealthy_gpu_and_a_new_boot_clears_it(node: SimulatedNode) -> None:
    uuids = start(node)
    node.control.xid(0, 46)
    node.kubelet.wait_for(device_health(uuids[0], healthy=False), TIMEOUT)

    def saved() -> list[dict[str, str]]:
        devices: list[dict[str, str]] = json.loads((node.state_dir / "health.json").read_text())["devices"]
        return devices

    # Written by the saver thread just after the kubelet has the news (its fsync must not delay it).
    wait_until(lambda: bool(saved()), TIMEOUT, "the fault in the state file")
    assert [d["uuid"] for d in saved()] == [uuids[0]] and saved()[0]["clears"] == "reset"
    for sig in (signal.SIGTERM, signal.SIGKILL):
        assert node.stop_daemon(sig) in (0, -signal.SIGKILL)
        mark = len(node.log_text())
        node.start_daemon()
        node.kubelet.wait_for(registered_with(8), TIMEOUT)
        plugin = node.kubelet.plugin(GPU_RESOURCE)
        assert plugin is not None
        # Unhealthy in every list the new daemon sent, the first one included.
        assert all(not next(d for d in u.devices if d.id == uuids[0]).healthy for u in plugin.updates)
        node.wait_log(f"{uuids[0]} (0000:18:00.0) was Unhealthy before this start: XID 46", after=mark)
        node.wait_log("restored unhealthy: XID 46 ROBUST_CHANNEL_GPU_TIMEOUT_ERROR (RESET_GPU) (recorded", after=mark)
    node.stop_daemon()
    node.new_boot()
    mark = len(node.log_text())
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.allocatable == 8
    node.wait_log("is from another boot: ignored (a reboot resets every GPU)", after=mark)
    wait_until(
        lambda: not json.loads((node.state_dir / "health.json").read_text())["devices"],
        TIMEOUT,
        "the state file emptied",
    )


def test_a_corrupt_state_file_is_logged_and_ignored(node: SimulatedNode) -> None:
    node.state_dir.mkdir()
    (node.state_dir / "health.json").write_text('{"format": 1, "devices": [')
    start(node)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.allocatable == 8
    node.wait_log("WARNING nvplug.sinks.health_state_file: health state file")
    assert "ignored: not JSON" in node.log_text()
    assert node.daemon is not None and node.daemon.poll() is None


def test_heal_with_a_reset_checks_processes_runs_nvidia_smi_and_heals(node: SimulatedNode) -> None:
    uuids = start(node)
    assert heal(node, "0").stdout.strip().endswith("is Healthy; nothing to heal")
    node.control.xid(0, 46)
    node.kubelet.wait_for(device_health(uuids[0], healthy=False), TIMEOUT)
    reset = ["-r", "-i", "0000:18:00.0"]
    devices = subprocess.run(
        [sys.executable, "-m", "nvplug", "devices", "--status-listen", f"unix:{node.status_socket}"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    lines = devices.splitlines()
    row, waiting = next((ln, lines[n + 1]) for n, ln in enumerate(lines) if uuids[0] in ln)
    assert "Unhealthy" in row and "XID 46 ROBUST_CHANNEL_GPU_TIMEOUT_ERROR (RESET_GPU)" in row
    assert waiting.strip() == "waiting for a GPU reset (nvidia-smi -r -i 0000:18:00.0) or a reboot, or `nvplug heal 0`"
    # A process on the GPU: no reset.
    node.control.procs(0, [4242])
    busy = heal(node, "0000:18:00.0", "--reset")
    assert busy.returncode == 1 and "not reset: processes use it (pids 4242)" in busy.stdout
    assert nvidia_smi.calls(node.nvidia_smi_log) == []
    node.control.procs(0, [])
    # nvidia-smi refuses: the GPU stays out, and the error says why.
    Path(f"{node.nvidia_smi_log}.fail").touch()
    failed = heal(node, "0", "--reset")
    assert failed.returncode == 1 and "exited 255: GPU 0000:18:00.0 is currently in use" in failed.stdout
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and not plugin.devices[uuids[0]].healthy
    Path(f"{node.nvidia_smi_log}.fail").unlink()
    done = heal(node, uuids[0], "--reset")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is Healthy: recovered: GPU reset by nvidia-smi at the request of uid 0" in done.stdout
    assert nvidia_smi.calls(node.nvidia_smi_log) == [reset, reset]
    node.kubelet.wait_for(device_health(uuids[0], healthy=True), TIMEOUT)
    log = node.wait_log("heal asked by uid 0")
    assert "heal with a reset asked by uid 0" in log and "not reset: processes use it (pids 4242)" in log
    # Events flow again after the reset's rescan.
    node.control.xid(2, 79)
    node.kubelet.wait_for(device_health(uuids[2], healthy=False), TIMEOUT)
    # Nonsense is refused with a reason; no daemon is exit 2.
    unknown = heal(node, "9")
    assert unknown.returncode == 1 and "no GPU '9' on this node (indices: 0, 1, 2, 3, 4, 5, 6, 7)" in unknown.stdout
    node.stop_daemon()
    assert heal(node, "0").returncode == 2
