"""Device taints (KEP-5055) without the daemon: which taint each fault asks for, how the fault's kind gets
into the state and the state file, what the API server's stored taints keep, tolerations, prepare, the
slices, the standard attributes, and the PCIe root read from sysfs."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_dra import (
    DRIVER,
    NODE,
    REF,
    cdi_ids,
    claim,
    dra_device,
    gpu,
    mig_gpu,
    naming,
    node,
    pool_of,
    result,
    uuid,
)

from nvplug import config
from nvplug.base.checkpoint import seal
from nvplug.config import TaintEffects
from nvplug.core.events import (
    Event,
    GpuFellOffBus,
    HealthReported,
    InventoryFound,
    KernelXid,
    NvmlCallHung,
    NvmlFailed,
    PciChanged,
    ProbeResult,
    XidOccurred,
)
from nvplug.core.gpu import Gpu
from nvplug.core.health import Clears, Fault, Health, HealthState, Recorded
from nvplug.core.node_state import NodeState
from nvplug.dra import claims
from nvplug.dra import dra_devices as devices
from nvplug.dra import resource_slices as slices
from nvplug.dra.claims import ClaimError
from nvplug.dra.device_taints import (
    LOST_KEY,
    MAX_TAINTS,
    UNMONITORED_KEY,
    XID_KEY,
    Taint,
    keep_stored,
    kept,
    taints_for,
    tolerates,
    unmonitored,
    untolerated,
)
from nvplug.dra.dra_devices import DraDevice
from nvplug.sinks import health_state_file as state_file
from nvplug.sinks.health_state_file import StateFileError
from nvplug.sources.nvml_discovery import Nvml
from nvplug.testing.simulated_node import SimulatedNode

DEFAULT = TaintEffects()
# Every kind changed from its default: a test that passes with these did not read the defaults.
CUSTOM = TaintEffects(xid="NoExecute", gpu_lost="NoExecute", unmonitored="NoSchedule", unhealthy="None")
MIXED = "flags:\n  migStrategy: mixed\n"


def unhealthy(fault: Fault | None, clears: Clears = Clears.RESET, xid: int | None = None) -> HealthState:
    return HealthState(Health.UNHEALTHY, "test fault", 1.0, clears, fault=fault, xid=xid)


HEALTHY = HealthState(Health.HEALTHY, "discovered", 1.0)


# --- 1. the taint each fault asks for --------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "default", "custom"),
    [
        (unhealthy(Fault.XID, xid=79), "gpu.nvidia.com/xid=79:NoSchedule", "gpu.nvidia.com/xid=79:NoExecute"),
        # An Xid whose code is unknown still is an Xid: the key without a value.
        (unhealthy(Fault.XID), "gpu.nvidia.com/xid:NoSchedule", "gpu.nvidia.com/xid:NoExecute"),
        (
            unhealthy(Fault.LOST, Clears.PROBE),
            "gpu.nvidia.com/gpu-lost:NoSchedule",
            "gpu.nvidia.com/gpu-lost:NoExecute",
        ),
        (
            unhealthy(Fault.UNMONITORED, Clears.PROBE),
            "gpu.nvidia.com/unmonitored:None",
            "gpu.nvidia.com/unmonitored:NoSchedule",
        ),
        # The rest say what clears them, in the Clears value.
        (unhealthy(Fault.OTHER), "gpu.nvidia.com/unhealthy=reset:NoSchedule", "gpu.nvidia.com/unhealthy=reset:None"),
        (
            unhealthy(Fault.OTHER, Clears.PROBE),
            "gpu.nvidia.com/unhealthy=probe:NoSchedule",
            "gpu.nvidia.com/unhealthy=probe:None",
        ),
        (
            unhealthy(Fault.OTHER, Clears.CHECK),
            "gpu.nvidia.com/unhealthy=check:NoSchedule",
            "gpu.nvidia.com/unhealthy=check:None",
        ),
        # An Unhealthy state from before the fault kind existed reads as OTHER.
        (unhealthy(None), "gpu.nvidia.com/unhealthy=reset:NoSchedule", "gpu.nvidia.com/unhealthy=reset:None"),
    ],
)
def test_each_fault_kind_has_its_taint(state: HealthState, default: str, custom: str) -> None:
    assert [str(t) for t in taints_for(state, False, DEFAULT)] == [default]
    assert [str(t) for t in taints_for(state, False, CUSTOM)] == [custom]


def test_the_effects_come_from_the_config() -> None:
    text = "nvplug:\n  dra:\n    enabled: true\n    taintEffect:\n      xid: NoExecute\n      gpuLost: None\n"
    effects = config.parse(text, "c.yaml").dra.taint_effect
    assert effects == TaintEffects(xid="NoExecute", gpu_lost="None")
    assert taints_for(unhealthy(Fault.XID, xid=48), False, effects) == (Taint(XID_KEY, "48", "NoExecute"),)
    assert taints_for(unhealthy(Fault.LOST, Clears.PROBE), False, effects) == (Taint(LOST_KEY, "", "None"),)


def test_an_unchecked_device_is_unmonitored_beside_its_fault() -> None:
    # Healthy but an NVML call on its GPU hangs: only unmonitored, which is the kubelet's Unknown.
    only = taints_for(HEALTHY, True, DEFAULT)
    assert only == (Taint(UNMONITORED_KEY, "", "None"),)
    assert unmonitored(only)
    # Unhealthy of an Xid and unchecked: both, the fault first; no longer merely unmonitored.
    both = taints_for(unhealthy(Fault.XID, xid=79), True, DEFAULT)
    assert both == (Taint(XID_KEY, "79", "NoSchedule"), Taint(UNMONITORED_KEY, "", "None"))
    assert not unmonitored(both)
    # An UNMONITORED fault that is unchecked too is one taint, not two of one key.
    assert taints_for(unhealthy(Fault.UNMONITORED, Clears.PROBE), True, DEFAULT) == only
    # Healthy and checked: nothing to say.
    assert taints_for(HEALTHY, False, DEFAULT) == ()
    assert not unmonitored(())


def test_a_taint_as_a_slice_holds_it() -> None:
    xid = Taint(XID_KEY, "79", "NoSchedule")
    lost = Taint(LOST_KEY, "", "NoExecute")
    assert str(xid) == "gpu.nvidia.com/xid=79:NoSchedule"
    assert str(lost) == "gpu.nvidia.com/gpu-lost:NoExecute"
    assert xid.as_object() == {"key": XID_KEY, "value": "79", "effect": "NoSchedule"}
    # No empty value (the API would store "" and compare it), and never a timeAdded: the server sets it.
    assert lost.as_object() == {"key": LOST_KEY, "effect": "NoExecute"}
    assert all("timeAdded" not in t.as_object() for t in (xid, lost))


# --- 2. the fault's kind through NodeState --------------------------------------------------------


def kinds(state: NodeState, i: int = 0) -> tuple[Health, Fault | None, int | None]:
    h = state.current.health[uuid(i)]
    return h.health, h.fault, h.xid


def taints_offered(state: NodeState, extra: str = "") -> dict[str, list[str]]:
    return {d.name: [str(t) for t in d.taints] for d in devices.offered(state.current, naming("", extra))}


def test_an_nvml_xid_is_an_xid_fault_with_its_code() -> None:
    state = node(gpu(0), gpu(1))
    state.apply(XidOccurred(uuid(1), 79))
    assert kinds(state, 1) == (Health.UNHEALTHY, Fault.XID, 79)
    assert kinds(state, 0) == (Health.HEALTHY, None, None)
    assert taints_offered(state) == {"gpu-0": [], "gpu-1": ["gpu.nvidia.com/xid=79:NoSchedule"]}


def test_a_kernel_log_xid_and_a_fall_off_the_bus_are_xid_79() -> None:
    state = node(gpu(0), gpu(1))
    state.apply(KernelXid(gpu(0).bus_id, 48, "Xid (PCI:0000:18:00): 48, DBE", seq=1))
    # The line alone, with no Xid number: the kernel's words for Xid 79's fault.
    state.apply(GpuFellOffBus(gpu(1).bus_id, seq=2))
    assert kinds(state, 0) == (Health.UNHEALTHY, Fault.XID, 48)
    assert kinds(state, 1) == (Health.UNHEALTHY, Fault.XID, 79)
    assert taints_offered(state)["gpu-1"] == ["gpu.nvidia.com/xid=79:NoSchedule"]


def test_a_logged_fault_keeps_its_xid_for_the_gpu_found_later() -> None:
    state = NodeState()
    # NVML down at the start: the kernel log names a GPU no scan has found yet.
    state.apply(GpuFellOffBus(gpu(0).bus_id, seq=5))
    assert gpu(0).bus_id in state.current.logged
    state.apply(InventoryFound((gpu(0),)))
    assert kinds(state) == (Health.UNHEALTHY, Fault.XID, 79)


@pytest.mark.parametrize(
    ("event", "fault", "taint"),
    [
        (
            HealthReported(uuid(0), "GPU is lost", Clears.PROBE, Fault.LOST),
            Fault.LOST,
            "gpu.nvidia.com/gpu-lost:NoSchedule",
        ),
        # A double-bit ECC error is reported with the defaults: needs a reset, of no named kind.
        (HealthReported(uuid(0), "double-bit ECC error"), Fault.OTHER, "gpu.nvidia.com/unhealthy=reset:NoSchedule"),
        (ProbeResult(uuid(0), "GPU is lost", fault=Fault.LOST), Fault.LOST, "gpu.nvidia.com/gpu-lost:NoSchedule"),
        (
            ProbeResult(uuid(0), "row remap pending", clears=Clears.RESET),
            Fault.OTHER,
            "gpu.nvidia.com/unhealthy=reset:NoSchedule",
        ),
        # Unbound from the driver: perhaps being reset, unreachable until re-bound.
        (PciChanged("unbind", gpu(0).bus_id), Fault.LOST, "gpu.nvidia.com/gpu-lost:NoSchedule"),
        (
            NvmlCallHung(1, "probe", uuid(0), None, 1.0, 120.0, past_limit=True),
            Fault.UNMONITORED,
            "gpu.nvidia.com/unmonitored:None",
        ),
    ],
)
def test_each_source_sets_its_fault_kind(event: Event, fault: Fault, taint: str) -> None:
    state = node(gpu(0))
    state.apply(event)
    assert kinds(state) == (Health.UNHEALTHY, fault, None)
    # One taint: a hung call's GPU is unchecked too, and that is the same unmonitored taint.
    assert taints_offered(state)["gpu-0"] == [taint]


def test_nvml_failing_leaves_every_gpu_unmonitored_but_keeps_an_xid() -> None:
    state = node(gpu(0), gpu(1), gpu(2))
    state.apply(XidOccurred(uuid(2), 79))
    state.apply(NvmlFailed("Driver Not Loaded"))
    assert [kinds(state, i)[1] for i in range(3)] == [Fault.UNMONITORED, Fault.UNMONITORED, Fault.XID]
    # The Xid needs a reset, more than NVML's failure asks: it stays an Xid, with its code.
    assert kinds(state, 2) == (Health.UNHEALTHY, Fault.XID, 79)
    assert taints_offered(state) == {
        "gpu-0": ["gpu.nvidia.com/unmonitored:None"],
        "gpu-1": ["gpu.nvidia.com/unmonitored:None"],
        "gpu-2": ["gpu.nvidia.com/xid=79:NoSchedule"],
    }


def test_a_stronger_fault_replaces_the_kind_of_a_weaker_one() -> None:
    state = node(gpu(0))
    state.apply(HealthReported(uuid(0), "GPU is lost", Clears.PROBE, Fault.LOST))
    # An Xid needs a reset, more than a lost GPU's probe: it is the fault now, with its kind.
    state.apply(XidOccurred(uuid(0), 79))
    assert kinds(state) == (Health.UNHEALTHY, Fault.XID, 79)


def test_what_a_check_finds_replaces_cannot_be_checked() -> None:
    # NVML fails (unmonitored, cleared by a probe); once it answers, the GPU turns out lost (also a probe's
    # to clear): the kind the check found is the fault now, and its taint keeps claims off.
    state = node(gpu(0))
    state.apply(NvmlFailed("Driver Not Loaded"))
    state.apply(HealthReported(uuid(0), "GPU is lost", Clears.PROBE, Fault.LOST))
    assert kinds(state) == (Health.UNHEALTHY, Fault.LOST, None)
    assert taints_offered(state) == {"gpu-0": ["gpu.nvidia.com/gpu-lost:NoSchedule"]}


def test_a_hung_call_marks_its_gpu_unmonitored_while_healthy() -> None:
    state = node(gpu(0), gpu(1))
    state.apply(NvmlCallHung(1, "probe", uuid(1), None, 1.0, 30.0, past_limit=False))
    # Not past the limit: still Healthy, but nothing checks it now.
    assert kinds(state, 1) == (Health.HEALTHY, None, None)
    assert taints_offered(state) == {"gpu-0": [], "gpu-1": ["gpu.nvidia.com/unmonitored:None"]}
    # A hung scan that names no GPU leaves every GPU unchecked.
    state.apply(NvmlCallHung(2, "scan", None, None, 1.0, 30.0, past_limit=False))
    assert taints_offered(state) == {"gpu-0": [UNMONITORED_KEY + ":None"], "gpu-1": [UNMONITORED_KEY + ":None"]}
    state.apply(NvmlCallHung(1, "probe", uuid(1), None, 1.0, 31.0, past_limit=False, returned=True))
    state.apply(NvmlCallHung(2, "scan", None, None, 1.0, 31.0, past_limit=False, returned=True))
    assert taints_offered(state) == {"gpu-0": [], "gpu-1": []}


def test_a_healed_device_has_no_fault_and_no_taint() -> None:
    state = node(gpu(0))
    state.apply(XidOccurred(uuid(0), 79))
    # The unbind is the reset's evidence; the scan's passing probe completes it.
    state.apply(PciChanged("unbind", gpu(0).bus_id))
    assert kinds(state) == (Health.UNHEALTHY, Fault.XID, 79)  # the unbind does not replace the Xid
    state.apply(InventoryFound(state.current.gpus, (ProbeResult(uuid(0), None, "scan"),)))
    assert kinds(state) == (Health.HEALTHY, None, None)
    assert taints_offered(state) == {"gpu-0": []}


def test_a_fault_of_the_gpu_taints_each_of_its_mig_devices() -> None:
    state = node(mig_gpu(), gpu(1))
    # An Xid naming a GPU and compute instance is that MIG device's alone, and so is its taint.
    state.apply(XidOccurred(uuid(0), 31, gpu_instance=2, compute_instance=0))  # harmless: stays Healthy
    state.apply(XidOccurred(uuid(0), 79, gpu_instance=2, compute_instance=0))
    assert state.current.health["MIG-b"].fault is Fault.XID
    assert taints_offered(state, MIXED) == {
        "gpu-7-mig-1g10gb-1-0": [],
        "gpu-7-mig-3g40gb-2-0": ["gpu.nvidia.com/xid=79:NoSchedule"],
        "gpu-7-mig-1c2g20gb-5-1": [],
        "gpu-1": [],
    }
    # The whole GPU lost: every MIG device carries the GPU's fault.
    state.apply(HealthReported(uuid(0), "GPU is lost", Clears.PROBE, Fault.LOST))
    found = taints_offered(state, MIXED)
    assert found == {
        "gpu-7-mig-1g10gb-1-0": ["gpu.nvidia.com/gpu-lost:NoSchedule"],
        "gpu-7-mig-3g40gb-2-0": ["gpu.nvidia.com/gpu-lost:NoSchedule"],
        "gpu-7-mig-1c2g20gb-5-1": ["gpu.nvidia.com/gpu-lost:NoSchedule"],
        "gpu-1": [],
    }


def test_offered_takes_the_effects_it_is_given() -> None:
    state = node(gpu(0))
    state.apply(XidOccurred(uuid(0), 79))
    (d,) = devices.offered(state.current, naming(""), CUSTOM)
    assert d.taints == (Taint(XID_KEY, "79", "NoExecute"),)


# --- 3. the state file -----------------------------------------------------------------------------


def record(fault: Fault | None, xid: int | None = None, clears: Clears = Clears.RESET) -> Recorded:
    state = HealthState(Health.UNHEALTHY, "XID 79 test", 12.5, clears, fault=fault, xid=xid)
    return Recorded("0000:18:00.0", state)


def test_the_state_file_keeps_the_fault_kind_and_xid() -> None:
    records = {
        uuid(0): record(Fault.XID, 79),
        uuid(1): record(Fault.LOST, clears=Clears.PROBE),
        uuid(2): record(Fault.UNMONITORED, clears=Clears.PROBE),
        uuid(3): record(Fault.OTHER),
    }
    boot, back = state_file.decode(state_file.encode(records, "boot-1"))
    assert boot == "boot-1"
    assert back == records
    # An Unhealthy state of no kind is written as OTHER, as it would be read.
    _, none = state_file.decode(state_file.encode({uuid(4): record(None)}, "boot-1"))
    assert none[uuid(4)].state.fault is Fault.OTHER


def older(records: dict[str, Recorded], **changes: Any) -> bytes:
    """The file as an older nvplug wrote it (no fault, no xid), or with `changes` to each record, resealed:
    a well-sealed file, so only the record's check can refuse it."""
    doc = json.loads(state_file.encode(records, "boot-1"))
    for entry in doc["devices"]:
        for k in ("fault", "xid"):
            entry.pop(k)
        entry.update(changes)
    body = {k: v for k, v in doc.items() if k not in ("kind", "version", "boot_id", "sha256")}
    return seal(state_file.KIND, state_file.FORMAT, body, doc["boot_id"])


