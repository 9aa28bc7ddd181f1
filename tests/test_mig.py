"""MIG facts without NVML: profile names and the capability minors."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvplug import config
from nvplug.core.events import EvidenceFound, InventoryFound, PciChanged, ProbeResult, XidOccurred
from nvplug.core.gpu import Gpu, MigDevice
from nvplug.core.health import Health
from nvplug.core.mig import parse_mig_minors, profile_name, read_mig_minors
from nvplug.core.node_state import NodeState
from nvplug.shaping.resource_plan import mig_spec
from nvplug.shaping.resource_plan import plan as plan_resources

H100 = 81559  # MiB, an H100 80GB HBM3
A100 = 40960  # MiB, an A100 40GB


@pytest.mark.parametrize(
    ("gi", "ci", "memory_mb", "total", "ofa", "name"),
    [
        (1, 1, 9856, H100, 0, "1g.10gb"),
        (1, 1, 9856, H100, 1, "1g.10gb.me"),
        (1, 1, 19968, H100, 0, "1g.20gb"),
        (2, 2, 19968, H100, 0, "2g.20gb"),
        (3, 3, 40192, H100, 0, "3g.40gb"),
        (4, 4, 40192, H100, 0, "4g.40gb"),
        (7, 7, 80896, H100, 1, "7g.80gb"),
        (2, 1, 19968, H100, 0, "1c.2g.20gb"),
        (1, 1, 4864, A100, 0, "1g.5gb"),
        (3, 3, 19968, A100, 0, "3g.20gb"),
    ],
)
def test_profile_names(gi: int, ci: int, memory_mb: int, total: int, ofa: int, name: str) -> None:
    assert profile_name(gi, ci, memory_mb, total, ofa) == name


def test_mig_minors_table(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "config 1",
            "monitor 2",
            "gpu0/gi1/access 12",
            "gpu0/gi1/ci0/access 13",
            "gpu1/gi2/access 161",
            "gpu1/gi2/ci0/access 162",
            "garbage",
            "gpu0/gix/access 9",
        ]
    )
    minors = parse_mig_minors(text)
    assert minors.nodes(0, 1, 0) == ("/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13")
    assert minors.nodes(1, 2, 0) == ("/dev/nvidia-caps/nvidia-cap161", "/dev/nvidia-caps/nvidia-cap162")
    assert minors.nodes(0, 2, 0) is None
    (tmp_path / "driver/nvidia-caps").mkdir(parents=True)
    (tmp_path / "driver/nvidia-caps/mig-minors").write_text(text)
    assert read_mig_minors(tmp_path) == minors
    assert read_mig_minors(tmp_path / "absent").nodes(0, 1, 0) is None


# --- MIG in the state and the strategies ---------------------------------------------


def mig_gpu(i: int, profiles: list[str]) -> Gpu:
    migs = tuple(
        MigDevice(f"MIG-{i}-{n}", gpu_instance=n + 1, compute_instance=0, profile=p) for n, p in enumerate(profiles)
    )
    return Gpu(f"GPU-{i}", i, f"0000:{i:02x}:00.0", minor=i, mig_enabled=bool(profiles), mig=migs)


def node(*gpus: Gpu) -> NodeState:
    state = NodeState()
    state.apply(InventoryFound(gpus))
    return state


def plan(strategy: str, state: NodeState) -> tuple[list[str], str | None]:
    cfg = config.parse(f"version: v1\nflags:\n  migStrategy: {strategy}\n", "c.yaml")
    found = plan_resources(cfg, state.current)
    return [f"{s.name}={len(s.project(state.current).devices)}" for s in found.specs], found.error


def test_strategies_on_a_mixed_node() -> None:
    state = node(mig_gpu(0, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]), mig_gpu(1, []), mig_gpu(2, ["1g.10gb"] * 7))
    assert plan("none", state) == (["nvidia.com/gpu=3"], None)
    assert plan("mixed", state) == (
        ["nvidia.com/gpu=1", "nvidia.com/mig-1g.10gb=9", "nvidia.com/mig-2g.20gb=1", "nvidia.com/mig-3g.40gb=1"],
        None,
    )
    specs, error = plan("single", state)
    assert specs == [] and error is not None and "GPUs without MIG" in error


def test_single_serves_one_profile_as_the_gpu_resource() -> None:
    state = node(mig_gpu(0, ["1g.10gb"] * 7), mig_gpu(1, ["1g.10gb"] * 7))
    assert plan("single", state) == (["nvidia.com/gpu=14"], None)
    two = node(mig_gpu(0, ["1g.10gb"] * 7), mig_gpu(1, ["3g.40gb"]))
    specs, error = plan("single", two)
    assert specs == [] and "MIG profiles nvidia.com/gpu: ['1g.10gb', '3g.40gb']" in (error or "")
    assert plan("single", node(mig_gpu(0, []), mig_gpu(1, []))) == (["nvidia.com/gpu=2"], None)


def test_instance_scoped_xid_marks_only_its_mig_device() -> None:
    state = node(mig_gpu(0, ["1g.10gb"] * 3))
    state.apply(XidOccurred("GPU-0", 79, gpu_instance=2, compute_instance=0))
    resource = mig_spec("nvidia.com/mig-1g.10gb", "1g.10gb").project(state.current)
    assert [(d.id, d.health.health) for d in resource.devices] == [
        ("MIG-0-0", Health.HEALTHY),
        ("MIG-0-1", Health.UNHEALTHY),
        ("MIG-0-2", Health.HEALTHY),
    ]
    assert state.current.health["GPU-0"].healthy
    # A whole-GPU XID takes every MIG device of the GPU with it; its reset brings them all back.
    state.apply(XidOccurred("GPU-0", 48))
    assert all(not d.health.healthy for d in mig_spec("m", "1g.10gb").project(state.current).devices)
    state.apply(ProbeResult("GPU-0", None, "re-probe 1"))
    assert all(not d.health.healthy for d in mig_spec("m", "1g.10gb").project(state.current).devices)
    state.apply(PciChanged("unbind", "0000:00:00.0"))
    state.apply(ProbeResult("GPU-0", None, "scan"))
    assert all(d.health.healthy for d in mig_spec("m", "1g.10gb").project(state.current).devices)


def test_layout_change_drops_and_adds_mig_health() -> None:
    state = node(mig_gpu(0, ["1g.10gb"] * 2))
    state.apply(InventoryFound((mig_gpu(0, ["3g.40gb"]),)))
    assert set(state.current.health) == {"GPU-0", "MIG-0-0"}
    assert state.current.gpus[0].mig[0].profile == "3g.40gb"


def test_allocate_a_mig_device_with_its_capability_nodes() -> None:
    from nvplug.core.mig import CapMinors
    from nvplug.kubelet.allocation import AllocationError, AllocationPolicy, allocate

    state = NodeState()
    minors = CapMinors({(0, 1): 12, (0, 2): 21}, {(0, 1, 0): 13, (0, 2, 0): 22})
    state.apply(InventoryFound((mig_gpu(0, ["3g.40gb", "3g.40gb"]),), cap_minors=minors))
    resource = mig_spec("nvidia.com/mig-3g.40gb", "3g.40gb").project(state.current)
    out = allocate(resource, ["MIG-0-1"], AllocationPolicy(), lambda p: "/host" + p, lambda p: False)
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": "MIG-0-1"}
    assert [n.container_path for n in out.device_nodes] == [
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap21",
        "/dev/nvidia-caps/nvidia-cap22",
    ]
    by_index = allocate(resource, ["MIG-0-1", "MIG-0-0"], AllocationPolicy(id_strategy="index"), str, lambda p: False)
    assert by_index.envs == {"NVIDIA_VISIBLE_DEVICES": "0:1,0:0"}
    # A MIG device whose minors the driver does not list cannot be handed out safely.
    bare = mig_spec("m", "3g.40gb").project(node(mig_gpu(0, ["3g.40gb"])).current)
    with pytest.raises(AllocationError, match="no capability device minors listed for MIG-0-0"):
        allocate(bare, ["MIG-0-0"], AllocationPolicy(), str, lambda p: False)


def test_a_probe_of_the_gpu_heals_its_mig_device_once_the_evidence_is_in() -> None:
    state = node(mig_gpu(0, ["1g.10gb"] * 2))
    state.apply(XidOccurred("GPU-0", 46, gpu_instance=1, compute_instance=0))
    assert [g.uuid for g in state.current.unhealthy()] == ["GPU-0"]
    # XID 46 needs a reset: no re-probes, and a probe alone proves nothing.
    assert state.current.reprobe_due() == ()
    state.apply(ProbeResult("GPU-0", None, "scan"))
    assert not state.current.health["MIG-0-0"].healthy
    state.apply(EvidenceFound("GPU-0", "the operator's word"))
    assert [g.uuid for g in state.current.reprobe_due()] == ["GPU-0"]  # so the GPU is probed
    state.apply(ProbeResult("GPU-0", None, "re-probe 1 of the Unhealthy GPU"))
    assert state.current.health["MIG-0-0"].healthy and state.current.unhealthy() == ()
    assert state.current.health["MIG-0-0"].reason == "recovered with its GPU: the operator's word"
