"""MPS from state alone: the groups a config makes, their health at the kubelet, Allocate's and the
CDI spec's view of a group, and the state's record of compute modes."""

from __future__ import annotations

import pytest

from nvplug import config
from nvplug.core.events import ComputeModeRecorded, InventoryFound, MpsGroupChanged, MpsGroupRemoved
from nvplug.core.gpu import Gpu, MigDevice
from nvplug.core.node_state import NodeState
from nvplug.kubelet.allocation import AllocationError, AllocationPolicy, allocate
from nvplug.shaping.resource_plan import mps_groups, plan
from nvplug.sinks.cdi.cdi_publisher import CdiSettings, SpecPublisher

H100 = "NVIDIA H100 80GB HBM3"
ROOT = "/run/nvplug/mps"


def gpu(i: int, mig: tuple[str, ...] = (), cc: tuple[int, int] = (9, 0)) -> Gpu:
    migs = tuple(MigDevice(f"MIG-{i}-{n}", n + 1, 0, p, memory_mib=10240) for n, p in enumerate(mig))
    return Gpu(f"GPU-{i:08x}-0000-0000-0000-000000000000", i, f"0000:{0x18 + i:02x}:00.0", minor=i, name=H100,
               memory_mib=81920, compute_capability=cc, mig_enabled=bool(mig), mig=migs)  # fmt: skip


def node(*gpus: Gpu) -> NodeState:
    state = NodeState()
    state.apply(InventoryFound(gpus))
    return state


def load(text: str) -> config.Config:
    return config.parse(text, "c.yaml")


FOUR_ON_TWO = """version: v1
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      devices: [0, 1]
      rename: nvidia.com/gpu.mps
      replicas: 4
"""


def ready(state: NodeState, cfg: config.Config) -> None:
    for g in mps_groups(cfg, state.current).values():
        state.apply(MpsGroupChanged(g.name, g.resource, g.uuids, True, "up", 42, 0, g.thread_percentage,
                                    g.pinned_mib))  # fmt: skip


def test_one_group_of_whole_gpus_with_the_equal_split() -> None:
    state = node(gpu(0), gpu(1), gpu(2))
    cfg = load(FOUR_ON_TWO)
    (group,) = mps_groups(cfg, state.current).values()
    assert group.name == "nvidia.com_gpu.mps" and group.resource == "nvidia.com/gpu.mps"
    assert group.uuids == (gpu(0).uuid, gpu(1).uuid)
    assert group.thread_percentage == 25 and group.pinned_mib == (20480, 20480)
    assert group.pipe_dir(ROOT) == "/run/nvplug/mps/nvidia.com_gpu.mps/pipe"


def test_limits_from_nvplug_mps_resources() -> None:
    cfg = load(FOUR_ON_TWO + "nvplug:\n  mps:\n    resources:\n    - name: gpu.mps\n"
               "      activeThreadPercentage: 40\n      pinnedMemoryLimit: 8G\n")  # fmt: skip
    (group,) = mps_groups(cfg, node(gpu(0), gpu(1)).current).values()
    assert group.thread_percentage == 40 and group.pinned_mib == (8192, 8192)


def test_devices_are_unhealthy_until_their_daemon_answers_and_again_when_it_dies() -> None:
    state = node(gpu(0), gpu(1), gpu(2))
    cfg = load(FOUR_ON_TWO)
    spec = next(s for s in plan(cfg, state.current).served if s.name == "nvidia.com/gpu.mps")
    before = spec.project(state.current)
    assert len(before.devices) == 8 and before.healthy_count == 0
    assert before.devices[0].health.reason == "its MPS control daemon has not started yet"
    whole = next(s for s in plan(cfg, state.current).served if s.name == "nvidia.com/gpu")
    assert whole.project(state.current).healthy_count == 1  # GPU 2 is not shared, nor held back
    ready(state, cfg)
    up = spec.project(state.current, before)
    assert up.healthy_count == 8
    (group,) = up.mps_groups
    state.apply(MpsGroupChanged(group.name, group.resource, group.uuids, False, "it exited with status 1"))
    down = spec.project(state.current, up)
    assert down.healthy_count == 0 and down.devices[3].health.reason == "it exited with status 1"
    state.apply(MpsGroupRemoved(group.name))
    assert spec.project(state.current).devices[0].health.reason == "its MPS control daemon has not started yet"


def test_a_mig_device_is_a_group_of_its_own() -> None:
    state = node(gpu(0, ("3g.40gb", "3g.40gb")), gpu(1))
    cfg = load("version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  mps:\n    resources:\n"
               "    - name: nvidia.com/mig-3g.40gb\n      replicas: 2\n")  # fmt: skip
    groups = mps_groups(cfg, state.current)
    assert sorted(groups) == ["MIG-0-0", "MIG-0-1"]
    assert groups["MIG-0-0"].uuids == ("MIG-0-0",) and groups["MIG-0-0"].pinned_mib == (5120,)
    # No compute mode for a GPU in MIG mode: NVML refuses it there.
    assert groups["MIG-0-0"].exclusive_gpus == ()


