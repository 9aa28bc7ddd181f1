"""The daemon: wires sources, core and sinks around one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nvplug import config
from nvplug.config import Config
from nvplug.core.events import (
    CdiChecked,
    Event,
    HealthWatchChanged,
    InventoryFound,
    KubeletSocketCreated,
    MigConfigChanged,
    NvmlFailed,
    PciChanged,
    PluginSocketRemoved,
    ProbeResult,
)
from nvplug.core.node_state import Change, NodeState, Snapshot
from nvplug.core.xid_policy import XidPolicy
from nvplug.daemon.sd_notify import Notifier
from nvplug.dra.dra_driver import DraDriver
from nvplug.kubelet.allocation import AllocationPolicy
from nvplug.kubelet.device_plugin import MAX_MESSAGE, PLUGIN_OPTIONS, DevicePluginService, PluginServer, list_size
from nvplug.kubelet.pod_holders import Holder, holders, of_gpu
from nvplug.kubelet.podresources_client import PodResourcesClient, PodView
from nvplug.kubelet.registrar import Registrar
from nvplug.shaping.resource_plan import Plan, Resource, ResourceSpec, plan
from nvplug.sinks.cdi.cdi_publisher import CdiSettings, SpecPublisher
from nvplug.sinks.health_state_file import StateFile, read_boot_id, state_dir
from nvplug.sinks.nfd_feature_file import FeatureFile
from nvplug.sources.event_bus import EventBus
from nvplug.sources.kubelet_dir_watch import KubeletDirWatch
from nvplug.sources.nvml_discovery import Nvml
from nvplug.sources.nvml_scanner import Scanner
from nvplug.sources.reprober import Reprober
from nvplug.sources.udev_monitor import UdevSource
from nvplug.status.heal_route import Healer
from nvplug.status.status_server import (
    PROMETHEUS_TEXT,
    Metrics,
    ResourceView,
    StatusServer,
    json_answer,
    reason_class,
    status_document,
)

log = logging.getLogger("nvplug")

# Retrying a CDI spec that could not be written: the first delay, doubling up to the last.
CDI_RETRY_FIRST = 1.0
CDI_RETRY_MAX = 300.0
# PodResources: how old an answer may be for the Unhealthy log line, and how long after an Allocate to ask.
PODS_FRESH_FOR_LOG = 1.0
PODS_LOG_DELAY = 0.05
# How long /status and /metrics wait for the kubelet's answer before serving without it.
PODS_READER_WAIT = 0.5
PODS_AFTER_ALLOCATE = 1.0
# udev actions after which NVML must enumerate again ("change": a MIG layout, for one).
RESCAN_ACTIONS = {"add", "bind", "remove", "change"}


@dataclass(frozen=True)
class Options:
    plugin_dir: Path
    dev_root: Path
    sysfs_root: Path
    config: Config
    # Where SIGHUP re-reads the config from; None is the default path.
    config_path: Path | None = None
    proc_root: Path = Path("/proc")
    # Overrides the config's nvplug.status.listen.
    status_listen: str | None = None
    # --state-dir: where the health state file lives, unless systemd says ($STATE_DIRECTORY).
    state_dir: Path | None = None
    # --cdi-spec-dir: overrides the config's nvplug.cdi.specDir.
    cdi_spec_dir: Path | None = None
    # --nfd-feature-file: overrides the config's nvplug.labels.featureFile.
    feature_file: Path | None = None
    # --pod-resources-socket: overrides the config's nvplug.podResources.socket.
    pod_resources_socket: Path | None = None


@dataclass
class _Plugin:
    spec: ResourceSpec
    server: PluginServer
    registrar: Registrar
    registering: asyncio.Task[None] | None = None
    rebinding: asyncio.Task[None] | None = None
    # Our socket vanished again while a rebind was under way: bind once more.
    rebind_again: bool = False


class Daemon:
    def __init__(self, options: Options, notifier: Notifier | None = None) -> None:
        self.options = options
        self.config = options.config
        health = options.config.health
        self.state_file = StateFile(state_dir(options.state_dir, os.environ), read_boot_id(options.proc_root))
        self.state = NodeState(
            XidPolicy.with_overrides(health.ignore_xids, health.fatal_xids), restored=self.state_file.load()
        )
        self.notifier = notifier or Notifier()
        self._plugins: list[_Plugin] = []
        self._reprober: Reprober | None = None
        self._scanner: Scanner | None = None
        self._resources_lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._reloading: asyncio.Task[None] | None = None
        self._kubelet_dir: KubeletDirWatch | None = None
        self.metrics = Metrics(self._resource_views, lambda: self._holders() or {}, self._dra_status)
        # When each recent revision's event arrived, for the event-to-ListAndWatch latency.
        self._event_times: dict[int, float] = {}
        self._plan_error: str | None = None
        # Resources left out (a list past the kubelet's message limit, a device shared twice), and why.
        self._refused: Mapping[str, str] = {}
        # GPUs nvplug.devices leaves out, and why; and its selectors that pick no GPU.
        self._excluded: Mapping[str, str] = {}
        self._unmatched: tuple[str, ...] = ()
        self._status = ""
        self.cdi = SpecPublisher(self._cdi_settings(options.config))
        self.nfd = FeatureFile(self._feature_file(options.config), options.sysfs_root)
        # The DRA driver, a sink of the same state as the device plugin, when nvplug.dra is on.
        self.dra = (
            DraDriver(options.config, self.state_file.path.parent, self._update_status)
            if options.config.dra.enabled
            else None
        )
        socket = options.pod_resources_socket or _off_or_path(options.config.pod_resources_socket)
        self.pods = PodView(PodResourcesClient(socket) if socket is not None else None)
        # Work started from synchronous code (a log line that waits for PodResources); kept to be awaited.
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._pods_refresh: asyncio.TimerHandle | None = None
        self._save_pending = False
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state file")
        self._cdi_retry: asyncio.TimerHandle | None = None
        self._cdi_retry_delay = CDI_RETRY_FIRST

    def request_stop(self, why: str) -> None:
        log.info("stopping: %s", why)
        self.notifier.stopping()
        self._stop.set()

    def request_reload(self) -> None:
        """SIGHUP: one reload at a time; a second signal during one is folded in."""
        if self._reloading is None or self._reloading.done():
            self._reloading = asyncio.create_task(self._reload())

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        bus = EventBus(loop)
        opts = self.options
        opts.plugin_dir.mkdir(parents=True, exist_ok=True)
        log.info("nvplug starting: config from %s, plugin dir %s", opts.config.source, opts.plugin_dir)

        # One server, socket and registration per resource name; which ones depends on the
        # GPUs found (MIG profiles), so they are made after the first scan.
        scanner = Scanner(
            Nvml(opts.sysfs_root, opts.proc_root), bus.publish, bus.publish_threadsafe, dev_root=opts.dev_root
        )
        self._scanner = scanner
        health = opts.config.health
        reprober = Reprober(scanner.probe, bus.publish, health.reprobe_initial_seconds, health.reprobe_max_seconds)
        self._reprober = reprober
        # Sources start before the first scan and the first look at kubelet.sock: nothing slips between.
        udev = UdevSource(loop, bus.publish, on_overflow=lambda: scanner.request("udev events were lost"))
        try:
            udev.start()
        except OSError as err:
            log.error("udev hotplug events unavailable (%s); new GPUs are found only by rescans", err)
        dra_dirs = [p.parent for p in self.dra.sockets.sockets] if self.dra is not None else []
        kubelet_dir = KubeletDirWatch(opts.plugin_dir, [], bus.publish_threadsafe, dra_dirs)
        self._kubelet_dir = kubelet_dir
        kubelet_dir.start()
        tasks: list[asyncio.Task[None]] = []
        status: StatusServer | None = None
        try:
            # Applied before serving, so the kubelet's first list is the real one.
            first = await scanner.scan()
            self._apply(first, reprober)
            # Also when nothing changed: a file from an earlier boot is replaced by this boot's.
            self.state_file.save(self.state.current.records())
            if isinstance(first, NvmlFailed):
                scanner.request("NVML unavailable at start")
            await self._apply_resources(self._planned(self.config), self._policy(self.config))
            if self.dra is not None:
                await self.dra.start()
            status = StatusServer(
                opts.status_listen or self.config.status_listen,
                {
                    "/healthz": self._healthz,
                    "/status": self._status_route,
                    "/metrics": self._metrics_route,
                },
                {"/heal": Healer(self.state, scanner, self._handle).route},
            )
            try:
                await status.start()
            except OSError as err:
                log.error("status endpoint %s unavailable: %s", status.listen, err)
            # Ready once serving: the kubelet may come later, and we wait for it ourselves.
            self.notifier.ready(self._status_line())
            tasks.append(asyncio.create_task(self._dispatch(bus), name="dispatch"))
            if self.notifier.watchdog_interval is not None:
                tasks.append(asyncio.create_task(self._watchdog(self.notifier.watchdog_interval), name="watchdog"))
            tasks.append(asyncio.create_task(scanner.run(), name="scanner"))
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    raise RuntimeError(f"{task.get_name()} failed") from task.exception()
        finally:
            # A reload under way would open servers after the closes below.
            tasks += [self._reloading] if self._reloading is not None else []
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # The sources first, now that nothing reads the bus; then what they fed. The rebinds and
            # closes below remove and make our sockets in the watched directory: nobody needs those events.
            reprober.close()
            if self._cdi_retry is not None:
                self._cdi_retry.cancel()
            if self._pods_refresh is not None:
                self._pods_refresh.cancel()
            await asyncio.gather(*self._side_tasks, return_exceptions=True)
            if self.pods.client is not None:
                await self.pods.client.close()
            udev.stop()
            kubelet_dir.stop()
            # The registrars before the rebinds that would wake them.
            registering = [p.registering for p in self._plugins if p.registering is not None]
            for task in registering:
                task.cancel()
            await asyncio.gather(*registering, return_exceptions=True)
            # A rebind is a task of its own: left running, it serves again after the closes below, and
            # its server dies with the loop. Let finish (bounded: the kubelet may keep wiping the socket),
            # since one cancelled inside gRPC's start() makes a server that no close can reach.
            rebinds = [p.rebinding for p in self._plugins if p.rebinding is not None]
            if rebinds:
                _, late = await asyncio.wait(rebinds, timeout=2.0)
                for task in late:
                    task.cancel()
                await asyncio.gather(*rebinds, return_exceptions=True)
            if status is not None:
                await status.stop()
            if self.dra is not None:
                await self.dra.stop()
            for plugin in self._plugins:
                await self._close(plugin)
            await scanner.close()
            self._save_state()  # whatever a last event changed
            log.info("nvplug stopped")

    def _plan(self, cfg: Config) -> Plan:
        """The resources this config asks for on the GPUs present; those whose list would pass the
        kubelet's message limit are refused too."""
        found = plan(cfg, self.state.current)
        too_big = oversized(list(found.specs), self.state.current)
        return replace(found, refused={**found.refused, **too_big}) if too_big else found

    def _planned(self, cfg: Config, found: Plan | None = None) -> list[ResourceSpec]:
        """The resources to serve for this config and the GPUs present; a misfit is said once.

        A refused resource is not advertised: a list past the kubelet's message limit would be
        refused by the kubelet, and the resource would vanish from the node all the same.
        """
        found = found or self._plan(cfg)
        if found.error != self._plan_error:
            if found.error:
                log.error("advertising nothing: %s", found.error)
            elif self._plan_error:
                log.info("the MIG layout fits %s again", cfg.flags.mig_strategy)
            self._plan_error = found.error
        if found.refused != self._refused:
            for problem in found.refused.values():
                log.error("not advertised: %s", problem)
            self._refused = found.refused
        if found.excluded != self._excluded or found.unmatched != self._unmatched:
            for gpu in self.state.current.gpus:
                why = found.excluded.get(gpu.uuid)
                if why is not None and self._excluded.get(gpu.uuid) != why:
                    log.info("%s excluded (%s): not advertised, still health-watched", gpu.label, why)
                elif why is None and gpu.uuid in self._excluded:
                    log.info("%s no longer excluded by nvplug.devices", gpu.label)
            for selector in set(found.unmatched) - set(self._unmatched):
                log.warning("nvplug.devices.%s picks no GPU on this node", selector)
            self._excluded, self._unmatched = found.excluded, found.unmatched
        return found.served

    def _make_plugin(self, spec: ResourceSpec, policy: AllocationPolicy) -> _Plugin:
        opts = self.options
        service = DevicePluginService(
            spec.name, self.state, spec.project, opts.dev_root, policy, self._sent, self._delivered, self._allocated
        )
        server = PluginServer(service, opts.plugin_dir / _socket_name(spec.name))
        registrar = Registrar(
            opts.plugin_dir, spec.name, server.endpoint, PLUGIN_OPTIONS, on_change=self._update_status
        )
        return _Plugin(spec, server, registrar)

    async def _open(self, plugin: _Plugin) -> None:
        """Serve first, then register: the kubelet dials back inside Register."""
        await plugin.server.start()
        plugin.registering = asyncio.create_task(plugin.registrar.run(), name=f"register {plugin.spec.name}")
        plugin.registering.add_done_callback(self._registrar_ended)

    async def _close(self, plugin: _Plugin, retire: bool = False) -> None:
        """`retire`: the resource stops being served, so the kubelet gets an empty list first;
        otherwise it would keep the stale capacity for its endpoint grace period. Never at SIGTERM."""
        if plugin.registering is not None:
            plugin.registering.cancel()
            await asyncio.gather(plugin.registering, return_exceptions=True)
        if retire:
            await plugin.server.service.retire()
        await plugin.server.stop()
        # What it last delivered no longer holds CDI entries in place.
        self.cdi.forget(plugin.spec.name)

    def _registrar_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s ended: %r; stopping so that systemd restarts us", task.get_name(), task.exception())
            self.request_stop("a registrar failed")

    async def _apply_resources(self, specs: list[ResourceSpec], policy: AllocationPolicy) -> None:
        """A reload that changes what is advertised: new servers register, gone ones stop, changed ones
        register again so that the kubelet reads their new device lists. Unchanged ones are left alone;
        so is one whose spec changed but whose devices did not (a filter that left out another model)."""
        # One at a time: a rescan (a heal's, say) and a reload may both change what is served.
        async with self._resources_lock:
            wanted = {spec.name: spec for spec in specs}
            keep: list[_Plugin] = []
            snap = self.state.current
            for plugin in self._plugins:
                spec = wanted.get(plugin.spec.name)
                if spec is not None and (spec == plugin.spec or _same_list(spec, plugin.spec, snap)):
                    if spec != plugin.spec:
                        log.info("%s: advertised devices unchanged, no re-registration", spec.name)
                        plugin.spec = spec
                        plugin.server.service.reproject(spec.project)
                    keep.append(plugin)
                    del wanted[plugin.spec.name]
                else:
                    gone = plugin.spec.name not in wanted
                    how = "no longer served: sending an empty list" if gone else "advertised differently now"
                    log.info("%s: %s, stopping its server", plugin.spec.name, how)
                    await self._close(plugin, retire=gone)
            fresh = [self._make_plugin(spec, policy) for spec in wanted.values()]
            self._plugins = keep + fresh
            if self._kubelet_dir is not None:
                dra = list(self.dra.sockets.sockets) if self.dra is not None else []
                self._kubelet_dir.set_own([p.server.socket_path for p in self._plugins] + dra)
            for plugin in fresh:
                await self._open(plugin)

    async def _dispatch(self, bus: EventBus) -> None:
        while True:
            await self._handle(await bus.next())

    async def _handle(self, event: Event) -> None:
        """One event, from a source through the bus or from an operator's heal."""
        scanner, reprober = self._scanner, self._reprober
        assert scanner is not None and reprober is not None  # set before any event is handled
        if isinstance(event, (KubeletSocketCreated, MigConfigChanged, PluginSocketRemoved)):
            self._count(event)  # the others are counted as they are applied
        if isinstance(event, KubeletSocketCreated):
            log.info("kubelet.sock appeared: registering")
            for plugin in self._plugins:
                self._reconnect(plugin, registered_again=True)
        elif isinstance(event, MigConfigChanged):
            scanner.request(f"MIG layout of {event.uuid} changed")
        elif isinstance(event, PluginSocketRemoved):
            self._dra_socket_removed(Path(event.path))
            # After a change of resources under way: a server it stops removes its socket, and a new
            # one of the same name serves at that path once it is done (then nothing is to rebind).
            async with self._resources_lock:
                for plugin in self._plugins:
                    if str(plugin.server.socket_path) == event.path:
                        self._reconnect(plugin, registered_again=False)
        else:
            if isinstance(event, PciChanged):
                log.info("udev: %s %s %s", event.action, event.bus_id, event.driver or "")
                if event.action in RESCAN_ACTIONS:
                    scanner.request(f"udev {event.action} of {event.bus_id}")
            self._apply(event, reprober)
            if isinstance(event, InventoryFound):
                # A MIG layout change can add or remove whole resources.
                specs = self._planned(self.config)
                if specs != [p.spec for p in self._plugins]:
                    await self._apply_resources(specs, self._policy(self.config))

    def _apply(self, event: Event, reprober: Reprober) -> None:
        arrived = time.monotonic()
        before = self.state.current.revision
        self._count(event)
        changes = self.state.apply(event)
        if self.state.current.revision != before:
            self._event_times[self.state.current.revision] = arrived
            if len(self._event_times) > 1024:
                del self._event_times[min(self._event_times)]
        snap = self.state.current
        if changes:
            # Evidence starts re-probes of a GPU, and a probe at once.
            reprober.follow(snap)
        for change in changes:
            if change.what == "unhealthy" and change.gpu is not None and self.pods.client is not None:
                # The operator's first question is whose job broke: ask the kubelet before saying it.
                self._spawn(self._log_with_pods(change, snap))
            else:
                _log_change(change, snap)
            if change.what == "recovery evidence" and change.gpu is not None:
                reprober.now(change.gpu.uuid)
            if change.what in ("healthy", "unhealthy"):
                self.metrics.transitions.labels(change.what, reason_class(change.reason)).inc()
        if snap.revision != before:
            # Before any ListAndWatch stream runs again: no device is advertised before its CDI entry.
            self._publish_spec()
            # By the saver thread, after this loop turn: an fsync must not delay the kubelet's news.
            self._save_soon()
            self.nfd.update(self.state.current, self.config, self.config.unhealthy_count_label)
            if self.dra is not None:
                self.dra.update(self.state.current)
        if changes:
            self._update_status()

    def _count(self, event: Event) -> None:
        kind = type(event).__name__
        self.metrics.events.labels(_SOURCES.get(kind, "nvplug"), kind).inc()
        failed = (
            "nvmlInit"
            if isinstance(event, NvmlFailed)
            else "nvmlEventSetWait"
            if isinstance(event, HealthWatchChanged) and event.error
            else "probe"
            if isinstance(event, ProbeResult) and not event.passed
            else None
        )
        if failed:
            self.metrics.nvml_errors.labels(failed).inc()

    def _save_soon(self) -> None:
        if not self._save_pending:
            self._save_pending = True
            asyncio.get_running_loop().call_soon(self._queue_save)

    def _queue_save(self) -> None:
        """The records as they are now, written by the saver thread: its fsync must not hold up the loop
        (a ListAndWatch message waits on it). One thread, so saves land in the order they were taken."""
        self._save_pending = False
        records = self.state.current.records()
        asyncio.get_running_loop().run_in_executor(self._saver, self.state_file.save, records)

    def _save_state(self) -> None:
        """At the end, once the saver is done: whatever a last event changed."""
        self._saver.shutdown(wait=True)
        self.state_file.save(self.state.current.records())

    def _publish_spec(self) -> None:
        """Write the CDI spec for the current state; devices whose names would not resolve are not offered."""
        unresolved = self.cdi.update(self.state.current)
        if unresolved != self.state.current.unresolved and self._reprober is not None:
            self._apply(CdiChecked(unresolved), self._reprober)
        extra = self.cdi.extra_names
        for plugin in self._plugins:
            if plugin.server.service.policy.cdi_extra != extra:
                plugin.server.service.policy = replace(plugin.server.service.policy, cdi_extra=extra)
        if self.cdi.error is None:
            self._cdi_retry_delay = CDI_RETRY_FIRST
        elif self._cdi_retry is None:
            # Nothing else may change for hours: try again on a timer, backing off.
            self._cdi_retry = asyncio.get_running_loop().call_later(self._cdi_retry_delay, self._retry_spec)
            self._cdi_retry_delay = min(self._cdi_retry_delay * 2, CDI_RETRY_MAX)

    def _retry_spec(self) -> None:
        self._cdi_retry = None
        self._publish_spec()
        self._update_status()

    def _delivered(self, resource: str, devices: Resource) -> None:
        """A list went out: entries of devices it no longer holds may leave the spec now."""
        self.cdi.delivered(resource, devices.units)
        self._publish_spec()

    async def _status_route(self) -> tuple[int, str, bytes]:
        answer = await self.pods.fresh(wait=PODS_READER_WAIT)
        doc = status_document(
            self.state.current,
            self._resource_views(),
            self._plan_error,
            self._holders(),
            answer.error,
            self._excluded,
            self.dra.by_gpu() if self.dra is not None else None,
        )
        doc["cdi"] = self.cdi.status()
        doc["labels"] = {"file": _text(self.nfd.path), "error": self.nfd.error, "labels": self.nfd.labels}
        doc["dra"] = self._dra_status()
        return json_answer(doc)

    async def _metrics_route(self) -> tuple[int, str, bytes]:
        await self.pods.fresh(wait=PODS_READER_WAIT)
        return 200, PROMETHEUS_TEXT, self.metrics.render()

    def _holders(self) -> dict[str, list[Holder]] | None:
        """Who holds each device (GPU or MIG UUID), from the last PodResources answer; None if unknown."""
        entries = self.pods.answer.entries
        if entries is None:
            return None
        return holders(entries, self.state.current, [p.spec.name for p in self._plugins])

    async def _log_with_pods(self, change: Change, snap: Snapshot) -> None:
        # After the kubelet has the news: the question to the kubelet must not compete with the list.
        await asyncio.sleep(PODS_LOG_DELAY)
        await self.pods.fresh(max_age=PODS_FRESH_FOR_LOG)
        gpu = change.gpu
        assert gpu is not None
        by_device = self._holders()
        if by_device is None:
            _log_change(change, snap)  # why the pods are unknown was said once already
            return
        held = of_gpu(by_device, gpu)
        suffix = "; in use by " + ", ".join(h.text for h in held) if held else "; no pod holds it"
        _log_change(change, snap, suffix)

    def _allocated(self) -> None:
        """The kubelet records the pod just after Allocate: ask then, once for a burst of allocations."""
        if self.pods.client is not None and self._pods_refresh is None:
            self._pods_refresh = asyncio.get_running_loop().call_later(PODS_AFTER_ALLOCATE, self._refresh_pods)

    def _refresh_pods(self) -> None:
        self._pods_refresh = None
        self._spawn(self._fresh_pods())

    async def _fresh_pods(self) -> None:
        await self.pods.fresh(max_age=0.0)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    def _cdi_settings(self, cfg: Config) -> CdiSettings:
        return CdiSettings.from_config(cfg, self.options.dev_root, self.options.cdi_spec_dir)

    def _feature_file(self, cfg: Config) -> Path | None:
        if self.options.feature_file is not None:
            return self.options.feature_file
        return None if cfg.feature_file == "off" else Path(cfg.feature_file)

    def _policy(self, cfg: Config) -> AllocationPolicy:
        return replace(allocation_policy(cfg), cdi_extra=self.cdi.extra_names)

    def _sent(self, resource: str, revision: int) -> None:
        arrived = self._event_times.get(revision)
        if arrived is not None:
            self.metrics.latency.labels(resource).observe(time.monotonic() - arrived)

    def _resource_views(self) -> list[ResourceView]:
        return [
            ResourceView(
                p.server.service.resource(),
                p.server.endpoint,
                p.registrar.registered.is_set(),
                p.registrar.registrations,
                p.registrar.failures,
            )
            for p in self._plugins
        ]

    def _healthz(self) -> tuple[int, str, bytes]:
        """200 when the loop answers (it does, or nothing would) and everything is registered."""
        ready = bool(self._plugins) and all(p.registrar.registered.is_set() for p in self._plugins)
        refused = self._plan_error or self._refused or (self.cdi.error and self.cdi.settings.enforce)
        if ready and not refused:
            # Serving; but say which devices are out because Allocate could not hand them out.
            notes = [*_unready_note(self.state.current), *self._cdi_note()]
            return 200, "text/plain", "; ".join(["ok", *notes]).encode() + b"\n"
        return 503, "text/plain", (self._status_line() or "nothing to advertise").encode() + b"\n"

    async def _watchdog(self, interval: float) -> None:
        """Pinged from the loop itself, so a hung loop stops the pings and systemd restarts us."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    def _status_line(self) -> str:
        snap = self.state.current
        parts = []
        for plugin in self._plugins:
            resource = plugin.server.service.resource()
            if plugin.registrar.registered.is_set():
                how = "registered"
            elif plugin.registrar.kubelet_socket.exists():
                how = "registering"
            else:
                how = "waiting for kubelet.sock"
            parts.append(f"{resource.name} {how}: {len(resource.devices)} devices, {resource.healthy_count} healthy")
        if snap.nvml_error:
            parts.append(f"NVML unavailable: {snap.nvml_error}")
        if snap.health_watch_error:
            parts.append(f"health events unavailable: {snap.health_watch_error}")
        if self._plan_error:
            parts.append(f"advertising nothing: {self._plan_error}")
        parts += [f"not advertised: {problem}" for problem in self._refused.values()]
        parts += _unready_note(snap)
        parts += self._cdi_note()
        parts += self._dra_note()
        return "; ".join(parts)

    def _dra_status(self) -> dict[str, object] | None:
        return self.dra.status() if self.dra is not None else None

    def _dra_note(self) -> list[str]:
        dra = self.dra
        if dra is None:
            return []
        if dra.publisher.error:
            return [f"DRA {dra.driver}: {dra.publisher.error}"]
        how = (
            "registered"
            if dra.registered
            else f"not registered ({dra.registration_error or 'waiting for the kubelet'})"
        )
        healthy = sum(1 for d in dra.devices if d.healthy)
        return [f"DRA {dra.driver} {how}: {healthy} devices in {len(dra.publisher.slice_names)} ResourceSlices"]

    def _cdi_note(self) -> list[str]:
        return [f"CDI spec not written: {self.cdi.error}"] if self.cdi.error else []

    def _update_status(self) -> None:
        line = self._status_line()
        if line != self._status:
            self._status = line
            self.notifier.status(line)

    async def _reload(self) -> None:
        self.notifier.reloading()
        try:
            await self._load_and_apply()
        finally:
            # Whatever happened, systemd must not wait on a reload forever.
            self.notifier.ready(self._status_line())

    async def _load_and_apply(self) -> None:
        source = self.options.config_path or "the default config"
        try:
            new = config.load(self.options.config_path)
            if new.dra != self.config.dra:
                raise config.ConfigError(f"{new.source}: nvplug.dra changed; that takes `systemctl restart nvplug`")
            found = self._plan(new)
            if found.refused:
                raise config.ConfigError(f"{new.source}: " + "; ".join(found.refused.values()))
            policy = XidPolicy.with_overrides(new.health.ignore_xids, new.health.fatal_xids)
            cdi = self._cdi_settings(new)
            specs = self._planned(new, found)
        except Exception as err:  # a bug in the loader must not take the daemon's reload with it
            log.error("reload refused, the config in force stays: %s", err)
        else:
            self.state.set_xid_policy(policy)
            if self._reprober is not None:
                self._reprober.set_backoff(new.health.reprobe_initial_seconds, new.health.reprobe_max_seconds)
            # The spec for the new names first, then the Allocate that hands them out.
            if self.cdi.configure(cdi):
                self._publish_spec()
            allocation = self._policy(new)
            for plugin in self._plugins:
                plugin.server.service.policy = allocation
            if specs != [p.spec for p in self._plugins]:
                await self._apply_resources(specs, allocation)
                log.info("reloaded the config from %s; resources now: %s", source, [s.name for s in specs])
            else:
                log.info("reloaded the config from %s; resources unchanged, no re-registration", source)
            self.config = new
            # Strategy and sharing are in the labels.
            self.nfd.configure(self._feature_file(new))
            self.nfd.update(self.state.current, new, new.unhealthy_count_label)
            if self.dra is not None:
                # nvplug.devices, the MIG strategy and the ID strategy shape the pool too.
                self.dra.configure(new, self.state.current)

    def _dra_socket_removed(self, path: Path) -> None:
        # Only if it is still gone: the stop inside a rebind removes the old socket too.
        if self.dra is not None and path in self.dra.sockets.sockets and not path.exists():
            log.warning("%s was removed: serving it again", path)
            self._spawn(self.dra.sockets.rebind(path))

    def _reconnect(self, plugin: _Plugin, registered_again: bool) -> None:
        """Rebind a wiped socket before registering: the kubelet dials back inside Register."""
        if plugin.rebinding is not None and not plugin.rebinding.done():
            # The rebind under way registers when it is done, and binds again if the
            # socket it made was wiped meanwhile (a kubelet restarting twice in a row).
            plugin.rebind_again = plugin.rebind_again or not registered_again
            return
        if plugin.server.socket_path.exists():
            # Our own rebind removes the old socket too; only a new kubelet needs a new Register.
            if registered_again:
                plugin.registrar.wake()
            return
        log.warning("%s was removed (kubelet restart?): rebinding", plugin.server.socket_path)
        plugin.rebinding = asyncio.create_task(self._rebind(plugin))

    async def _rebind(self, plugin: _Plugin) -> None:
        while True:
            plugin.rebind_again = False
            await plugin.server.rebind()
            if not plugin.rebind_again and plugin.server.socket_path.exists():
                break
            log.warning("%s was removed again while rebinding: rebinding", plugin.server.socket_path)
        plugin.registrar.wake()


def allocation_policy(cfg: Config) -> AllocationPolicy:
    """How Allocate names devices: NVIDIA's flags.plugin settings."""
    plugin = cfg.flags.plugin
    return AllocationPolicy(
        list_strategies=tuple(plugin.device_list_strategy),
        id_strategy=plugin.device_id_strategy,
        pass_device_specs=plugin.pass_device_specs,
        cdi_annotation_prefix=plugin.cdi_annotation_prefix,
        packed=cfg.shared_policy == "packed",
    )


