"""Resource shaping from state alone: per-model names, device filters, MIG time-slicing, and the
config errors each of them can make."""

from __future__ import annotations

import pytest

from nvplug import config
from nvplug.config.selectors import DeviceFilter, Selector, covers, matches
from nvplug.core.events import InventoryFound
from nvplug.core.gpu import Gpu, MigDevice
from nvplug.core.node_state import NodeState
from nvplug.kubelet.allocation import AllocationPolicy, allocate, preferred
from nvplug.shaping.resource_plan import Naming, Plan, plan

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"


def gpu(i: int, name: str, profiles: tuple[str, ...] = ()) -> Gpu:
    migs = tuple(MigDevice(f"MIG-{i}-{n}", n + 1, 0, p) for n, p in enumerate(profiles))
    return Gpu(f"GPU-{i:08x}-0000-0000-0000-000000000000", i, f"0000:{0x18 + i:02x}:00.0", minor=i, name=name,
               mig_enabled=bool(profiles), mig=migs)  # fmt: skip


def two_models() -> NodeState:
    """GPUs 0-3 are H100s, 4-7 A100s."""
    state = NodeState()
    state.apply(InventoryFound(tuple(gpu(i, H100 if i < 4 else A100) for i in range(8))))
    return state


def load(text: str) -> config.Config:
    return config.parse(text, "c.yaml")


def advertised(found: Plan, state: NodeState) -> dict[str, list[str]]:
    return {s.name: [d.id for d in s.project(state.current).devices] for s in found.served}


def short(ids: list[str]) -> list[str]:
    """GPU-00000004-...::1 as 4::1, MIG-4-0::1 as it is."""
    return [i if i.startswith("MIG") else str(int(i[4:12], 16)) + i[40:] for i in ids]


RENAMES = """resources:
  gpus:
  - pattern: H100
    name: nvidia.com/h100
  - pattern: "NVIDIA A100*80GB"
    name: a100
"""


# --- patterns ------------------------------------------------------------------------------------


def test_patterns_match_as_nvidia_matches_them() -> None:
    # An unanchored search with * as any text: a word of the product name is enough.
    assert matches("H100", H100) and matches("*", "") and matches("A100*80GB", A100)
    assert not matches("A100", H100) and not matches("H100 PCIe", H100)
    assert matches("1g.10gb", "1g.10gb.me")  # as NVIDIA: write 1g.10gb.me first to tell them apart
    assert matches("a.b", "a.b") and not matches("a.b", "axb")  # no regex meta characters


def test_covers_says_when_a_later_pattern_can_never_win() -> None:
    assert covers("*", "H100") and covers("H100", "NVIDIA H100*") and covers("A100", "A100*80GB")
    assert covers("1g", "1g.10gb") and covers("A*B", "AxB") and covers("A*B", "A*x*B")
    assert not covers("H100", "A100") and not covers("A100*80GB", "A100") and not covers("A*B", "B*A")
    assert not covers("80GB*HBM3", "HBM3")


# --- per-model names ---------------------------------------------------------------------------


def test_a_node_with_two_models_serves_two_resources() -> None:
    state = two_models()
    found = plan(load(RENAMES), state.current)
    assert short_all(advertised(found, state)) == {
        "nvidia.com/a100": ["4", "5", "6", "7"],
        "nvidia.com/h100": ["0", "1", "2", "3"],
    }
    # An unmatched GPU keeps NVIDIA's default name; the first match wins.
    only = plan(load("resources:\n  gpus:\n  - {pattern: A100, name: a100}\n  - {pattern: '*', name: any}\n"),
                state.current)  # fmt: skip
    assert {k: len(v) for k, v in advertised(only, state).items()} == {"nvidia.com/a100": 4, "nvidia.com/any": 4}
    default = plan(load("resources:\n  gpus:\n  - {pattern: A100, name: a100}\n"), state.current)
    assert {k: len(v) for k, v in advertised(default, state).items()} == {"nvidia.com/a100": 4, "nvidia.com/gpu": 4}


