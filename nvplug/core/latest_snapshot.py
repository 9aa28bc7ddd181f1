"""The newest snapshot a part was handed, and a wait for the next one.

A sink that serves streams (the device plugin's ListAndWatch) shows each snapshot its `update` is
handed here; its streams wait on it, not on the live state, so a stream lists only what its sink
has seen: after the sinks before it in the wiring's order (the CDI spec) have seen it too.
"""

from __future__ import annotations

import asyncio

from nvplug.core.snapshot import Snapshot


class LatestSnapshot:
    def __init__(self, first: Snapshot) -> None:
        self._current = first
        # Replaced at each new revision; a waiter holds the one it saw, so a burst wakes it once.
        self._shown = asyncio.Event()

    @property
    def current(self) -> Snapshot:
        return self._current

    def show(self, snapshot: Snapshot) -> None:
        """Keep it; wake the waiters if it is a new revision (counters alone wake nobody)."""
        revised = snapshot.revision != self._current.revision
        self._current = snapshot
        if revised:
            self.wake()

    async def next_revision(self) -> None:
        """Until a new revision (or a wake): one wait, so the waiter runs in the loop turn after it."""
        await self._shown.wait()

    def wake(self) -> None:
        """Wake every waiter with no new revision: one that is closing looks again."""
        shown, self._shown = self._shown, asyncio.Event()
        shown.set()
