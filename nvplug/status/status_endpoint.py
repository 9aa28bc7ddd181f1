"""A status endpoint as a part: it serves requests and reads no snapshot, so it opens after every other
part (nothing is asked of a part not yet serving) and closes before any of them.

An address it cannot take now (a port another exporter still holds, an address the node is not given yet
at boot) is tried again with backoff, and the status line says so meanwhile; a reload that changes the
address moves it. One this process can never take (a socket family the unit refuses) is said once, with
what to do."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Callable

from nvplug.base.backoff import Backoff, keep_trying
from nvplug.config import Config
from nvplug.core.events import NotesChanged
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import Commit, Emit, Sink, no_change
from nvplug.status.status_server import StatusServer

log = logging.getLogger(__name__)

REBIND_BACKOFF = Backoff(first=0.5, maximum=30.0)


class StatusEndpoint(Sink):
    reads = frozenset[str]()
    closes_before_sources = True

    def __init__(
        self,
        server: StatusServer,
        configured: Callable[[Config], str] | None = None,
        emit: Emit | None = None,
        backoff: Backoff = REBIND_BACKOFF,
    ) -> None:
        """`configured`: its address in a config, which a reload may change; `emit`: where a change in
        whether it serves tells the status line to say so."""
        self.name = server.name
        self._server = server
        self._configured = configured
        self._emit = emit
        self._backoff = backoff
        self.error: str | None = None  # why it is not serving its address now
        self._retrying: asyncio.Task[None] | None = None

    async def open(self, snapshot: Snapshot) -> None:
        await self._start()

    def prepare(self, cfg: Config) -> Commit:
        listen = self._configured(cfg) if self._configured is not None else self._server.listen
        if listen == self._server.listen:
            return no_change

        async def commit(snapshot: Snapshot) -> None:
            log.info("%s moves from %s to %s", self.name, self._server.listen, listen)
            await self.close()
            self._server.listen = listen
            await self._start()

        return commit

    def notes(self) -> list[str]:
        return [f"{self.name} {self._server.listen} unavailable: {self.error}"] if self.error else []

    def status(self) -> object:
        return {"listen": self._server.listen, "serving": self._server.serving, "error": self.error}

    async def close(self) -> None:
        retrying, self._retrying = self._retrying, None
        if retrying is not None:
            retrying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await retrying
        await self._server.stop()

    async def _start(self) -> None:
        """GPUs are served without it (/healthz and the heal route are the operator's, not the kubelet's):
        a failure is said, never raised."""
        before = self.error
        try:
            await self._server.start()
        except OSError as err:
            self.error = str(err)
            if err.errno == errno.EAFNOSUPPORT:
                log.error(
                    "%s %s unavailable: %s (this process may not make such sockets; under the shipped unit, "
                    "install its drop-in for TCP and restart: docs/telemetry.md)",
                    self.name,
                    self._server.listen,
                    err,
                )
            else:
                log.error("%s %s unavailable: %s; trying again with backoff", self.name, self._server.listen, err)
                self._retrying = asyncio.create_task(self._retry(), name=f"{self.name} rebind")
        else:
            self.error = None
        if self.error != before:
            self._notes_changed()

    async def _retry(self) -> None:
        await keep_trying(self._server.start, self._backoff, self._still_unavailable, (OSError,))
        self.error = None
        self._retrying = None
        self._notes_changed()

    def _still_unavailable(self, err: Exception, delay: float) -> None:
        if str(err) != self.error:
            log.warning("%s %s still unavailable: %s", self.name, self._server.listen, err)
            self.error = str(err)
            self._notes_changed()

    def _notes_changed(self) -> None:
        if self._emit is not None:
            self._emit(NotesChanged())