def test_gpus_older_than_volta_are_refused_for_mps() -> None:
    state = node(gpu(0, cc=(6, 0)), gpu(1))
    found = plan(load(FOUR_ON_TWO), state.current)
    assert "compute capability 6.0; MPS limits need Volta (7.0) or newer" in found.refused["nvidia.com/gpu.mps"]


def test_an_mps_entry_without_a_rename_must_take_all_devices() -> None:
    state = node(gpu(0), gpu(1))
    cfg = load("version: v1\nsharing:\n  mps:\n    resources:\n    - name: gpu\n      devices: [0]\n"
               "      replicas: 2\n")  # fmt: skip
    assert "must share all devices of nvidia.com/gpu" in plan(cfg, state.current).refused["nvidia.com/gpu"]


POLICY = AllocationPolicy(mps_root=ROOT, pass_device_specs=False)


def test_allocate_hands_out_the_groups_pipe_and_shm() -> None:
    state = node(gpu(0), gpu(1))
    cfg = load(FOUR_ON_TWO)
    ready(state, cfg)
    spec = next(s for s in plan(cfg, state.current).served if s.name == "nvidia.com/gpu.mps")
    resource = spec.project(state.current)
    out = allocate(resource, [f"{gpu(1).uuid}::2"], POLICY, lambda p: p, lambda p: False)
    pipe = "/run/nvplug/mps/nvidia.com_gpu.mps/pipe"
    assert out.envs["CUDA_MPS_PIPE_DIRECTORY"] == pipe and out.envs["NVIDIA_VISIBLE_DEVICES"] == gpu(1).uuid
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in out.envs
    assert [(m.container_path, m.host_path, m.read_only) for m in out.mounts] == [
        (pipe, pipe, False),
        ("/dev/shm", "/run/nvplug/mps/shm", False),
    ]
    limited = allocate(resource, [f"{gpu(1).uuid}::0"], AllocationPolicy(mps_root=ROOT, mps_client_limits=True),
                       lambda p: p, lambda p: False)  # fmt: skip
    assert limited.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert limited.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"  # the container's device 0
    with pytest.raises(AllocationError, match="failRequestsGreaterThanOne"):
        allocate(resource, [f"{gpu(0).uuid}::0", f"{gpu(1).uuid}::0"], POLICY, lambda p: p, lambda p: False)


def test_allocate_refuses_devices_of_two_groups_in_one_container() -> None:
    state = node(gpu(0, ("3g.40gb", "3g.40gb")))
    cfg = load("version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  mps:\n    resources:\n"
               "    - name: nvidia.com/mig-3g.40gb\n      replicas: 2\n")  # fmt: skip
    ready(state, cfg)
    spec = plan(cfg, state.current).served[0]
    resource = spec.project(state.current)
    unlimited = type(spec)(spec.name, spec.replicas, False, spec.base, spec.naming, mps=spec.mps)
    two = unlimited.project(state.current)
    with pytest.raises(
        AllocationError, match=r"belong to 2 MPS groups \(MIG-0-0, MIG-0-1\); .* one MPS control daemon"
    ):
        allocate(two, ["MIG-0-0::0", "MIG-0-1::0"], POLICY, lambda p: p, lambda p: False)
    out = allocate(resource, ["MIG-0-1::1"], POLICY, lambda p: p, lambda p: False)
    assert out.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvplug/mps/MIG-0-1/pipe"


def test_the_cdi_spec_carries_the_same_edits(tmp_path: object) -> None:
    state = node(gpu(0), gpu(1), gpu(2))
    cfg = load(FOUR_ON_TWO + "nvplug:\n  mps:\n    clientLimits: true\n")
    ready(state, cfg)
    publisher = SpecPublisher(CdiSettings.from_config(cfg))
    specs, _ = publisher.specs(state.current)
    devices = specs[0].as_dict()["devices"]
    assert isinstance(devices, list)
    edits = {d["name"]: d["containerEdits"] for d in devices}
    pipe = "/run/nvplug/mps/nvidia.com_gpu.mps/pipe"
    assert edits[gpu(1).uuid]["env"] == [
        f"CUDA_MPS_PIPE_DIRECTORY={pipe}",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M",
    ]
    assert edits[gpu(1).uuid]["mounts"] == [
        {"hostPath": pipe, "containerPath": pipe, "options": ["rw", "nosuid", "nodev", "bind"]},
        {"hostPath": "/run/nvplug/mps/shm", "containerPath": "/dev/shm", "options": ["rw", "nosuid", "nodev", "bind"]},
    ]
    assert "env" not in edits[gpu(2).uuid] and "mounts" not in edits[gpu(2).uuid]


def test_compute_modes_recorded_and_dropped_bump_the_revision() -> None:
    state = node(gpu(0))
    before = state.current.revision
    state.apply(ComputeModeRecorded(gpu(0).uuid, 0))
    assert state.current.compute_modes == {gpu(0).uuid: 0} and state.current.revision == before + 1
    state.apply(ComputeModeRecorded(gpu(0).uuid, None))
    assert state.current.compute_modes == {}
