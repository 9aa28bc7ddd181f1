"""Health of a device: a state with the reason and time it was set."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Health(str, enum.Enum):
    # The kubelet compares these strings exactly.
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class HealthState:
    health: Health
    reason: str
    since: float  # wall-clock seconds, for operators

    @property
    def healthy(self) -> bool:
        return self.health is Health.HEALTHY
