"""What prepare does to the node for a claim's sharing, and unprepare undoes: the time-slice interval,
the claim's MPS group, and the claim's own CDI spec.

Each step is recorded before it is taken (the interval in the claims checkpoint, the compute mode in the
health state file, the daemon's pid file), so that a restart after a crash finds and undoes what no
prepared claim needs any more. A claim whose sharing cannot be set up fails alone, with what was done
for it undone.

Which claims share a device is the scheduler's business; what nvplug refuses is a way of sharing that
cannot hold beside another claim's: two time-slice intervals on one GPU, MPS beside time-slicing, or
MPS on a device another claim uses outside that MPS group.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from nvplug.cdi.cdi_spec import mps_edits
from nvplug.core.gpu import Gpu, MigDevice, uuid_of
from nvplug.core.snapshot import Snapshot
from nvplug.dra.claim_specs import ClaimSpecs
from nvplug.dra.claims import ClaimError, ClaimStore, PreparedClaim, PreparedDevice
from nvplug.dra.dra_devices import DraDevice
from nvplug.dra.opaque_config import ClaimMps
from nvplug.dra.time_slices import DEFAULT_INTERVAL, TimeSliceError, TimeSlicer
from nvplug.shaping.mps_groups import CLAIM_GROUP_PREFIX, MpsGroup

log = logging.getLogger("nvplug.dra")

TIME_SLICING = "TimeSlicing"
MPS = "MPS"


class ClaimDaemons(Protocol):
    """The supervised MPS control daemons (nvplug.mps), as the claims use them."""

    @property
    def root(self) -> str: ...

    async def start_claim_group(self, group: MpsGroup) -> str | None:
        """Started and answering with its defaults set: None; else why not (it is stopped again)."""
        ...

    async def stop_claim_group(self, name: str) -> None: ...

    def claims_restored(self, names: frozenset[str]) -> None:
        """At start, the groups of the prepared claims are these: another claim's daemon left running is not
        wanted."""


class ClaimSetup:
    def __init__(self, store: ClaimStore, specs: ClaimSpecs, slicer: TimeSlicer, daemons: ClaimDaemons | None) -> None:
        self.store = store
        self.specs = specs
        self.slicer = slicer
        self.daemons = daemons
        self._restored = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def apply(self, prepared: PreparedClaim, pool: Mapping[str, DraDevice]) -> PreparedClaim:
        """The claim with its sharing set up: its MPS group and its spec's names. Raises ClaimError."""
        ref = prepared.claim
        others = [c for c in self.store if c.claim.uid != ref.uid]
        _check_shares(prepared, others)
        group, joined = self._mps_group(prepared, pool, others)
        slices = [(d.uuid, d.sharing.interval) for d in prepared.shared(TIME_SLICING) if d.sharing is not None]
        set_now = [(u, i) for u, i in dict(slices).items() if self.store.time_slices.get(u, DEFAULT_INTERVAL) != i]
        started = None
        try:
            for uuid, interval in set_now:
                self.store.record_time_slice(uuid, interval)  # first: a crash right after still undoes it
                await self.slicer.set(uuid, interval)
            if group is not None and not joined:
                assert self.daemons is not None
                why = await self.daemons.start_claim_group(group)
                if why is not None:
                    raise ClaimError(f"{ref}: {group.describe()} did not start: {why}")
                started = group.name
            if group is not None:
                prepared = self._with_spec(prepared, group)
        except (ClaimError, TimeSliceError, OSError) as err:
            if started is not None:
                await self._stop_group(started)
            for uuid, _ in set_now:
                await self._default(uuid, others)
            raise err if isinstance(err, ClaimError) else ClaimError(f"{ref}: {err}") from err
        return prepared

    async def undo(self, prepared: PreparedClaim) -> None:
        """At unprepare, after the claim left the store: what no other claim needs goes back."""
        others = list(self.store)
        if prepared.mps_group is not None and not any(c.mps_group == prepared.mps_group for c in others):
            await self._stop_group(prepared.mps_group)
        for uuid in dict.fromkeys(d.uuid for d in prepared.shared(TIME_SLICING)):
            await self._default(uuid, others)
        if prepared.cdi_spec is not None:
            try:
                self.specs.remove(prepared.cdi_spec)
            except OSError as err:  # the claim is gone all the same: the next start removes the orphan
                log.error("%s: cannot remove its CDI spec %s: %s", prepared.claim, prepared.cdi_spec, err)

    def restore(self, snapshot: Snapshot) -> None:
        """Once, with the first inventory after a start: the prepared claims' MPS groups run again, their
        intervals are set again, and what an earlier run left that no claim needs goes (specs, intervals)."""
        if self._restored or not snapshot.gpus:
            return
        self._restored = True
        claims = list(self.store)
        for path in self.specs.orphans(c.claim.uid for c in claims):
            log.info("removing the CDI spec %s: no prepared claim owns it (left by an earlier run)", path)
            try:
                self.specs.remove(str(path))
            except OSError as err:
                log.error("cannot remove the orphan CDI spec %s: %s", path, err)
        units = {uuid_of(g, m): (g, m) for g in snapshot.gpus for m in (None, *g.mig)}
        started: set[str] = set()
        for claim in claims:
            name = claim.mps_group
            if name is None or name in started or self.daemons is None:
                continue
            started.add(name)  # the first claim of a group: those that joined it have its devices and limits
            try:
                group = claim_group(name, claim.shared(MPS), units, str(claim.claim))
            except ClaimError as err:
                log.error("cannot start the MPS group of %s again: %s", claim.claim, err)
                continue
            self._spawn(self._start_again(group))
        if self.daemons is not None:
            self.daemons.claims_restored(frozenset(started))
        needed = {d.uuid: d.sharing.interval for c in claims for d in c.shared(TIME_SLICING) if d.sharing is not None}
        for uuid, interval in needed.items():
            self._spawn(self._set_again(uuid, interval))
        for uuid in set(self.store.time_slices) - set(needed):
            self._spawn(self._default(uuid, claims))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _mps_group(
        self, prepared: PreparedClaim, pool: Mapping[str, DraDevice], others: Sequence[PreparedClaim]
    ) -> tuple[MpsGroup | None, bool]:
        """The claim's MPS group, and whether it joins one that runs already (the same devices and limits)."""
        devices = prepared.shared(MPS)
        if not devices:
            return None, False
        ref = prepared.claim
        if self.daemons is None:
            raise ClaimError(f"{ref}: MPS is asked for, and this nvplug runs no MPS daemons")
        units = {d.uuid: (d.gpu, d.mig) for d in pool.values()}
        group = claim_group(f"{CLAIM_GROUP_PREFIX}{ref.uid}", devices, units, str(ref))
        for other in others:
            if other.mps_group is None or not {d.uuid for d in other.shared(MPS)} & set(group.uuids):
                continue
            theirs = claim_group(other.mps_group, other.shared(MPS), units, str(other.claim))
            if theirs.settings != group.settings:
                raise ClaimError(
                    f"{ref}: its MPS devices and limits differ from those of {other.claim}, whose MPS "
                    f"group {other.mps_group} serves {', '.join(theirs.uuids)} already: a device "
                    "takes one control daemon"
                )
            return theirs, True
        return group, False

    def _with_spec(self, prepared: PreparedClaim, group: MpsGroup) -> PreparedClaim:
        """The claim's spec written (its MPS devices' view of the group), its names beside the node's."""
        assert self.daemons is not None
        edits = mps_edits(self.daemons.root, group.name)
        mps = {d.device for d in prepared.shared(MPS)}
        written = self.specs.write(prepared.claim.uid, {d: edits for d in mps})
        devices = tuple(
            replace(d, cdi_ids=(*d.cdi_ids, written.names[d.device])) if d.device in mps else d
            for d in prepared.devices
        )
        return replace(prepared, devices=devices, mps_group=group.name, cdi_spec=str(written.path))

    async def _stop_group(self, name: str) -> None:
        assert self.daemons is not None
        await self.daemons.stop_claim_group(name)

    async def _default(self, uuid: str, others: Iterable[PreparedClaim]) -> None:
        """The GPU's interval back to Default, unless another claim time-slices it; kept on record (retried at
        the next start) if nvidia-smi fails."""
        if any(d.uuid == uuid for c in others for d in c.shared(TIME_SLICING)):
            return
        if uuid not in self.store.time_slices:
            return
        try:
            await self.slicer.set(uuid, DEFAULT_INTERVAL)
        except TimeSliceError as err:
            log.error("%s; the claims checkpoint keeps it, set again at the next start", err)
            return
        self.store.record_time_slice(uuid, None)
        log.info("GPU %s: time-slice interval back to Default: no prepared claim needs it now", uuid)

    async def _start_again(self, group: MpsGroup) -> None:
        assert self.daemons is not None
        why = await self.daemons.start_claim_group(group)
        if why is not None:
            log.error("%s did not start again: %s", group.describe(), why)

    async def _set_again(self, uuid: str, interval: str) -> None:
        try:
            await self.slicer.set(uuid, interval)
        except TimeSliceError as err:
            log.error("%s; the claims checkpoint keeps it, set again at the next start", err)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _check_shares(prepared: PreparedClaim, others: Sequence[PreparedClaim]) -> None:
    """Refused: a way of sharing a device that cannot hold beside another prepared claim's."""
    for device in prepared.devices:
        sharing = device.sharing
        if sharing is None:
            continue
        for other in others:
            for theirs in (d for d in other.devices if d.uuid == device.uuid):
                why = _clash(device, theirs)
                if why is not None:
                    raise ClaimError(
                        f"{prepared.claim}: device {device.device} ({device.uuid}): {why} by {other.claim}"
                    )


