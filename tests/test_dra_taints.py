"""Device taints on a control plane that keeps them (Kubernetes 1.36: DRADeviceTaints beta, on): an
Unhealthy DRA device stays in its slice, tainted as NVIDIA's DRA driver taints, until the evidence
that makes it Healthy; a restart of nvplug keeps the taint and its timeAdded; NoExecute where the
config raises it; an admin's taint kept through nvplug's writes; a server that drops taints."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_devices import devices
from test_dra_e2e import DRIVER, NODE, Dra, serving_136
from test_health import heal

from nvplug.status import status_client as statusclient
from nvplug.testing.simulated_node import SimulatedNode

TIMEOUT = 15.0
XID = "gpu.nvidia.com/xid"
ADMIN = {"key": "example.com/maintenance", "value": "rack-7", "effect": "NoSchedule"}


@pytest.fixture
def dra(node: SimulatedNode) -> Iterator[Dra]:
    yield from serving_136(node)


def taints(dra: Dra, device: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = dra.pool().get(device, {}).get("taints") or []
    return found


def status(dra: Dra) -> dict[str, Any]:
    """/status's dra section; empty while no daemon answers (a restart)."""
    try:
        doc: dict[str, Any] = statusclient.status(f"unix:{dra.node.status_socket}", timeout=5)["dra"]
    except statusclient.StatusUnavailable:
        return {}
    return doc


def tainted_slice(dra: Dra, what: str) -> None:
    """The stored slice, for the record: what the scheduler reads."""
    (found,) = dra.slices()
    devices_ = [{k: d[k] for k in ("name", "taints") if k in d} for d in found["spec"]["devices"]]
    print(f"{what}: {found['metadata']['name']} generation {found['spec']['pool']['generation']}: "
          f"{json.dumps(devices_)}")  # fmt: skip


def test_an_xid_taints_the_device_until_the_evidence_a_restart_keeps_it(dra: Dra) -> None:
    dra.start()
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    dra.wait(lambda: status(dra).get("taints_kept") is True, "the dry run that says taints are kept")
    dra.node.wait_log("the API server keeps device taints", TIMEOUT)
    # The attributes schedulers align a GPU and a NIC on: its root complex (bus 0x9a under 0x90), its NUMA node.
    attributes = dra.pool()["gpu-4"]["attributes"]
    assert attributes["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:90"}
    assert attributes["resource.kubernetes.io/numaNode"] == {"int": 1}
    began = time.monotonic()
    dra.node.control.xid(5, 79)
    dra.wait(lambda: bool(taints(dra, "gpu-5")), "gpu-5 tainted")
    print(f"XID 79 on GPU 5 -> tainted in its slice: {(time.monotonic() - began) * 1000:.1f} ms")
    tainted_slice(dra, "after the XID")
    (taint,) = taints(dra, "gpu-5")
    assert (taint["key"], taint["value"], taint["effect"]) == (XID, "79", "NoSchedule")
    added = taint["timeAdded"]
    # Still in the pool (the scheduler sees a broken GPU, not an absent one); the others untouched.
    assert sorted(dra.pool()) == ["gpu-4", "gpu-5", "gpu-6", "gpu-7"] and not taints(dra, "gpu-4")
    assert status(dra)["tainted"] == {"gpu-5": [f"{XID}=79:NoSchedule"]}
    metrics = statusclient.fetch(f"unix:{dra.node.status_socket}", "/metrics")[1]
    assert f'nvplug_dra_device_tainted{{device="gpu-5",driver="{DRIVER}",taint="{XID}=79:NoSchedule"}} 1.0' in metrics
    assert f'nvplug_dra_taints_kept{{driver="{DRIVER}"}} 1.0' in metrics
    rc, out, _ = devices(dra.node)
    assert rc == 0 and f"gpu-5, in the pool, tainted {XID}=79:NoSchedule" in out, out
    # A new claim of it without a toleration fails alone, with the reason; with one, it is prepared.
    late = dra.claim("late", "gpu-5")
    assert "is Unhealthy: XID 79" in dra.kubelet.prepare(DRIVER, [late])[late[2]].error

    # nvplug restarts: the fault is restored from the state file, so the taint stays, timeAdded too.
    writes = sum(1 for m, path, _ in dra.api.requests if m == "PUT" and "/resourceslices/" in path)
    assert dra.node.stop_daemon() == 0
    time.sleep(1.1)  # a PUT without timeAdded would now show a later second
    dra.node.start_daemon()
    dra.wait(lambda: status(dra).get("taints_kept") is True, "the restarted daemon's check")
    time.sleep(0.5)
    assert taints(dra, "gpu-5") == [taint] and taint["timeAdded"] == added
    assert sum(1 for m, path, _ in dra.api.requests if m == "PUT" and "/resourceslices/" in path) == writes

    # The evidence (an operator's heal after a reset) clears it.
    assert heal(dra.node, "5").returncode == 0
    began = time.monotonic()
    dra.wait(lambda: not taints(dra, "gpu-5"), "the taint removed")
    print(f"heal answered -> taint removed: {(time.monotonic() - began) * 1000:.1f} ms")
    tainted_slice(dra, "after the heal")
    assert status(dra)["tainted"] == {}