def short_all(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {k: short(v) for k, v in found.items()}


def test_time_slicing_names_the_per_model_resource() -> None:
    state = two_models()
    cfg = load(RENAMES + "sharing:\n  timeSlicing:\n    resources:\n    - {name: a100, replicas: 2, devices: [4, 5]}\n")
    found = plan(cfg, state.current)
    assert short_all(advertised(found, state)) == {
        "nvidia.com/a100": ["4::0", "4::1", "5::0", "5::1", "6", "7"],
        "nvidia.com/h100": ["0", "1", "2", "3"],
    }
    # A count is the first N devices of that resource, not GPU indices below N.
    counted = plan(load(RENAMES + "sharing:\n  timeSlicing:\n    resources:\n    - {name: a100, replicas: 2, "
                        "devices: 1, rename: a100-half}\n"), state.current)  # fmt: skip
    assert short_all(advertised(counted, state))["nvidia.com/a100-half"] == ["4::0", "4::1"]
    assert short_all(advertised(counted, state))["nvidia.com/a100"] == ["5", "6", "7"]


def test_mig_names_and_mixed_models() -> None:
    state = NodeState()
    state.apply(InventoryFound((gpu(0, H100, ("1g.10gb", "1g.10gb.me", "3g.40gb")), gpu(1, A100, ("1g.10gb",)),
                                gpu(2, A100))))  # fmt: skip
    cfg = load(RENAMES + "  mig:\n  - {pattern: 1g.10gb.me, name: mig-media}\n  - {pattern: 1g, name: mig-small}\n"
               "flags:\n  migStrategy: mixed\n")  # fmt: skip
    assert {k: v for k, v in advertised(plan(cfg, state.current), state).items()} == {
        "nvidia.com/a100": [gpu(2, A100).uuid],
        "nvidia.com/mig-3g.40gb": ["MIG-0-2"],
        "nvidia.com/mig-media": ["MIG-0-1"],
        "nvidia.com/mig-small": ["MIG-0-0", "MIG-1-0"],
    }
    # single: MIG devices stand in for their GPUs, under the model's name.
    single = NodeState()
    single.apply(InventoryFound((gpu(0, H100, ("1g.10gb",) * 2), gpu(1, A100, ("3g.40gb",)))))
    cfg = load(RENAMES + "flags:\n  migStrategy: single\n")
    assert advertised(plan(cfg, single.current), single) == {
        "nvidia.com/a100": ["MIG-1-0"],
        "nvidia.com/h100": ["MIG-0-0", "MIG-0-1"],
    }
    # A GPU given to DRA is not the device plugin's: it need not be in MIG mode for single to fit.
    dra = NodeState()
    dra.apply(InventoryFound((gpu(0, H100, ("1g.10gb",) * 2), gpu(1, A100))))
    cfg = load("flags:\n  migStrategy: single\nnvplug:\n  dra:\n    enabled: true\n    devices: [1]\n")
    assert advertised(plan(cfg, dra.current), dra) == {"nvidia.com/gpu": ["MIG-0-0", "MIG-0-1"]}
    # One profile per resource: two under one name do not fit single.
    both = plan(config.parse("version: v1\nflags:\n  migStrategy: single\n", "c"), single.current)
    assert both.specs == () and "nvidia.com/gpu: ['1g.10gb', '3g.40gb']" in (both.error or "")


# --- device filters -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selectors", "left_out"),
    [
        ("exclude: [3]", [3]),
        ("exclude: ['5', 6]", [5, 6]),
        ("exclude: [GPU-00000002-0000-0000-0000-000000000000]", [2]),
        ("exclude: ['0000:19:00.0']", [1]),  # GPU 1's bus id, as sysfs writes it
        ("exclude: ['00000000:1A:00.0']", [2]),  # as NVML writes it
        ("exclude: ['1b:00.0']", [3]),  # as lspci writes it
        ("exclude: [A100]", [4, 5, 6, 7]),
        ("include: ['NVIDIA H100*']", [4, 5, 6, 7]),
        ("include: [H100, 4]\n    exclude: [0]", [0, 5, 6, 7]),
    ],
)
def test_filter_by_each_kind_of_selector(selectors: str, left_out: list[int]) -> None:
    state = two_models()
    found = plan(load(f"nvplug:\n  devices:\n    {selectors}\n"), state.current)
    served = {int(i[4:12], 16) for ids in advertised(found, state).values() for i in ids}
    assert served == set(range(8)) - set(left_out)
    assert sorted(state.current.gpus[i].uuid for i in left_out) == sorted(found.excluded)
    assert all("nvplug.devices" in why for why in found.excluded.values())


def test_an_excluded_gpu_takes_its_mig_devices_and_stays_health_watched() -> None:
    state = NodeState()
    state.apply(InventoryFound((gpu(0, H100, ("1g.10gb",) * 2), gpu(1, H100, ("1g.10gb",)))))
    found = plan(load("flags:\n  migStrategy: mixed\nnvplug:\n  devices:\n    exclude: [0]\n"), state.current)
    assert advertised(found, state) == {"nvidia.com/mig-1g.10gb": ["MIG-1-0"]}
    assert set(state.current.health) >= {"GPU-00000000-0000-0000-0000-000000000000", "MIG-0-0", "MIG-0-1"}


