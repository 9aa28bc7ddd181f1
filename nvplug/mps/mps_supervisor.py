"""The MPS control daemons as a sink: one supervised daemon per group the config and the inventory make.

Each new inventory or config gives the groups wanted (shaping.resource_plan.mps_groups). A group
that is new starts; one that is gone stops; one whose devices or limits changed starts again, after
its old daemon has quit (they share directories). A reload that would restart a group whose GPUs
have MPS clients is refused, unless nvplug.mps.restartWithClients says otherwise. At stop, every
daemon quits and every GPU gets its compute mode back.

DRA claims that ask for MPS add groups of their own (start_claim_group, stop_claim_group): supervised
the same way, started and stopped by prepare and unprepare rather than by the config.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from nvplug.config import Config, ConfigError
from nvplug.core.events import Event, MpsGroupChanged, MpsGroupRemoved
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import Commit, Emit, Sink, StateUpdate
from nvplug.mps.compute_modes import ComputeModes, ModeCalls
from nvplug.mps.control_daemon import START_SECONDS, ControlDaemon, DaemonHooks, kill_leftover
from nvplug.mps.control_log_watch import ControlLogWatch
from nvplug.mps.mps_dirs import PID_FILE, RootLayout
from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.shaping.mps_groups import MpsGroup
from nvplug.shaping.resource_plan import mps_groups

log = logging.getLogger("nvplug.mps")

# A claim's prepare waits this long for its daemon: the directories, the compute modes, the first answer.
CLAIM_START_SECONDS = START_SECONDS + 5.0


class MpsCalls(ModeCalls, Protocol):
    async def mps_clients(self, uuid: str) -> tuple[int, ...]: ...


class MpsSupervisor(Sink):
    name = "mps"
    # The daemons quit and their GPUs' compute modes go back through NVML: before the scanner stops.
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
        # Whether nvplug mounted the shm tmpfs itself (not nvplug-mps.service): then it unmounts it.
        self._mounted = False
        self.root_notes: list[str] = []
        self._logs = ControlLogWatch(self._trouble)
        self._chores: set[asyncio.Task[None]] = set()
        # Before any daemon of ours runs (a few files, no NVML): what an nvplug killed earlier left
        # running goes, whatever the config says now. A group started again would kill its own; a
        # group the config no longer has would run on, unowned.
        for pid_file in Path(cfg.mps_root).glob(f"*/{PID_FILE}"):
            kill_leftover(pid_file, cfg.mps_control)
            pid_file.unlink(missing_ok=True)

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

        return commit

    def notes(self) -> list[str]:
        down = [d for d in self._daemons.values() if d.up_since is None and d.last_error]
        return [f"MPS group {d.group.name} down: {d.last_error}" for d in down]

    def status(self) -> object:
        if not self._daemons and not self._cfg.sharing.mps.resources and not self._claimed:
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
        }

    async def close(self) -> None:
        """Every daemon quits, every compute mode goes back, the shm tmpfs goes. Again: nothing."""
        daemons, self._daemons = list(self._daemons.values()), {}
        await asyncio.gather(*(d.stop() for d in daemons), *self._retiring.values(), return_exceptions=True)
        for task in list(self._chores):
            task.cancel()
        await self._modes.restore_unused(self._snapshot.gpus)
        if self._root_ready:
            self._root_ready = False
            failed = await asyncio.to_thread(self._layout.remove_root, self._mounted)
            if failed:
                log.warning("MPS: %s", failed)
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
                daemon = ControlDaemon(group, self._cfg.mps_control, self._layout, self._hooks(holder))
                self._daemons[name] = daemon
                retiring = self._retiring.get(name)
                daemon.start(after=asyncio.ensure_future(retiring) if retiring is not None else None)
        held = {g.uuid for group in wanted.values() for g in group.exclusive_gpus}
        free = [g for g in snap.gpus if g.uuid not in held and g.uuid in snap.compute_modes]
        if free:
            self._chore(self._modes.restore_unused(free))
        return events

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
                prepared = await asyncio.to_thread(self._layout.prepare_root)
                self.root_notes, self._mounted = prepared.notes, prepared.mounted
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
