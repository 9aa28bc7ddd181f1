"""Backoff helpers shared by everything that retries."""

from __future__ import annotations

import asyncio


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