def test_selectors_that_pick_no_gpu_are_named() -> None:
    state = two_models()
    cfg = load("nvplug:\n  devices:\n    include: [0, 9, GPU-0badc0de-0000-0000-0000-000000000000, Z100]\n")
    # A product pattern may well pick nothing on this node; a GPU's own index, UUID or bus id should not.
    assert plan(cfg, state.current).unmatched == (
        "include index 9",
        "include uuid GPU-0badc0de-0000-0000-0000-000000000000",
    )


def test_selector_parsing() -> None:
    assert Selector.parse("12") == Selector("index", "12")
    assert Selector.parse("0000:3B:00.0") == Selector("bus id", "0000:3b:00.0")
    assert Selector.parse("L40S") == Selector("product", "L40S")
    nothing = DeviceFilter()
    assert not nothing.excludes(gpu(0, H100)) and nothing.why(gpu(0, H100)) is None


# --- MIG time-slicing ----------------------------------------------------------------------------


def test_mig_devices_are_time_sliced_and_allocated_whole() -> None:
    state = NodeState()
    state.apply(InventoryFound((gpu(0, H100, ("1g.10gb",) * 3 + ("3g.40gb",)),)))
    cfg = load("flags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
               "    - {name: mig-1g.10gb, replicas: 2, devices: ['0:0', '0:2']}\n")  # fmt: skip
    found = plan(cfg, state.current)
    got = advertised(found, state)
    assert got["nvidia.com/mig-1g.10gb"] == ["MIG-0-0::0", "MIG-0-0::1", "MIG-0-1", "MIG-0-2::0", "MIG-0-2::1"]
    assert got["nvidia.com/mig-3g.40gb"] == ["MIG-0-3"]
    (spec,) = [s for s in found.served if s.name == "nvidia.com/mig-1g.10gb"]
    resource = spec.project(state.current)
    # Two replicas of one MIG device: the container gets that MIG device, once.
    policy = AllocationPolicy(pass_device_specs=False)
    out = allocate(resource, ["MIG-0-0::0", "MIG-0-0::1"], policy, str, lambda p: False)
    assert out.envs == {"NVIDIA_VISIBLE_DEVICES": "MIG-0-0"}
    # Replicas spread over MIG devices (not over GPUs: one GPU holds them all), the most free first;
    # or pack onto one.
    ids = [d.id for d in resource.devices]
    assert preferred(resource, ids, [], 2) == ["MIG-0-0::0", "MIG-0-2::0"]
    assert preferred(resource, ids, [], 3) == ["MIG-0-0::0", "MIG-0-2::0", "MIG-0-1"]
    replicas = [i for i in ids if "::" in i]
    assert preferred(resource, replicas, [], 2, packed=True) == ["MIG-0-0::0", "MIG-0-0::1"]


def test_mig_time_slicing_renamed_by_default() -> None:
    state = NodeState()
    state.apply(InventoryFound((gpu(0, H100, ("1g.10gb",) * 2), gpu(1, A100))))
    cfg = load("flags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
               "    - {name: mig-1g.10gb, replicas: 3}\n")  # fmt: skip
    assert {k: len(v) for k, v in advertised(plan(cfg, state.current), state).items()} == {
        "nvidia.com/gpu": 1,
        "nvidia.com/mig-1g.10gb.shared": 6,
    }