def test_no_execute_where_the_config_raises_it_and_a_tolerating_claim(dra: Dra) -> None:
    dra.start(dra.config() + "    taintEffect:\n      xid: NoExecute\n")
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    dra.node.control.xid(6, 79)
    dra.wait(lambda: bool(taints(dra, "gpu-6")), "gpu-6 tainted")
    (taint,) = taints(dra, "gpu-6")
    assert (taint["key"], taint["effect"]) == (XID, "NoExecute")
    tainted_slice(dra, "NoExecute")
    # A claim whose request tolerates the taint (a diagnostic pod's) is prepared on the broken GPU.
    uid = "uid-diag"
    toleration = {"key": XID, "operator": "Exists", "effect": "NoExecute"}
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-6", "tolerations": [toleration]}
    dra.api.add_claim({
        "metadata": {"namespace": "ml", "name": "diag", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {"allocation": {"devices": {"results": [result]}}},
    })  # fmt: skip
    assert dra.kubelet.prepare(DRIVER, [("ml", "diag", uid)])[uid].error == ""


def test_an_admins_taint_is_kept_through_nvplugs_writes(dra: Dra) -> None:
    dra.start()
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    (found,) = dra.slices()

    def add_admin_taint(obj: dict[str, Any]) -> None:
        for device in obj["spec"]["devices"]:
            if device["name"] == "gpu-4":
                device["taints"] = [dict(ADMIN)]

    dra.api.edit_slice(found["metadata"]["name"], add_admin_taint)
    (admin,) = taints(dra, "gpu-4")
    dra.node.wait_log("was modified by someone else", TIMEOUT)
    # nvplug's own writes (a fault, then its heal) keep it as the API server stored it.
    dra.node.control.xid(4, 79)
    dra.wait(lambda: len(taints(dra, "gpu-4")) == 2, "nvplug's taint beside the admin's")
    tainted_slice(dra, "an admin's taint and nvplug's")
    assert taints(dra, "gpu-4")[0] == admin and taints(dra, "gpu-4")[1]["key"] == XID
    assert heal(dra.node, "4").returncode == 0
    dra.wait(lambda: len(taints(dra, "gpu-4")) == 1, "nvplug's taint removed")
    assert taints(dra, "gpu-4") == [admin]


def test_an_admins_taint_outlives_the_kubelets_wipe_until_the_admin_removes_it(dra: Dra) -> None:
    """The kubelet deletes the node's slices when it starts, an admin's taints with them: nvplug writes
    them back, timeAdded and all. One the admin removed from the live slice does not come back."""
    dra.start()
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")

    def set_admin_taint(taints_: list[dict[str, Any]]) -> Callable[[dict[str, Any]], None]:
        def edit(obj: dict[str, Any]) -> None:
            for device in obj["spec"]["devices"]:
                if device["name"] == "gpu-4":
                    device["taints"] = taints_

        return edit

    mark = len(dra.node.log_text())
    dra.api.edit_slice(dra.slices()[0]["metadata"]["name"], set_admin_taint([dict(ADMIN)]))
    (admin,) = taints(dra, "gpu-4")
    dra.node.wait_log("was modified by someone else", TIMEOUT, after=mark)
    dra.kubelet.restart()  # its wipe at start
    dra.wait(lambda: taints(dra, "gpu-4") == [admin], "the admin's taint back after the wipe")
    dra.node.wait_log(
        "were deleted with taints nvplug did not set: put back (gpu-4 example.com/maintenance=rack-7:NoSchedule)",
        TIMEOUT,
    )
    tainted_slice(dra, "after the kubelet's wipe")
    # The admin takes it off the live slice: nvplug sees that, and the next wipe does not bring it back.
    mark = len(dra.node.log_text())
    dra.api.edit_slice(dra.slices()[0]["metadata"]["name"], set_admin_taint([]))
    dra.node.wait_log("was modified by someone else", TIMEOUT, after=mark)
    mark = len(dra.node.log_text())
    dra.kubelet.restart()
    # Logged by the name the answer to its POST gave it.
    dra.node.wait_log("ResourceSlices of node-a: 4 devices in node-a-gpu.nvidia.com-", TIMEOUT, after=mark)
    dra.wait(lambda: len(dra.pool()) == 4, "the pool back after the second wipe")
    assert not taints(dra, "gpu-4")
    assert "put back" not in dra.node.log_text()[mark:]


def test_a_server_that_drops_taints_and_one_whose_gate_turns_off(dra: Dra) -> None:
    dra.start()
    dra.wait(lambda: status(dra).get("taints_kept") is True, "the first check")
    # The control plane is downgraded under nvplug (the gate off): its next tainted write comes back bare.
    dra.api.taints = False
    dra.node.control.xid(7, 79)
    dra.wait(lambda: "gpu-7" not in dra.pool(), "gpu-7 out of the pool")
    assert status(dra)["taints_kept"] is False and status(dra)["tainted"] == {}
    rc, out, _ = devices(dra.node)
    assert rc == 0 and "gpu-7, left out of the pool (Unhealthy)" in out, out
    # Said once, however many devices and writes follow.
    dra.node.control.xid(6, 79)
    dra.wait(lambda: "gpu-6" not in dra.pool(), "gpu-6 out of the pool")
    assert dra.node.log_text().count("the API server drops device taints") == 1
    assert all(not taints(dra, name) for name in dra.pool())