def test_a_record_from_an_older_nvplug_is_of_an_other_fault() -> None:
    _, back = state_file.decode(older({uuid(0): record(Fault.XID, 79)}))
    state = back[uuid(0)].state
    assert (state.fault, state.xid) == (Fault.OTHER, None)
    assert state.reason == "XID 79 test" and state.clears is Clears.RESET
    # And one from before the envelope (format 1), which had no kind either.
    legacy = {"format": 1, "boot_id": "b", "devices": json.loads(older({uuid(0): record(Fault.XID, 79)}))["devices"]}
    _, old = state_file.decode(json.dumps(legacy).encode())
    assert (old[uuid(0)].state.fault, old[uuid(0)].state.xid) == (Fault.OTHER, None)


@pytest.mark.parametrize("changes", [{"xid": "79"}, {"xid": 79.0}, {"xid": True}, {"xid": [79]}])
def test_a_bad_xid_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(StateFileError, match="device 0"):
        state_file.decode(older({uuid(0): record(Fault.XID, 79)}, **changes))


@pytest.mark.parametrize("fault", ["bogus", None])
def test_a_fault_kind_this_nvplug_does_not_know_keeps_the_fault(fault: str | None) -> None:
    # A newer nvplug's kind (after a rollback), or none: the fault stays, as another fault.
    _, back = state_file.decode(older({uuid(0): record(Fault.XID, 79)}, fault=fault))
    state = back[uuid(0)].state
    assert (state.health, state.fault, state.reason) == (Health.UNHEALTHY, Fault.OTHER, "XID 79 test")


