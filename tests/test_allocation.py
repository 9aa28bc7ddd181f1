"""Allocate and GetPreferredAllocation answers, from state alone."""

from __future__ import annotations

import pytest

from nvplug import config
from nvplug.cdi.cdi_spec import GPU_KIND
from nvplug.core.events import HealthReported, InventoryFound
from nvplug.core.gpu import Gpu
from nvplug.core.node_state import NodeState
from nvplug.kubelet.allocation import (
    CONTROL_NODES,
    AllocationError,
    AllocationPolicy,
    ContainerAllocation,
    allocate,
    preferred,
)
from nvplug.shaping.resource_plan import Resource, ResourceSpec


@pytest.fixture
def resource() -> Resource:
    state = NodeState()
    gpus = tuple(Gpu(uuid=f"GPU-{i}", index=i, bus_id=f"0000:{i:02x}:00.0", minor=i) for i in range(4))
    state.apply(InventoryFound(gpus))
    state.apply(HealthReported("GPU-3", "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS"))
    return ResourceSpec().project(state.current)


POLICY = AllocationPolicy()


def host(path: str) -> str:
    return "/host" + path


def test_allocate_two_gpus(resource: Resource) -> None:
    present = {"/host/dev/nvidiactl", "/host/dev/nvidia-uvm"}
    out = allocate(resource, ["GPU-2", "GPU-0"], POLICY, host, present.__contains__)
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-2,GPU-0"}
    assert [(n.container_path, n.host_path, n.permissions) for n in out.device_nodes] == [
        ("/dev/nvidia2", "/host/dev/nvidia2", "rw"),
        ("/dev/nvidia0", "/host/dev/nvidia0", "rw"),
        ("/dev/nvidiactl", "/host/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", "/host/dev/nvidia-uvm", "rw"),
    ]


def test_allocate_includes_every_control_node_present(resource: Resource) -> None:
    out = allocate(resource, ["GPU-0"], POLICY, host, lambda p: True)
    assert [n.container_path for n in out.device_nodes] == ["/dev/nvidia0", *CONTROL_NODES]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (["GPU-9"], "unknown device ID 'GPU-9'"),
        (["GPU-0", "GPU-3"], "'GPU-3' is Unhealthy: XID 79"),
        (["GPU-1", "GPU-1"], "'GPU-1' is requested twice"),
        ([], "names no device"),
    ],
)
def test_allocate_refusals_name_the_id(resource: Resource, ids: list[str], message: str) -> None:
    with pytest.raises(AllocationError, match=message):
        allocate(resource, ids, POLICY, host, lambda p: False)


def test_preferred_must_include_first_then_lowest_index(resource: Resource) -> None:
    assert preferred(resource, ["GPU-2", "GPU-1", "GPU-0"], ["GPU-2"], 2) == ["GPU-2", "GPU-0"]
    assert preferred(resource, ["GPU-2", "GPU-1", "GPU-0"], [], 3) == ["GPU-0", "GPU-1", "GPU-2"]


@pytest.mark.parametrize(
    ("available", "must", "size", "message"),
    [
        (["GPU-0"], [], 0, "not positive"),
        (["GPU-0"], [], 2, "exceeds the 1 available"),
        (["GPU-0", "GPU-1"], ["GPU-2"], 1, "not among the available"),
        (["GPU-0", "GPU-1"], ["GPU-0", "GPU-1"], 1, "exceed allocation size"),
    ],
)
def test_preferred_refuses_impossible_requests(
    resource: Resource, available: list[str], must: list[str], size: int, message: str
) -> None:
    with pytest.raises(AllocationError, match=message):
        preferred(resource, available, must, size)


# --- device-list and ID strategies, time-slicing -----------------------------------


def test_each_list_strategy_and_both_id_strategies(resource: Resource) -> None:
    def run(policy: AllocationPolicy) -> ContainerAllocation:
        return allocate(resource, ["GPU-2", "GPU-1"], policy, host, lambda p: False)

    out = run(AllocationPolicy(list_strategies=("envvar",), id_strategy="index"))
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": "2,1"}
    out = run(AllocationPolicy(list_strategies=("volume-mounts",)))
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert [(m.container_path, m.host_path) for m in out.mounts] == [
        ("/var/run/nvidia-container-devices/GPU-2", "/dev/null"),
        ("/var/run/nvidia-container-devices/GPU-1", "/dev/null"),
    ]
    out = run(AllocationPolicy(list_strategies=("cdi-annotations",), cdi_annotation_prefix="cdi.k8s.io/"))
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": "void"}
    ((key, value),) = out.annotations.items()
    assert key.startswith("cdi.k8s.io/nvplug_") and value == f"{GPU_KIND}=GPU-2,{GPU_KIND}=GPU-1"
    out = run(AllocationPolicy(list_strategies=("cdi-cri",), id_strategy="index"))
    assert out.cdi_devices == (f"{GPU_KIND}=2", f"{GPU_KIND}=1")
    out = run(AllocationPolicy(list_strategies=("envvar", "cdi-cri"), pass_device_specs=False))
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-2,GPU-1"} and out.device_nodes == ()
    assert out.cdi_devices == (f"{GPU_KIND}=GPU-2", f"{GPU_KIND}=GPU-1")
    with pytest.raises(ValueError, match="unknown strategy"):
        AllocationPolicy(list_strategies=("carrier-pigeon",))


