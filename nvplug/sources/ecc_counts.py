"""Each GPU's volatile double-bit ECC count: the evidence that neither loses nor doubles an ECC event.

NVML delivers an event only to event sets that exist when it fires, so one that fires while a rescan has
handed the old watch over (NVML's init count at zero) is never delivered. The driver's count still grows.
After a hand-over the scan reads each GPU's count (`catch_up`) and reports the errors no event told of.
An event reads it too (`confirm`): one whose error a catch-up reported already (the count has not risen
since, and that catch-up left a report unclaimed) is not reported again; every other is, so a count the
driver updates late, or cannot read, costs a second report and never a lost one. Both read and record
under the GPU's lock, so the counts are recorded in the order they were read.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pynvml  # type: ignore[import-untyped]

log = logging.getLogger(__name__)

UNCORRECTED = 1  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED
VOLATILE = 0  # NVML_VOLATILE_ECC: since the driver loaded or the GPU was last reset
# An event's read that takes longer (a GPU whose calls hang) is not waited for: the event is reported.
CONFIRM_SECONDS = 1.0


def volatile_double_bit(handle: Any) -> int | None:
    """None where the GPU cannot say (ECC off or unsupported, lost, a failing call)."""
    try:
        return int(pynvml.nvmlDeviceGetTotalEccErrors(handle, UNCORRECTED, VOLATILE))
    except pynvml.NVMLError:
        return None


class DoubleBitCounts:
    """The count each GPU's reports so far account for; shared by every watch a scanner makes."""

    def __init__(self, confirm_seconds: float = CONFIRM_SECONDS) -> None:
        self._confirm_seconds = confirm_seconds
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._counted: dict[str, int] = {}
        # Errors a catch-up reported that an event may still arrive for (it fired after the subscription).
        self._unclaimed: dict[str, int] = {}

    def confirm(self, handle: Any, uuid: str) -> bool:
        """An event of `uuid`: False only when a catch-up has reported this rise already. The read runs on
        a thread of its own, so a GPU whose calls hang holds up neither the watch nor the report."""
        answer: list[bool] = []
        reader = threading.Thread(
            target=lambda: answer.append(self._record(handle, uuid, event=True) != 0),
            name=f"ecc-count {uuid}",
            daemon=True,
        )
        reader.start()
        reader.join(self._confirm_seconds)
        if not answer:
            log.warning("%s: its ECC count did not answer in %.1f s; reporting the event", uuid, self._confirm_seconds)
        return answer[0] if answer else True

    def catch_up(self, handle: Any, uuid: str) -> int:
        """Errors counted since the last read that no report told of: 0 at first sight, and after a reset
        (the count went down). Call once the GPU's new event watch is subscribed, so that every error
        after the read reaches the watch."""
        return self._record(handle, uuid, event=False)

    def _record(self, handle: Any, uuid: str, *, event: bool) -> int:
        with self._guard:
            lock = self._locks.setdefault(uuid, threading.Lock())
        with lock:
            count = volatile_double_bit(handle)
            if count is None:
                return 1 if event else 0
            last = self._counted.get(uuid)
            self._counted[uuid] = count
            if event:
                if count == last and self._unclaimed.get(uuid, 0):
                    self._unclaimed[uuid] -= 1
                    return 0
                return 1
            rise = 0 if last is None or count < last else count - last
            self._unclaimed[uuid] = rise
            return rise