def test_a_good_xid_of_an_older_kind_reads() -> None:
    # The new keys written by hand into an older file: read as they say.
    _, back = state_file.decode(older({uuid(0): record(Fault.OTHER)}, fault="xid", xid=94))
    assert (back[uuid(0)].state.fault, back[uuid(0)].state.xid) == (Fault.XID, 94)


def test_a_restored_fault_keeps_its_taint() -> None:
    _, back = state_file.decode(state_file.encode({uuid(0): record(Fault.XID, 79)}, "boot-1"))
    state = NodeState(restored=back)
    state.apply(InventoryFound((gpu(0),)))
    assert kinds(state) == (Health.UNHEALTHY, Fault.XID, 79)
    assert taints_offered(state) == {"gpu-0": ["gpu.nvidia.com/xid=79:NoSchedule"]}


# --- 4. keep_stored --------------------------------------------------------------------------------

T0 = "2025-01-01T00:00:00Z"
T1 = "2025-02-01T00:00:00Z"
XID79: dict[str, Any] = {"key": XID_KEY, "value": "79", "effect": "NoSchedule"}
ADMIN: dict[str, Any] = {"key": "example.com/maintenance", "value": "rack-4", "effect": "NoExecute", "timeAdded": T1}


def dev(name: str, *taints: dict[str, Any], version: str = "v1") -> dict[str, Any]:
    body: dict[str, Any] = {"attributes": {"type": {"string": "gpu"}}, "capacity": {}}
    if taints:
        body["taints"] = [dict(t) for t in taints]
    return {"name": name, "basic": body} if version == "v1beta1" else {"name": name, **body}


