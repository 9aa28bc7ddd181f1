"""A budget of writes per second, as a value: a token bucket that a writer asks before each write.

The first write after a quiet spell goes at once (the bucket is full); a run of changes after it is
paced at `per_second`, and a writer that waits writes the newest state when its turn comes, so the
changes in between are coalesced, never queued. Pure: the caller hands the clock in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WriteBudget:
    """At most `per_second` writes a second on average, `burst` of them back to back."""

    per_second: float
    burst: int = 2

    def __post_init__(self) -> None:
        if not self.per_second > 0 or self.burst < 1:
            raise ValueError(f"a write budget needs a positive rate and a burst of 1 or more, not {self}")

    def bucket(self, now: float) -> Bucket:
        return Bucket(self, now)


class Bucket:
    """One writer's tokens: full at the start."""

    def __init__(self, budget: WriteBudget, now: float) -> None:
        self.budget = budget
        self._tokens = float(budget.burst)
        self._at = now

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._at)
        self._tokens = min(float(self.budget.burst), self._tokens + elapsed * self.budget.per_second)
        self._at = max(self._at, now)

    def wait(self, now: float) -> float:
        """Seconds until a write is within the budget; 0: now."""
        self._refill(now)
        return 0.0 if self._tokens >= 1.0 else (1.0 - self._tokens) / self.budget.per_second

    def spend(self, now: float) -> None:
        """A write was made. A repair that did not wait counts too, and may leave the bucket in debt,
        of at most a burst: the changes after a run of repairs wait for it to be paid."""
        self._refill(now)
        self._tokens = max(self._tokens - 1.0, -float(self.budget.burst))
