"""The node's ResourceSlices, kept equal to the pool through the API server.

Driven by events: `want` hands over the pool after each state change, and one task
writes what changed at once. API errors are logged once, retried with backoff, and
never reach the device plugin. After each registration with the kubelet (which
deletes its node's slices when it starts) the slices are listed and written again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

from nvplug.base.backoff import Backoff
from nvplug.dra.api_client import ApiClient, ApiError, KubeConfigError
from nvplug.dra.dra_devices import DraDevice
from nvplug.dra.resource_slices import GROUP, VERSIONS, pool_devices, slices

log = logging.getLogger("nvplug.dra")

RETRY_BACKOFF = Backoff(first=0.5, maximum=60.0)
# asyncio.TimeoutError is not TimeoutError before Python 3.11.
FAILURES = (ApiError, OSError, TimeoutError, asyncio.TimeoutError, KubeConfigError, ValueError, KeyError, TypeError)


class SlicePublisher:
    def __init__(
        self,
        client: ApiClient | None,
        driver: str,
        node: str,
        error: str | None = None,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        """`client` None: no API server can be reached (`error` says why); the pool is only kept.
        `on_change` is told after each write and each change of error (the status line)."""
        self.client = client
        self._on_change = on_change
        self.driver = driver
        self.node = node
        self.error = error
        self.version: str | None = None
        self.generation = 0
        self.published_at: float | None = None
        self.writes = 0
        self._devices: list[DraDevice] = []
        # The slices as last written or listed; None: list them first.
        self._known: list[dict[str, Any]] | None = None
        # Counts republish(): one that comes during a write outlives what that write saw.
        self._republished = 0
        self._wake = asyncio.Event()

    def want(self, devices: Sequence[DraDevice]) -> None:
        self._devices = list(devices)
        self._wake.set()

    def republish(self) -> None:
        """The kubelet registered us: it may have deleted the slices, so look again."""
        self._known = None
        self._republished += 1
        self._wake.set()

    @property
    def slice_names(self) -> list[str]:
        return [str(s["metadata"]["name"]) for s in self._known or []]

    def status(self) -> dict[str, object]:
        return {
            "driver": self.driver,
            "node": self.node,
            "api_version": f"{GROUP}/{self.version}" if self.version else None,
            "pool_generation": self.generation,
            "slices": self.slice_names,
            "pool_devices": sum(1 for d in self._devices if d.healthy),
            "published_at": self.published_at,
            "error": self.error,
        }

    async def run(self) -> None:
        retrying = RETRY_BACKOFF.schedule()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.client is None:
                continue
            try:
                await self._reconcile(self.client)
            except FAILURES as err:
                self._failed(f"ResourceSlices of {self.node} not published: {err}")
                self._known = None
                await asyncio.sleep(retrying.next())
                self._wake.set()
            else:
                retrying.reset()
                if self.error is not None:
                    log.info("ResourceSlices of %s published again", self.node)
                    self.error = None
            self._on_change()

    def _failed(self, error: str) -> None:
        if error != self.error:
            log.error("%s; retrying with backoff (the device plugin is not affected)", error)
            self.error = error

    async def _reconcile(self, client: ApiClient) -> None:
        republished = self._republished
        version = self.version or await self.discover(client)
        base = f"/apis/{GROUP}/{version}/resourceslices"
        if self._known is None:
            try:
                self._known = await list_slices(client, version, self.node, self.driver)
            except ApiError as err:
                if err.status == 404:
                    self.version = None  # the API server changed: discover again
                raise
            self.generation = max([self.generation, *(int(s["spec"]["pool"]["generation"]) for s in self._known)])
        wanted = pool_devices(self._devices, version)
        known = self._known
        if _same_pool(known, wanted, self.generation):
            return
        self.generation += 1
        objects = slices(wanted, self.driver, self.node, self.generation, version)
        written: list[dict[str, Any]] = []
        self._known = None  # until every write is through
        for n, obj in enumerate(objects):
            if n < len(known):
                meta = known[n]["metadata"]
                obj["metadata"] = {"name": meta["name"], "resourceVersion": meta["resourceVersion"]}
                written.append(await client.request("PUT", f"{base}/{meta['name']}", obj))
            else:
                written.append(await client.request("POST", base, obj))
        for old in known[len(objects) :]:
            await client.request("DELETE", f"{base}/{old['metadata']['name']}")
        # A republish() meanwhile (the kubelet restarted and wiped them) means list again.
        self._known = written if self._republished == republished else None
        self.writes += 1
        self.published_at = time.time()
        log.info(
            "ResourceSlices of %s: %d devices in %s (pool generation %d)",
            self.node, len(wanted), ", ".join(self.slice_names), self.generation,
        )  # fmt: skip

    async def discover(self, client: ApiClient) -> str:
        self.version = await discover(client)
        log.info("publishing ResourceSlices as %s/%s", GROUP, self.version)
        return self.version


async def discover(client: ApiClient) -> str:
    """The newest resource.k8s.io version the API server serves (and nvplug writes)."""
    group = await client.request("GET", f"/apis/{GROUP}")
    served = {v.get("version") for v in group.get("versions") or [] if isinstance(v, dict)}
    version = next((v for v in VERSIONS if v in served), None)
    if version is None:
        raise ValueError(f"the API server serves {GROUP} {sorted(map(str, served))}, none of {list(VERSIONS)}")
    return version


async def list_slices(client: ApiClient, version: str, node: str, driver: str) -> list[dict[str, Any]]:
    """The node's ResourceSlices of this driver, by name."""
    selector = quote(f"spec.nodeName={node},spec.driver={driver}")
    listed = await client.request("GET", f"/apis/{GROUP}/{version}/resourceslices?fieldSelector={selector}")
    return sorted(listed.get("items") or [], key=lambda s: str(s["metadata"]["name"]))


def _same_pool(known: list[dict[str, Any]], wanted: list[dict[str, Any]], generation: int) -> bool:
    """Whether the slices already hold exactly these devices, all of one current generation."""
    if not known or any(int(s["spec"]["pool"]["generation"]) != generation for s in known):
        return False
    if any(int(s["spec"]["pool"]["resourceSliceCount"]) != len(known) for s in known):
        return False
    return [d for s in known for d in s["spec"].get("devices") or []] == wanted