def stored_slice(*devs: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "s-1"}, "spec": {"driver": DRIVER, "nodeName": NODE, "devices": list(devs)}}


def taints_in(found: list[dict[str, Any]], version: str = "v1") -> dict[str, list[dict[str, Any]]]:
    return {d["name"]: (d["basic"] if version == "v1beta1" else d).get("taints", []) for d in found}


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_our_stored_taint_keeps_its_time_added(version: str) -> None:
    wanted = [dev("gpu-0", XID79, version=version)]
    stored = [stored_slice(dev("gpu-0", {**XID79, "timeAdded": T0}, version=version))]
    # A PUT without timeAdded would reset it, and NoExecute's tolerationSeconds count from it.
    assert taints_in(keep_stored(wanted, stored), version) == {"gpu-0": [{**XID79, "timeAdded": T0}]}
    # Not stored yet: sent as it is, the server adds the time.
    assert taints_in(keep_stored(wanted, []), version) == {"gpu-0": [XID79]}


@pytest.mark.parametrize("changed", [{"effect": "NoExecute"}, {"value": "48"}])
def test_a_changed_taint_is_a_new_one(changed: dict[str, str]) -> None:
    new = {**XID79, **changed}
    found = keep_stored([dev("gpu-0", new)], [stored_slice(dev("gpu-0", {**XID79, "timeAdded": T0}))])
    assert taints_in(found) == {"gpu-0": [new]}


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_an_admins_taint_is_kept_in_the_stored_order_and_outlives_ours(version: str) -> None:
    other = {"key": "example.com/burn-in", "effect": "NoSchedule", "timeAdded": T0}
    stored = [stored_slice(dev("gpu-0", ADMIN, {**XID79, "timeAdded": T0}, other, version=version))]
    both = keep_stored([dev("gpu-0", XID79, version=version)], stored)
    assert taints_in(both, version) == {"gpu-0": [ADMIN, {**XID79, "timeAdded": T0}, other]}
    # Healed: ours goes, the admin's stay as stored.
    healed = keep_stored([dev("gpu-0", version=version)], stored)
    assert taints_in(healed, version) == {"gpu-0": [ADMIN, other]}
    # The rest of the device is ours as wanted.
    shape = healed[0]["basic"] if version == "v1beta1" else healed[0]
    assert shape["attributes"] == {"type": {"string": "gpu"}}


