"""GFD-compatible node labels from the state, without a daemon."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from nvplug import config
from nvplug.core.events import InventoryFound, XidOccurred
from nvplug.core.gpu import Gpu, MigAttributes, MigDevice
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import Snapshot
from nvplug.sinks.gfd_labels import UNHEALTHY_COUNT, Machine, model_gpus, node_labels, render

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-40GB"
ATTRS_1G = MigAttributes(1, 1, 16, 1, 1, 0, 1, 0)
ATTRS_3G = MigAttributes(3, 3, 60, 3, 3, 0, 3, 0)
COMPUTE = 0x030200


def gpu(index: int, name: str = H100, mig: tuple[MigDevice, ...] = (), **changes: Any) -> Gpu:
    made = Gpu(
        f"GPU-{index}",
        index,
        f"0000:{index + 0x18:02x}:00.0",
        minor=index,
        name=name,
        memory_mib=81559 if name == H100 else 40960,
        compute_capability=(9, 0) if name == H100 else (8, 0),
        mig_enabled=bool(mig),
        mig=mig,
        mig_capable=True,
    )
    return replace(made, **changes)


def mig(gpu_index: int, gi: int, profile: str = "1g.10gb", attrs: MigAttributes = ATTRS_1G) -> MigDevice:
    return MigDevice(f"MIG-{gpu_index}-{gi}", gi, 0, profile, memory_mib=9856 if profile == "1g.10gb" else 40192,
                     attributes=attrs)  # fmt: skip


def snapshot(*gpus: Gpu, driver: str = "550.54.15", cuda: int = 12040) -> Snapshot:
    state = NodeState()
    state.apply(InventoryFound(gpus, driver_version=driver, cuda_version=cuda))
    return state.current


def labels(snap: Snapshot, text: str = "", unhealthy: bool = False) -> dict[str, str]:
    machine = Machine("DGX H100", {g.bus_id: COMPUTE for g in snap.gpus})
    out = node_labels(snap, config.parse("version: v1\n" + text, "t.yaml"), machine, unhealthy)
    return {k.removeprefix("nvidia.com/"): v for k, v in out.items()}


def test_the_demo_node_has_gfds_labels() -> None:
    assert labels(snapshot(*(gpu(i) for i in range(8)))) == {
        "cuda.driver-version.full": "550.54.15",
        "cuda.driver-version.major": "550",
        "cuda.driver-version.minor": "54",
        "cuda.driver-version.revision": "15",
        "cuda.driver.major": "550",
        "cuda.driver.minor": "54",
        "cuda.driver.rev": "15",
        "cuda.runtime-version.full": "12.4",
        "cuda.runtime-version.major": "12",
        "cuda.runtime-version.minor": "4",
        "cuda.runtime.major": "12",
        "cuda.runtime.minor": "4",
        "gpu.compute.major": "9",
        "gpu.compute.minor": "0",
        "gpu.count": "8",
        "gpu.family": "hopper",
        "gpu.machine": "DGX-H100",
        "gpu.memory": "81559",
        "gpu.mode": "compute",
        "gpu.product": "NVIDIA-H100-80GB-HBM3",
        "gpu.replicas": "1",
        "gpu.sharing-strategy": "none",
        "mig.capable": "true",
        "mps.capable": "false",
        "vgpu.present": "false",
    }


def test_no_gpu_no_labels() -> None:
    assert labels(snapshot()) == {}


def test_time_slicing_with_and_without_a_rename() -> None:
    snap = snapshot(*(gpu(i) for i in range(8)))
    sharing = "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    shared = labels(snap, sharing)
    assert shared["gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"
    assert (shared["gpu.replicas"], shared["gpu.sharing-strategy"], shared["gpu.count"]) == ("4", "time-slicing", "8")
    renamed = labels(snap, sharing.replace("timeSlicing:\n", "timeSlicing:\n    renameByDefault: true\n"))
    assert renamed["gpu.product"] == "NVIDIA-H100-80GB-HBM3" and renamed["gpu.replicas"] == "4"
    one = labels(snap, sharing.replace("replicas: 4", "replicas: 1"))
    assert (one["gpu.replicas"], one["gpu.sharing-strategy"]) == ("1", "none")


def test_mps_says_so_as_gfd_does() -> None:
    snap = snapshot(*(gpu(i) for i in range(8)))
    shared = labels(snap, "sharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n")
    assert shared["mps.capable"] == "true" and shared["gpu.sharing-strategy"] == "mps"
    assert (shared["gpu.replicas"], shared["gpu.product"]) == ("4", "NVIDIA-H100-80GB-HBM3-SHARED")
    assert labels(snap)["mps.capable"] == "false"


def test_mig_mixed_labels_per_profile() -> None:
    gpus = [
        gpu(0, mig=tuple(mig(0, gi) for gi in range(1, 8))),
        gpu(1, mig=(mig(1, 1, "3g.40gb", ATTRS_3G), mig(1, 2))),
        *(gpu(i) for i in range(2, 8)),
    ]
    out = labels(snapshot(*gpus), "flags:\n  migStrategy: mixed\n")
    assert out["mig.strategy"] == "mixed"
    assert out["gpu.count"] == "8" and out["gpu.replicas"] == "1"
    assert {k: v for k, v in out.items() if k.startswith("mig-1g.10gb.")} == {
        "mig-1g.10gb.count": "8",
        "mig-1g.10gb.engines.copy": "1",
        "mig-1g.10gb.engines.decoder": "1",
        "mig-1g.10gb.engines.encoder": "0",
        "mig-1g.10gb.engines.jpeg": "1",
        "mig-1g.10gb.engines.ofa": "0",
        "mig-1g.10gb.memory": "9856",
        "mig-1g.10gb.multiprocessors": "16",
        "mig-1g.10gb.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb",
        "mig-1g.10gb.replicas": "1",
        "mig-1g.10gb.sharing-strategy": "none",
        "mig-1g.10gb.slices.ci": "1",
        "mig-1g.10gb.slices.gi": "1",
    }
    assert out["mig-3g.40gb.count"] == "1" and out["mig-3g.40gb.slices.gi"] == "3"
    assert out["mig-3g.40gb.multiprocessors"] == "60"


def test_mig_single_describes_the_mig_devices_or_says_invalid() -> None:
    gpus = [gpu(i, mig=tuple(mig(i, gi) for gi in range(1, 8))) for i in range(8)]
    out = labels(snapshot(*gpus), "flags:\n  migStrategy: single\n")
    assert out["mig.strategy"] == "single"
    assert out["gpu.product"] == "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"
    assert (out["gpu.count"], out["gpu.memory"], out["gpu.multiprocessors"]) == ("56", "9856", "16")
    assert (out["gpu.slices.gi"], out["gpu.engines.copy"], out["gpu.replicas"]) == ("1", "1", "1")
    assert out["gpu.family"] == "hopper"  # the parent's
    mixed_modes = [gpus[0], *(gpu(i) for i in range(1, 8))]
    bad = labels(snapshot(*mixed_modes), "flags:\n  migStrategy: single\n")
    assert (bad["gpu.product"], bad["gpu.count"], bad["gpu.replicas"], bad["gpu.memory"]) == (
        "NVIDIA-H100-80GB-HBM3-MIG-INVALID",
        "0",
        "0",
        "0",
    )


def test_two_models_the_most_numerous_wins_then_the_lowest_index() -> None:
    mixed = [gpu(0, A100), gpu(1, A100), gpu(2), gpu(3), gpu(4)]
    out = labels(snapshot(*mixed))
    assert (out["gpu.product"], out["gpu.count"], out["gpu.family"]) == ("NVIDIA-H100-80GB-HBM3", "3", "hopper")
    tie = [gpu(0, A100), gpu(1), gpu(2, A100), gpu(3)]
    assert [g.name for g in model_gpus(tie)] == [A100, A100]
    assert labels(snapshot(*tie))["gpu.product"] == "NVIDIA-A100-SXM4-40GB"


@pytest.mark.parametrize(
    ("cc", "family"),
    [((7, 0), "volta"), ((7, 5), "turing"), ((8, 0), "ampere"), ((8, 9), "ada-lovelace"), ((9, 0), "hopper"),
     ((10, 0), "blackwell"), ((12, 0), "blackwell"), ((13, 0), "rubin"), ((11, 0), "undefined"), ((4, 0), "undefined")],
)  # fmt: skip
def test_family_by_compute_capability(cc: tuple[int, int], family: str) -> None:
    assert labels(snapshot(gpu(0, compute_capability=cc)))["gpu.family"] == family


def test_unknowns_and_edges() -> None:
    g = Gpu("GPU-0", 0, "0000:18:00.0", name="NVIDIA TITAN X (Pascal)", compute_capability=(0, 0))
    out = node_labels(snapshot(g, driver="535.1", cuda=0), config.Config(), Machine(None, {}))
    short = {k.removeprefix("nvidia.com/"): v for k, v in out.items()}
    assert short["gpu.product"] == "NVIDIA-TITAN-X-Pascal"
    assert short["gpu.machine"] == "unknown" and short["gpu.mode"] == "unknown"
    assert "gpu.memory" not in short and "gpu.family" not in short and "gpu.compute.major" not in short
    assert short["cuda.driver-version.revision"] == "" and "cuda.runtime-version.major" not in short
    assert short["mig.capable"] == "false" and "mig.strategy" not in short
    # Graphics and compute GPUs on one node: unknown, as GFD says.
    two = snapshot(gpu(0), gpu(1))
    mode = node_labels(two, config.Config(), Machine("x", {"0000:18:00.0": 0x030000, "0000:19:00.0": COMPUTE}))
    assert mode["nvidia.com/gpu.mode"] == "unknown"


def test_values_are_valid_label_values() -> None:
    long_name = "NVIDIA RTX PRO 6000 Blackwell Server Edition With A Name Far Too Long For A Label"
    out = node_labels(snapshot(gpu(0, long_name)), config.Config(), Machine("Box (rev 2) / tall", {}))
    product = out["nvidia.com/gpu.product"]
    assert len(product) == 63 and product[-1].isalnum()
    assert out["nvidia.com/gpu.machine"] == "Box-rev-2--tall"


def test_the_health_label_counts_gpus_with_a_fault_and_is_off_by_default() -> None:
    state = NodeState()
    state.apply(InventoryFound(tuple(gpu(i) for i in range(8)), driver_version="550.54.15", cuda_version=12040))
    assert UNHEALTHY_COUNT not in node_labels(state.current, config.Config(), Machine())
    assert node_labels(state.current, config.Config(), Machine(), unhealthy_count=True)[UNHEALTHY_COUNT] == "0"
    state.apply(XidOccurred("GPU-3", 79))
    assert node_labels(state.current, config.Config(), Machine(), unhealthy_count=True)[UNHEALTHY_COUNT] == "1"
    # Without the label, a GPU turning Unhealthy changes nothing.
    before = snapshot(*(gpu(i) for i in range(8)))
    assert node_labels(state.current, config.Config(), Machine()) == node_labels(before, config.Config(), Machine())


def test_render_is_sorted_and_has_no_timestamp() -> None:
    text = render({"nvidia.com/b": "2", "nvidia.com/a": "1"}).decode()
    assert text.splitlines()[1:] == ["nvidia.com/a=1", "nvidia.com/b=2"]
    assert text.startswith("#") and "time" not in text.lower()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("nvplug: {labels: {featureFile: relative}}", "neither off nor an absolute path"),
        ("nvplug: {labels: {unhealthyCount: maybe}}", "unhealthyCount"),
        ("nvplug: {labels: {colour: blue}}", "colour"),
    ],
)
def test_label_config_errors(text: str, error: str) -> None:
    with pytest.raises(config.ConfigError, match=error):
        config.parse(text, "t.yaml")


def test_label_config_defaults_and_off() -> None:
    assert config.Config().feature_file == "/etc/kubernetes/node-feature-discovery/features.d/nvplug"
    cfg = config.parse("nvplug: {labels: {featureFile: 'off', unhealthyCount: true}}", "t.yaml")
    assert (cfg.feature_file, cfg.unhealthy_count_label) == ("off", True)
    assert config.parse(config.to_yaml(cfg), "again") == config.parse(config.to_yaml(cfg), "again")
