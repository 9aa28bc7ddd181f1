"""Waiting for what a test cannot be told of: a condition polled until it holds, with a generous deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    explain: Callable[[], str] | None = None,
    poll: float = 0.05,
) -> float:
    """Poll `predicate` every `poll` s until it holds; return the seconds it took (to within `poll`). On
    timeout, AssertionError saying `what` was awaited and, if given, what `explain()` says about the state."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        if predicate():
            return time.monotonic() - started
        if time.monotonic() >= deadline:
            detail = f"\n{explain()}" if explain is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(poll)