def test_our_new_taint_comes_after_the_stored_ones() -> None:
    unmon = {"key": UNMONITORED_KEY, "effect": "None"}
    stored = [stored_slice(dev("gpu-0", {**XID79, "timeAdded": T0}, ADMIN))]
    found = keep_stored([dev("gpu-0", XID79, unmon)], stored)
    assert taints_in(found) == {"gpu-0": [{**XID79, "timeAdded": T0}, ADMIN, unmon]}


def test_another_devices_taints_stay_on_it() -> None:
    stored = [stored_slice(dev("gpu-1", ADMIN), dev("gpu-0", {**XID79, "timeAdded": T0}))]
    found = keep_stored([dev("gpu-0"), dev("gpu-1"), dev("gpu-2", XID79)], stored)
    assert taints_in(found) == {"gpu-0": [], "gpu-1": [ADMIN], "gpu-2": [XID79]}


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_a_device_without_taints_anywhere_is_unchanged(version: str) -> None:
    plain = dev("gpu-0", version=version)
    (found,) = keep_stored([plain], [stored_slice(dev("gpu-0", version=version))])
    assert found is plain
    assert "taints" not in (found["basic"] if version == "v1beta1" else found)


def test_at_most_sixteen_taints_are_kept() -> None:
    admins = [{"key": f"example.com/t{i}", "effect": "NoSchedule", "timeAdded": T0} for i in range(MAX_TAINTS)]
    found = keep_stored([dev("gpu-0")], [stored_slice(dev("gpu-0", *admins))])
    assert taints_in(found)["gpu-0"] == admins
    many = keep_stored([dev("gpu-0", XID79)], [stored_slice(dev("gpu-0", *admins[:-1]))])
    assert len(taints_in(many)["gpu-0"]) == MAX_TAINTS
    # Room for ours after 15 of the admin's.
    assert taints_in(many)["gpu-0"][-1] == XID79


def test_our_fault_taint_is_not_the_one_cut_at_sixteen() -> None:
    # Others' taints are cut first: a fault left unsaid would publish an Unhealthy device untainted.
    admins = [{"key": f"example.com/t{i}", "effect": "NoSchedule", "timeAdded": T0} for i in range(MAX_TAINTS)]
    found = keep_stored([dev("gpu-0", XID79)], [stored_slice(dev("gpu-0", *admins))])
    kept_taints = taints_in(found)["gpu-0"]
    assert len(kept_taints) == MAX_TAINTS
    assert XID79 in kept_taints


