"""The one event bus: sources publish, the daemon's dispatcher consumes in order."""

from __future__ import annotations

import asyncio
import threading
import time

from nvplug.core.events import Event


class EventBus:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # Each event with the time it was published: the daemon's own latency starts there.
        self._queue: asyncio.Queue[tuple[Event, float]] = asyncio.Queue()
        self._loop_thread = threading.get_ident()

    def publish(self, event: Event) -> None:
        """From any thread: the loop's own (a reader, a task) or a source's (NVML wait)."""
        item = (event, time.monotonic())
        if threading.get_ident() == self._loop_thread:
            self._queue.put_nowait(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            # The loop closed under a thread still delivering (an XID in hand at shutdown): nobody
            # is left to act on it, and the next start reads the GPU afresh.
            if not self._loop.is_closed():
                raise

    async def next(self) -> tuple[Event, float]:
        """The next event, and when it was published (monotonic)."""
        return await self._queue.get()
