"""Backoff helpers shared by everything that retries."""

from __future__ import annotations

import asyncio
import contextlib


async def sleep_unless(wake: asyncio.Event, seconds: float) -> None:
    """Back off for `seconds`, but return as soon as `wake` is set: new evidence beats a timer."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), timeout=seconds)
