"""The events two NVML event watches both tell while one hands over to the next: each reported once.

A rescan that counts GPUs again keeps the old watch's child listening until the new watch's child has
subscribed (`nvml_events`), so that no event falls between the two: an event of a GPU that fires from the
new child's registration of that GPU (`since`) to the old child's kill (`until`) reaches both children's
event sets. Each child stamps a registration, and an event as its wait returns, with the system's monotonic
clock, so both copies of one event fall in that span, and an event either watch alone heard falls outside
it. The old watch's events from `since` and the new watch's up to `until` wait here for the other watch's
copy (same GPU, type, data and instances), which is then dropped. An event that truly fires twice is told
twice by each, and reported twice. What is still possible: an event whose stamp lags its firing across
`since` or `until` by the few microseconds a wait takes to return.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping

# An event as its child tells it: GPU UUID, type, data, GPU instance, compute instance.
Told = tuple[str, int, int, int, int]


class WatchOverlap:
    """Shared by every watch a scanner makes; one hand-over at a time (rescans are serialized)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._old: object | None = None
        self._new: object | None = None
        self._since: Mapping[str, int] = {}  # ns, the new child's registration of each GPU
        self._until: int | None = None  # ns, the old child's end
        # Each watch's events of the overlap that the other has not told yet.
        self._told: dict[object, Counter[Told]] = {}
        self.dropped = 0  # second tellings, ever

    def retire(self, old: object) -> None:
        """`old` listens on until the next watch has subscribed."""
        with self._lock:
            self._old, self._new, self._until, self._told = old, None, None, {}

    def subscribed(self, new: object, since: Mapping[str, int]) -> None:
        """`new`'s child registered each GPU's events at `since[uuid]`: from then on it hears what the old
        child hears of that GPU."""
        with self._lock:
            if self._old is not None and self._new is None and new is not self._old and self._until is None:
                self._new, self._since = new, since
                self._told = {self._old: Counter(), new: Counter()}

    def ended(self, watch: object, until: int | None = None) -> None:
        """`watch`'s child was killed at `until`, or its watch has read its last line (now, at the latest)."""
        with self._lock:
            if watch is self._old and self._until is None:
                self._until = time.monotonic_ns() if until is None else until

    def first_telling(self, watch: object, event: Told, at: int) -> bool:
        """False: the other watch has told `event`, stamped `at` by `watch`'s child, already; it is not to be
        reported again."""
        with self._lock:
            if watch is self._old:
                since = self._since.get(event[0])
                other, overlapping = self._new, self._new is not None and since is not None and at >= since
            elif watch is self._new:
                other, overlapping = self._old, self._until is None or at <= self._until
            else:
                return True
            if not overlapping:
                return True
            if self._told[other][event]:
                self._told[other][event] -= 1
                self.dropped += 1
                return False
            self._told[watch][event] += 1
            return True
