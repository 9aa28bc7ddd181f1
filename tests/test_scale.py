"""Costs independent of the device count: the cached, incremental projection; the ListAndWatch
encoder; GetPreferredAllocation's spread; the kubelet's 4 MiB message limit."""

from __future__ import annotations

import asyncio
import gc
import random
from collections import Counter
from pathlib import Path

import pytest

from nvplug.core.events import Event, InventoryFound, XidOccurred
from nvplug.core.gpu import Gpu
from nvplug.core.latest_snapshot import LatestSnapshot
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import Change
from nvplug.kubelet.allocation import AllocationError, AllocationPolicy, allocate, preferred
from nvplug.kubelet.device_plugin import (
    MAX_MESSAGE,
    DevicePluginService,
    ListEncoder,
    device_size,
    encode_device,
    list_size,
)
from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.shaping.resource_plan import Resource, ResourceSpec
from nvplug.testing.simulated_node import SimulatedNode

GPUS = tuple(Gpu(f"GPU-{i}", i, f"0000:{0x18 + i:02x}:00.0", minor=i, numa_node=i // 4) for i in range(8))
SHARED = ResourceSpec(replicas=16)
TIME_SLICED = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: {}\n"


class ShownState(NodeState):
    """A state that shows each new snapshot to the services, as their fleet's `update` does."""

    def __init__(self) -> None:
        super().__init__()
        self.shown = LatestSnapshot(self.current)

    def apply(self, event: Event) -> list[Change]:
        changes = super().apply(event)
        self.shown.show(self.current)
        return changes


def service(state: ShownState, spec: ResourceSpec = SHARED) -> DevicePluginService:
    return DevicePluginService(spec.name, state.shown, spec.project, Path("/"))


def fresh_state(gpus: tuple[Gpu, ...] = GPUS) -> ShownState:
    state = ShownState()
    state.apply(InventoryFound(gpus))
    return state


def same(a: Resource, b: Resource) -> None:
    """An incremental projection equals a projection from scratch, lookups and order included."""
    assert a.devices == b.devices
    assert all(a.get(d.id) == d and a.rank(d.id) == b.rank(d.id) for d in b.devices)
    assert a.healthy_count == b.healthy_count and set(a.known(d.id for d in b.devices)) == {d.id for d in b.devices}


def test_the_projection_is_cached_per_revision_and_follows_a_health_change() -> None:
    state = fresh_state()
    svc = service(state)
    first = svc.resource()
    assert svc.resource() is first  # no new projection without a new revision
    assert allocate(first, ["GPU-3::5"], AllocationPolicy(), str, lambda p: False).gpus[0].uuid == "GPU-3"
    state.apply(XidOccurred("GPU-3", 79))
    second = svc.resource()
    assert second is not first
    # A stale projection would hand out an Unhealthy replica.
    with pytest.raises(AllocationError, match=r"GPU-3::5.*Unhealthy"):
        allocate(second, ["GPU-3::5"], AllocationPolicy(), str, lambda p: False)
    # The GPUs that did not change keep their blocks; only GPU 3's replicas were made anew.
    reused = [b for b in second.blocks if any(b is old for old in first.blocks)]
    assert len(reused) == 7 and not second.get("GPU-3::0").health.healthy  # type: ignore[union-attr]
    same(second, SHARED.project(state.current))


def test_the_projection_follows_a_hot_add_and_remove() -> None:
    state = fresh_state(GPUS[:7])
    svc = service(state)
    assert svc.resource().get("GPU-7::0") is None
    state.apply(InventoryFound(GPUS))
    assert svc.resource().get("GPU-7::15") is not None
    same(svc.resource(), SHARED.project(state.current))
    state.apply(InventoryFound(GPUS[1:]))
    with pytest.raises(AllocationError, match="unknown device ID 'GPU-0::1'"):
        allocate(svc.resource(), ["GPU-0::1"], AllocationPolicy(), str, lambda p: False)
    same(svc.resource(), SHARED.project(state.current))


def test_a_reload_that_changes_the_replicas_projects_anew() -> None:
    state = fresh_state()
    assert service(state, ResourceSpec(replicas=16)).resource().get("GPU-0::15") is not None
    fewer = service(state, ResourceSpec(replicas=2)).resource()
    assert fewer.get("GPU-0::15") is None and len(fewer.devices) == 16


def test_incremental_projections_equal_fresh_ones_under_random_changes() -> None:
    rng = random.Random(7)
    state = fresh_state()
    previous = SHARED.project(state.current)
    for _ in range(200):
        roll = rng.random()
        if roll < 0.5:
            state.apply(XidOccurred(rng.choice(GPUS).uuid, rng.choice([13, 79, 31, 48])))
        elif roll < 0.8:
            state.apply(InventoryFound(tuple(g for g in GPUS if rng.random() < 0.8)))
        else:
            state.apply(InventoryFound(GPUS))
        current = SHARED.project(state.current, previous)
        same(current, SHARED.project(state.current))
        previous = current


def test_the_encoder_writes_what_protobuf_writes_and_reuses_blocks() -> None:
    state = fresh_state()
    encoder = ListEncoder()
    resource = SHARED.project(state.current)
    expected = pb.ListAndWatchResponse()
    for d in resource.devices:
        expected.devices.add(ID=d.id, health=d.health.health.value).topology.nodes.add(ID=d.gpu.numa_node)
    data = encoder.encode(resource)
    assert data == expected.SerializeToString()
    assert pb.ListAndWatchResponse.FromString(data) == expected
    assert list_size(resource.devices) == len(data)
    state.apply(XidOccurred("GPU-2", 79))
    after = SHARED.project(state.current, resource)
    decoded = pb.ListAndWatchResponse.FromString(encoder.encode(after))
    assert [d.health for d in decoded.devices if d.ID.startswith("GPU-2::")] == ["Unhealthy"] * 16
    assert sum(d.health == "Healthy" for d in decoded.devices) == 7 * 16
    for case in (("x", "Healthy", None), ("", "Unhealthy", 0), ("GPU-1::1023", "Healthy", 200), ("y" * 300, "", 1)):
        assert len(encode_device(*case)) == device_size(*case), case


def reference_spread(resource: Resource, candidates: list[str], chosen: list[str], size: int) -> list[str]:
    """The quadratic spread nvplug used before, kept as the oracle: the new one must choose the same."""

    def gpu_of(device_id: str) -> str:
        device = resource.get(device_id)
        assert device is not None
        return device.gpu.uuid

    free = Counter(gpu_of(i) for i in candidates)
    taken = Counter(gpu_of(i) for i in chosen)
    rest = [i for i in candidates if i not in set(chosen)]
    while len(chosen) < size:
        pick = min(rest, key=lambda i: (taken[gpu_of(i)], -free[gpu_of(i)]))
        rest.remove(pick)
        chosen.append(pick)
        taken[gpu_of(pick)] += 1
    return chosen


def test_the_spread_chooses_as_the_quadratic_one_did() -> None:
    rng = random.Random(3)
    resource = SHARED.project(fresh_state().current)
    ids = [d.id for d in resource.devices]
    for _ in range(300):
        available = rng.sample(ids, rng.randint(1, len(ids)))
        must = rng.sample(available, rng.randint(0, min(2, len(available))))
        size = rng.randint(max(1, len(must)), min(len(available), 8))
        candidates = sorted(set(available), key=resource.rank)
        want = reference_spread(resource, candidates, list(dict.fromkeys(must)), size)
        assert preferred(resource, available, must, size) == want


def sixty_four_gpu_scenario(path: Path) -> list[str]:
    """64 GPUs (the fake library's most) with 79-character UUIDs (NVML's buffer holds 80): real UUIDs are
    40 characters, and 64 GPUs of 1,024 replicas (the config's most) stay just under 4 MiB with them."""
    uuids = [f"GPU-{n:08x}-{'0' * 66}" for n in range(64)]
    lines = ["driver 550.54.15", "nvml 12.550.54.15", "cuda 12040"]
    lines += [f"gpu uuid={u} minor={n} bus=0000:{n + 1:02x}:00.0 numa={n // 32}" for n, u in enumerate(uuids)]
    path.write_text("\n".join(lines) + "\n")
    return uuids


def largest_replicas(uuids: list[str]) -> int:
    """The most replicas per GPU whose list still fits the kubelet's 4 MiB, by nvplug's own count."""

    def size(replicas: int) -> int:
        state = NodeState()
        gpus = tuple(Gpu(u, n, f"0000:{n + 1:02x}:00.0", numa_node=n // 32) for n, u in enumerate(uuids))
        state.apply(InventoryFound(gpus))
        return list_size(ResourceSpec(replicas=replicas).project(state.current).devices)

    low, high = 1, 1024  # size grows with the replicas: bisect
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if size(mid) <= MAX_MESSAGE else (low, mid - 1)
    return low


def test_the_kubelets_4_mib_limit(short_tmp: Path, nvml_lib_dir: Path) -> None:
    """At the largest list that fits, the stand-in (whose gRPC client takes 4 MiB, the kubelet's default)
    gets every device; one replica more and nvplug refuses the reload, naming count, size and limit."""
    scenario = short_tmp / "64.scenario"
    uuids = sixty_four_gpu_scenario(scenario)
    fits = largest_replicas(uuids)
    assert 100 < fits < 1024
    with SimulatedNode(short_tmp / "n", scenario=scenario, lib_dir=nvml_lib_dir) as node:
        node.config.write_text(TIME_SLICED.format(fits))
        node.kubelet.start()
        daemon = node.start_daemon(log_level="info")
        devices = 64 * fits
        node.kubelet.wait_for(lambda k: (p := k.plugin("nvidia.com/gpu")) is not None and p.capacity == devices, 60)
        node.config.write_text(TIME_SLICED.format(fits + 1))
        daemon.send_signal(1)  # SIGHUP
        log = node.wait_log("reload refused", timeout=60)
        assert f"would advertise {64 * (fits + 1):,} devices in a" in log
        assert f"over the kubelet's {MAX_MESSAGE:,}-byte limit" in log
        plugin = node.kubelet.plugin("nvidia.com/gpu")
        assert plugin is not None and plugin.capacity == devices and plugin.stream_open


def test_a_list_over_the_limit_is_not_advertised_from_the_start(short_tmp: Path, nvml_lib_dir: Path) -> None:
    scenario = short_tmp / "64.scenario"
    uuids = sixty_four_gpu_scenario(scenario)
    too_many = largest_replicas(uuids) + 1
    with SimulatedNode(short_tmp / "n", scenario=scenario, lib_dir=nvml_lib_dir) as node:
        node.config.write_text(TIME_SLICED.format(too_many))
        node.kubelet.start()
        node.start_daemon(log_level="info")
        node.wait_log("not advertised: nvidia.com/gpu would advertise", timeout=60)
        from nvplug.status import status_client as statusclient

        # The plan is refused while the parts start; the status endpoint is served once they have.
        node.wait_log("status endpoint on", timeout=60)
        code, text = statusclient.fetch(f"unix:{node.status_socket}", "/healthz", timeout=10)
        assert code == 503 and "not advertised: nvidia.com/gpu would advertise" in text
        assert node.kubelet.plugin("nvidia.com/gpu") is None


def test_allocate_needs_no_projection_per_call() -> None:
    """Allocate through the service: one projection serves every call of a revision."""
    state = fresh_state()
    calls = []

    def counting(snapshot: object, previous: Resource | None) -> Resource:
        calls.append(1)
        return SHARED.project(state.current, previous)

    svc = DevicePluginService("nvidia.com/gpu", state.shown, counting, Path("/"))

    class Context:
        async def abort(self, code: object, details: str) -> None:
            raise AssertionError(details)

    async def run() -> None:
        for i in range(50):
            request = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"GPU-1::{i % 16}"])]
            )
            await svc.Allocate(request, Context())  # type: ignore[arg-type]

    asyncio.run(run())
    assert len(calls) == 1


def test_collections_wait_until_the_list_is_handed_over() -> None:
    """A GPU's thousand new replicas set off the cyclic collector: it runs after the message is handed
    to gRPC, not between the fault and the kubelet; and it is never left off."""
    state = fresh_state()
    collecting: list[bool] = []

    def projection(snapshot: object, previous: Resource | None) -> Resource:
        collecting.append(gc.isenabled())
        return SHARED.project(state.current, previous)

    svc = DevicePluginService("nvidia.com/gpu", state.shown, projection, Path("/"))

    async def run() -> None:
        stream = svc.ListAndWatch(pb.Empty(), None)  # type: ignore[arg-type]
        await anext(stream)
        state.apply(XidOccurred("GPU-3", 79))
        message = await anext(stream)
        assert pb.ListAndWatchResponse.FromString(message).devices[3 * 16].health == "Unhealthy"
        assert not gc.isenabled()  # handed over, and gRPC not yet past it
        await asyncio.sleep(0)
        assert gc.isenabled()
        await stream.aclose()

    assert gc.isenabled()
    asyncio.run(run())
    assert collecting == [False, False] and gc.isenabled()
