"""The kernel log as it stood at the start: which of its records still say something about the GPUs now.

/dev/kmsg shows a new reader the log since boot. A fault printed there before nvplug started must
make its GPU Unhealthy from the first list, unless something after it says the GPU was reset:
- a later driver load line: every fault before it belonged to the previous driver instance;
- a state file of this boot whose cursor is past the record: an earlier nvplug already took it
  into account (it is Unhealthy in that file still, or it was repaired since).
"""

from __future__ import annotations

from collections.abc import Iterable

from nvplug.core.events import DriverLoaded, Event, GpuFellOffBus, GpuNamedInLog, KernelXid, SwitchXid

FAULTS = (KernelXid, GpuFellOffBus)


def record_seq(event: Event) -> int | None:
    """The kernel log record an event came from; None for events that are not one record."""
    match event:
        case KernelXid(seq=seq) | GpuFellOffBus(seq=seq) | DriverLoaded(seq=seq) | GpuNamedInLog(seq=seq):
            return seq
        case SwitchXid(seq=seq):
            return seq
        case _:
            return None


def settle(backlog: Iterable[Event], cursor: int | None) -> tuple[Event, ...]:
    """The backlog's events that still apply, in order: past the cursor, faults after the last driver load."""
    kept = [e for e in backlog if not _taken(record_seq(e), cursor)]
    last_load = max((i for i, e in enumerate(kept) if isinstance(e, DriverLoaded)), default=-1)
    return tuple(e for i, e in enumerate(kept) if i > last_load or not isinstance(e, FAULTS))


def _taken(seq: int | None, cursor: int | None) -> bool:
    return seq is not None and cursor is not None and seq <= cursor
