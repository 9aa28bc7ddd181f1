"""Topology-aware choice of GPUs: optimal against brute force, and read from NVML."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvplug.core.topology import Link, PcieLevel, Topology, best_set
from nvplug.testing import fakenvml_library


def ids(n: int) -> list[str]:
    return [f"GPU-{i:02d}" for i in range(n)]


def brute_force(topology: Topology, candidates: list[str], must: list[str], size: int) -> int:
    pool = [c for c in candidates if c not in must]
    return max(topology.set_score(must + list(rest)) for rest in itertools.combinations(pool, size - len(must)))


def build(n: int, link: Callable[[int, int], Link]) -> Topology:
    gpus = ids(n)
    return Topology.of({(gpus[i], gpus[j]): link(i, j) for i, j in itertools.combinations(range(n), 2)})


DGX = build(
    8,
    lambda i, j: Link(
        18, PcieLevel.SINGLE if i // 2 == j // 2 else PcieLevel.NODE if i // 4 == j // 4 else PcieLevel.SYSTEM
    ),
)
ISLANDS = build(
    8, lambda i, j: Link(12 if i // 4 == j // 4 else 0, PcieLevel.NODE if i // 4 == j // 4 else PcieLevel.SYSTEM)
)
PCIE_ONLY = build(
    8,
    lambda i, j: Link(
        0, PcieLevel.SINGLE if i // 2 == j // 2 else PcieLevel.HOSTBRIDGE if i // 4 == j // 4 else PcieLevel.SYSTEM
    ),
)
ISLANDS_16 = build(
    16, lambda i, j: Link(6 if i // 4 == j // 4 else 0, PcieLevel.NODE if i // 8 == j // 8 else PcieLevel.SYSTEM)
)


@pytest.mark.parametrize("topology", [DGX, ISLANDS, PCIE_ONLY, ISLANDS_16], ids=["dgx", "islands", "pcie", "islands16"])
def test_optimal_for_every_size_and_must_include(topology: Topology) -> None:
    gpus = sorted({g for pair in topology.links for g in pair})
    for size in range(1, len(gpus) + 1):
        for must in ([], [gpus[-1]], [gpus[1], gpus[-2]]):
            if len(must) > size:
                continue
            got = best_set(topology.score, gpus, must, size)
            assert len(got) == size and len(set(got)) == size and set(must) <= set(got)
            assert got[: len(must)] == must
            assert topology.set_score(got) == brute_force(topology, gpus, must, size), (size, must, got)


def test_islands_are_kept_together() -> None:
    gpus = ids(8)
    assert sorted(best_set(ISLANDS.score, gpus, [], 4)) == gpus[:4]
    assert sorted(best_set(ISLANDS.score, gpus, [gpus[5]], 4)) == gpus[4:]
    # Among equals (a DGX pair on one PCIe switch), the lowest index wins.
    assert best_set(DGX.score, gpus, [], 2) == gpus[:2]
    assert best_set(PCIE_ONLY.score, gpus, [gpus[3]], 2) == [gpus[3], gpus[2]]


@st.composite
def random_requests(draw: st.DrawFn) -> tuple[Topology, list[str], list[str], int]:
    n = draw(st.integers(2, 12))
    gpus = ids(n)
    nvlinks = st.sampled_from([0, 0, 1, 2, 4, 6, 12, 18])
    links = {
        (a, b): Link(draw(nvlinks), draw(st.sampled_from(list(PcieLevel)))) for a, b in itertools.combinations(gpus, 2)
    }
    available = draw(st.lists(st.sampled_from(gpus), min_size=1, unique=True))
    size = draw(st.integers(1, len(available)))
    must = draw(st.lists(st.sampled_from(available), max_size=size, unique=True))
    return Topology.of(links), available, must, size


@settings(max_examples=300, deadline=None)
@given(random_requests())
def test_optimal_on_random_graphs(request: tuple[Topology, list[str], list[str], int]) -> None:
    topology, available, must, size = request
    got = best_set(topology.score, available, must, size)
    assert len(got) == size and set(must) <= set(got) <= set(available)
    assert topology.set_score(got) == brute_force(topology, available, must, size)


def test_topology_is_read_from_nvml(tmp_path: Path, nvml_lib_dir: Path) -> None:
    """Two NVLink pairs, one pair of PCIe switches, and an NVSwitch-less node, through pynvml."""
    scenario = tmp_path / "s.scenario"
    scenario.write_text(
        "\n".join(
            [
                *(f"gpu uuid=GPU-{i} minor={i} bus=0000:{0x10 + i:02x}:00.0 numa={i // 2}" for i in range(4)),
                "link 0 1 nvlink=4 pcie=SINGLE",
                "link 2 3 nvlink=2 pcie=MULTIPLE",
                "link 0 2 pcie=NODE",
                "link 1 3 nvlink=0 pcie=HOSTBRIDGE",
            ]
        )
    )
    code = (
        "import json; from nvplug.sources.nvml_discovery import Nvml; t = Nvml().scan().discovery.topology;"
        "print(json.dumps({f'{a}-{b}': [l.nvlinks, l.pcie.name] for (a, b), l in sorted(t.links.items())}))"
    )
    env = fakenvml_library.environ(nvml_lib_dir, scenario, tmp_path / "ctl")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "GPU-0-GPU-1": [4, "SINGLE"],
        "GPU-0-GPU-2": [0, "NODE"],
        "GPU-0-GPU-3": [0, "SYSTEM"],
        "GPU-1-GPU-2": [0, "SYSTEM"],
        "GPU-1-GPU-3": [0, "HOSTBRIDGE"],
        "GPU-2-GPU-3": [2, "MULTIPLE"],
    }


def test_default_scenario_is_an_nvswitch_node(tmp_path: Path, nvml_lib_dir: Path) -> None:
    code = (
        "import json; from nvplug.sources.nvml_discovery import Nvml; d = Nvml().scan().discovery;"
        "u = [g.uuid for g in d.gpus]; t = d.topology;"
        "pairs = [(u[0], u[1]), (u[0], u[2]), (u[0], u[4])];"
        "print(json.dumps([[t.link(a, b).nvlinks, t.link(a, b).pcie.name] for a, b in pairs]))"
    )
    env = fakenvml_library.environ(nvml_lib_dir, fakenvml_library.DEFAULT_SCENARIO, tmp_path / "ctl")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[18, "SINGLE"], [18, "NODE"], [18, "SYSTEM"]]
