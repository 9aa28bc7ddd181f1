"""A hung driver is never silent: NVML calls with a deadline, serving from the state, Unhealthy past the limit."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from nvplug.core.events import Event, InventoryFound, NvmlCallHung
from nvplug.core.gpu import Gpu
from nvplug.core.health import Clears
from nvplug.core.node_state import NodeState
from nvplug.nvml.nvml_calls import NvmlCalls
from nvplug.nvml.nvml_errors import NvmlHung
from nvplug.status import status_client
from nvplug.testing.simulated_node import SimulatedNode, device_health, registered_with

TIMEOUT = 15.0
MIG_CONFIG_CHANGE = 0x100  # an NVML event after which nvplug rescans


def test_a_hung_call_is_left_behind_and_nothing_queues_behind_it() -> None:
    published: list[Event] = []
    release = threading.Event()

    def hangs() -> str:
        release.wait(10)
        return "late"

    async def scenario() -> None:
        calls = NvmlCalls(published.append, deadline=0.1, hang_limit=0.3)
        with pytest.raises(NvmlHung, match=r"has not returned from probe \(GPU-2\) for 0.1 s"):
            await calls.run("probe", "GPU-2", hangs)
        assert [type(e) for e in published] == [NvmlCallHung]
        assert calls.hung_on("GPU-2") is not None and calls.hung_on("GPU-1") is None
        # The same GPU is refused at once, where a second thread would hang too ...
        started = time.monotonic()
        with pytest.raises(NvmlHung, match="since"):
            await calls.run("probe", "GPU-2", lambda: "never runs")
        assert time.monotonic() - started < 1.0  # the hung call it would queue behind runs for 10 s
        # ... another GPU's call runs on a fresh worker, and a scan (every GPU) waits.
        assert await calls.run("probe", "GPU-1", lambda: "answered") == "answered"
        with pytest.raises(NvmlHung):
            await calls.run("scan", None, lambda: "never runs")
        await asyncio.sleep(0.35)
        hung = [e for e in published if isinstance(e, NvmlCallHung)]
        assert [(e.past_limit, e.returned) for e in hung] == [(False, False), (True, False)]
        release.set()
        await asyncio.wait_for(calls.until_clear(), 5)
        last = published[-1]
        assert isinstance(last, NvmlCallHung) and last.returned and last.uuid == "GPU-2"
        assert await calls.run("probe", "GPU-2", lambda: "again") == "again"
        calls.shutdown()

    asyncio.run(scenario())


def test_a_call_queued_behind_a_hung_one_is_not_called_hung_and_runs_on_the_fresh_worker() -> None:
    published: list[Event] = []
    release = threading.Event()

    async def scenario() -> None:
        calls = NvmlCalls(published.append, deadline=0.1, hang_limit=5.0)
        hung = asyncio.ensure_future(calls.run("probe", "GPU-2", lambda: release.wait(10)))
        await asyncio.sleep(0.01)  # GPU-2's call has the worker
        assert await calls.run("probe", "GPU-1", lambda: "answered") == "answered"
        with pytest.raises(NvmlHung):
            await hung
        assert [(e.uuid, e.returned) for e in published if isinstance(e, NvmlCallHung)] == [("GPU-2", False)]
        release.set()
        await asyncio.wait_for(calls.until_clear(), 5)
        calls.shutdown()

    asyncio.run(scenario())


def test_the_state_faults_a_hung_gpu_only_past_the_limit_and_lets_a_probe_heal_it() -> None:
    state = NodeState()
    gpu = Gpu("GPU-2", 2, "0000:2a:00.0")
    state.apply(InventoryFound((gpu,)))
    state.apply(NvmlCallHung(1, "scan", None, 2, 100.0, 10.0, past_limit=False))
    assert state.current.health["GPU-2"].healthy
    assert state.current.hung_calls[1].uuid == "GPU-2"  # the scan's index named the GPU
    assert "NVML has not returned from scan (GPU-2)" in state.current.hung_calls[1].describe()
    state.apply(NvmlCallHung(1, "scan", None, 2, 100.0, 60.0, past_limit=True))
    health = state.current.health["GPU-2"]
    assert health.reason == "the driver has not answered for 60 s (scan)" and health.clears is Clears.PROBE
    changes = state.apply(NvmlCallHung(1, "scan", None, 2, 100.0, 61.0, past_limit=True, returned=True))
    assert not state.current.hung_calls and [c.what for c in changes] == ["nvml answered again"]
    assert state.current.reprobe_due() == (gpu,)


def test_a_hung_driver_call_keeps_serving_says_so_and_withholds_only_its_gpu(tmp_path: Path) -> None:
    with SimulatedNode(tmp_path) as node:
        node.config.write_text(
            "version: v1\nnvplug:\n  health:\n    nvmlCallDeadlineSeconds: 0.5\n    driverHangSeconds: 2\n"
        )
        gpus = node.scenario_gpus()
        node.kubelet.start()
        node.start_daemon()
        node.kubelet.wait_for(registered_with(len(gpus)), TIMEOUT)
        listen = f"unix:{node.status_socket}"
        victim = gpus[2]["uuid"]
        with node.control.blocked(2, "nvmlDeviceGetPciInfo_v3"):
            node.control.event(0, MIG_CONFIG_CHANGE)  # a rescan, which reads every GPU
            node.control.wait_blocked(1)
            log = node.wait_log("NVML has not returned from scan")
            assert "its GPU turns Unhealthy after 2 s" in log
            status, body = status_client.fetch(listen, "/healthz", timeout=5)
            assert status == 503 and f"NVML has not returned from scan ({victim})" in body
            # Serving goes on from the state: Allocate answers, the other GPUs stay Healthy.
            response = node.kubelet.allocate("nvidia.com/gpu", [gpus[0]["uuid"]])
            assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == gpus[0]["uuid"]
            node.kubelet.wait_for(device_health(victim, False), TIMEOUT)
            doc = status_client.status(listen, timeout=5)
            reasons = {g["uuid"]: g["reason"] for g in doc["gpus"]}
            assert reasons[victim].startswith("the driver has not answered for ")
            assert all(g["health"] == "Healthy" for g in doc["gpus"] if g["uuid"] != victim)
            _, metrics = status_client.fetch(listen, "/metrics", timeout=5)
            assert 'nvplug_nvml_errors_total{function="scan (hung)"} 1.0' in metrics
        # Released: the call returns, the deferred rescan runs, and its probe heals the GPU.
        node.kubelet.wait_for(device_health(victim, True), TIMEOUT)
        assert "NVML returned from scan" in node.wait_log("NVML returned from scan")
        assert status_client.fetch(listen, "/healthz", timeout=5)[0] == 200
