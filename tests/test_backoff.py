"""The one backoff policy, and the retry of what must never be left undone (a socket to serve again)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from nvplug.base.backoff import Backoff, keep_trying


def test_the_delay_doubles_up_to_its_cap_and_jitter_stays_under_it() -> None:
    policy = Backoff(first=0.5, maximum=3.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.delay(10_000) == 3.0  # no overflow however long it has failed
    jittered = Backoff(first=0.5, maximum=3.0, jitter=True)
    assert all(0 <= jittered.delay(n) <= min(3.0, 0.5 * 2 ** (n - 1)) for n in range(1, 8) for _ in range(20))


def test_keep_trying_tells_each_failure_with_its_wait_and_counts_them() -> None:
    tries: list[float] = []
    told: list[tuple[str, float]] = []

    async def attempt() -> None:
        tries.append(time.monotonic())
        if len(tries) < 4:
            raise OSError(f"in use ({len(tries)})")

    failures = asyncio.run(
        keep_trying(attempt, Backoff(0.01, 0.02), lambda err, delay: told.append((str(err), delay)), (OSError,))
    )
    assert failures == 3
    assert told == [("in use (1)", 0.01), ("in use (2)", 0.02), ("in use (3)", 0.02)]
    assert all(b - a >= 0.009 for a, b in itertools.pairwise(tries))  # it waited each time


def test_news_cuts_the_wait_short_and_closing_ends_it() -> None:
    async def run() -> tuple[int | None, float, int | None]:
        wake = asyncio.Event()
        closed = False
        tries = 0

        async def attempt() -> None:
            nonlocal tries
            tries += 1
            if tries == 1:
                raise RuntimeError("the directory is gone")

        async def news() -> None:
            await asyncio.sleep(0.05)
            wake.set()  # the directory came back

        began = time.monotonic()
        _, worked = await asyncio.gather(
            news(), keep_trying(attempt, Backoff(60.0, 60.0), lambda e, d: None, (RuntimeError,), wake)
        )
        took = time.monotonic() - began

        async def never() -> None:
            raise OSError("still in use")

        def close_now(err: Exception, delay: float) -> None:
            nonlocal closed
            closed = True
            wake.set()

        ended = await keep_trying(never, Backoff(60.0, 60.0), close_now, (OSError,), wake, lambda: closed)
        return worked, took, ended

    worked, took, ended = asyncio.run(run())
    assert worked == 1 and took < 30.0  # not the minute the policy would have waited
    assert ended is None


def test_an_error_it_was_not_told_to_retry_is_raised() -> None:
    async def attempt() -> None:
        raise ValueError("a bug, not a busy port")

    with pytest.raises(ValueError, match="a bug"):
        asyncio.run(keep_trying(attempt, Backoff(0.01, 0.01), lambda e, d: None, (OSError,)))
