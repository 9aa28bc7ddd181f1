"""An asyncio loop in a thread of its own, for sync code (tests, benches) that drives async parts as the
daemon runs them: on a loop, while the caller's thread waits or acts from outside."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

_T = TypeVar("_T")


class LoopThread:
    def __init__(self, timeout: float = 15.0) -> None:
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run `coro` on the loop; its result (or its exception) here."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout)

    def call(self, fn: Callable[[], _T]) -> _T:
        """Call `fn` on the loop (what must run there: a loop reader's start, say)."""

        async def call() -> _T:
            return fn()

        return self.run(call())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(self.timeout)
        self.loop.close()

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