def _unready_note(snap: Snapshot) -> list[str]:
    """What the status line and /healthz say of devices Allocate could not hand out (nothing if none)."""
    out = {**snap.unresolved, **snap.unready}
    if not out:
        return []
    uuid, problem = next(iter(out.items()))
    return [f"{len(out)} devices cannot be allocated: {uuid}: {problem}"]


def oversized(specs: list[ResourceSpec], snapshot: Snapshot) -> dict[str, str]:
    """Resources whose ListAndWatch message would pass the kubelet's limit, with the count and size."""
    out = {}
    for spec in specs:
        devices = spec.project(snapshot).devices
        size = list_size(devices)
        if size > MAX_MESSAGE:
            out[spec.name] = (
                f"{spec.name} would advertise {len(devices):,} devices in a {size:,}-byte ListAndWatch message, "
                f"over the kubelet's {MAX_MESSAGE:,}-byte limit (fewer replicas, or fewer GPUs per resource)"
            )
    return out


def _same_list(spec: ResourceSpec, other: ResourceSpec, snapshot: Snapshot) -> bool:
    """Whether two specs advertise the same device IDs, and Allocate treats them alike."""
    if spec.fail_requests_greater_than_one != other.fail_requests_greater_than_one:
        return False
    return [d.id for d in spec.project(snapshot).devices] == [d.id for d in other.project(snapshot).devices]


