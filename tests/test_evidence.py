"""Recovery needs evidence that fits the fault: the rules of the core state, and the state file."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from nvplug.core.events import (
    EvidenceFound,
    HealthReported,
    InventoryFound,
    PciChanged,
    ProbeResult,
    RecoveryActionChanged,
    XidOccurred,
)
from nvplug.core.gpu import Gpu, MigDevice
from nvplug.core.health import Clears, Fault, Health, HealthState, Recorded
from nvplug.core.mig import CapMinors
from nvplug.core.node_state import DRIVER_RELOADED, NodeState
from nvplug.core.readiness import unready
from nvplug.sinks.health_state_file import Saved, StateFile, decode, encode, state_dir

UUID = "GPU-00000000"
BUS = "0000:18:00.0"
PASS = ProbeResult(UUID, None, "re-probe 1 of the Unhealthy GPU")


def gpu(i: int = 0) -> Gpu:
    return Gpu(uuid=f"GPU-{i:08d}", index=i, bus_id=f"0000:{0x18 + i:02x}:00.0", minor=i)


def node(instance: str | None = "7", restored: dict[str, Recorded] | None = None) -> NodeState:
    state = NodeState(restored=restored)
    state.apply(InventoryFound((gpu(0), gpu(1)), driver_instance=instance))
    return state


def health(state: NodeState, uuid: str = UUID) -> HealthState:
    return state.current.health[uuid]


# Each reset-class source: XIDs of each catalog bucket that needs a reset, ECC, poison, a pending repair.
RESET_FAULTS = {
    "XID 46 (RESET_GPU)": XidOccurred(UUID, 46),
    "XID 79 (RESTART_BM)": XidOccurred(UUID, 79),
    "XID 119 (RESET_GPU)": XidOccurred(UUID, 119),
    "XID 48 (WORKFLOW_XID_48)": XidOccurred(UUID, 48),
    "XID 74 (WORKFLOW_NVLINK_ERR)": XidOccurred(UUID, 74),
    "XID 109 (RESET_GPU; NVIDIA ignores it)": XidOccurred(UUID, 109),
    "double-bit ECC": HealthReported(UUID, "double-bit ECC error"),
    "fatal poison": HealthReported(UUID, "fatal poison error"),
    "page retirement pending": ProbeResult(UUID, "page retirement pending", "scan", Clears.RESET),
    "NVML recovery action": RecoveryActionChanged(UUID, 1),
}


@pytest.mark.parametrize("fault", RESET_FAULTS.values(), ids=RESET_FAULTS.keys())
def test_a_reset_class_fault_survives_passing_probes(fault: object) -> None:
    state = node()
    state.apply(fault)  # type: ignore[arg-type]
    assert health(state).clears is Clears.RESET
    for _ in range(3):
        state.apply(PASS)
        state.apply(InventoryFound(state.current.gpus, (ProbeResult(UUID, None, "scan"),), driver_instance="7"))
    assert not health(state).healthy
    assert state.current.reprobe_due() == ()  # nothing a probe could prove
    assert health(state).waiting_for(BUS, 0) == f"a GPU reset (nvidia-smi -r -i {BUS}) or a reboot, or `nvplug heal 0`"


EVIDENCE = {
    "udev unbind and bind": (PciChanged("unbind", BUS), "driver unbound and re-bound"),
    "the operator's word": (EvidenceFound(UUID, "the operator's word"), "the operator's word"),
    "a reset nvplug ran": (EvidenceFound(UUID, "GPU reset by nvidia-smi"), "GPU reset by nvidia-smi"),
    "a reloaded driver": (InventoryFound((gpu(0), gpu(1)), driver_instance="8"), DRIVER_RELOADED),
}


@pytest.mark.parametrize("xid", [46, 79, 119])
@pytest.mark.parametrize("name", EVIDENCE)
def test_each_kind_of_evidence_then_a_probe_heals_a_reset_class_fault(xid: int, name: str) -> None:
    event, text = EVIDENCE[name]
    state = node()
    state.apply(XidOccurred(UUID, xid))
    state.apply(event)
    assert health(state).evidence == text and not health(state).healthy  # a probe must still pass
    assert [g.uuid for g in state.current.reprobe_due()] == [UUID]
    state.apply(ProbeResult(UUID, "GPU is lost", "re-probe 1"))
    assert not health(state).healthy
    state.apply(PASS)
    assert health(state).healthy and health(state).reason == f"recovered: {text}, probe passed"


def test_recovery_action_back_to_none_counts_only_after_it_asked_for_something() -> None:
    state = node()
    state.apply(XidOccurred(UUID, 79))
    state.apply(RecoveryActionChanged(UUID, 0))
    state.apply(PASS)
    assert not health(state).healthy  # NONE all along says nothing about a reset
    state.apply(RecoveryActionChanged(UUID, 2))  # the driver asks for a reboot: recorded on the fault
    assert health(state).reason.startswith("XID 79") and health(state).recovery_action == 2
    state.apply(RecoveryActionChanged(UUID, 0))
    state.apply(PASS)
    assert health(state).reason == "recovered: NVML recovery action back to none, probe passed"


def test_a_probe_that_began_before_newer_word_on_the_gpu_is_not_counted() -> None:
    """A scan's probe read the recovery action just before the driver put it back to none, and
    came in after that event: it must neither undo the evidence nor stop the re-probes."""
    state = node()
    state.apply(XidOccurred(UUID, 79), arrived=1.0)
    state.apply(RecoveryActionChanged(UUID, 1), arrived=2.0)
    state.apply(RecoveryActionChanged(UUID, 0), arrived=4.0)
    stale = ProbeResult(UUID, "NVML recovery action pending (1)", "scan", Clears.RESET, 1, started=3.0)
    state.apply(InventoryFound(state.current.gpus, (stale,), driver_instance="7"), arrived=5.0)
    assert health(state).evidence == "NVML recovery action back to none"
    assert state.current.reprobe_due() == (gpu(0),)
    # A probe that read after that word counts, failing or passing.
    state.apply(replace(stale, started=4.5), arrived=5.5)
    assert health(state).evidence is None and health(state).reason == "probe failed: NVML recovery action pending (1)"
    state.apply(RecoveryActionChanged(UUID, 0), arrived=6.0)
    state.apply(replace(PASS, started=6.5), arrived=7.0)
    assert health(state).reason == "recovered: NVML recovery action back to none, probe passed"


def test_a_pass_that_began_before_a_fault_came_in_does_not_heal_it() -> None:
    state = node()
    state.apply(HealthReported(UUID, "GPU is lost", Clears.PROBE, Fault.LOST), arrived=1.0)
    # A re-probe begins at 2.0; the GPU is reported lost again at 2.5 while it reads.
    state.apply(HealthReported(UUID, "GPU is lost", Clears.PROBE, Fault.LOST), arrived=2.5)
    state.apply(replace(PASS, started=2.0), arrived=3.0)
    assert not health(state).healthy and state.current.reprobe_due() == (gpu(0),)
    state.apply(replace(PASS, started=3.5), arrived=4.0)
    assert health(state).healthy
    # Without times (a test's events, a hung call's result) a probe counts as it always did.
    state.apply(HealthReported(UUID, "GPU is lost", Clears.PROBE, Fault.LOST), arrived=5.0)
    state.apply(PASS)
    assert health(state).healthy


def test_remove_and_add_bring_the_gpu_back_as_new() -> None:
    state = node()
    state.apply(XidOccurred(UUID, 79))
    state.apply(PciChanged("remove", BUS))
    assert state.current.gpu(UUID) is None
    state.apply(InventoryFound((gpu(0), gpu(1)), driver_instance="7"))
    assert health(state).healthy and health(state).reason == "discovered"


def test_a_driver_reload_is_no_evidence_for_a_fault_that_came_after_it() -> None:
    state = node("7")
    state.apply(InventoryFound(state.current.gpus, driver_instance="8"))
    state.apply(XidOccurred(UUID, 46))
    assert health(state).driver_instance == "8"
    state.apply(InventoryFound(state.current.gpus, driver_instance="8"))
    assert health(state).evidence is None
    # Where sysfs cannot tell the instance, nothing counts as a reload.
    blind = node(None)
    blind.apply(XidOccurred(UUID, 46))
    blind.apply(InventoryFound(blind.current.gpus, driver_instance="9"))
    assert blind.current.health[UUID].evidence is None


def test_a_fault_after_the_evidence_needs_new_evidence() -> None:
    state = node()
    state.apply(XidOccurred(UUID, 46))
    state.apply(EvidenceFound(UUID, "the operator's word"))
    state.apply(XidOccurred(UUID, 79))
    assert health(state).evidence is None and health(state).reason.startswith("XID 79")
    state.apply(PASS)
    assert not health(state).healthy


def test_an_unreachable_gpu_clears_on_a_passing_probe_unless_a_reset_fault_joins() -> None:
    state = node()
    state.apply(HealthReported(UUID, "GPU unavailable (NVML event)", Clears.PROBE))
    assert health(state).waiting_for(BUS, 0) == "the GPU to answer NVML again (re-probed with backoff)"
    assert [g.uuid for g in state.current.reprobe_due()] == [UUID]
    state.apply(PASS)
    assert health(state).healthy
    # Lost, then an XID that needs a reset: the stronger fault replaces the weaker.
    state.apply(ProbeResult(UUID, "GPU is lost", "re-probe 1"))
    changes = state.apply(XidOccurred(UUID, 79))
    assert [c.what for c in changes] == ["fault while unhealthy"]
    assert health(state).clears is Clears.RESET
    state.apply(PASS)
    assert not health(state).healthy
    # The weaker one does not replace the stronger.
    assert state.apply(ProbeResult(UUID, "GPU is lost", "re-probe 2")) == []


def test_xid_94_leaves_the_gpu_healthy() -> None:
    state = node()
    changes = state.apply(XidOccurred(UUID, 94))
    assert [c.what for c in changes] == ["xid, stays healthy"] and health(state).healthy


def test_what_allocate_needs_is_checked_at_every_scan() -> None:
    mig = MigDevice("MIG-0", 1, 0, "1g.10gb")
    parent = Gpu(UUID, 0, BUS, minor=0, mig_enabled=True, mig=(mig,))
    exists = {"/dev/nvidia0"}
    problems = unready((parent, gpu(1)), CapMinors(), exists.__contains__)
    assert problems == {
        "MIG-0": "no capability device minors listed for gpu 0 gi 1 ci 0 in /proc/driver/nvidia-caps/mig-minors",
        "GPU-00000001": "its device node /dev/nvidia1 is missing",
    }
    state = NodeState()
    state.apply(InventoryFound((parent, gpu(1)), unready=problems))
    assert not state.current.health["MIG-0"].healthy and health(state).healthy
    assert state.current.health["MIG-0"].clears is Clears.CHECK
    # A probe cannot heal it, nor can evidence: only a scan that finds what was missing.
    state.apply(EvidenceFound(UUID, "the operator's word"))
    state.apply(ProbeResult(UUID, None, "probe"))
    assert not state.current.health["MIG-0"].healthy
    state.apply(InventoryFound((parent, gpu(1)), unready={"GPU-00000001": problems["GPU-00000001"]}))
    assert state.current.health["MIG-0"].reason == "recovered: what Allocate needs is present now"
    # A GPU healed by its evidence while Allocate would still refuse it stays out.
    state.apply(XidOccurred("GPU-00000001", 46))
    state.apply(EvidenceFound("GPU-00000001", "the operator's word"))
    state.apply(ProbeResult("GPU-00000001", None, "probe"))
    assert state.current.health["GPU-00000001"].reason == "cannot be allocated: its device node /dev/nvidia1 is missing"


def test_restored_faults_apply_when_their_device_shows_up_and_are_consumed() -> None:
    fault = HealthState(Health.UNHEALTHY, "XID 46 ROBUST_CHANNEL_GPU_TIMEOUT_ERROR (RESET_GPU)", 5.0, Clears.RESET)
    restored = {UUID: Recorded(BUS, fault), "GPU-gone": Recorded("0000:99:00.0", fault)}
    state = NodeState(restored=restored)
    assert set(state.current.records()) == {UUID, "GPU-gone"}  # kept even before the first scan
    changes = state.apply(InventoryFound((gpu(0),), (ProbeResult(UUID, None, "scan"),)))
    assert health(state) == fault and "restored unhealthy" in [c.what for c in changes]
    assert set(state.current.restored) == {"GPU-gone"}
    # A removal of the not-yet-seen GPU is the evidence its record waited for.
    state.apply(PciChanged("remove", "0000:99:00.0"))
    assert set(state.current.records()) == {UUID}


def test_the_state_file_round_trips_and_knows_its_boot(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fault = HealthState(
        Health.UNHEALTHY, "XID 79 x (RESTART_BM)", 5.5, Clears.RESET, "udev", 2, "12", fault=Fault.XID, xid=79
    )
    records = {UUID: Recorded(BUS, fault)}
    assert decode(encode(records, "boot-a")) == ("boot-a", records)
    StateFile(tmp_path, "boot-a").save(Saved(records))
    assert StateFile(tmp_path, "boot-a").load() == records
    caplog.set_level(logging.INFO)
    assert StateFile(tmp_path, "boot-b").load() == {}
    assert "is from another boot: ignored" in caplog.text


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{not json", "not JSON"),
        (b"[]", "not a JSON object"),
        (json.dumps({"format": 99, "boot_id": "b", "devices": []}).encode(), "written by a newer nvplug (format 99"),
        (json.dumps({"format": 1, "boot_id": "b", "devices": [{"uuid": 3}]}).encode(), "device 0:"),
        (json.dumps({"format": 1, "boot_id": "b", "devices": "x"}).encode(), "of the wrong type"),
    ],
)
def test_a_bad_state_file_is_logged_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, why: str
) -> None:
    (tmp_path / "health.json").write_bytes(content)
    assert StateFile(tmp_path, "b").load() == {}
    assert "ignored" in caplog.text and why in caplog.text


def test_the_state_file_is_written_only_when_it_changes_and_a_failure_is_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = StateFile(tmp_path / "state", "b")
    file.save(Saved({}))
    first = file.path.stat().st_mtime_ns
    file.path.write_bytes(file.path.read_bytes())  # same content, new mtime
    touched = file.path.stat().st_mtime_ns
    file.save(Saved({}))
    assert file.path.stat().st_mtime_ns == touched != 0 and first != 0
    blocked = StateFile(tmp_path / "file-not-dir" / "x", "b")
    (tmp_path / "file-not-dir").write_text("")
    blocked.save(Saved({}))
    blocked.save(Saved({}))
    assert caplog.text.count("cannot write the health state file") == 1


def test_state_dir_prefers_systemd_then_the_flag() -> None:
    assert state_dir(Path("/x"), {"STATE_DIRECTORY": "/var/lib/nvplug:/var/lib/other"}) == Path("/var/lib/nvplug")
    assert state_dir(Path("/x"), {}) == Path("/x")
    assert state_dir(None, {}) == Path("/var/lib/nvplug")