# --- 5. kept ---------------------------------------------------------------------------------------


def test_kept_says_whether_the_server_kept_our_taints() -> None:
    sent = [dev("gpu-0", XID79), dev("gpu-1")]
    # A server with DRADeviceTaints off drops the field.
    assert not kept(sent, [dev("gpu-0"), dev("gpu-1")])
    assert kept(sent, [dev("gpu-0", {**XID79, "timeAdded": T0}), dev("gpu-1")])
    # Nothing of ours sent: nothing to lose, whatever came back.
    assert kept([dev("gpu-0"), dev("gpu-1", ADMIN)], [dev("gpu-0")])
    assert kept([], [])
    # An admin's taint in the answer is not ours kept.
    assert not kept(sent, [dev("gpu-0", ADMIN), dev("gpu-1")])
    # The same in v1beta1's shape.
    assert not kept([dev("gpu-0", XID79, version="v1beta1")], [dev("gpu-0", version="v1beta1")])
    assert kept([dev("gpu-0", XID79, version="v1beta1")], [dev("gpu-0", XID79, version="v1beta1")])


# --- 6. tolerations --------------------------------------------------------------------------------

XID_TAINT = Taint(XID_KEY, "79", "NoSchedule")
LOST_TAINT = Taint(LOST_KEY, "", "NoExecute")


@pytest.mark.parametrize(
    ("toleration", "xid", "lost"),
    [
        # Exists without a key: every taint.
        ({"operator": "Exists"}, True, True),
        ({"operator": "Exists", "key": XID_KEY}, True, False),
        ({"operator": "Exists", "key": LOST_KEY}, False, True),
        # Equal (the default) needs the key and the value.
        ({"key": XID_KEY, "value": "79"}, True, False),
        ({"operator": "Equal", "key": XID_KEY, "value": "79"}, True, False),
        ({"operator": "Equal", "key": XID_KEY, "value": "48"}, False, False),
        ({"operator": "Equal", "key": XID_KEY}, False, False),
        ({"operator": "Equal", "key": LOST_KEY}, False, True),  # no value equals the empty one
        ({"operator": "Equal", "value": "79"}, False, False),
        # An effect named must be the taint's.
        ({"operator": "Exists", "effect": "NoSchedule"}, True, False),
        ({"operator": "Exists", "effect": "NoExecute"}, False, True),
        ({"key": XID_KEY, "value": "79", "effect": "NoExecute"}, False, False),
    ],
)
def test_tolerates(toleration: dict[str, Any], xid: bool, lost: bool) -> None:
    assert tolerates(toleration, XID_TAINT) is xid
    assert tolerates(toleration, LOST_TAINT) is lost


def test_untolerated_is_the_binding_taints_no_toleration_matches() -> None:
    none = Taint(UNMONITORED_KEY, "", "None")
    taints = [XID_TAINT, LOST_TAINT, none]
    # A None effect never keeps a claim off, tolerated or not.
    assert untolerated(taints, []) == [XID_TAINT, LOST_TAINT]
    assert untolerated([none], []) == []
    assert untolerated(taints, [{"operator": "Exists", "key": XID_KEY}]) == [LOST_TAINT]
    assert untolerated(taints, [{"operator": "Exists", "key": XID_KEY}, {"operator": "Exists", "key": LOST_KEY}]) == []
    assert untolerated(taints, [{"operator": "Exists"}]) == []


# --- 7. prepare ------------------------------------------------------------------------------------


def faulty(i: int, *taints: Taint) -> DraDevice:
    """An Unhealthy device with these taints (none: as where the server keeps no taints)."""
    base = dra_device(i, healthy=False)
    return DraDevice(base.name, base.gpu, base.mig, False, base.reason, base.attributes, base.capacity, taints)


def prepare(device: DraDevice, **kw: Any) -> list[str]:
    doc = claim([result(device.name, **kw)])
    return [d.device for d in claims.prepare(REF, doc, DRIVER, NODE, pool_of(device), cdi_ids).devices]


def test_an_unhealthy_tainted_device_is_refused_unless_tolerated() -> None:
    d = faulty(2, XID_TAINT)
    with pytest.raises(ClaimError, match=r"gpu-002 .* is Unhealthy: XID 79"):
        prepare(d)
    # A diagnostic pod's claim that tolerates the taint gets it.
    assert prepare(d, tolerations=[{"key": XID_KEY, "operator": "Exists"}]) == ["gpu-002"]
    assert prepare(d, tolerations=[{"key": XID_KEY, "value": "79", "effect": "NoSchedule"}]) == ["gpu-002"]
    # One that tolerates another taint does not.
    with pytest.raises(ClaimError, match="is Unhealthy"):
        prepare(d, tolerations=[{"key": LOST_KEY, "operator": "Exists"}])
    with pytest.raises(ClaimError, match="is Unhealthy"):
        prepare(d, tolerations=[{"key": XID_KEY, "value": "48"}])


