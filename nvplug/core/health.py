"""Health of a device: a state with the reason and time it was set, and what would clear it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

RESET_GPU = "RESET_GPU"


def merged_remedy(current: str | None, new: str | None) -> str | None:
    """Two faults of one device: a reset is all they ask for only if both ask only for that."""
    return new if current == RESET_GPU else current


class Health(str, enum.Enum):
    # The kubelet compares these strings exactly.
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class Clears(str, enum.Enum):
    """The evidence a fault waits for before its device may be Healthy again."""

    # Only unreachable (NVML failed on it, GPU_IS_LOST): answering a probe again is the evidence.
    PROBE = "probe"
    # Something Allocate needs is missing (a device node, MIG capability minors): a scan that finds it.
    CHECK = "check"
    # Needs a reset or more: evidence of a reset (udev, NVML's recovery action, a driver reload,
    # a new boot, an operator's heal), then a passing probe. A probe alone never clears it.
    RESET = "reset"

    @property
    def rank(self) -> int:
        """A stronger fault replaces a weaker one on a device already Unhealthy."""
        return _RANK[self]


_RANK = {Clears.CHECK: 0, Clears.PROBE: 1, Clears.RESET: 2}


class Fault(str, enum.Enum):
    """What kind of fault it is, for those who say so outside nvplug (the DRA driver's device taints)."""

    # An Xid: its code is in HealthState.xid.
    XID = "xid"
    # The GPU cannot be reached: NVML cannot read it, or the driver let go of it.
    LOST = "lost"
    # Nothing can check it: NVML is down, or the driver does not answer.
    UNMONITORED = "unmonitored"
    # The rest: ECC, poison, a pending repair, a recovery action, what Allocate needs missing, a reset.
    OTHER = "other"


@dataclass(frozen=True)
class HealthState:
    health: Health
    reason: str
    since: float  # wall-clock seconds, for operators
    # What clears the fault; None while Healthy.
    clears: Clears | None = None
    # Reset evidence seen since the fault (e.g. "driver unbound and re-bound"); a passing probe completes it.
    evidence: str | None = None
    # The last NVML recovery action read during the fault: "back to none" counts only after another value.
    recovery_action: int = 0
    # The driver instance the fault happened under: a reloaded driver has reset the GPU.
    driver_instance: str | None = None
    # What the faults ask for, in the XID catalog's words: RESET_GPU is one nvplug may do itself
    # (nvplug.health.autoReset); None where no fault said (or they disagree with RESET_GPU).
    remedy: str | None = None
    # What kind of fault it is, and the Xid's code for an Xid; None while Healthy.
    fault: Fault | None = None
    xid: int | None = None

    @property
    def resettable(self) -> bool:
        """Whether a GPU reset is all the faults ask for."""
        return self.clears is Clears.RESET and self.evidence is None and self.remedy == RESET_GPU

    @property
    def healthy(self) -> bool:
        return self.health is Health.HEALTHY

    @property
    def probe_clears(self) -> bool:
        """Whether a passing probe would make the device Healthy now."""
        return self.clears is Clears.PROBE or (self.clears is Clears.RESET and self.evidence is not None)

    def waiting_for(self, bus_id: str, index: int) -> str | None:
        """What an Unhealthy device waits for, in the operator's words; None while Healthy."""
        if self.healthy:
            return None
        if self.clears is Clears.RESET and self.evidence is None:
            return f"a GPU reset (nvidia-smi -r -i {bus_id}) or a reboot, or `nvplug heal {index}`"
        if self.evidence is not None:
            return f"a passing probe after the evidence: {self.evidence}"
        if self.clears is Clears.CHECK:
            return f"what Allocate needs to appear (checked at every scan, or `nvplug heal {index}`)"
        return "the GPU to answer NVML again (re-probed with backoff)"


@dataclass(frozen=True)
class Recorded:
    """An Unhealthy device as the state file kept it, restored when the device shows up in the same boot."""

    bus_id: str
    state: HealthState
