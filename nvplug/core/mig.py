"""MIG facts that need no NVML: profile names and the capability device minors."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# Where the driver lists the /dev/nvidia-caps minors of every GPU and compute instance.
MIG_MINORS = Path("driver/nvidia-caps/mig-minors")
CAPS_DIR = "/dev/nvidia-caps"


def profile_name(
    gi_slices: int, ci_slices: int, memory_mb: int, total_memory_mb: int, ofa: int = 0, full_slices: int = 7
) -> str:
    """NVIDIA's profile names from an instance's attributes: 1g.10gb, 1c.2g.20gb, 1g.10gb.me.

    The memory in the name is the instance's share of the whole GPU, rounded up to
    eighths, times the GPU's memory in whole GB: 9856 of 81559 MiB is 10gb, as
    NVIDIA names it. A media-extension profile (short of the whole GPU, yet holding
    an OFA engine) gets `.me`, the resource-name form of NVIDIA's `+me`.
    """
    eighths = math.ceil(memory_mb / total_memory_mb * 8 - 1e-9)
    total_gb = math.ceil(total_memory_mb / 1024)
    name = f"{gi_slices}g.{round(eighths / 8 * total_gb)}gb"
    if ci_slices and ci_slices != gi_slices:
        name = f"{ci_slices}c.{name}"
    if ofa > 0 and gi_slices < full_slices:
        name += ".me"
    return name


@dataclass(frozen=True)
class CapMinors:
    """The /dev/nvidia-caps minors, by (gpu minor, gi) and (gpu minor, gi, ci)."""

    gpu_instances: Mapping[tuple[int, int], int] = field(default_factory=dict)
    compute_instances: Mapping[tuple[int, int, int], int] = field(default_factory=dict)

    def nodes(self, gpu_minor: int, gi: int, ci: int) -> tuple[str, str] | None:
        """The two capability nodes a container needs for one MIG device, if listed."""
        g = self.gpu_instances.get((gpu_minor, gi))
        c = self.compute_instances.get((gpu_minor, gi, ci))
        if g is None or c is None:
            return None
        return f"{CAPS_DIR}/nvidia-cap{g}", f"{CAPS_DIR}/nvidia-cap{c}"


def parse_mig_minors(text: str) -> CapMinors:
    """Lines `gpu0/gi1/access 12` and `gpu0/gi1/ci0/access 13`; anything else is skipped."""
    gis: dict[tuple[int, int], int] = {}
    cis: dict[tuple[int, int, int], int] = {}
    for line in text.splitlines():
        try:
            path, minor_text = line.split()
            parts = path.split("/")
            minor = int(minor_text)
            if parts[-1] != "access" or not parts[0].startswith("gpu") or not parts[1].startswith("gi"):
                continue
            gpu, gi = int(parts[0][3:]), int(parts[1][2:])
            if len(parts) == 3:
                gis[(gpu, gi)] = minor
            elif len(parts) == 4 and parts[2].startswith("ci"):
                cis[(gpu, gi, int(parts[2][2:]))] = minor
        except ValueError:
            continue
    return CapMinors(gis, cis)


def read_mig_minors(proc_root: Path) -> CapMinors:
    """The driver's table, or an empty one where the driver has none (no MIG support)."""
    try:
        return parse_mig_minors((proc_root / MIG_MINORS).read_text())
    except OSError:
        return CapMinors({}, {})