def test_every_binding_taint_must_be_tolerated() -> None:
    d = faulty(2, XID_TAINT, LOST_TAINT)
    with pytest.raises(ClaimError, match="is Unhealthy"):
        prepare(d, tolerations=[{"key": XID_KEY, "operator": "Exists"}])
    assert prepare(d, tolerations=[{"key": XID_KEY, "operator": "Exists"}, {"key": LOST_KEY, "operator": "Exists"}])


def test_a_device_whose_only_taint_has_no_effect_is_prepared() -> None:
    # Unmonitored with effect None: the scheduler may hand it out, so prepare does.
    assert prepare(faulty(2, Taint(UNMONITORED_KEY, "", "None"))) == ["gpu-002"]
    # With unmonitored made NoSchedule it binds like any other.
    with pytest.raises(ClaimError, match="is Unhealthy"):
        prepare(faulty(2, Taint(UNMONITORED_KEY, "", "NoSchedule")))


def test_an_unhealthy_device_without_taints_is_refused_whatever_it_tolerates() -> None:
    d = faulty(2)
    with pytest.raises(ClaimError, match="is Unhealthy"):
        prepare(d)
    with pytest.raises(ClaimError, match="is Unhealthy"):
        prepare(d, tolerations=[{"operator": "Exists"}])


def test_admin_access_prepares_a_tainted_or_untainted_unhealthy_device() -> None:
    assert prepare(faulty(2, XID_TAINT), adminAccess=True) == ["gpu-002"]
    assert prepare(faulty(2), adminAccess=True) == ["gpu-002"]


def test_tolerations_that_are_not_objects_are_ignored() -> None:
    with pytest.raises(ClaimError, match="is Unhealthy"):
        prepare(faulty(2, XID_TAINT), tolerations=["Exists", None, 3])


# --- 8. pool_devices and slices --------------------------------------------------------------------


def test_a_tainted_unhealthy_device_stays_in_the_pool_where_taints_are_kept() -> None:
    pool = [dra_device(0), faulty(1, XID_TAINT), faulty(2)]
    v1 = slices.pool_devices(pool, "v1", taints=True)
    # Tainted, it stays; untainted, it leaves: nothing would tell the scheduler it is broken.
    assert [d["name"] for d in v1] == ["gpu-000", "gpu-001"]
    assert "taints" not in v1[0]
    assert v1[1]["taints"] == [{"key": XID_KEY, "value": "79", "effect": "NoSchedule"}]
    beta = slices.pool_devices(pool, "v1beta1", taints=True)
    assert [d["name"] for d in beta] == ["gpu-000", "gpu-001"]
    assert beta[1]["basic"]["taints"] == [{"key": XID_KEY, "value": "79", "effect": "NoSchedule"}]
    assert "taints" not in beta[1]
    # Where the server drops taints, every Unhealthy device leaves, and none is written with taints.
    assert [d["name"] for d in slices.pool_devices(pool, "v1")] == ["gpu-000"]


def test_a_healthy_unmonitored_device_carries_its_taint() -> None:
    base = dra_device(0)
    d = DraDevice(base.name, base.gpu, None, True, "", base.attributes, base.capacity,
                  (Taint(UNMONITORED_KEY, "", "None"),))  # fmt: skip
    assert slices.pool_devices([d], "v1", taints=True)[0]["taints"] == [{"key": UNMONITORED_KEY, "effect": "None"}]
    assert "taints" not in slices.pool_devices([d], "v1", taints=False)[0]


def test_a_pool_that_may_be_tainted_is_cut_at_64() -> None:
    wanted = slices.pool_devices([dra_device(i) for i in range(130)], "v1", taints=True)
    made = slices.slices(wanted, DRIVER, NODE, 3, "v1", per_slice=64)
    assert [len(s["spec"]["devices"]) for s in made] == [64, 64, 2]
    assert [d for s in made for d in s["spec"]["devices"]] == wanted
    assert all(s["spec"]["pool"]["resourceSliceCount"] == 3 for s in made)


# --- 9. the standard attributes --------------------------------------------------------------------


def test_pcie_root_and_numa_node_are_standard_attributes() -> None:
    (d,) = devices.offered(node(gpu(0, pcie_root="pci0000:10", numa_node=1)).current, naming(""))
    assert d.attributes["resource.kubernetes.io/pcieRoot"] == ("string", "pci0000:10")
    assert d.attributes["resource.kubernetes.io/numaNode"] == ("int", 1)
    # NUMA node 0 is a node, not an absence.
    (zero,) = devices.offered(node(gpu(0, numa_node=0)).current, naming(""))
    assert zero.attributes["resource.kubernetes.io/numaNode"] == ("int", 0)


def test_unknown_pcie_root_and_numa_node_are_left_out() -> None:
    (d,) = devices.offered(node(gpu(0, numa_node=-1)).current, naming(""))
    assert "resource.kubernetes.io/pcieRoot" not in d.attributes
    assert "resource.kubernetes.io/numaNode" not in d.attributes