def shared_resource(replicas: int = 4, fail_gt_one: bool = False) -> Resource:
    state = NodeState()
    state.apply(
        InventoryFound(tuple(Gpu(uuid=f"GPU-{i}", index=i, bus_id=f"0000:{i:02x}:00.0", minor=i) for i in range(3)))
    )
    spec = ResourceSpec("nvidia.com/gpu.shared", replicas, fail_requests_greater_than_one=fail_gt_one)
    return spec.project(state.current)


def test_replicas_are_advertised_and_folded_to_their_gpus() -> None:
    resource = shared_resource()
    assert [d.id for d in resource.devices][:5] == ["GPU-0::0", "GPU-0::1", "GPU-0::2", "GPU-0::3", "GPU-1::0"]
    out = allocate(resource, ["GPU-1::0", "GPU-1::3", "GPU-2::1"], POLICY, host, lambda p: False)
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-1,GPU-2"}
    assert [n.container_path for n in out.device_nodes] == ["/dev/nvidia1", "/dev/nvidia2"]


def test_fail_requests_greater_than_one() -> None:
    resource = shared_resource(fail_gt_one=True)
    assert allocate(resource, ["GPU-0::1"], POLICY, host, lambda p: False).envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
    with pytest.raises(AllocationError, match=r"2 replicas requested.*\(failRequestsGreaterThanOne\)"):
        allocate(resource, ["GPU-0::1", "GPU-1::1"], POLICY, host, lambda p: False)


def test_preferred_replicas_spread_over_the_least_loaded_gpus() -> None:
    resource = shared_resource()
    # GPU-0 has one replica left, GPU-1 two, GPU-2 all four: the freest GPUs come first.
    available = ["GPU-0::3", "GPU-1::2", "GPU-1::3", "GPU-2::0", "GPU-2::1", "GPU-2::2", "GPU-2::3"]
    assert preferred(resource, available, [], 2) == ["GPU-2::0", "GPU-1::2"]
    assert preferred(resource, available, [], 4) == ["GPU-2::0", "GPU-1::2", "GPU-0::3", "GPU-2::1"]
    assert preferred(resource, available, ["GPU-1::3"], 2) == ["GPU-1::3", "GPU-2::0"]


def test_packed_fills_the_busiest_gpu_before_the_next() -> None:
    resource = shared_resource()
    available = ["GPU-0::3", "GPU-1::2", "GPU-1::3", "GPU-2::0", "GPU-2::1", "GPU-2::2", "GPU-2::3"]
    # GPU-0 has one replica left (the busiest), then GPU-1 with two: packed fills them in that order.
    assert preferred(resource, available, [], 2, packed=True) == ["GPU-0::3", "GPU-1::2"]
    assert preferred(resource, available, [], 3, packed=True) == ["GPU-0::3", "GPU-1::2", "GPU-1::3"]
    # A must-include replica draws the rest to its GPU.
    assert preferred(resource, available, ["GPU-2::3"], 3, packed=True) == ["GPU-2::3", "GPU-2::0", "GPU-2::1"]
    # Distributed, the default, is unchanged by the option's existence.
    assert preferred(resource, available, [], 2) == preferred(resource, available, [], 2, packed=False)


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ("version: v1\n", "distributed"),
        ("flags: {plugin: {sharedDevicesAllocationPolicy: packed}}", "packed"),
        ("sharing: {timeSlicing: {sharedDevicesAllocationPolicy: packed}}", "packed"),
        (
            "flags: {plugin: {sharedDevicesAllocationPolicy: packed}}\n"
            "sharing: {timeSlicing: {sharedDevicesAllocationPolicy: packed}}",
            "packed",
        ),
    ],
)
def test_shared_devices_allocation_policy_in_nvidias_place_or_under_time_slicing(text: str, policy: str) -> None:
    cfg = config.parse(text, "t.yaml")
    assert cfg.shared_policy == policy
    assert config.parse(config.to_yaml(cfg), "again").shared_policy == policy


def test_shared_devices_allocation_policy_errors() -> None:
    with pytest.raises(config.ConfigError, match=r"disagrees with flags\.plugin\.sharedDevicesAllocationPolicy"):
        config.parse(
            "flags: {plugin: {sharedDevicesAllocationPolicy: packed}}\n"
            "sharing: {timeSlicing: {sharedDevicesAllocationPolicy: distributed}}",
            "t.yaml",
        )
    with pytest.raises(config.ConfigError, match="sharedDevicesAllocationPolicy"):
        config.parse("flags: {plugin: {sharedDevicesAllocationPolicy: tight}}", "t.yaml")
