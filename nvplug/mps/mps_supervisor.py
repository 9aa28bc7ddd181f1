"""The MPS control daemons as a sink: one supervised daemon per group the config and the inventory make.

Each new inventory or config gives the groups wanted (shaping.resource_plan.mps_groups). A group
that is new starts; one that is gone stops; one whose devices or limits changed starts again, after
its old daemon has quit (they share directories). A reload that would restart a group whose GPUs
have MPS clients is refused, unless nvplug.mps.restartWithClients says otherwise.

At stop nothing is torn down: the daemons run on for their clients, with their compute modes, their
directories and the shm, and the next nvplug adopts them from their record (daemon_records.py). A
recorded daemon whose group that nvplug does not run quits once it has no client (leftover_daemon.py).

DRA claims that ask for MPS add groups of their own (start_claim_group, stop_claim_group): supervised
the same way, started and stopped by prepare and unprepare rather than by the config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from nvplug.config import Config, ConfigError
from nvplug.core.events import Event, MpsGroupChanged, MpsGroupRemoved
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import Commit, Emit, Sink, StateUpdate
from nvplug.mps.compute_modes import ComputeModes, ModeCalls
from nvplug.mps.control_daemon import START_SECONDS, ControlDaemon, DaemonHooks
from nvplug.mps.control_log_watch import ControlLogWatch
from nvplug.mps.daemon_records import DaemonRecord, DaemonRecords
from nvplug.mps.daemon_units import reload_shm_unit, systemd_service
from nvplug.mps.leftover_daemon import LeftoverDaemon
from nvplug.mps.mps_dirs import RootLayout
from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.shaping.mps_groups import CLAIM_GROUP_PREFIX, LOG, MpsGroup
from nvplug.shaping.resource_plan import mps_groups

log = logging.getLogger("nvplug.mps")

# A claim's prepare waits this long for its daemon: the directories, the compute modes, the first answer.
CLAIM_START_SECONDS = START_SECONDS + 5.0
# How long opening waits for the recorded daemons to be adopted, so that the kubelet's first list has
# their devices Healthy. Short: a daemon that must be started again is not waited for (boot order).
ADOPT_SECONDS = 2.0


class MpsCalls(ModeCalls, Protocol):
    async def mps_clients(self, uuid: str) -> tuple[int, ...]: ...


class MpsSupervisor(Sink):
    name = "mps"
    # A group retiring for a new config gives its GPUs' compute modes back through NVML: before the scanner stops.
    closes_before_sources = True
    # Groups follow the inventory and the config alone; the compute modes to give back are recorded in
    # the state. Before the CDI spec, which holds the groups' directories.
    reads = frozenset({"gpus", "compute_modes"})
    before_list = True

    def __init__(
        self,
        cfg: Config,
        calls: MpsCalls,
        first: Snapshot,
        apply: Emit,
        written: Callable[[], Awaitable[str | None]],
        records: DaemonRecords,
        selinux_enforce: Path = Path("/sys/fs/selinux/enforce"),
    ) -> None:
        self._cfg = cfg
        self._calls = calls
        # The newest snapshot it was handed: the GPUs its groups run on, the modes to give back.
        self._snapshot = first
        self._apply = apply
        self._modes = ComputeModes(calls, self._recorded_modes, apply, written)
        self._selinux = selinux_enforce
        self._layout = RootLayout(Path(cfg.mps_root), selinux_enforce)
        self._daemons: dict[str, ControlDaemon] = {}
        self._retiring: dict[str, asyncio.Task[None]] = {}
        # The DRA claims' groups, by name: wanted beside the config's until their last claim goes.
        self._claimed: dict[str, MpsGroup] = {}
        self._root_lock = asyncio.Lock()
        self._root_ready = False
        self.root_notes: list[str] = []
        self._logs = ControlLogWatch(self._trouble)
        self._chores: set[asyncio.Task[None]] = set()
        self._records = records
        # What an earlier nvplug left running, by group: adopted by the group of the name when it is made,
        # else settled as a leftover. Their GPUs keep EXCLUSIVE_PROCESS meanwhile.
        self._recorded: dict[str, DaemonRecord] = dict(records.load())
        for record in self._recorded.values():
            self._modes.hold_uuids(record.exclusive, record)
        self._leftovers: dict[str, LeftoverDaemon] = {}
        self._settling: set[str] = set()
        # As a systemd service, each daemon runs in a unit of its own: a stop of nvplug.service kills its cgroup.
        self._in_units = systemd_service(os.environ)

    async def open(self, snapshot: Snapshot) -> None:
        """The recorded daemons adopted (briefly waited for: the kubelet's first list then has their devices
        Healthy), and those of groups no config runs settled. A claim's are settled once DRA has said which
        claims it restored (claims_restored), unless DRA is off."""
        adopting = [d.started(ADOPT_SECONDS) for d in self._daemons.values() if d.adopting]
        await asyncio.gather(*adopting)
        claims_too = not self._cfg.dra.enabled
        self._settle([n for n in self._recorded if claims_too or not n.startswith(CLAIM_GROUP_PREFIX)])

    def claims_restored(self, names: frozenset[str]) -> None:
        """DRA started again the groups of these prepared claims: any other claim's recorded daemon is a leftover."""
        self._settle([n for n in self._recorded if n.startswith(CLAIM_GROUP_PREFIX) and n not in names])

    def update(self, update: StateUpdate) -> Sequence[Event]:
        self._snapshot = update.snapshot
        return self._sync(update.snapshot) if "gpus" in update.changed else ()

    def _recorded_modes(self) -> Mapping[str, int]:
        return self._snapshot.compute_modes

    @property
    def root(self) -> str:
        return str(self._layout.root)

    async def start_claim_group(self, group: MpsGroup) -> str | None:
        """A claim's group: its daemon started, and its first start's outcome (None: it answers with its
        defaults set). One that did not start is stopped again."""
        self._claimed[group.name] = group
        for event in self._sync(self._snapshot):
            self._apply(event)
        why = await self._daemons[group.name].started(CLAIM_START_SECONDS)
        if why is not None:
            await self.stop_claim_group(group.name)
        return why

    async def stop_claim_group(self, name: str) -> None:
        """A claim's group: its daemon quits, its GPUs get their compute mode back; returns once done."""
        if self._claimed.pop(name, None) is None:
            return
        for event in self._sync(self._snapshot):
            self._apply(event)
        retiring = self._retiring.get(name)
        if retiring is not None:
            await asyncio.wait({retiring})

    def probe_all(self, why: str) -> None:
        for daemon in self._daemons.values():
            daemon.probe_soon(why)
        self._settle(list(self._leftovers))  # whether their clients left

    async def admit(self, cfg: Config) -> None:
        if cfg.mps_root != self._cfg.mps_root and (self._daemons or self._retiring):
            raise ConfigError(
                f"{cfg.source}: nvplug.mps.root changed while MPS daemons run under "
                f"{self._cfg.mps_root}; that takes `systemctl restart nvplug`"
            )
        if cfg.mps.restart_with_clients:
            return
        wanted = mps_groups(cfg, self._snapshot) | self._claimed
        for name, daemon in self._daemons.items():
            new = wanted.get(name)
            if new is not None and new.settings == daemon.group.settings:
                continue
            for gpu in daemon.group.gpus:
                try:
                    clients = await self._calls.mps_clients(gpu.uuid)
                except NvmlUnavailable as err:
                    raise ConfigError(
                        f"{cfg.source}: {daemon.group.describe()} would restart, and whether "
                        f"{gpu.label} has MPS clients cannot be told: {err}"
                    ) from err
                if clients:
                    raise ConfigError(
                        f"{cfg.source}: {daemon.group.describe()} would restart, cutting off the MPS clients "
                        f"on {gpu.label} (pids {', '.join(map(str, clients))}); wait for them to end, or set "
                        "nvplug.mps.restartWithClients: true"
                    )

    def prepare(self, cfg: Config) -> Commit:
        async def commit(snapshot: Snapshot) -> None:
            self._cfg = cfg
            self._layout = RootLayout(Path(cfg.mps_root), self._selinux)
            for event in self._sync(snapshot):
                self._apply(event)
            self.probe_all("a reload")

        return commit

    def notes(self) -> list[str]:
        down = [d for d in self._daemons.values() if d.up_since is None and d.last_error]
        notes = [f"MPS group {d.group.name} down: {d.last_error}" for d in down]
        notes += [
            f"MPS group {d.group.name} runs with an earlier config's settings while it has clients"
            for d in self._daemons.values()
            if d.kept is not None
        ]
        return notes + [
            f"{leftover.describe()}, which no config or claim asks for, runs on while its clients "
            f"(pids {', '.join(map(str, leftover.clients))}) are connected"
            for leftover in self._leftovers.values()
            if leftover.clients
        ]

    def status(self) -> object:
        if not self._daemons and not self._cfg.sharing.mps.resources and not self._claimed and not self._leftovers:
            return None
        now = time.time()
        return {
            "root": str(self._layout.root),
            "notes": self.root_notes,
            "groups": [
                {
                    "name": d.group.name,
                    "resource": d.group.resource,
                    "devices": list(d.group.uuids),
                    "exclusive_process": [g.uuid for g in d.group.exclusive_gpus],
                    "pid": d.pid,
                    "up": d.up_since is not None,
                    "uptime_seconds": round(now - d.up_since, 3) if d.up_since is not None else None,
                    # When this nvplug adopted the daemon an earlier one started; None: it started it.
                    "adopted_at": d.adopted_at,
                    "kept_settings": d.kept.as_dict() if d.kept is not None else None,
                    "restarts": d.restarts,
                    "active_thread_percentage": d.group.thread_percentage,
                    "pinned_memory_mib": list(d.group.pinned_mib),
                    "servers": list(d.servers),
                    "clients": d.clients,
                    "probed_at": d.probed_at,
                    "last_error": d.last_error,
                }
                for d in self._daemons.values()
            ],
            "leftovers": [
                {"name": name, "pid": o.record.pid, "clients": list(o.clients)} for name, o in self._leftovers.items()
            ],
        }

    async def close(self) -> None:
        """nvplug stops: every daemon runs on for its clients, with its compute modes, its directories and the
        shm, recorded for the next nvplug. A group retiring for a new config finishes. Again: nothing."""
        daemons, self._daemons = list(self._daemons.values()), {}
        await asyncio.gather(*(d.leave() for d in daemons), *self._retiring.values(), return_exceptions=True)
        for task in list(self._chores):
            task.cancel()
        await asyncio.gather(*self._chores, return_exceptions=True)
        for leftover in self._leftovers.values():
            leftover.leave()
        self._leftovers.clear()
        if daemons:
            log.info("MPS: %d control daemons run on for their clients; the next start adopts them", len(daemons))
        await self._logs.stop()

    def _sync(self, snap: Snapshot) -> list[Event]:
        wanted = mps_groups(self._cfg, snap) | self._claimed
        events: list[Event] = []
        for name, daemon in list(self._daemons.items()):
            new = wanted.get(name)
            if new is not None and new.settings == daemon.group.settings:
                continue
            del self._daemons[name]
            self._logs.unwatch(name)
            why = "its devices or limits changed" if new is not None else "no MPS resource has its devices now"
            log.info("%s: stopping its control daemon: %s", daemon.group.describe(), why)
            # After an earlier daemon of the name still quitting (two reloads in a row): one at a time.
            earlier = self._retiring.get(name)
            self._retiring[name] = asyncio.create_task(self._retire(daemon, new is None, earlier))
            if new is not None:
                events.append(_restarting(new, daemon.restarts))
        for name, group in wanted.items():
            if name not in self._daemons:
                holder = object()
                self._modes.hold(group, holder)
                record = self._take_record(name)
                daemon = ControlDaemon(
                    group,
                    self._cfg.mps_control,
                    self._layout,
                    self._hooks(holder),
                    self._records,
                    record,
                    self._in_units,
                )
                if record is not None:
                    self._let_go(record)  # the group holds its GPUs now
                self._daemons[name] = daemon
                retiring = self._retiring.get(name)
                daemon.start(after=asyncio.ensure_future(retiring) if retiring is not None else None)
        held = {g.uuid for group in wanted.values() for g in group.exclusive_gpus}
        free = [g for g in snap.gpus if g.uuid not in held and g.uuid in snap.compute_modes]
        if free:
            self._chore(self._modes.restore_unused(free))
        return events

    def _take_record(self, name: str) -> DaemonRecord | None:
        """The recorded daemon of the group `name`, for it to adopt: one not yet settled, or a leftover kept
        for its clients (its group is wanted again)."""
        record = self._recorded.pop(name, None)
        leftover = self._leftovers.pop(name, None)
        if leftover is not None:
            leftover.leave()
            record = leftover.record
        return record

    def _let_go(self, record: DaemonRecord) -> None:
        """The record's hold on its GPUs' compute modes ends: those no group holds get their old mode back."""
        free = set(self._modes.let_go(record.exclusive, record))
        gpus = [g for g in self._snapshot.gpus if g.uuid in free]
        if gpus:
            self._chore(self._modes.restore_unused(gpus))

    def _settle(self, names: Sequence[str]) -> None:
        """Recorded daemons whose groups are not run: each quits once it has no client."""
        for name in names:
            if name in self._settling:
                continue
            record = self._recorded.pop(name, None)
            leftover = self._leftovers.get(name)
            if record is not None:
                leftover = self._leftovers[name] = LeftoverDaemon(record, Path(record.pipe_dir).parent / LOG)
            if leftover is not None:
                self._settling.add(name)
                self._chore(self._settle_one(name, leftover))

    async def _settle_one(self, name: str, leftover: LeftoverDaemon) -> None:
        try:
            if not await leftover.settle():
                log.warning(
                    "%s, which no config or claim asks for, runs on while its clients (pids %s) are connected; "
                    "asked again at each Allocate and reload",
                    leftover.describe(),
                    ", ".join(map(str, leftover.clients)),
                )
                return
        finally:
            self._settling.discard(name)
        if self._leftovers.get(name) is not leftover:
            return  # its group is wanted again, and adopted it
        del self._leftovers[name]
        await asyncio.to_thread(shutil.rmtree, leftover.record.pipe_dir, True)
        await asyncio.to_thread(self._records.drop, name)
        self._let_go(leftover.record)

    async def _retire(self, daemon: ControlDaemon, removed: bool, earlier: asyncio.Task[None] | None) -> None:
        try:
            if earlier is not None:
                await asyncio.wait({earlier})
            await daemon.stop()
        finally:
            if self._retiring.get(daemon.group.name) is asyncio.current_task():
                del self._retiring[daemon.group.name]
            if removed and daemon.group.name not in self._daemons:
                self._apply(MpsGroupRemoved(daemon.group.name))

    def _hooks(self, holder: object) -> DaemonHooks:
        async def release(group: MpsGroup) -> None:
            await self._modes.release(group, holder)

        return DaemonHooks(self._apply, self._modes.exclusive, release, self._root, self._prepared)

    async def _root(self) -> None:
        async with self._root_lock:
            if not self._root_ready:
                if self._in_units and not await asyncio.to_thread(self._layout.shm.is_mount):
                    # Mounted by its unit where containers see it; a mount of ours would stay in our namespace.
                    failed = await asyncio.to_thread(reload_shm_unit)
                    if failed is not None:
                        log.warning("MPS: the clients' shm: %s", failed)
                self.root_notes = await asyncio.to_thread(self._layout.prepare_root)
                for note in self.root_notes:
                    log.warning("MPS: %s", note)
                self._root_ready = True

    def _prepared(self, group: MpsGroup) -> None:
        self._logs.watch(group.name, group.log_dir(str(self._layout.root)))

    def _trouble(self, group: str, line: str) -> None:
        daemon = self._daemons.get(group)
        if daemon is not None:
            daemon.probe_soon(f"control.log: {line}")

    def _chore(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)


def _restarting(group: MpsGroup, restarts: int) -> MpsGroupChanged:
    return MpsGroupChanged(
        group.name,
        group.resource,
        group.uuids,
        False,
        "its MPS control daemon restarts for a new config",
        None,
        restarts,
        group.thread_percentage,
        group.pinned_mib,
    )
