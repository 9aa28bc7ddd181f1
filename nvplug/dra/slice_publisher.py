"""The node's ResourceSlices, kept equal to the pool through the API server: checked, not assumed.

Driven by events: `want` hands over the pool after each state change, and one task
writes what changed at once. A watch on the node's slices of this driver sees every
change made by anyone else (the kubelet deletes its node's slices when it starts, up to
60 ms after it registered the plugin; an admin may delete one): the slices are listed
again and whatever is missing is written. After each registration, and once more when
the kubelet's start-up wipe is surely over, they are listed again too. API errors are
logged once, retried with backoff, and never reach the device plugin.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

from nvplug.base.backoff import Backoff, sleep_unless
from nvplug.base.write_budget import WriteBudget
from nvplug.dra.api_client import ApiClient, ApiError, KubeConfigError
from nvplug.dra.device_taints import MAX_TAINTED_DEVICES, as_stored, keep_stored, kept, others, stored_taint_text
from nvplug.dra.dra_devices import DraDevice, without_effect_none
from nvplug.dra.resource_slices import GROUP, MAX_DEVICES, in_pool, pool_devices, same_pool, slices
from nvplug.dra.slice_requests import discover, list_slices_at, probe_taints

log = logging.getLogger("nvplug.dra")

RETRY_BACKOFF = Backoff(first=0.5, maximum=60.0)
# nvplug.dra.maxWritesPerSecond's default: a node's changes cost the API server at most about this.
DEFAULT_BUDGET = WriteBudget(per_second=1.0, burst=2)
WATCH_BACKOFF = Backoff(first=0.2, maximum=30.0, jitter=True)
# Longer than the kubelet's start-up wipe takes to land after it registered the plugin (60 ms seen).
SETTLE_SECONDS = 2.0
# The API server ends a watch after this long, and it is made again: a silent dead connection
# cannot outlast it.
WATCH_SECONDS = 300
# Our writes' resourceVersions kept for the watch to recognise; more means no watch takes them in.
MAX_OURS = 1024
# 409s in a row (someone else wrote the slice meanwhile) read again and merged at once; then backoff.
MAX_CONFLICTS = 3
# asyncio.TimeoutError is not TimeoutError before Python 3.11.
TRANSPORT = (ApiError, OSError, TimeoutError, asyncio.TimeoutError, KubeConfigError)
FAILURES = (*TRANSPORT, ValueError, KeyError, TypeError)


class SlicePublisher:
    def __init__(
        self,
        client: ApiClient | None,
        driver: str,
        node: str,
        error: str | None = None,
        on_change: Callable[[], None] = lambda: None,
        budget: WriteBudget = DEFAULT_BUDGET,
    ) -> None:
        """`client` None: no API server can be reached (`error` says why); the pool is only kept.
        `on_change` is told after each write and each change of error (the status line). `budget`
        paces the writes of changes; a repair (the slices wiped or deleted) is written at once."""
        self.client = client
        self._on_change = on_change
        self.driver = driver
        self.node = node
        self.error = error
        self.version: str | None = None
        self.generation = 0
        self.published_at: float | None = None
        self.writes = 0
        self._bucket = budget.bucket(time.monotonic())
        # Set when the slices must be listed again (a wipe, a deletion, a registration): a repair does not
        # wait for the budget.
        self._repair = asyncio.Event()
        # When the next write is due, while a change waits for the budget (wall clock, for status).
        self.next_write_at: float | None = None
        # The pool's changes handed over; those written together with a later one; those not written yet.
        self.changes = 0
        self.coalesced = 0
        self._pending = 0
        # The requests that write slices, by (verb, outcome), and the bytes of their bodies.
        self.requests: dict[tuple[str, str], int] = {}
        self.bytes_written = 0
        self._devices: list[DraDevice] = []
        # The slices as last written or listed; None: list them first.
        self._known: list[dict[str, Any]] | None = None
        # The taints nvplug did not write (an admin's), as last seen on a live slice, by device: a deletion of
        # the slices (the kubelet's wipe at its start) takes them too, and they are put back.
        self._others: dict[str, list[dict[str, Any]]] = {}
        # Counts republish() and changes the watch saw: one during a write outlives what that write saw.
        self._republished = 0
        self._wake = asyncio.Event()
        # The resourceVersion the watch goes on from (a list's, then each event's); None: list first.
        self._watch_from: str | None = None
        self._listed = asyncio.Event()
        self.watching = False
        self.watch_error: str | None = None
        # The resourceVersions of our own writes: their events are no news.
        self._ours: set[str] = set()
        # The names of the slices we deleted ourselves: a deletion's version is in no answer of ours.
        self._deleted: set[str] = set()
        # The last change to our slices that was not ours: when, and what (for status and doctor).
        self.foreign_change: dict[str, object] | None = None
        self._settle: asyncio.TimerHandle | None = None
        # Events that came while our writes were in flight: judged once their answers (and so their
        # resourceVersions) are in, or our own write would read as someone else's.
        self._writing = False
        self._held_back: list[dict[str, Any]] = []
        # Whether the API server keeps device taints (a dry run tells; so does each write); None: not asked.
        self.taints: bool | None = None
        self._said_taints: bool | None = None
        # Whether it takes the effect None (1.35 on); where it does not, such a taint is left out.
        self._effect_none = True
        self._probe_due = True
        # Set after each pass of the publish loop: what waits for the API server to hold the pool.
        self._passed = asyncio.Event()

    def want(self, devices: Sequence[DraDevice]) -> None:
        wanted = list(devices)
        if wanted != self._devices:
            self.changes += 1
            self._pending += 1
        self._devices = wanted
        self._wake.set()

    def republish(self, settle: bool = True) -> None:
        """The kubelet registered us: it may have deleted the slices, so look again, now and (`settle`)
        once its start-up wipe is surely over: the watch sees it, this does if the watch cannot."""
        self._known = None
        self._republished += 1
        self._repair.set()
        # Whether taints are kept is asked again (the control plane may have been upgraded meanwhile);
        # the last answer stands until then.
        self._probe_due = True
        self._wake.set()
        if settle:
            if self._settle is not None:
                self._settle.cancel()
            self._settle = asyncio.get_running_loop().call_later(SETTLE_SECONDS, self.republish, False)

    @property
    def published(self) -> bool:
        """Whether the API server holds exactly the pool, as last listed, written or watched."""
        known, version = self._known, self.version
        return (
            known is not None
            and version is not None
            and same_pool(known, self._wanted(version, known), self.generation)
        )

    def _wanted(self, version: str, known: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The pool's devices as they must be stored: tainted where taints are kept (not yet asked: as if),
        with the stored ones kept."""
        devices = self._devices if self._effect_none else [without_effect_none(d) for d in self._devices]
        # Slices gone (wiped, deleted): the others' taints come back from what was last seen of them.
        stored = known if known or not self._others else as_stored(self._others)
        return keep_stored(pool_devices(devices, version, self.taints is not False), stored)

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
            "pool_devices": sum(1 for d in self._devices if in_pool(d, bool(self.taints))),
            # Whether an Unhealthy device stays in the pool, tainted (True), or leaves it (False); None: not known.
            "taints_kept": self.taints,
            "tainted": {d.name: shown for d in self._devices if (shown := self.shown_taints(d))},
            "published_at": self.published_at,
            "writes": self.writes,
            "next_write_at": self.next_write_at,
            "changes": self.changes,
            "changes_coalesced": self.coalesced,
            "requests": {f"{verb} {outcome}": n for (verb, outcome), n in sorted(self.requests.items())},
            "bytes_written": self.bytes_written,
            # What the API server holds, not what nvplug last wrote: False from a deletion seen by
            # the watch until the slices are written again.
            "published": self.published,
            "watching": self.watching,
            "watch_error": self.watch_error,
            "foreign_change": self.foreign_change,
            "error": self.error,
        }

    async def run(self) -> None:
        watch = asyncio.create_task(self._watch_loop(), name="resourceslice watch")
        try:
            await self._publish_loop()
        finally:
            watch.cancel()
            if self._settle is not None:
                self._settle.cancel()

    async def _publish_loop(self) -> None:
        retrying = RETRY_BACKOFF.schedule()
        conflicts = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.client is None:
                continue
            await self._within_budget()
            writes = self.writes
            try:
                await self._reconcile(self.client)
            except FAILURES as err:
                self._known = None
                if isinstance(err, ApiError) and err.status == 409 and conflicts < MAX_CONFLICTS:
                    # Written by someone else meanwhile (an admin's taint): read again and merge, now.
                    conflicts += 1
                    log.info("ResourceSlices of %s changed meanwhile (%s); reading them again", self.node, err)
                    self._wake.set()
                    continue
                self._failed(f"ResourceSlices of {self.node} not published: {err}", err)
                await asyncio.sleep(retrying.next())
                self._wake.set()
            else:
                wrote = self.writes > writes
                if wrote:
                    self._bucket.spend(time.monotonic())
                # Changes written by this pass (or that cancelled out): all but the one written were coalesced.
                self.coalesced += max(0, self._pending - wrote)
                self._pending = 0
                retrying.reset()
                if self.error is not None:
                    log.info("ResourceSlices of %s published again", self.node)
                    self.error = None
            conflicts = 0
            self._on_change()
            passed, self._passed = self._passed, asyncio.Event()
            passed.set()

    def _seen_others(self, stored: list[dict[str, Any]], whole: bool = True) -> None:
        """Live slices show the others' taints as they are now: one an admin removed is forgotten. `whole`:
        these are all the node's slices (a list, our writes); else some of them (a watch event)."""
        if not stored:
            return
        if whole:
            self._others = others(stored)
            return
        shown = {str(d.get("name")) for s in stored for d in (s.get("spec") or {}).get("devices") or []}
        self._others = {n: t for n, t in self._others.items() if n not in shown} | others(stored)

    async def _within_budget(self) -> None:
        """A change of the pool waits for its turn in the write budget: what changes meanwhile goes into the
        same write. A repair does not wait, and stops a change's wait."""
        wait = self._bucket.wait(time.monotonic())
        if wait <= 0 or self._known is None:
            return
        self._repair.clear()
        self.next_write_at = time.time() + wait
        await sleep_unless(self._repair, wait)
        self.next_write_at = None
        self._wake.clear()  # this pass writes the newest pool

    async def held(self, timeout: float) -> bool:
        """Whether the API server holds the pool as it is now, waiting up to `timeout` for the writes."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.published:
            left = deadline - asyncio.get_running_loop().time()
            if self.client is None or left <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._passed.wait(), left)
        return True

    def _failed(self, error: str, cause: BaseException) -> None:
        if error != self.error:
            # Not the API server's answer nor the network's: an answer nvplug could not read, or a bug of
            # nvplug's. Either way the traceback says where.
            unexpected = not isinstance(cause, TRANSPORT)
            log.error("%s; retrying with backoff (the device plugin is not affected)", error, exc_info=unexpected)
            self.error = error

    async def _reconcile(self, client: ApiClient) -> None:
        republished = self._republished
        version = self.version or await self.discover(client)
        base = f"/apis/{GROUP}/{version}/resourceslices"
        # Until a list and the probe hold with no republish() during their awaits: one that came (the
        # kubelet registered us again, and may wipe the slices) asks to list again.
        while (known := self._known) is None or self.taints is None or self._probe_due:
            if known is None:
                before = self._republished
                try:
                    self._known, listed_at = await list_slices_at(client, version, self.node, self.driver)
                except ApiError as err:
                    if err.status == 404:
                        self.version = self.taints = None  # the API server changed: discover again
                    raise
                self.generation = max([self.generation, *(int(s["spec"]["pool"]["generation"]) for s in self._known)])
                if self._republished == before:  # else a change crossed the list: its answer may be older
                    self._seen_others(self._known)
                if self._watch_from is None:
                    self._watch_from = listed_at
                    self._listed.set()
            if self.taints is None or self._probe_due:
                self._probe_due = False
                self._taints_kept(*await probe_taints(client, version, self.node, self.driver))
        wanted = self._wanted(version, known)
        if same_pool(known, wanted, self.generation):
            return
        self.generation += 1
        per_slice = MAX_TAINTED_DEVICES if self.taints else MAX_DEVICES
        objects = slices(wanted, self.driver, self.node, self.generation, version, per_slice)
        written: list[dict[str, Any]] = []
        self._known = None  # until every write is through
        self._writing = True
        try:
            await self._write(client, base, objects, known, written)
        finally:
            self._writing = False
            held, self._held_back = self._held_back, []
        for event in held:
            self._watched(event)
        sent = [d for o in objects for d in o["spec"]["devices"]]
        stored = [d for w in written for d in w["spec"].get("devices") or []]
        if self.taints and not kept(sent, stored):
            # Dropped on the way in after all (the gate turned off?): the Unhealthy devices leave the pool.
            self._taints_kept(False)
            self._republished += 1
            self._wake.set()
        if not known and self._others:
            back = [f"{name} {', '.join(map(stored_taint_text, ts))}" for name, ts in sorted(self._others.items())]
            log.info(
                "ResourceSlices of %s were deleted with taints nvplug did not set: put back (%s)",
                self.node,
                "; ".join(back),
            )
        # A republish() or a change seen meanwhile (the kubelet restarted and wiped them) means list again.
        if self._republished == republished:
            self._seen_others(written)
        self._known = written if self._republished == republished else None
        self.writes += 1
        self.published_at = time.time()
        log.info(
            "ResourceSlices of %s: %d devices in %s (pool generation %d)",
            self.node,
            len(wanted),
            ", ".join(str(w["metadata"]["name"]) for w in written),
            self.generation,
        )

    async def _write(
        self,
        client: ApiClient,
        base: str,
        objects: list[dict[str, Any]],
        known: list[dict[str, Any]],
        written: list[dict[str, Any]],
    ) -> None:
        if len(self._ours) + len(self._deleted) > MAX_OURS:
            # No watch has taken them in: judging by versions starts afresh.
            self._ours.clear()
            self._deleted.clear()
        for n, obj in enumerate(objects):
            if n < len(known):
                meta = known[n]["metadata"]
                obj["metadata"] = {"name": meta["name"], "resourceVersion": meta["resourceVersion"]}
                written.append(await self._send(client, "PUT", f"{base}/{meta['name']}", obj))
            else:
                written.append(await self._send(client, "POST", base, obj))
            self._ours.add(str(written[-1]["metadata"]["resourceVersion"]))
        for old in known[len(objects) :]:
            self._deleted.add(str(old["metadata"]["name"]))
            await self._send(client, "DELETE", f"{base}/{old['metadata']['name']}")

    async def _send(
        self, client: ApiClient, verb: str, path: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One write, counted by its outcome: ok, the error status, or no answer."""
        outcome = "no answer"
        try:
            answer = await client.request(verb, path, body)
            outcome = "ok"
            return answer
        except ApiError as err:
            outcome = str(err.status)
            raise
        finally:
            self.requests[verb, outcome] = self.requests.get((verb, outcome), 0) + 1
            if body is not None:
                self.bytes_written += len(json.dumps(body, separators=(",", ":")))

    async def _watch_loop(self) -> None:
        """Follow the node's slices of this driver from the last list on; anything not ours: list again."""
        schedule = WATCH_BACKOFF.schedule()
        while True:
            await self._listed.wait()
            client, version, since = self.client, self.version, self._watch_from
            if client is None or version is None or since is None:
                self._listed.clear()
                continue
            selector = quote(f"spec.nodeName={self.node},spec.driver={self.driver}")
            path = (
                f"/apis/{GROUP}/{version}/resourceslices?watch=true&allowWatchBookmarks=true"
                f"&fieldSelector={selector}&resourceVersion={since}&timeoutSeconds={WATCH_SECONDS}"
            )
            try:
                self.watching = True
                async for event in client.watch(path):
                    schedule.reset()
                    if not self._watched(event):
                        break  # 410 Gone: the watch goes on from a new list
            except FAILURES as err:
                self.watching = False
                delay = schedule.next()
                text = f"the watch on the ResourceSlices of {self.node} ended: {err}"
                # Once per kind of failure (a forbidden watch: the ClusterRole lacks the verb), not per retry.
                level = logging.DEBUG if text == self.watch_error else logging.WARNING
                log.log(level, "%s; again in %.3g s (a deletion is seen at the next list meanwhile)", text, delay)
                self.watch_error = text
                await asyncio.sleep(delay)
                self._relist()  # what changed meanwhile is not known
            else:
                self.watch_error = None
            finally:
                self.watching = False

    def _watched(self, event: dict[str, Any]) -> bool:
        """One watch event; False when the watch must start again from a new list (its version expired)."""
        kind, obj = event.get("type"), event.get("object") or {}
        meta = obj.get("metadata") or {}
        version = str(meta.get("resourceVersion") or "")
        if kind == "ERROR":
            log.info("the watch on the ResourceSlices of %s: %s; listing again", self.node, obj.get("message"))
            self._watch_from = None
            self._listed.clear()
            self._relist()
            return False
        if version:
            self._watch_from = version
        if kind == "BOOKMARK":
            return True
        if self._writing:
            self._held_back.append(event)
            return True
        name = str(meta.get("name") or "")
        ours = version in self._ours or (kind == "DELETED" and name in self._deleted)
        self._ours.discard(version)
        if kind == "DELETED":
            self._deleted.discard(name)
        if ours:
            return True
        if kind in ("ADDED", "MODIFIED"):
            # An admin's taint may be seen only here: a wipe right after it leaves nothing for a list to show.
            self._seen_others([obj], whole=False)
        what = f"{str(kind).lower()} {name}"
        log.warning(
            "ResourceSlice %s of %s was %s by someone else; writing the pool again", name, self.node, str(kind).lower()
        )
        self.foreign_change = {"at": time.time(), "what": what}
        self._relist()
        return True

    def _taints_kept(self, keeps: bool, effect_none: bool = True) -> None:
        """Said once a change: whether an Unhealthy device stays in the pool tainted, or leaves it."""
        if keeps and self._said_taints is not True:
            but = "" if effect_none else " (it takes no effect None: those taints are left out)"
            log.info(
                "the API server keeps device taints: an Unhealthy device of %s stays in its slice, tainted%s",
                self.node,
                but,
            )
        elif not keeps and self._said_taints is not False:
            log.warning(
                "the API server drops device taints (DRADeviceTaints is off, or Kubernetes is older than "
                "1.33): an Unhealthy device of %s leaves the pool instead",
                self.node,
            )
        self.taints = keeps
        self._effect_none = effect_none
        self._said_taints = keeps

    def shown_taints(self, device: DraDevice) -> list[str]:
        """Its taints as the slice holds them (`gpu.nvidia.com/xid=79:NoSchedule`); none where they are not kept."""
        return [str(t) for t in device.taints if self._effect_none or t.effect != "None"] if self.taints else []

    def _relist(self) -> None:
        self._known = None
        self._republished += 1
        self._repair.set()
        self._wake.set()
        self._on_change()

    async def discover(self, client: ApiClient) -> str:
        self.version = await discover(client)
        log.info("publishing ResourceSlices as %s/%s", GROUP, self.version)
        return self.version
