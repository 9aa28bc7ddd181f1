"""The daemon's lifecycle: start and stop order, signals, reloads and the systemd watchdog.

What is wired to what is `wiring.py`; what an event does is `dispatch.py`. Here: the order in
which parts open and close, and a reload that every part accepts before any part changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from dataclasses import replace

from nvplug import config
from nvplug.config import Config
from nvplug.core.node_state import NodeState
from nvplug.core.xid_policy import XidPolicy
from nvplug.daemon.dispatch import Dispatcher
from nvplug.daemon.options import Options
from nvplug.daemon.sd_notify import Notifier
from nvplug.daemon.wiring import Wiring, wire
from nvplug.edges.edge_protocols import FirstEvents
from nvplug.shaping.resource_plan import moved
from nvplug.sinks.health_state_file import StateFile, read_boot_id, state_dir
from nvplug.sinks.health_state_sink import saved
from nvplug.sources.event_bus import EventBus

log = logging.getLogger("nvplug")


class Daemon:
    def __init__(self, options: Options, notifier: Notifier | None = None) -> None:
        self.options = options
        self.config: Config = options.config
        health = options.config.health
        self.state_file = StateFile(state_dir(options.state_dir, os.environ), read_boot_id(options.proc_root))
        restored = self.state_file.load()
        self.state = NodeState(
            XidPolicy.with_overrides(health.ignore_xids, health.fatal_xids),
            restored=restored,
            kernel_log_seq=self.state_file.loaded.kernel_log_seq,
            auto_resets=self.state_file.loaded.auto_resets,
            compute_modes=self.state_file.loaded.compute_modes,
        )
        self.notifier = notifier or Notifier()
        # Events in, snapshots out: the daemon's own, which every part that feeds events back is handed.
        self.dispatcher = Dispatcher(self.state)
        self._stop = asyncio.Event()
        self._reloading: asyncio.Task[None] | None = None
        # A SIGHUP during a reload: one more reload once it is done, so that the last edit is read.
        self._reload_again = False
        self._wiring: Wiring | None = None

    def request_stop(self, why: str) -> None:
        log.info("stopping: %s", why)
        self.notifier.stopping()
        self._stop.set()

    def request_reload(self) -> None:
        """SIGHUP: one reload at a time; signals during one make one more after it."""
        if self._reloading is None or self._reloading.done():
            self._reloading = asyncio.create_task(self._reload())
        else:
            self._reload_again = True

    async def run(self) -> None:
        bus = EventBus(asyncio.get_running_loop())
        opts = self.options
        opts.plugin_dir.mkdir(parents=True, exist_ok=True)
        log.info("nvplug starting: config from %s, plugin dir %s", opts.config.source, opts.plugin_dir)
        parts = self._wiring = wire(
            opts, self.config, self.state, self.dispatcher, self.state_file, bus, self.notifier, self.request_stop
        )
        dispatcher = self.dispatcher
        tasks: list[asyncio.Task[None]] = []
        try:
            for source in parts.sources:
                try:
                    running = source.start()
                except OSError as err:
                    if source.without is None:
                        raise
                    log.error("%s unavailable (%s); %s", source.name, err, source.without)
                    continue
                if running is not None:
                    tasks.append(running)
            # Applied before serving, so the kubelet's first list is the real one (the first scan, then
            # what the kernel log said before we started).
            for source in parts.sources:
                if isinstance(source, FirstEvents):
                    for event in await source.first_events(self.state.current):
                        dispatcher.apply(event)
            # Also when nothing changed: a file from an earlier boot is replaced by this boot's.
            self.state_file.save(saved(self.state.current))
            # One server, socket and registration per resource name; which ones depends on the
            # GPUs found (MIG profiles), so they are made after the first scan.
            for sink in parts.sinks:
                await sink.open(self.state.current)
            tasks.append(asyncio.create_task(dispatcher.run(bus), name="dispatch"))
            tasks.append(asyncio.create_task(dispatcher.failed(), name="the sinks after the list"))
            # Pinged during the wait too: systemd's watchdog may run before READY=1.
            if self.notifier.watchdog_interval is not None:
                tasks.append(asyncio.create_task(self._watchdog(self.notifier.watchdog_interval), name="watchdog"))
            await self._driver_wait(self.config.health.driver_wait_seconds)
            # Ready once serving: the kubelet may come later, and we wait for it ourselves.
            self.notifier.ready()
            # What start-up made lives as long as the daemon (modules, gRPC, the config): kept out of the
            # cyclic collector's full passes, whose pause would otherwise fall on some fault's way to the
            # kubelet (48,000 objects, 25 ms on a 2-core node).
            gc.freeze()
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
            # What needs a source to close (a retiring MPS group's compute modes, through NVML) before the sources
            # stop; last opened, first closed (the status endpoint, then the MPS daemons).
            for sink in reversed(parts.sinks):
                if sink.closes_before_sources:
                    await sink.close()
            # The sources first, now that nothing reads the bus; then what they fed. The fleet's
            # rebinds and closes remove and make our sockets in the watched directory: nobody needs
            # those events.
            for source in reversed(parts.sources):
                await source.stop()
            # The status report last: it closes the PodResources client the others read through.
            for sink in parts.sinks:
                await sink.close()
            # Once the write in flight is done: whatever a last event changed (counters too, which no sink is handed).
            self.state_file.close(saved(self.state.current))
            log.info("nvplug stopped")

    async def _driver_wait(self, limit: float) -> None:
        """READY=1 held while NVML says the driver is not there, up to `limit` s: the kubelet, started after
        us at boot, fails the pods it admits against a resource with no device (UnexpectedAdmissionError),
        and never restarts them. Events flow meanwhile: the driver's bind (udev) brings the GPUs."""
        made = self.dispatcher.made
        error = made.current.nvml_error
        if error is None or limit <= 0:
            return
        self.notifier.meanwhile(f"waiting up to {limit:g} s for the NVIDIA driver before READY=1: {error}")
        log.warning("NVML unavailable at start (%s): READY=1 waits up to %g s for the driver", error, limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while made.current.nvml_error is not None:
            left = deadline - loop.time()
            if left <= 0:
                log.error("no NVIDIA driver %g s after the start: ready without GPUs; they come once it loads", limit)
                return
            waits = {asyncio.ensure_future(made.next_revision()), asyncio.ensure_future(self._stop.wait())}
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
            if self._stop.is_set():
                return  # a stop asked meanwhile: it goes on at once
        log.info("NVML works: ready with the GPUs it found")

    async def _watchdog(self, interval: float) -> None:
        """Pinged from the loop itself, so a hung loop stops the pings and systemd restarts us."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def _reload(self) -> None:
        self.notifier.reloading()
        try:
            await self._load_and_apply()
            while self._reload_again:
                self._reload_again = False
                await self._load_and_apply()
        finally:
            # Whatever happened, systemd must not wait on a reload forever.
            self.notifier.ready()

    async def _load_and_apply(self) -> None:
        """Prepare every part, then commit every part: a config one part refuses changes nothing."""
        parts = self._wiring
        if parts is None:
            return
        source = self.options.config_path or "the default config"
        try:
            new = self.options.configured(config.load(self.options.config_path))
            changed = new.dra.needs_restart(self.config.dra)
            if changed:
                raise config.ConfigError(
                    f"{new.source}: nvplug.dra.{', nvplug.dra.'.join(changed)} changed; beyond "
                    "devices, extendedResources and taintEffect that takes "
                    "`systemctl restart nvplug`"
                )
            policy = XidPolicy.with_overrides(new.health.ignore_xids, new.health.fatal_xids)
            # The status report refuses to move a GPU a pod holds.
            for sink in parts.sinks:
                await sink.admit(new)
            commits = [sink.prepare(new) for sink in parts.sinks]
            # GPUs that change sides are first given up by both (each side's commit ends once it has said
            # so), then taken by the new one: no moment offers one GPU twice.
            moving = moved(self.config, new, self.state.current)
            between = replace(new, dra=replace(new.dra, moving=moving))
            releases = [sink.prepare(between) for sink in parts.sinks] if moving else []
        except Exception as err:  # a bug in the loader must not take the daemon's reload with it
            log.error("reload refused, the config in force stays: %s", err)
            return
        self.state.set_xid_policy(policy)
        if releases:
            log.info(
                "reload moves %d GPUs between the device plugin and DRA: %s", len(moving), ", ".join(sorted(moving))
            )
        for commit in [*releases, *commits]:
            try:
                await commit(self.state.current)
            except Exception:  # one part's bug must not leave the others (and GPUs given up) half-way
                log.exception("reload: a part failed to apply the new config; the others go on")
        log.info("reloaded the config from %s", source)
        self.config = new


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