def test_a_mig_device_shares_its_gpus_pcie_root_and_numa_node() -> None:
    g = replace(mig_gpu(), pcie_root="pci0000:10", numa_node=1)
    found = devices.offered(node(g).current, naming("", MIXED))
    assert len(found) == 3
    for d in found:
        assert d.attributes["resource.kubernetes.io/pcieRoot"] == ("string", "pci0000:10")
        assert d.attributes["resource.kubernetes.io/numaNode"] == ("int", 1)


def test_a_device_stays_within_the_apis_32_attributes_and_capacities() -> None:
    # Everything a GPU can be described with, and a MIG device with all its engines.
    whole = Gpu(uuid(1), 1, "0000:19:00.0", minor=1, numa_node=1, name="X" * 100, memory_mib=81559,
                compute_capability=(9, 0), brand="Nvidia", architecture="Hopper", pcie_root="pci0000:10")  # fmt: skip
    g = replace(mig_gpu(), pcie_root="pci0000:10", numa_node=1, brand="Nvidia", architecture="Hopper")
    state = node(g, whole, driver_version="550.54.15", cuda_version=12040)
    found = devices.offered(state.current, naming("", MIXED))
    assert {d.name for d in found} >= {"gpu-1", "gpu-7-mig-1g10gb-1-0"}
    for d in found:
        assert len(d.attributes) + len(d.capacity) <= devices.MAX_FIELDS, d.name
    mig = next(d for d in found if d.name == "gpu-7-mig-1g10gb-1-0")
    # The MIG device with its engines is the largest: it is the one the limit is for.
    assert len(mig.capacity) == 7 and "resource.kubernetes.io/pcieRoot" in mig.attributes


# --- 10. the PCIe root from sysfs ------------------------------------------------------------------

BDF = "0000:18:00.0"


def sysfs_with(tmp_path: Path, target: Path | None) -> Path:
    """A sysfs whose bus/pci/devices/<BDF> links to `target` (None: no entry)."""
    sys = tmp_path / "sys"
    (sys / "devices").mkdir(parents=True)
    listing = sys / "bus/pci/devices"
    listing.mkdir(parents=True)
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
        (listing / BDF).symlink_to(os.path.relpath(target, listing))
    return sys


def test_the_pcie_root_is_the_first_directory_under_devices(tmp_path: Path) -> None:
    sys = tmp_path / "sys"
    sysfs_with(tmp_path, sys / "devices/pci0000:10/0000:10:01.0" / BDF)
    assert Nvml(sys, tmp_path / "proc")._sysfs_pcie_root(BDF) == "pci0000:10"


def test_the_pcie_root_through_switches(tmp_path: Path) -> None:
    # Every bridge and switch in between is skipped: the root complex is the first component.
    sys = tmp_path / "sys"
    deep = sys / "devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0" / BDF
    sysfs_with(tmp_path, deep)
    assert Nvml(sys, tmp_path / "proc")._sysfs_pcie_root(BDF) == "pci0000:15"


def test_the_simulated_nodes_layout_gives_the_root(tmp_path: Path) -> None:
    # SimulatedNode.add_pci_device's own layout (it needs only its sysfs root): buses 0x10 apart share a root.
    sim = SimpleNamespace(sysfs_root=tmp_path / "sys")
    for bdf in ("0000:18:00.0", "0000:1f:00.0", "0000:29:00.0"):
        SimulatedNode.add_pci_device(sim, bdf)  # type: ignore[arg-type]
    nvml = Nvml(tmp_path / "sys", tmp_path / "proc")
    assert [nvml._sysfs_pcie_root(b) for b in ("0000:18:00.0", "0000:1f:00.0", "0000:29:00.0")] == [
        "pci0000:10",
        "pci0000:10",
        "pci0000:20",
    ]
    assert nvml._sysfs_pcie_root("0000:3a:00.0") is None


def test_no_pcie_root_where_sysfs_does_not_say(tmp_path: Path) -> None:
    sys = sysfs_with(tmp_path, None)
    nvml = Nvml(sys, tmp_path / "proc")
    # Missing.
    assert nvml._sysfs_pcie_root(BDF) is None
    # A plain directory, no link: not under devices/.
    (sys / "bus/pci/devices" / BDF).mkdir()
    assert nvml._sysfs_pcie_root(BDF) is None


@pytest.mark.parametrize(
    "target",
    [
        "elsewhere/pci0000:10/0000:10:01.0/" + BDF,  # outside devices/
        "sys/devices/platform/soc/" + BDF,  # under devices/, not a PCI root
        "sys/devices/pci0000:10/0000:10:01.0/0000:19:00.0",  # another device's directory
        "sys/devices/pci0000:10",  # the root itself
    ],
)
def test_no_pcie_root_for_a_link_elsewhere(tmp_path: Path, target: str) -> None:
    sys = sysfs_with(tmp_path, tmp_path / target)
    assert Nvml(sys, tmp_path / "proc")._sysfs_pcie_root(BDF) is None


def test_no_pcie_root_for_a_dangling_link(tmp_path: Path) -> None:
    sys = sysfs_with(tmp_path, None)
    (sys / "bus/pci/devices" / BDF).symlink_to("../../../devices/pci0000:10/0000:10:01.0/" + BDF)
    assert Nvml(sys, tmp_path / "proc")._sysfs_pcie_root(BDF) is None
