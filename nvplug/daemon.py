"""The daemon: wires sources, core and sinks around one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

from tenacity import AsyncRetrying, retry_if_exception_type, wait_random_exponential

from .config import Config
from .event import Event, InventoryFound, KubeletSocketCreated, NvmlFailed, PluginSocketRemoved
from .events.bus import EventBus
from .events.kubelet_dir import KubeletDirWatch
from .kubelet.api import deviceplugin_pb2 as pb
from .kubelet.registrar import Registrar
from .kubelet.server import DevicePluginService, PluginServer
from .nvml import Nvml, NvmlUnavailable
from .resources import whole_gpus
from .state import Change, NodeState

log = logging.getLogger("nvplug")

# NVML may come up long after us (driver loading at boot); don't hammer it.
DISCOVERY_BACKOFF_MAX = 300.0


@dataclass(frozen=True)
class Options:
    plugin_dir: Path
    dev_root: Path
    sysfs_root: Path
    config: Config


@dataclass
class _Plugin:
    server: PluginServer
    registrar: Registrar
    rebinding: asyncio.Task[None] | None = None


class Daemon:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.state = NodeState()
        self.nvml = Nvml(options.sysfs_root)
        self._plugins: list[_Plugin] = []
        self._stop = asyncio.Event()

    def request_stop(self, why: str) -> None:
        log.info("stopping: %s", why)
        self._stop.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        bus = EventBus(loop)
        opts = self.options
        opts.plugin_dir.mkdir(parents=True, exist_ok=True)
        log.info("nvplug starting: config from %s, plugin dir %s", opts.config.source, opts.plugin_dir)

        name = opts.config.resource_name
        service = DevicePluginService(name, self.state, functools.partial(whole_gpus, name=name), opts.dev_root)
        server = PluginServer(service, opts.plugin_dir / _socket_name(name))
        options = pb.DevicePluginOptions(get_preferred_allocation_available=True)
        self._plugins.append(_Plugin(server, Registrar(opts.plugin_dir, name, server.endpoint, options)))

        # Watch before the first look at kubelet.sock, so its creation cannot slip between.
        watch = KubeletDirWatch(opts.plugin_dir, [p.server.socket_path for p in self._plugins], bus.publish_threadsafe)
        watch.start()
        tasks: list[asyncio.Task[None]] = []
        try:
            # Applied before serving, so the kubelet's first list is the real one.
            first = await self._discover()
            self._handle(first)
            for plugin in self._plugins:
                await plugin.server.start()
            tasks.append(asyncio.create_task(self._dispatch(bus), name="dispatch"))
            if isinstance(first, NvmlFailed):
                tasks.append(asyncio.create_task(self._rediscover(bus), name="discovery"))
            tasks += [
                asyncio.create_task(p.registrar.run(), name=f"register {p.registrar.resource_name}")
                for p in self._plugins
            ]
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    raise RuntimeError(f"{task.get_name()} failed") from task.exception()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for plugin in self._plugins:
                await plugin.server.stop()
            watch.stop()
            log.info("nvplug stopped")

    async def _discover(self) -> InventoryFound | NvmlFailed:
        try:
            found = await asyncio.to_thread(self.nvml.discover)
        except NvmlUnavailable as err:
            return NvmlFailed(str(err))
        for note in found.absent:
            log.info("%s", note)
        for problem in found.problems:
            log.warning("%s", problem)
        log.info("discovered %d GPUs (driver %s)", len(found.gpus), found.driver_version or "version unknown")
        return InventoryFound(found.gpus)

    async def _rediscover(self, bus: EventBus) -> None:
        """Retry discovery with backoff while NVML is unusable; never spin, never give up."""
        retrying = AsyncRetrying(
            wait=wait_random_exponential(multiplier=1.0, max=DISCOVERY_BACKOFF_MAX),
            retry=retry_if_exception_type(NvmlUnavailable),
        )
        async for attempt in retrying:
            with attempt:
                event = await self._discover()
                bus.publish(event)
                if isinstance(event, NvmlFailed):
                    raise NvmlUnavailable(event.reason)

    async def _dispatch(self, bus: EventBus) -> None:
        while True:
            event = await bus.next()
            self._handle(event)

    def _handle(self, event: Event) -> None:
        if isinstance(event, KubeletSocketCreated):
            log.info("kubelet.sock appeared: registering")
            for plugin in self._plugins:
                self._reconnect(plugin, registered_again=True)
        elif isinstance(event, PluginSocketRemoved):
            for plugin in self._plugins:
                if str(plugin.server.socket_path) == event.path:
                    self._reconnect(plugin, registered_again=False)
        else:
            for change in self.state.apply(event):
                _log_change(change)

    def _reconnect(self, plugin: _Plugin, registered_again: bool) -> None:
        """Rebind a wiped socket before registering: the kubelet dials back inside Register."""
        if plugin.rebinding is not None and not plugin.rebinding.done():
            return  # the rebind under way registers when it is done
        if plugin.server.socket_path.exists():
            # Our own rebind removes the old socket too; only a new kubelet needs a new Register.
            if registered_again:
                plugin.registrar.wake()
            return
        log.warning("%s was removed (kubelet restart?): rebinding", plugin.server.socket_path)
        plugin.rebinding = asyncio.create_task(self._rebind(plugin))

    async def _rebind(self, plugin: _Plugin) -> None:
        await plugin.server.rebind()
        plugin.registrar.wake()


def _socket_name(resource_name: str) -> str:
    """nvidia.com/gpu -> nvplug-nvidia.com-gpu.sock"""
    return "nvplug-" + resource_name.replace("/", "-") + ".sock"


def _log_change(change: Change) -> None:
    reason = f": {change.reason}" if change.reason else ""
    if change.gpu is None:
        if change.what == "nvml failed":
            log.error("NVML unavailable%s; no GPUs can be discovered or checked until it works, retrying", reason)
        else:
            log.info("NVML works again (it failed with%s)", reason)
        return
    level = logging.WARNING if change.what in ("unhealthy", "removed") else logging.INFO
    log.log(level, "%s %s%s", change.gpu.label, change.what, reason)


async def serve(options: Options) -> None:
    daemon = Daemon(options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop, signal.Signals(sig).name)
    try:
        await daemon.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
