"""The device-plugin fleet: one endpoint (server, socket, registration) per resource name.

As the kubelet's devicemanager keeps one endpoint object per plugin, the fleet keeps one per
resource it serves. It makes, rebinds and retires them as the plan changes: the plan is the
config applied to the GPUs present, so a MIG layout or a hot-added model can add or remove
whole resources. Every change of what is served goes through one lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from nvplug.base.backoff import Backoff, keep_trying
from nvplug.base.linked_socket_server import LinkedSocketServer, remove_leftover_listeners
from nvplug.config import Config, ConfigError
from nvplug.core.events import (
    Event,
    InventoryFound,
    KubeletSocketCreated,
    NotesChanged,
    PluginSocketRemoved,
    WatchedDirChanged,
)
from nvplug.core.latest_snapshot import LatestSnapshot
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import Commit, Emit, HealthVerdict, Sink, StateUpdate
from nvplug.kubelet.allocation import AllocationPolicy
from nvplug.kubelet.device_plugin import PLUGIN_OPTIONS, DevicePluginService, plugin_server
from nvplug.kubelet.registrar import Registrar
from nvplug.kubelet.resource_fit import allocation_policy, oversized, same_list, socket_name, unready_note
from nvplug.shaping.resource_plan import Plan, Resource, ResourceSpec, plan

log = logging.getLogger("nvplug")

# How long a stop lets a rebind under way finish: the kubelet may keep wiping the socket.
REBIND_GRACE = 2.0
# A socket that cannot be bound again (its directory gone with the kubelet's, a file in its place):
# retried, never left undone. The directory made again cuts the wait short, so the cap can be long.
REBIND_BACKOFF = Backoff(first=0.1, maximum=10.0, jitter=True)


async def ignore(event: Event) -> None:
    """No one to feed events back to (a fleet on its own)."""


@dataclass(frozen=True)
class FleetHooks:
    """What the fleet tells the rest of the daemon, and asks of it."""

    # A ListAndWatch message went out (resource, revision, whether a new stream's first), for the latency metrics.
    sent: Callable[[str, int, bool], None] = lambda resource, revision, first: None
    # A list was delivered (the resource's name, what it listed): the CDI entries of devices it no longer holds may go.
    delivered: Callable[[str, Resource], None] = lambda resource, devices: None
    # A resource stopped being served: what it last delivered holds no CDI entry any more.
    retired: Callable[[str], None] = lambda resource: None
    # An Allocate was answered: the kubelet records the pod just after.
    allocated: Callable[[], None] = lambda: None
    # Our sockets changed (the kubelet-directory watch tells a wipe of ours from others' files).
    own_sockets: Callable[[list[Path]], None] = lambda paths: None
    # How the fleet feeds events back: NotesChanged when a registration or a bind flipped, for the status line.
    emit: Emit = ignore
    # A registrar failed (a bug): the daemon stops so that systemd restarts it.
    failed: Callable[[str], None] = lambda why: None


@dataclass
class PluginEndpoint:
    """One resource as served: its spec, its service, the server of its socket, and its registration."""

    spec: ResourceSpec
    service: DevicePluginService
    server: LinkedSocketServer
    registrar: Registrar
    registering: asyncio.Task[None] | None = None
    rebinding: asyncio.Task[None] | None = None
    # Why the last bind failed, while the rebind backs off (for the status line and /healthz).
    serve_error: str | None = None
    # Set when a bind backing off should try again now (its directory is back), or give up (closed).
    retry_now: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class ResourceView:
    """One advertised resource as the status page and the metrics show it."""

    resource: Resource
    endpoint: str
    registered: bool
    registrations: int
    registration_failures: int


class PluginFleet(Sink):
    """Every device-plugin endpoint, kept to the plan. Its lists follow the snapshots it is handed
    (each ListAndWatch stream waits for a newer revision of them); it keeps Allocate's CDI names
    current, and a new inventory may change which resources exist."""

    name = "device plugins"
    # Every new snapshot: its streams list each revision; Allocate takes the CDI spec's optional names.
    reads = None
    before_list = True
    works = frozenset({KubeletSocketCreated, PluginSocketRemoved, WatchedDirChanged, InventoryFound})

    def __init__(self, cfg: Config, plugin_dir: Path, hooks: FleetHooks) -> None:
        # The newest snapshot `update` (or `open`) was handed, and its streams' wait for the next.
        self._shown = LatestSnapshot(Snapshot(revision=0))
        self._cfg = cfg
        self._plugin_dir = plugin_dir
        # flags.nvidiaDevRoot: where Allocate's device specs point, for endpoints made now and later.
        self._dev_root = Path(cfg.flags.nvidia_dev_root)
        self._hooks = hooks
        self.endpoints: list[PluginEndpoint] = []
        self._lock = asyncio.Lock()
        # What the plan last said, so that each problem is logged once.
        self.plan_error: str | None = None
        # Resources left out (a list past the kubelet's message limit, a device shared twice), and why.
        self.refused: Mapping[str, str] = {}
        # GPUs nvplug.devices leaves out, and why; and its selectors that pick no GPU.
        self.excluded: Mapping[str, str] = {}
        self._unmatched: tuple[str, ...] = ()
        # The device-plugin directory went (with the kubelet's) and is not back yet.
        self.dir_missing = False

    # The plan.

    def plan(self, cfg: Config) -> Plan:
        """The resources this config asks for on the GPUs present; those whose list would pass the
        kubelet's message limit are refused too."""
        found = plan(cfg, self._shown.current)
        too_big = oversized(found.specs, self._shown.current)
        return replace(found, refused={**found.refused, **too_big}) if too_big else found

    def planned(self, cfg: Config, found: Plan | None = None) -> list[ResourceSpec]:
        """The resources to serve for this config and the GPUs present; a misfit is said once.

        A refused resource is not advertised: a list past the kubelet's message limit would be
        refused by the kubelet, and the resource would vanish from the node all the same.
        """
        found = found or self.plan(cfg)
        if found.error != self.plan_error:
            if found.error:
                log.error("advertising nothing: %s", found.error)
            elif self.plan_error:
                log.info("the MIG layout fits %s again", cfg.flags.mig_strategy)
            self.plan_error = found.error
        if found.refused != self.refused:
            for problem in found.refused.values():
                log.error("not advertised: %s", problem)
            self.refused = found.refused
        if found.excluded != self.excluded or found.unmatched != self._unmatched:
            for gpu in self._shown.current.gpus:
                why = found.excluded.get(gpu.uuid)
                if why is not None and self.excluded.get(gpu.uuid) != why:
                    log.info("%s excluded (%s): not advertised, still health-watched", gpu.label, why)
                elif why is None and gpu.uuid in self.excluded:
                    log.info("%s no longer excluded by nvplug.devices", gpu.label)
            for selector in set(found.unmatched) - set(self._unmatched):
                log.warning("nvplug.devices.%s picks no GPU on this node", selector)
            self.excluded, self._unmatched = found.excluded, found.unmatched
        return found.served

    def policy(self, cfg: Config) -> AllocationPolicy:
        return replace(allocation_policy(cfg), cdi_extra=self._shown.current.cdi_extra)

    async def open(self, snapshot: Snapshot) -> None:
        """Serve what the config asks for on the first scan's GPUs."""
        self._shown.show(snapshot)
        remove_leftover_listeners(self._plugin_dir)
        await self.apply(self.planned(self._cfg), self.policy(self._cfg))

    async def follow_inventory(self) -> None:
        """A new inventory: a MIG layout change or a new model can add or remove whole resources."""
        specs = self.planned(self._cfg)
        if specs != self.specs:
            await self.apply(specs, self.policy(self._cfg))

    # As a sink.

    def update(self, update: StateUpdate) -> Sequence[Event]:
        """The streams list the new snapshot in the next loop turn. Allocate adds the spec's optional
        names to every container: take them as the spec has them now."""
        self._shown.show(update.snapshot)
        extra = update.snapshot.cdi_extra
        for plugin in self.endpoints:
            service = plugin.service
            if service.policy.cdi_extra != extra:
                service.policy = replace(service.policy, cdi_extra=extra)
        return ()

    def prepare(self, cfg: Config) -> Commit:
        found = self.plan(cfg)
        if found.refused:
            raise ConfigError(f"{cfg.source}: " + "; ".join(found.refused.values()))

        async def commit(snapshot: Snapshot) -> None:
            specs = self.planned(cfg, found)
            allocation = self.policy(cfg)
            self._dev_root = Path(cfg.flags.nvidia_dev_root)
            for plugin in self.endpoints:
                plugin.service.policy = allocation
                plugin.service.dev_root = self._dev_root
            if specs != self.specs:
                await self.apply(specs, allocation)
                log.info("reload: resources now: %s", [s.name for s in specs])
            elif not cfg.dra.moving:  # the half-way config of GPUs changing sides is no reload of its own
                log.info("reload: resources unchanged, no re-registration")
            self._cfg = cfg

        return commit

    def notes(self) -> list[str]:
        notes = [f"advertising nothing: {self.plan_error}"] if self.plan_error else []
        notes += [f"not advertised: {problem}" for problem in self.refused.values()]
        return notes + unready_note(self._shown.current)

    def verdict(self) -> HealthVerdict:
        """Healthy once everything planned is served and registered, and nothing planned was refused."""
        return HealthVerdict(self.registered and not (self.plan_error or self.refused))

    def status(self) -> dict[str, object]:
        """Why a resource is not served now (its directory gone, a bind failing), for /status and doctor."""
        return {
            "plugin_dir": str(self._plugin_dir),
            "plugin_dir_missing": self.dir_missing,
            "not_served": {p.name: why for p in self.endpoints if (why := self._not_served(p)) is not None},
        }

    async def close(self) -> None:
        """SIGTERM: stop serving and close the sockets. Never an empty list: the kubelet would
        take the capacity away at once, when a restart is seconds."""
        # A rebind backing off (a directory still missing) gives up at once.
        for plugin in self.endpoints:
            plugin.closed = True
            plugin.retry_now.set()
        # The registrars before the rebinds that would wake them.
        registering = [p.registering for p in self.endpoints if p.registering is not None]
        for task in registering:
            task.cancel()
        await asyncio.gather(*registering, return_exceptions=True)
        # A rebind is a task of its own: left running, it serves again after the closes below, and
        # its server dies with the loop. Let it finish (bounded: the kubelet may keep wiping the
        # socket), since one cancelled inside gRPC's start() makes a server that no close can reach.
        rebinds = [p.rebinding for p in self.endpoints if p.rebinding is not None]
        if rebinds:
            _, late = await asyncio.wait(rebinds, timeout=REBIND_GRACE)
            for task in late:
                task.cancel()
            await asyncio.gather(*rebinds, return_exceptions=True)
        for plugin in self.endpoints:
            await self._close(plugin)

    # What operators see.

    def views(self) -> list[ResourceView]:
        return [
            ResourceView(
                p.service.resource(),
                p.server.socket_path.name,
                p.registrar.registered.is_set(),
                p.registrar.registrations,
                p.registrar.failures,
            )
            for p in self.endpoints
        ]

    @property
    def registered(self) -> bool:
        """Serving something, and all of it served and registered."""
        return bool(self.endpoints) and all(
            p.registrar.registered.is_set() and self._not_served(p) is None for p in self.endpoints
        )

    def _not_served(self, plugin: PluginEndpoint) -> str | None:
        """Why the resource's socket is not served now, naming the directory or the socket; None if it is."""
        if self.dir_missing:
            return f"the device-plugin directory {self._plugin_dir} is missing (served again once it is made again)"
        if plugin.serve_error is not None:
            return f"{plugin.serve_error} (retrying)"
        return None

    def registrations(self) -> list[str]:
        """The status line's lead: each resource, whether it is registered, and its devices."""
        parts = []
        for plugin in self.endpoints:
            resource = plugin.service.resource()
            if (why := self._not_served(plugin)) is not None:
                how = f"not served: {why}"
            elif plugin.registrar.registered.is_set():
                how = "registered"
            elif plugin.registrar.kubelet_socket.exists():
                how = "registering"
            else:
                how = "waiting for kubelet.sock"
            parts.append(f"{resource.name} {how}: {len(resource.devices)} devices, {resource.healthy_count} healthy")
        return parts

    @property
    def specs(self) -> list[ResourceSpec]:
        return [p.spec for p in self.endpoints]

    @property
    def sockets(self) -> list[Path]:
        return [p.server.socket_path for p in self.endpoints]

    # The kubelet's side.

    async def work(self, event: Event) -> None:
        match event:
            case KubeletSocketCreated():
                self.kubelet_started()
            case PluginSocketRemoved(path=path):
                await self.socket_removed(Path(path))
            case WatchedDirChanged(path=path, exists=exists):
                await self.dir_changed(Path(path), exists)
            case InventoryFound():
                await self.follow_inventory()
            case _:
                pass

    def kubelet_started(self) -> None:
        """A (new) kubelet.sock: register everything again, rebinding any socket it wiped."""
        for plugin in self.endpoints:
            self._reconnect(plugin, registered_again=True)

    async def dir_changed(self, path: Path, exists: bool) -> None:
        """A watched directory went or came back: ours is the device-plugin directory (a re-join or a
        kubelet reinstall wipes /var/lib/kubelet and makes it again)."""
        if path != self._plugin_dir:
            return
        async with self._lock:
            self.dir_missing = not exists
            for plugin in self.endpoints:
                if not exists:
                    # The kubelet went with its directory: whatever the last Register said, it is gone.
                    plugin.registrar.wake()
                if plugin.rebinding is not None and not plugin.rebinding.done():
                    plugin.retry_now.set()  # a bind backing off tries again now
                else:
                    # Gone: our socket went with it (its own removal event may never come). Back: bound
                    # again in the new directory, registered once kubelet.sock is there (now, or on its
                    # KubeletSocketCreated).
                    self._reconnect(plugin, registered_again=False)
            self._notes_changed()

    async def socket_removed(self, path: Path) -> None:
        """One of our sockets vanished, as when the kubelet restarts."""
        # After a change of resources under way: a server it stops removes its socket, and a new
        # one of the same name serves at that path once it is done (then nothing is to rebind).
        async with self._lock:
            for plugin in self.endpoints:
                if plugin.server.socket_path == path:
                    self._reconnect(plugin, registered_again=False)

    async def apply(self, specs: list[ResourceSpec], policy: AllocationPolicy) -> None:
        """A change of what is advertised: new servers register, gone ones stop, changed ones
        register again so that the kubelet reads their new device lists. Unchanged ones are left alone;
        so is one whose spec changed but whose devices did not (a filter that left out another model)."""
        # One at a time: a rescan (a heal's, say) and a reload may both change what is served.
        async with self._lock:
            wanted = {spec.name: spec for spec in specs}
            keep: list[PluginEndpoint] = []
            snap = self._shown.current
            for plugin in self.endpoints:
                spec = wanted.get(plugin.spec.name)
                if spec is not None and (spec == plugin.spec or same_list(spec, plugin.spec, snap)):
                    if spec != plugin.spec:
                        log.info("%s: advertised devices unchanged, no re-registration", spec.name)
                        plugin.spec = spec
                        plugin.service.reproject(spec.project)
                    keep.append(plugin)
                    del wanted[plugin.spec.name]
                else:
                    gone = plugin.spec.name not in wanted
                    how = "no longer served: sending an empty list" if gone else "advertised differently now"
                    log.info("%s: %s, stopping its server", plugin.spec.name, how)
                    await self._close(plugin, retire=gone)
            fresh = [self._make(spec, policy) for spec in wanted.values()]
            self.endpoints = keep + fresh
            self._hooks.own_sockets(self.sockets)
            for plugin in fresh:
                await self._open(plugin)

    def _make(self, spec: ResourceSpec, policy: AllocationPolicy) -> PluginEndpoint:
        hooks = self._hooks
        service = DevicePluginService(
            spec.name, self._shown, spec.project, self._dev_root, policy, hooks.sent, hooks.delivered, hooks.allocated
        )
        server = plugin_server(service, self._plugin_dir / socket_name(spec.name))
        registrar = Registrar(
            self._plugin_dir,
            spec.name,
            server.socket_path.name,
            PLUGIN_OPTIONS,
            on_change=self._notes_changed,
            listing=service,
        )
        return PluginEndpoint(spec, service, server, registrar)

    async def _open(self, plugin: PluginEndpoint) -> None:
        """Serve first, then register: the kubelet dials back inside Register."""
        await plugin.server.start()
        plugin.registering = asyncio.create_task(plugin.registrar.run(), name=f"register {plugin.spec.name}")
        plugin.registering.add_done_callback(self._registrar_ended)

    async def _close(self, plugin: PluginEndpoint, retire: bool = False) -> None:
        """`retire`: the resource stops being served, so the kubelet gets an empty list first;
        otherwise it would keep the stale capacity for its endpoint grace period. Never at SIGTERM."""
        plugin.closed = True
        if plugin.rebinding is not None:
            # One backing off gives up; one in a bind finishes it first, so that the stop below ends it.
            plugin.retry_now.set()
            await asyncio.gather(plugin.rebinding, return_exceptions=True)
        if plugin.registering is not None:
            plugin.registering.cancel()
            await asyncio.gather(plugin.registering, return_exceptions=True)
        if retire:
            await plugin.service.retire()
        await plugin.server.stop()
        self._hooks.retired(plugin.spec.name)

    def _notes_changed(self) -> None:
        self._hooks.emit(NotesChanged())

    def _registrar_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s ended: %r; stopping so that systemd restarts us", task.get_name(), task.exception())
            self._hooks.failed("a registrar failed")

    def _reconnect(self, plugin: PluginEndpoint, registered_again: bool) -> None:
        """Rebind a wiped socket before registering: the kubelet dials back inside Register."""
        if plugin.rebinding is not None and not plugin.rebinding.done():
            # The rebind under way registers when it is done, and binds again if the
            # socket it made was wiped meanwhile (a kubelet restarting twice in a row).
            return
        if plugin.server.socket_path.exists():
            # Served: only a new kubelet needs a new Register.
            if registered_again:
                plugin.registrar.kubelet_came()
            return
        log.warning("%s was removed (kubelet restart?): rebinding", plugin.server.socket_path)
        plugin.rebinding = asyncio.create_task(self._rebind(plugin))

    async def _rebind(self, plugin: PluginEndpoint) -> None:
        failures = 0
        while not plugin.closed:
            bound = await keep_trying(
                plugin.server.rebind,
                REBIND_BACKOFF,
                lambda err, delay: self._bind_failed(plugin, err, delay),
                (OSError, RuntimeError),
                plugin.retry_now,
                lambda: plugin.closed,
            )
            if bound is None:
                return
            failures += bound
            # Looked at, not told: a removal event that comes meanwhile may be of the socket our own
            # stop unlinked, and binding again for it would unlink the new one, and so on.
            if plugin.server.socket_path.exists():
                break
            log.warning("%s was removed again while rebinding: rebinding", plugin.server.socket_path)
        if plugin.closed:
            return
        if plugin.serve_error is not None:
            log.info("%s: serving again after %d failed binds", plugin.name, failures)
            plugin.serve_error = None
        plugin.registrar.wake()  # which refreshes the status line too

    def _bind_failed(self, plugin: PluginEndpoint, err: Exception, delay: float) -> None:
        # Never left undone (the directory gone with the kubelet's): said once, then retried.
        if str(err) != plugin.serve_error:
            log.warning("%s: %s; retrying (next in %.2fs)", plugin.name, err, delay)
        plugin.serve_error = str(err)
        self._notes_changed()
