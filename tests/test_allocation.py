"""Allocate and GetPreferredAllocation answers, from state alone."""

from __future__ import annotations

import pytest

from nvplug.allocation import CONTROL_NODES, AllocationError, allocate, preferred
from nvplug.event import HealthReported, InventoryFound
from nvplug.gpu import Gpu
from nvplug.health import Health
from nvplug.resources import Resource, whole_gpus
from nvplug.state import NodeState


@pytest.fixture
def resource() -> Resource:
    state = NodeState()
    gpus = tuple(Gpu(uuid=f"GPU-{i}", index=i, bus_id=f"0000:{i:02x}:00.0", minor=i) for i in range(4))
    state.apply(InventoryFound(gpus))
    state.apply(HealthReported("GPU-3", Health.UNHEALTHY, "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS"))
    return whole_gpus(state.current)


def host(path: str) -> str:
    return "/host" + path


def test_allocate_two_gpus(resource: Resource) -> None:
    present = {"/host/dev/nvidiactl", "/host/dev/nvidia-uvm"}
    out = allocate(resource, ["GPU-2", "GPU-0"], host, present.__contains__)
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-2,GPU-0"}
    assert [(n.container_path, n.host_path, n.permissions) for n in out.device_nodes] == [
        ("/dev/nvidia2", "/host/dev/nvidia2", "rw"),
        ("/dev/nvidia0", "/host/dev/nvidia0", "rw"),
        ("/dev/nvidiactl", "/host/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", "/host/dev/nvidia-uvm", "rw"),
    ]


def test_allocate_includes_every_control_node_present(resource: Resource) -> None:
    out = allocate(resource, ["GPU-0"], host, lambda p: True)
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
        allocate(resource, ids, host, lambda p: False)


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