def _clash(mine: PreparedDevice, theirs: PreparedDevice) -> str | None:
    want, have = mine.sharing, theirs.sharing
    assert want is not None
    if want.strategy == TIME_SLICING:
        if have is not None and have.strategy == MPS:
            return "time-slicing is asked for, and it is shared through MPS"
        if have is not None and have.interval != want.interval:
            return f"the time-slice interval {want.interval} is asked for, and it is time-sliced at {have.interval}"
        return None
    if have is None:
        return "MPS is asked for (EXCLUSIVE_PROCESS), and it is used without MPS"
    if have.strategy == TIME_SLICING:
        return "MPS is asked for, and it is time-sliced"
    return None


def claim_group(
    name: str,
    devices: Sequence[PreparedDevice],
    units: Mapping[str, tuple[Gpu, MigDevice | None]],
    who: str,
) -> MpsGroup:
    """The MPS group of a claim's MPS devices: one daemon for them all (a container talks to one), with the
    limits of their mpsConfig. Raises ClaimError."""
    configs = [d.sharing.mps for d in devices if d.sharing is not None]
    if any(c != configs[0] for c in configs):
        raise ClaimError(
            f"{who}: its MPS devices have different mpsConfigs; a container talks to one control "
            "daemon, so one claim takes one"
        )
    mps = (configs[0] if configs else None) or ClaimMps()
    missing = [d.uuid for d in devices if d.uuid not in units]
    if missing:
        raise ClaimError(f"{who}: its MPS devices {', '.join(missing)} are not on this node now")
    members = tuple(units[d.uuid] for d in devices)
    uuids = [d.uuid for d in devices]
    per_device = dict(mps.per_device_mib or {})
    unknown = [k for k in per_device if k not in uuids and not (k.isdigit() and int(k) < len(uuids))]
    if unknown:
        raise ClaimError(
            f"{who}: mpsConfig.defaultPerDevicePinnedMemoryLimit names {unknown[0]!r}, neither the "
            f"index nor the UUID of one of its MPS devices ({', '.join(uuids)})"
        )
    pinned = tuple(per_device.get(uuid, per_device.get(str(n), mps.pinned_memory_mib)) for n, uuid in enumerate(uuids))
    percentage = mps.active_thread_percentage if mps.active_thread_percentage is not None else 100
    return MpsGroup(name, who, members, percentage, pinned)
