"""The status endpoint as a part: it serves requests and reads no snapshot, so it opens after every
other part (nothing is asked of a part not yet serving) and closes before any of them."""

from __future__ import annotations

import logging

from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import Sink
from nvplug.status.status_server import StatusServer

log = logging.getLogger(__name__)


class StatusEndpoint(Sink):
    name = "status endpoint"
    reads = frozenset[str]()
    closes_before_sources = True

    def __init__(self, server: StatusServer) -> None:
        self._server = server

    async def open(self, snapshot: Snapshot) -> None:
        try:
            await self._server.start()
        except OSError as err:
            # /healthz and the heal route are the operator's, not the kubelet's: GPUs are served without them.
            log.error("status endpoint %s unavailable: %s", self._server.listen, err)

    async def close(self) -> None:
        await self._server.stop()