def _off_or_path(value: str) -> Path | None:
    return None if value == "off" else Path(value)


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _socket_name(resource_name: str) -> str:
    """nvidia.com/gpu -> nvplug-nvidia.com-gpu.sock"""
    return "nvplug-" + resource_name.replace("/", "-") + ".sock"


# How each change that names no GPU reads in the log.
# Where each kind of event comes from, for the events metric.
_SOURCES = {
    "InventoryFound": "nvml",
    "NvmlFailed": "nvml",
    "ProbeResult": "nvml",
    "HealthReported": "nvml",
    "EvidenceFound": "operator",
    "XidOccurred": "nvml",
    "RecoveryActionChanged": "nvml",
    "HealthWatchChanged": "nvml",
    "MigConfigChanged": "nvml",
    "PciChanged": "udev",
    "KubeletSocketCreated": "kubelet_dir",
    "PluginSocketRemoved": "kubelet_dir",
}

_NODE_CHANGES = {
    "nvml failed": (logging.ERROR, "NVML unavailable: {}; no GPUs can be discovered or checked until it works"),
    "nvml recovered": (logging.INFO, "NVML works again (it failed with: {})"),
    "health watch failed": (logging.ERROR, "NVML health events cannot be received: {}; GPU faults go unseen"),
    "health watch running": (logging.INFO, "NVML health events are being received{}"),
}
_GPU_WARNINGS = {"unhealthy", "fault while unhealthy", "restored unhealthy", "removed", "xid without catalog action"}


def _log_change(change: Change, snap: Snapshot, suffix: str = "") -> None:
    gpu = change.gpu
    if gpu is None:
        level, text = _NODE_CHANGES.get(change.what, (logging.INFO, change.what + ": {}"))
        log.log(level, text.format(change.reason))
        return
    reason = f": {change.reason}" if change.reason else ""
    level = logging.WARNING if change.what in _GPU_WARNINGS else logging.INFO
    waiting = ""
    if change.what in ("unhealthy", "fault while unhealthy", "restored unhealthy"):
        # The operator reads here what the GPU needs before it is offered again.
        needs = [s.waiting_for(gpu.bus_id, gpu.index) for _, s in snap.devices_of(gpu) if not s.healthy]
        waiting = f"; waiting for {needs[0]}" if needs and needs[0] else ""
    log.log(level, "%s %s%s%s%s", gpu.label, change.what, reason, waiting, suffix)


async def serve(options: Options) -> None:
    daemon = Daemon(options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop, signal.Signals(sig).name)
    loop.add_signal_handler(signal.SIGHUP, daemon.request_reload)
    try:
        await daemon.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
