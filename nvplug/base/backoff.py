"""The one backoff policy: every retry in nvplug waits by a `Backoff`, as a value.

A policy is data (first delay, cap, jitter), as tenacity's waits are; `wait` hands it to
tenacity's retry loops, and a `Schedule` paces a retry that runs on a timer instead.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tenacity import RetryCallState

# 2**64 times any first delay is past every cap: the exponent stops there, so it never overflows.
_MAX_EXPONENT = 64


@dataclass(frozen=True)
class Backoff:
    """Exponential: `first`, doubling up to `maximum`. With `jitter`, each wait is drawn uniformly
    from zero up to that (full jitter), so that retries from many nodes do not march in step."""

    first: float
    maximum: float
    jitter: bool = False

    def delay(self, attempt: int) -> float:
        """The wait after failed attempt number `attempt` (1 is the first failure)."""
        top = min(self.maximum, self.first * 2 ** min(max(attempt - 1, 0), _MAX_EXPONENT))
        return random.uniform(0, top) if self.jitter else top

    def wait(self) -> Callable[[RetryCallState], float]:
        """This policy as tenacity's `wait=`."""
        return lambda state: self.delay(state.attempt_number)

    def schedule(self) -> Schedule:
        return Schedule(self)


class Schedule:
    """One retry's progress through a policy, for retries driven by a timer rather than a loop."""

    def __init__(self, policy: Backoff) -> None:
        self.policy = policy
        self.failures = 0

    def next(self) -> float:
        """Count a failure; the wait before the next try."""
        self.failures += 1
        return self.policy.delay(self.failures)

    def reset(self) -> None:
        """It worked: the next failure waits the first delay again."""
        self.failures = 0


async def sleep_unless(wake: asyncio.Event, seconds: float) -> None:
    """Back off for `seconds`, but return as soon as `wake` is set: new evidence beats a timer.

    asyncio.wait, not wait_for: before Python 3.12, wait_for swallows a cancel that lands just
    as `wake` is set, and a task stopped at shutdown would go on running.
    """
    waiter = asyncio.ensure_future(wake.wait())
    try:
        await asyncio.wait({waiter}, timeout=seconds)
    finally:
        waiter.cancel()


async def keep_trying(
    attempt: Callable[[], Awaitable[object]],
    policy: Backoff,
    failed: Callable[[Exception, float], None],
    errors: tuple[type[Exception], ...],
    wake: asyncio.Event | None = None,
    closed: Callable[[], bool] = lambda: False,
) -> int | None:
    """`attempt` until it raises none of `errors`: for what must never be left undone (a socket to serve
    again). Each failure goes to `failed` with the wait before the next try, which `wake` cuts short;
    `wake` is cleared before each try, so that only news after it does. Returns the failures before the
    try that worked, or None once `closed()`."""
    schedule = policy.schedule()
    while not closed():
        if wake is not None:
            wake.clear()
        try:
            await attempt()
        except errors as err:
            delay = schedule.next()
            failed(err, delay)
            await (asyncio.sleep(delay) if wake is None else sleep_unless(wake, delay))
        else:
            return schedule.failures
    return None
