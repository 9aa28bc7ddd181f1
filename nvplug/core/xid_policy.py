"""XID policy: which XID errors make a GPU Unhealthy.

The defaults come from NVIDIA's XID catalog, its "immediate action" bucket;
the operator can move any code to the ignore or the fatal list.
"""

from __future__ import annotations

import csv
import enum
import io
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources

# Buckets whose remedy is on the application's side: the GPU itself is fine.
_APP_LEVEL = {"RESTART_APP", "IGNORE", "WORKFLOW_XID_45", "CHECK_UVM"}
# Buckets that need a reset, a reboot or a person: stop offering the GPU.
_FATAL = {
    "RESET_GPU",
    "RESTART_BM",
    "RESTART_VM",
    "CHECK_MECHANICALS",
    "UPDATE_SWFW",
    "CONTACT_SUPPORT",
    "WORKFLOW_XID_48",
    "WORKFLOW_NVLINK_ERR",
    "WORKFLOW_NVLINK5_ERR",
}
# Application-level whatever bucket a catalog revision files them under (45 when alone).
_APP_LEVEL_CODES = {43, 45}
RECOVERY_ACTION_XID = 154
# XIDs after which the driver's recovery action (NVML field 230) is read at once: 154 announces a
# new one; 94, a contained error the GPU survives, may leave a reset "when convenient" behind it.
READS_RECOVERY_ACTION = frozenset({RECOVERY_ACTION_XID, 94})


class Verdict(enum.Enum):
    HEALTHY = "healthy"  # the application's problem; keep offering the GPU
    UNHEALTHY = "unhealthy"  # needs a reset or more
    RECOVERY_ACTION = "recovery action"  # XID 154: read what the driver asks for
    INFORMATIONAL = "informational"  # no catalog action: log it only


@dataclass(frozen=True)
class XidInfo:
    code: int
    mnemonic: str
    action: str
    description: str = ""


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str
    # The catalog's immediate action (RESET_GPU, RESTART_BM, ...); "" where the config decided, or none.
    action: str = ""


def load_catalog(text: str | None = None) -> dict[int, XidInfo]:
    """The shipped catalog, or `text` in the same CSV format."""
    if text is None:
        text = resources.files("nvplug.data").joinpath("xid-catalog.csv").read_text()
    catalog = {}
    for row in csv.DictReader(io.StringIO(text)):
        code = int(row["code"])
        catalog[code] = XidInfo(code, row["mnemonic"].strip(), row["immediate_action"].strip(), row["description"])
    return catalog


@dataclass(frozen=True)
class XidPolicy:
    catalog: Mapping[int, XidInfo] = field(default_factory=load_catalog)
    ignore: frozenset[int] = frozenset()
    fatal: frozenset[int] = frozenset()

    @classmethod
    def with_overrides(cls, ignore: Iterable[int] = (), fatal: Iterable[int] = ()) -> XidPolicy:
        ignore, fatal = frozenset(ignore), frozenset(fatal)
        both = ignore & fatal
        if both:
            raise ValueError(f"XIDs {sorted(both)} are both ignored and fatal")
        return cls(ignore=ignore, fatal=fatal)

    def name(self, code: int) -> str:
        info = self.catalog.get(code)
        return f"XID {code} {info.mnemonic}" if info else f"XID {code}"

    def decide(self, code: int) -> Decision:
        name = self.name(code)
        if code in self.fatal:
            return Decision(Verdict.UNHEALTHY, f"{name} (fatal by config)")
        if code in self.ignore:
            return Decision(Verdict.HEALTHY, f"{name} (ignored by config)")
        if code == RECOVERY_ACTION_XID:
            return Decision(Verdict.RECOVERY_ACTION, name)
        info = self.catalog.get(code)
        action = info.action if info else ""
        if code in _APP_LEVEL_CODES or action in _APP_LEVEL:
            return Decision(Verdict.HEALTHY, f"{name} ({action or 'application-level'})")
        if action in _FATAL:
            return Decision(Verdict.UNHEALTHY, f"{name} ({action})", action)
        return Decision(Verdict.INFORMATIONAL, f"{name} (no catalog action)")
