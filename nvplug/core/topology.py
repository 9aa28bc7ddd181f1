"""GPU-to-GPU links and the best-connected choice of GPUs for one request.

The link matrix is read from NVML once per inventory change; choosing a set
only reads it, so requests never wait on NVML nor break on a lost GPU.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


class PcieLevel(enum.IntEnum):
    """NVML's nvmlGpuTopologyLevel_t: the closest common PCIe ancestor of two GPUs."""

    INTERNAL = 0  # same board
    SINGLE = 10  # one PCIe switch
    MULTIPLE = 20  # several switches, no host bridge
    HOSTBRIDGE = 30  # one host bridge
    NODE = 40  # host bridges of one NUMA node
    SYSTEM = 50  # across sockets


_PCIE_SCORE = {
    PcieLevel.INTERNAL: 60,
    PcieLevel.SINGLE: 50,
    PcieLevel.MULTIPLE: 40,
    PcieLevel.HOSTBRIDGE: 30,
    PcieLevel.NODE: 20,
    PcieLevel.SYSTEM: 10,
}
# One NVLink outweighs any PCIe path.
NVLINK_WEIGHT = 100


@dataclass(frozen=True)
class Link:
    nvlinks: int = 0
    pcie: PcieLevel = PcieLevel.SYSTEM

    @property
    def score(self) -> int:
        return self.nvlinks * NVLINK_WEIGHT + _PCIE_SCORE[self.pcie]


_UNLINKED = Link().score


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


@dataclass(frozen=True)
class Topology:
    """Links between pairs of GPUs by UUID; a pair not listed meets across the system."""

    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    # Scores by ordered pair, both orders: the hot path of every preferred allocation.
    _scores: Mapping[tuple[str, str], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        scores = {}
        for (a, b), link in self.links.items():
            scores[(a, b)] = scores[(b, a)] = link.score
        object.__setattr__(self, "_scores", scores)

    @classmethod
    def of(cls, pairs: Mapping[tuple[str, str], Link]) -> Topology:
        return cls({_key(a, b): link for (a, b), link in pairs.items()})

    def link(self, a: str, b: str) -> Link:
        return self.links.get(_key(a, b), Link())

    def score(self, a: str, b: str) -> int:
        return self._scores.get((a, b), _UNLINKED)

    def set_score(self, ids: Sequence[str]) -> int:
        return sum(self.score(a, b) for a, b in itertools.combinations(ids, 2))


def best_set(
    score: Callable[[str, str], int],
    candidates: Sequence[str],
    must_include: Sequence[str],
    size: int,
) -> list[str]:
    """The set of `size` that holds `must_include`, draws the rest from `candidates`, and
    has the highest sum of pairwise scores. Exact (branch and bound); among equally good
    sets the one earliest in `candidates` order wins. The caller checks the request is possible."""
    chosen = list(dict.fromkeys(must_include))
    taken = set(chosen)
    pool = [c for c in dict.fromkeys(candidates) if c not in taken]
    need = size - len(chosen)
    if need <= 0:
        return chosen[:size]
    n = len(pool)
    w = [[score(a, b) if a != b else 0 for b in pool] for a in pool]
    gain = [sum(score(u, v) for u in chosen) for v in pool]
    # For the bound: each GPU's weights to the GPUs from position i on, best first; made when first needed.
    ahead: dict[int, list[list[int]]] = {}

    def weights_from(i: int) -> list[list[int]]:
        if i not in ahead:
            ahead[i] = [sorted((w[v][x] for x in range(i, n) if x != v), reverse=True) for v in range(n)]
        return ahead[i]

    best_score = -1
    best: list[int] = []
    picked: list[int] = []

    def bound(start: int, left: int, gains: list[int]) -> float:
        # Each new pair counted half from each end: no set of `left` more can beat this.
        top = weights_from(start)
        optimistic = sorted((gains[v] + sum(top[v][: left - 1]) / 2 for v in range(start, n)), reverse=True)
        return sum(optimistic[:left])

    def search(start: int, current: int, gains: list[int]) -> None:
        nonlocal best_score, best
        left = need - len(picked)
        if left == 0:
            if current > best_score:
                best_score, best = current, picked.copy()
            return
        if n - start < left or current + bound(start, left, gains) <= best_score:
            return
        for v in range(start, n - left + 1):
            picked.append(v)
            search(v + 1, current + gains[v], [g + w[v][x] for x, g in enumerate(gains)])
            picked.pop()

    search(0, 0, gain)
    return chosen + [pool[v] for v in best]