# --- config errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "resources:\n  gpus:\n  - {pattern: A100, name: a100}\n  - {pattern: A100-SXM4, name: big}\n",
            r"line 4: resources\.gpus\[1\]\.pattern: 'A100-SXM4' would give the devices it matches a second name, "
            r"nvidia\.com/big: every one of them already matches 'A100' \(nvidia\.com/a100, c\.yaml, line 3: "
            r"resources\.gpus\[0\]\), and the first match wins",
        ),
        (
            "resources:\n  gpus:\n  - {pattern: '*', name: gpu}\n  - {pattern: H100, name: h100}\n",
            r"line 4: resources\.gpus\[1\]\.pattern: 'H100' would give the devices it matches a second name",
        ),
        (
            "resources:\n  gpus:\n  - {pattern: H100, name: h100}\n  - {pattern: H100, name: h100}\n",
            r"line 4: resources\.gpus\[1\]\.pattern: 'H100' names the same devices again",
        ),
        (
            "resources:\n  gpus:\n  - {pattern: H100, name: 'h100 gpu'}\n",
            r"line 3: resources\.gpus\[0\]\.name: 'h100 gpu' is not a valid extended resource name",
        ),
        (
            "resources:\n  gpus:\n  - {pattern: H100, name: example.com/a/b}\n",
            r"line 3: resources\.gpus\[0\]\.name: 'example\.com/a/b' is not a valid extended resource name",
        ),
        (
            "flags:\n  migStrategy: mixed\nresources:\n  gpus:\n  - {pattern: H100, name: h100}\n"
            "  mig:\n  - {pattern: 1g, name: h100}\n",
            r"line 7: resources\.mig\[0\]\.name: nvidia\.com/h100 also names whole GPUs \(c\.yaml, line 5: "
            r"resources\.gpus\[0\]\) under flags\.migStrategy: mixed",
        ),
        (
            "nvplug:\n  devices:\n    exclude: [MIG-0e85ec6b-6af1-688b-30dd-e764b2fe55b6]\n",
            r"line 3: nvplug\.devices\.exclude\[0\]: 'MIG-0e85ec6b-6af1-688b-30dd-e764b2fe55b6' is a MIG device",
        ),
        ("nvplug:\n  devices:\n    exclude: ['0:1']\n", r"line 3: nvplug\.devices\.exclude\[0\]: '0:1' is a MIG"),
        ("nvplug:\n  devices:\n    include: [GPU-1234]\n", r"line 3: nvplug\.devices\.include\[0\]: 'GPU-1234' is not"),
        ("nvplug:\n  devices:\n    include: [3, '3']\n", r"line 3: nvplug\.devices\.include\[1\]: index 3 is listed"),
        ("nvplug:\n  devices:\n    include: 3\n", r"line 3: nvplug\.devices\.include: must be a list"),
        ("nvplug:\n  devices:\n    only: [3]\n", r"line 3: nvplug\.devices\.only: unknown key"),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2, devices: [0, 1], rename: a}\n"
            "    - {name: gpu, replicas: 4, devices: [1, 2], rename: b}\n",
            r"line 5: sharing\.timeSlicing\.resources\[1\]\.devices: device 1 of nvidia\.com/gpu also shared by "
            r"c\.yaml, line 4: sharing\.timeSlicing\.resources\[0\]",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2, devices: 2, rename: a}\n"
            "    - {name: gpu, replicas: 4, devices: 4, rename: b}\n",
            r"line 5: sharing\.timeSlicing\.resources\[1\]\.devices: the first 2 devices of nvidia\.com/gpu",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2, devices: [0]}\n"
            "    - {name: gpu, replicas: 4, devices: [1]}\n",
            r"line 5: sharing\.timeSlicing\.resources\[1\]\.name: nvidia\.com/gpu is advertised twice",
        ),
    ],
)
def test_config_errors_name_file_key_and_line(text: str, message: str) -> None:
    with pytest.raises(config.ConfigError, match=rf"^c\.yaml, {message}"):
        load(text)


def test_a_device_picked_twice_is_refused_on_the_gpus() -> None:
    """By index in one entry and by UUID in the other: only the GPUs tell, so the plan refuses it."""
    state = two_models()
    uuid = state.current.gpus[1].uuid
    entries = (
        "- {name: gpu, replicas: 2, devices: [0, 1], rename: a}\n"
        f"    - {{name: gpu, replicas: 4, devices: [{uuid}], rename: b}}"
    )
    cfg = load(f"sharing:\n  timeSlicing:\n    resources:\n    {entries}\n")
    found = plan(cfg, state.current)
    assert set(found.refused) == {"nvidia.com/a", "nvidia.com/b", "nvidia.com/gpu"} and found.served == []
    why = found.refused["nvidia.com/a"]
    assert f"gpu 1 {uuid}" in why and "c.yaml, line 4: sharing.timeSlicing.resources[0] and c.yaml, line 5" in why


def test_a_rename_may_not_take_a_resource_name() -> None:
    state = two_models()
    cfg = load(RENAMES + "sharing:\n  timeSlicing:\n    resources:\n    - {name: a100, rename: h100, replicas: 2}\n")
    found = plan(cfg, state.current)
    assert found.served == []  # every A100 went to the rename, and both lists named h100 are refused
    assert "nvidia.com/h100 would be advertised twice" in found.refused["nvidia.com/h100"]


def test_naming_follows_the_config() -> None:
    naming = Naming.from_config(load(RENAMES))
    assert naming.gpu_name(gpu(0, H100)) == "nvidia.com/h100"
    assert naming.gpu_name(gpu(0, "Tesla T4")) == "nvidia.com/gpu"
    assert naming.name(gpu(0, A100, ("1g.10gb",)), None) == "nvidia.com/a100"  # migStrategy none
