"""The write budget (nvplug.dra.maxWritesPerSecond): a run of health changes costs the API server a few
ResourceSlice writes, not one per change. The first change after a quiet spell is written at once, the
last is never held back, the stored slice ends exact, and the kubelet's health stream tells every change.
The storms' figures, against an unpaced publisher, are in bench/slice_storms.py."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_dra_e2e import DRIVER, Dra, serving_136

from nvplug.dra.slice_publisher import DEFAULT_BUDGET
from nvplug.status import status_client as statusclient
from nvplug.testing.simulated_node import SimulatedNode

EVERY_GPU = "[0, 1, 2, 3, 4, 5, 6, 7]"


@pytest.fixture
def dra(node: SimulatedNode) -> Iterator[Dra]:
    # 1.36: taints kept, so a fault changes a device's taints and a heal takes them off.
    yield from serving_136(node)


def writes(dra: Dra) -> list[tuple[str, str, int]]:
    """The requests that wrote the node's slices (a dry run stores nothing and reaches no watcher)."""
    return [
        r
        for r in list(dra.api.requests)
        if r[0] in ("PUT", "POST", "DELETE") and "/resourceslices" in r[1] and "dryRun" not in r[1]
    ]


def status(dra: Dra) -> dict[str, Any]:
    doc: dict[str, Any] = statusclient.status(f"unix:{dra.node.status_socket}", timeout=5)
    return doc


def tainted(dra: Dra) -> set[str]:
    return {name for name, d in dra.pool().items() if d.get("taints")}


def unhealthy(dra: Dra) -> set[str]:
    """The devices the daemon holds Unhealthy, by their DRA names."""
    return {d["name"] for d in status(dra)["dra"]["devices"] if not d["healthy"]}


def heal(dra: Dra, gpu: int) -> None:
    body = f'{{"gpu": "{gpu}", "operator": "test"}}'.encode()
    code, text = statusclient.fetch(f"unix:{dra.node.status_socket}", "/heal", 15.0, body)
    assert code == 200, text


def started(dra: Dra) -> int:
    """Every GPU in the pool, the publisher settled; how many writes that took."""
    dra.start(dra.config(EVERY_GPU))
    dra.wait(lambda: len(dra.pool()) == 8, "the pool of 8")
    dra.wait(lambda: status(dra)["dra"]["taints_kept"] is True, "the dry run that says taints are kept")
    dra.wait(lambda: status(dra)["dra"]["published"], "the pool held")
    time.sleep(2.5)  # past the registration's second list (2 s)
    return len(writes(dra))


def within_budget(count: int, span: float) -> bool:
    """What the budget allows for changes over `span` seconds: a burst, the rate, and the last one."""
    return count <= DEFAULT_BUDGET.burst + math.ceil(span * DEFAULT_BUDGET.per_second) + 1


def health_states(dra: Dra, device: str) -> list[str]:
    """The device's health as the kubelet's stream told it, each change once."""
    states: list[str] = []
    for update in list(dra.kubelet.health):
        state = update.devices.get(device, ("",))[0]
        if state and (not states or states[-1] != state):
            states.append(state)
    return states


def test_a_burst_of_one_fault_is_one_write_and_its_heal_another(dra: Dra) -> None:
    before = started(dra)
    began = time.monotonic()
    for _ in range(50):
        dra.node.control.xid(5, 79)
    dra.wait(lambda: tainted(dra) == {"gpu-5"}, "gpu-5 tainted")
    print(f"first fault -> its write: {(time.monotonic() - began) * 1000:.1f} ms (50 XIDs sent)")
    dra.wait(lambda: status(dra)["gpus"][5]["xids"] >= 50, "the 50 XIDs taken in")
    heal(dra, 5)
    # The stand-in records a request once it has answered: wait for the record, then past one interval.
    dra.wait(lambda: not tainted(dra) and len(writes(dra)) >= before + 2, "gpu-5's taint off")
    time.sleep(1.5 / DEFAULT_BUDGET.per_second)
    made = writes(dra)[before:]
    first = made[0]
    print(f"storm A: {len(made)} writes: {made}")
    assert first[0] == "PUT" and len(made) == 2, made
    assert health_states(dra, "gpu-5")[-2:] == ["UNHEALTHY", "HEALTHY"]


