"""The kubelet's DRA resource-health stream: what a 1.36 kubelet stand-in receives from nvplug on an
XID, a heal and a hung driver, and the resend that keeps a quiet device from turning Unknown."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from types import MappingProxyType

import pytest
from support.apiserver_standin import FakeApiServer
from support.dra_kubelet_standin import DraKubelet, HealthUpdate
from test_dra import naming
from test_dra_e2e import DRIVER, NODE, Dra, serving, serving_136
from test_driver_hang import MIG_CONFIG_CHANGE
from test_health import heal

from nvplug.core.gpu import Gpu
from nvplug.core.health import Clears, Fault, Health, HealthState
from nvplug.core.snapshot import HungCall, Snapshot
from nvplug.dra.dra_devices import offered
from nvplug.dra.dra_driver import health_reports
from nvplug.dra.resource_health import RESEND_SECONDS, TIMEOUT_SECONDS
from nvplug.testing.simulated_node import SimulatedNode

TIMEOUT = 15.0


@pytest.fixture
def dra(node: SimulatedNode) -> Iterator[Dra]:
    yield from serving_136(node)


@pytest.fixture
def dra_137(node: SimulatedNode) -> Iterator[Dra]:
    api = FakeApiServer(versions=("v1",), netns=node.netns)
    api.start()
    yield from serving(node, api, DraKubelet(node.root / "registry", NODE, "1.37", api))


def received(dra: Dra, check: Callable[[HealthUpdate], bool], what: str, since: float = 0.0) -> HealthUpdate:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        for update in list(dra.kubelet.health):
            if update.at >= since and check(update):
                return update
        time.sleep(0.005)
    raise AssertionError(f"no health update for {what}; received: {dra.kubelet.health[-3:]}")


def test_the_health_stream_on_an_xid_a_heal_and_a_hung_driver(dra: Dra) -> None:
    dra.start(dra.config() + "  health:\n    nvmlCallDeadlineSeconds: 0.5\n")
    first = received(dra, lambda u: len(u.devices) == 4, "the first list")
    assert set(first.devices) == {"gpu-4", "gpu-5", "gpu-6", "gpu-7"}
    assert all(h == ("HEALTHY", "") for h in first.devices.values())
    assert set(first.timeout.values()) == {TIMEOUT_SECONDS}
    # An XID: Unhealthy with its reason, within milliseconds, the other devices still listed.
    t0 = time.monotonic()
    dra.node.control.xid(5, 79)
    sick = received(dra, lambda u: u.devices.get("gpu-5", ("",))[0] == "UNHEALTHY", "the XID", t0)
    print(f"XID 79 -> Unhealthy in the health stream: {(sick.at - t0) * 1000:.1f} ms; {sick.devices['gpu-5']}")
    assert "XID 79" in sick.devices["gpu-5"][1] and len(sick.devices) == 4
    assert sick.devices["gpu-4"] == ("HEALTHY", "")
    # An operator's heal (as after a reset): Healthy again.
    t0 = time.monotonic()
    assert heal(dra.node, "5").returncode == 0
    received(dra, lambda u: u.devices.get("gpu-5") == ("HEALTHY", ""), "the heal", t0)
    # A hung driver: Unknown for the device whose GPU nvplug cannot check, the others as they are.
    t0 = time.monotonic()
    with dra.node.control.blocked(6, "nvmlDeviceGetPciInfo_v3"):
        dra.node.control.event(0, MIG_CONFIG_CHANGE)  # a rescan, which reads every GPU
        hung = received(dra, lambda u: u.devices.get("gpu-6", ("",))[0] == "UNKNOWN", "the hang", t0)
        print(f"a hung NVML call on GPU 6 -> {hung.devices['gpu-6']}")
        assert hung.devices["gpu-4"] == ("HEALTHY", "")
    received(dra, lambda u: u.devices.get("gpu-6") == ("HEALTHY", ""), "the call's return", time.monotonic())


def test_a_quiet_device_is_reported_again_before_the_kubelets_timeout(dra: Dra) -> None:
    dra.start()
    first = received(dra, lambda u: len(u.devices) == 4, "the first list")
    again = received(dra, lambda u: True, "a resend", first.at + 0.001)
    gap = again.at - first.at
    print(f"resend after {gap:.2f} s of quiet (the kubelet's timeout: {TIMEOUT_SECONDS} s)")
    assert RESEND_SECONDS * 0.8 < gap < TIMEOUT_SECONDS / 2
    assert again.devices == first.devices


def test_a_kubelet_that_picks_the_health_service_from_getinfo_takes_v1(dra_137: Dra) -> None:
    dra_137.start()
    first = received(dra_137, lambda u: len(u.devices) == 4, "the first list")
    assert dra_137.kubelet.health_services[DRIVER] == "v1.DRAResourceHealth"
    assert all(h == ("HEALTHY", "") for h in first.devices.values())
    t0 = time.monotonic()
    dra_137.node.control.xid(4, 79)
    sick = received(dra_137, lambda u: u.devices.get("gpu-4", ("",))[0] == "UNHEALTHY", "the XID", t0)
    assert "XID 79" in sick.devices["gpu-4"][1]


def test_which_devices_a_hung_call_leaves_unknown() -> None:
    g0, g1 = Gpu("GPU-0", 0, "0000:18:00.0"), Gpu("GPU-1", 1, "0000:19:00.0")
    xid = HealthState(Health.UNHEALTHY, "XID 79", 0.0, Clears.RESET, fault=Fault.XID, xid=79)
    health = {"GPU-0": HealthState(Health.HEALTHY, "discovered", 0.0), "GPU-1": xid}

    def reports(*hung: HungCall) -> list[tuple[str, str, str]]:
        snap = Snapshot(1, gpus=(g0, g1), health=MappingProxyType(health),
                        hung_calls=MappingProxyType(dict(enumerate(hung))))  # fmt: skip
        return [(r.device, r.health, r.message) for r in health_reports(offered(snap, naming("")))]

    assert reports() == [("gpu-0", "Healthy", ""), ("gpu-1", "Unhealthy", "XID 79")]
    # A scan that hangs on GPU 0 names it by index; a probe by UUID; a call that names neither, every GPU.
    # A known fault stays Unhealthy through a hang: nvplug knows it is broken.
    assert [h for _, h, _ in reports(HungCall("scan", None, 0, 0.0))] == ["Unknown", "Unhealthy"]
    assert [h for _, h, _ in reports(HungCall("probe", "GPU-0", None, 0.0))] == ["Unknown", "Unhealthy"]
    assert [h for _, h, _ in reports(HungCall("scan", None, None, 0.0))] == ["Unknown", "Unhealthy"]
    assert [h for _, h, _ in reports(HungCall("probe", "GPU-1", None, 0.0))] == ["Healthy", "Unhealthy"]
    # A fault of a GPU nvplug cannot check (the driver past its deadline) is Unknown too, with the reason.
    health["GPU-1"] = HealthState(Health.UNHEALTHY, "the driver has not answered for 60 s (probe)", 0.0,
                                  Clears.PROBE, fault=Fault.UNMONITORED)  # fmt: skip
    assert reports()[1] == ("gpu-1", "Unknown", "nvplug cannot check it: the driver has not answered for 60 s (probe)")
