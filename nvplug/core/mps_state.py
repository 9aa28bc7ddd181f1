"""The MPS groups' daemons as the node state keeps them: which devices each serves, and whether it answers.

A device of an MPS resource is Healthy only while its GPU is and its group's daemon runs with its
defaults set: a server started before them would take the whole GPU. A daemon that dies or stops
answering is a probe-class fault: one that runs and answers again clears it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from nvplug.core.events import MpsGroupChanged, MpsGroupRemoved
from nvplug.core.health import Clears, Fault, Health, HealthState

# The health of a device whose group no daemon has answered for yet: one object, so that the
# projection of an unchanged block compares equal revision after revision.
NOT_STARTED = HealthState(
    Health.UNHEALTHY, "its MPS control daemon has not started yet", 0.0, Clears.PROBE, fault=Fault.OTHER
)


@dataclass(frozen=True)
class MpsGroupState:
    group: str
    resource: str
    units: tuple[str, ...]
    health: HealthState
    pid: int | None = None
    # Wall-clock seconds when the daemon last answered with its defaults set; None while down.
    up_since: float | None = None
    restarts: int = 0
    thread_percentage: int = 100
    pinned_mib: tuple[int | None, ...] = ()


def apply_group(
    groups: Mapping[str, MpsGroupState], event: MpsGroupChanged | MpsGroupRemoved, now: float
) -> tuple[Mapping[str, MpsGroupState], str | None]:
    """The groups after the event, and the change to log ("mps daemon up", "mps daemon down"); None: none."""
    out = dict(groups)
    if isinstance(event, MpsGroupRemoved):
        if out.pop(event.group, None) is None:
            return groups, None
        return MappingProxyType(out), "mps group removed"
    before = groups.get(event.group)
    if event.ready:
        health = before.health if before is not None and before.health.healthy else None
        health = health or HealthState(Health.HEALTHY, event.reason, now)
        up_since = before.up_since if before is not None and before.up_since is not None else now
    else:
        same = before is not None and not before.health.healthy and before.health.reason == event.reason
        health = (
            before.health
            if same and before is not None
            else HealthState(Health.UNHEALTHY, event.reason, now, Clears.PROBE, fault=Fault.OTHER)
        )
        up_since = None
    state = MpsGroupState(
        event.group,
        event.resource,
        event.units,
        health,
        event.pid,
        up_since,
        event.restarts,
        event.thread_percentage,
        event.pinned_mib,
    )
    if state == before:
        return groups, None
    out[event.group] = state
    was_up = before is not None and before.health.healthy
    if before is not None and was_up == event.ready:
        return MappingProxyType(out), "mps daemon changed"
    return MappingProxyType(out), "mps daemon up" if event.ready else "mps daemon down"


def unit_health(groups: Mapping[str, MpsGroupState]) -> Mapping[str, HealthState]:
    """Each MPS device's daemon health, by its UUID (a whole GPU's or a MIG device's)."""
    return MappingProxyType({u: g.health for g in groups.values() for u in g.units})