def test_faults_on_every_gpu_then_their_heals_are_coalesced_and_end_exact(dra: Dra) -> None:
    before = started(dra)
    began = time.monotonic()
    for n in range(200):
        dra.node.control.xid(n % 8, 79)
    dra.wait(lambda: tainted(dra) == {f"gpu-{n}" for n in range(8)}, "every GPU tainted")
    # A heal before the last XID is taken in would be undone by it, rightly: heal after all 200.
    dra.wait(lambda: all(g["xids"] >= 25 for g in status(dra)["gpus"]), "the 200 XIDs taken in")
    for gpu in range(8):
        heal(dra, gpu)
    dra.wait(lambda: not unhealthy(dra), "the daemon to hold every GPU Healthy")
    settled = time.monotonic() - began
    dra.wait(lambda: not tainted(dra) and status(dra)["dra"]["published"], "every taint off, and known so")
    made = writes(dra)[before:]
    doc = status(dra)["dra"]
    print(f"storm B: {len(made)} writes for {doc['changes']} changes in {settled:.2f} s; {doc['changes_coalesced']} "
          f"coalesced; requests {doc['requests']}, {doc['bytes_written']} bytes")  # fmt: skip
    # Sixteen changes at least (a fault and a heal per GPU), far fewer writes, and nothing pending.
    assert len(made) < 16 and within_budget(len(made), settled), made
    assert doc["changes_coalesced"] > 0 and doc["next_write_at"] is None
    for n in range(8):
        assert health_states(dra, f"gpu-{n}")[-2:] == ["UNHEALTHY", "HEALTHY"], n


def test_a_flapping_gpu_writes_at_the_budget_and_the_stream_tells_each_flap(dra: Dra) -> None:
    before = started(dra)
    began = time.monotonic()
    for _ in range(10):
        dra.node.control.xid(5, 79)
        dra.wait(lambda: unhealthy(dra) == {"gpu-5"}, "gpu-5 Unhealthy")
        heal(dra, 5)
        dra.wait(lambda: not unhealthy(dra), "gpu-5 Healthy")
        time.sleep(0.2)
    span = time.monotonic() - began
    # The last change (a heal) is written within one interval of it: the slice ends exact.
    dra.wait(lambda: status(dra)["dra"]["published"] and not tainted(dra), "the last heal written")
    made = writes(dra)[before:]
    doc = status(dra)["dra"]
    print(f"storm C: 20 changes in {span:.2f} s: {len(made)} writes, {doc['changes_coalesced']} coalesced")
    assert within_budget(len(made), span) and len(made) < 20, made
    assert (
        f'nvplug_dra_slice_changes_coalesced_total{{driver="gpu.nvidia.com"}} {doc["changes_coalesced"]}.0'
        in (statusclient.fetch(f"unix:{dra.node.status_socket}", "/metrics")[1])
    )
    # The kubelet's stream is not paced: all 20 changes, in order.
    flaps = health_states(dra, "gpu-5")
    assert flaps[-20:] == ["UNHEALTHY", "HEALTHY"] * 10, flaps


def test_no_write_without_a_change_restart_reload_or_list(dra: Dra) -> None:
    """A restart of nvplug, a reload that changes nothing in the pool, and the lists they make write nothing:
    the stored slice keeps its resourceVersion, so no watcher in the cluster hears of it."""
    before = started(dra)
    (stored,) = dra.slices()
    assert dra.node.stop_daemon() == 0
    dra.node.start_daemon()
    dra.wait(lambda: dra.kubelet.accepted(DRIVER) >= 2, "registered again")
    dra.wait(lambda: status(dra)["dra"]["published"], "the pool known held again")
    mark = len(dra.node.log_text())
    assert dra.node.daemon is not None
    dra.node.daemon.send_signal(signal.SIGHUP)
    dra.node.wait_log("reloaded the config", after=mark)
    time.sleep(2.5)  # past the registration's second list
    assert len(writes(dra)) == before, writes(dra)[before:]
    assert dra.slices()[0]["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
