"""The fake NVML's GPU-side values, as ``fakenvml.c`` defines them.

Compute modes, the processes a GPU reports, the MIG profiles the fake knows, the
UUIDs it gives MIG devices and the nvidia-caps minors of their capabilities: what
a test states or expects of the fake's GPUs, computed here without loading it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, TypeAlias

__all__ = [
    "MIG_PROFILES",
    "PROCS_MAX",
    "ComputeMode",
    "GpuProcess",
    "MigProfile",
    "ProcessKind",
    "mig_minor",
    "mig_uuid",
    "write_mig_minors",
]

MigProfile: TypeAlias = Literal["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
# The H100 80GB MIG profiles the fake knows, in its table order.
MIG_PROFILES: tuple[MigProfile, ...] = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")

# Which running-process query lists a process: nvmlDeviceGet{Compute,Graphics,MPSCompute}RunningProcesses.
ProcessKind: TypeAlias = Literal["compute", "graphics", "mps"]
_PROCESS_KINDS: tuple[ProcessKind, ...] = ("compute", "graphics", "mps")
PROCS_MAX = 512  # PROCS_MAX in the C: processes per GPU
_MIG_MAX_GI = 14
_MIG_MAX_CI = 7


class ComputeMode(enum.IntEnum):
    """nvmlComputeMode_t (pynvml's NVML_COMPUTEMODE_*)."""

    DEFAULT = 0
    EXCLUSIVE_THREAD = 1  # "Support Removed": nvmlDeviceSetComputeMode refuses it, the driver may still hold it
    PROHIBITED = 2
    EXCLUSIVE_PROCESS = 3


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    """A process the fake reports as running on a GPU (``procs=`` / the ``procs`` command).

    ``used_mib`` None makes NVML report ``usedGpuMemory`` as NVML_VALUE_NOT_AVAILABLE
    (pynvml: None).  ``kinds`` picks the queries that list it (``("compute", "graphics")``
    is nvidia-smi's "C+G").  ``mig`` (gi, ci) puts it on the GPU's MIG device with
    those ids, which must exist when the command runs.
    """

    pid: int
    used_mib: int | None = None
    kinds: tuple[ProcessKind, ...] = ("compute",)
    mig: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.pid <= 0xFFFFFFFF:
            raise ValueError(f"pid out of range: {self.pid}")
        if self.used_mib is not None and not 0 <= self.used_mib <= 1 << 30:
            raise ValueError(f"used_mib out of range: {self.used_mib}")
        if not self.kinds or len(set(self.kinds)) != len(self.kinds) or set(self.kinds) - set(_PROCESS_KINDS):
            raise ValueError(f"bad process kinds: {self.kinds!r}")
        if self.mig is not None and not (0 <= self.mig[0] <= _MIG_MAX_GI and 0 <= self.mig[1] <= _MIG_MAX_CI):
            raise ValueError(f"no such MIG device ids (gi 0-{_MIG_MAX_GI}, ci 0-{_MIG_MAX_CI}): {self.mig}")

    def spec(self) -> str:
        """The ``PID[:MIB][:KIND][@GI/CI]`` text the C side parses (and its ``state`` reply shows)."""
        text = str(self.pid)
        if self.used_mib is not None:
            text += f":{self.used_mib}"
        if self.kinds != ("compute",):
            text += ":" + "+".join(k for k in _PROCESS_KINDS if k in self.kinds)
        if self.mig is not None:
            text += f"@{self.mig[0]}/{self.mig[1]}"
        return text


_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def _fnv1a(text: str, h: int) -> int:
    for byte in text.encode():
        h = ((h ^ byte) * _FNV_PRIME) & _MASK64
    return h


def mig_uuid(parent_uuid: str, gi: int, ci: int) -> str:
    """The UUID the fake gives a MIG device without a ``uuid=`` (mirrors ``mig_default_uuid`` in the C)."""
    key = f"{parent_uuid}/{gi}/{ci}"
    a = _fnv1a(key, 0xCBF29CE484222325)
    b = _fnv1a(key, 0x84222325CBF29CE4)
    return f"MIG-{a >> 32:08x}-{(a >> 16) & 0xFFFF:04x}-{a & 0xFFFF:04x}-{b >> 48:04x}-{b & 0xFFFFFFFFFFFF:012x}"


# nvidia-caps numbering (/proc/driver/nvidia-caps/mig-minors): "config 1", "monitor 2", then for
# each GPU minor 0..31 and GPU instance 0..14 the GI's access minor followed by its compute
# instances 0..7: 9 minors per GI, 135 per GPU.
_MIG_GIS = 15
_MIG_CIS = 8
_MIG_PER_GI = 1 + _MIG_CIS
_MIG_PER_GPU = _MIG_GIS * _MIG_PER_GI


def mig_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The nvidia-cap minor of ``gpu<gpu_minor>/gi<gi>/access`` or, with ``ci``, ``.../ci<ci>/access``.

    ``3 + gpu_minor*135 + gi*9`` for the GPU instance, plus ``1 + ci`` for a compute
    instance: the order in which the driver lists every possible capability (so
    ``gpu0/gi1/access 12``, ``gpu0/gi1/ci0/access 13``, ``gpu1/gi0/access 138``).
    """
    if not 0 <= gpu_minor <= 255 or not 0 <= gi < _MIG_GIS or (ci is not None and not 0 <= ci < _MIG_CIS):
        raise ValueError(f"no nvidia-caps minor for gpu{gpu_minor}/gi{gi}/ci{ci}")
    base = 3 + gpu_minor * _MIG_PER_GPU + gi * _MIG_PER_GI
    return base if ci is None else base + 1 + ci


def write_mig_minors(path: Path, layout: Mapping[int, Sequence[tuple[int, int]]]) -> None:
    """Write a ``mig-minors`` file like the driver's ``/proc/driver/nvidia-caps/mig-minors``.

    ``layout`` maps GPU minor numbers to (gi, ci) pairs.  The file has the
    ``config``/``monitor`` lines and, per GPU and GI in ascending order, the GI
    access line then its CI lines, numbered by :func:`mig_minor`.  (The real
    file lists every possible GPU/GI/CI; listing only the given ones keeps the
    same numbers.)
    """
    lines = ["config 1", "monitor 2"]
    for gpu in sorted(layout):
        gis: dict[int, set[int]] = {}
        for gi, ci in layout[gpu]:
            mig_minor(gpu, gi, ci)  # validates
            gis.setdefault(gi, set()).add(ci)
        for gi in sorted(gis):
            lines.append(f"gpu{gpu}/gi{gi}/access {mig_minor(gpu, gi)}")
            lines.extend(f"gpu{gpu}/gi{gi}/ci{ci}/access {mig_minor(gpu, gi, ci)}" for ci in sorted(gis[gi]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
