"""The wiring: which sources feed the bus, and which sinks react to each snapshot, in which order.

A new source or sink is one line here (and its module, its config declaration, its doctor step).
The order of `sinks` is the order the dispatcher calls them in, and the order of a reload's commits:
the CDI spec comes before the device-plugin fleet, whose Allocate hands out the spec's names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from nvplug.config import Config, off_or_path
from nvplug.core.node_state import NodeState
from nvplug.daemon.auto_reset import AutoReset
from nvplug.daemon.dev_root_follow import DevRootFollower
from nvplug.daemon.dispatch import Dispatcher
from nvplug.daemon.options import Options
from nvplug.daemon.sd_notify import Notifier
from nvplug.dra.dra_driver import DraDriver
from nvplug.edges.edge_protocols import Sink, Source
from nvplug.kubelet.plugin_fleet import FleetHooks, PluginFleet
from nvplug.kubelet.podresources_client import PodResourcesClient, PodView
from nvplug.mps.daemon_records import DaemonRecords
from nvplug.mps.mps_supervisor import MpsSupervisor
from nvplug.pods.pod_holders import Holder
from nvplug.sinks.cdi.cdi_publisher import CdiSettings, CdiSink
from nvplug.sinks.health_state_file import StateFile
from nvplug.sinks.health_state_sink import HealthStateSink
from nvplug.sinks.nfd_feature_file import FeatureFile
from nvplug.sources.dev_node_watch import DevNodeWatch
from nvplug.sources.event_bus import EventBus
from nvplug.sources.kernel_log import KernelLogSource
from nvplug.sources.kubelet_dir_watch import KubeletDirWatch
from nvplug.sources.nvml_discovery import Nvml
from nvplug.sources.nvml_scanner import Scanner
from nvplug.sources.reprober import Reprober
from nvplug.sources.telemetry_reader import GpuTelemetry
from nvplug.sources.udev_monitor import UdevSource
from nvplug.status.change_log import ChangeLog
from nvplug.status.heal_route import Healer
from nvplug.status.status_endpoint import StatusEndpoint
from nvplug.status.status_report import PODS_READER_WAIT, StatusReport
from nvplug.status.status_server import StatusServer


@dataclass(frozen=True)
class Wiring:
    """The parts, which the lifecycle reaches only through the protocols."""

    sources: tuple[Source, ...]
    sinks: tuple[Sink, ...]


def wire(
    options: Options,
    cfg: Config,
    state: NodeState,
    dispatcher: Dispatcher,
    state_file: StateFile,
    bus: EventBus,
    notifier: Notifier,
    request_stop: Callable[[str], None],
) -> Wiring:
    """Every part, built from the options and the config, and joined to its neighbours.

    Each part that feeds events back is handed the dispatcher's `emit`, and a part whose notes changed
    outside a dispatch emits NotesChanged, which the status report (made further down, since it reads the
    others) works for. The dispatcher is handed its workers and sinks here.
    """
    health = cfg.health
    # The command line's paths are the config's keys by now (Options.configured): each part reads its key.
    dev_root = Path(cfg.flags.nvidia_dev_root)
    scanner = Scanner(
        Nvml(options.sysfs_root, options.proc_root),
        bus.publish,
        dev_root=dev_root,
        deadline=health.nvml_call_deadline_seconds,
        hang_limit=health.driver_hang_seconds,
    )
    reprober = Reprober(scanner.probe, bus.publish, health.reprobe_initial_seconds, health.reprobe_max_seconds)
    mps = MpsSupervisor(
        cfg,
        scanner,
        state.current,
        dispatcher.emit,
        state_file.written,
        DaemonRecords(state_file.path.parent, state_file.boot_id),
        options.sysfs_root / "fs/selinux/enforce",
    )

    cdi = CdiSink(
        CdiSettings.from_config,
        cfg,
        dispatcher.emit,
    )
    # The claims' MPS groups are the supervisor's; their specs go beside the node's.
    spec_dir = cdi.publisher.settings.spec_dir
    dra = (
        DraDriver(cfg, state_file.path.parent, dispatcher.emit, state_file.boot_id, mps, spec_dir)
        if cfg.dra.enabled
        else None
    )
    dra_dirs = [p.parent for p in dra.sockets.sockets] if dra is not None else []
    kubelet_dir = KubeletDirWatch(options.plugin_dir, [], bus.publish, dra_dirs)
    socket = off_or_path(cfg.pod_resources_socket)
    pods = PodView(PodResourcesClient(socket) if socket is not None else None)

    dra_sockets = list(dra.sockets.sockets) if dra is not None else []

    def allocated() -> None:
        pods.after_allocate()
        mps.probe_all("a container was allocated")  # a hung daemon shows when a client would need it

    fleet = PluginFleet(
        cfg,
        options.plugin_dir,
        FleetHooks(
            sent=dispatcher.sent,
            delivered=cdi.delivered,
            retired=cdi.forget,
            allocated=allocated,
            own_sockets=lambda paths: kubelet_dir.set_own([*paths, *dra_sockets]),
            emit=dispatcher.emit,
            failed=request_stop,
        ),
    )
    roots = options.roots(cfg)
    # NVML names host PIDs: their cgroups are the host's /proc, whatever --proc-root says of the driver.
    telemetry = GpuTelemetry(scanner.sessions, Path("/proc"), Path(cfg.telemetry.log_root))
    report = StatusReport(cfg, state, fleet, pods, dra, telemetry, notifier.status, roots)
    dispatcher.metrics = report.metrics
    # Who works for which events, in order: DRA's sockets before the device plugins'.
    dispatcher.workers = (scanner, *((dra,) if dra is not None else ()), fleet, report)
    healer = Healer(state, scanner, dispatcher.emit)

    async def holders_now() -> Mapping[str, list[Holder]] | None:
        await pods.fresh(wait=PODS_READER_WAIT)
        return report.holders()

    dev_nodes = DevNodeWatch(dev_root, bus.publish)
    status = StatusServer(
        cfg.status_listen,
        {
            "/healthz": report.healthz,
            "/status": report.status_page,
            "/metrics": report.metrics_page,
            "/telemetry": report.telemetry_page,
        },
        {"/heal": healer.route},
    )
    # For Prometheus over the network: /metrics alone, never /status or a POST.
    scraped = StatusServer(cfg.metrics_listen, {"/metrics": report.metrics_page}, name="metrics endpoint")
    sinks: tuple[Sink, ...] = (
        DevRootFollower(cfg, scanner, dev_nodes, roots),  # first: a reload's new dev root, before what reads it
        reprober,
        ChangeLog(pods, report.holders, report.metrics),
        mps,  # before the CDI spec, which holds the groups' directories
        cdi,  # before anything that lists or hands out devices
        fleet,
        HealthStateSink(state_file, state.current),
        FeatureFile(cfg, options.sysfs_root),
        AutoReset(health, healer.reset, holders_now, scanner.processes, dispatcher.emit),
        *((dra,) if dra is not None else ()),
        telemetry,
        report,  # the status line says what the others did
        # Last: they ask the others.
        StatusEndpoint(status, lambda cfg: cfg.status_listen, dispatcher.emit),
        StatusEndpoint(scraped, lambda cfg: cfg.metrics_listen, dispatcher.emit),
    )
    dispatcher.sinks = report.sinks = sinks
    kernel_log = KernelLogSource(options.kernel_log, bus.publish) if health.kernel_log else None
    # The sources open before the first scan and the first look at kubelet.sock: nothing slips between.
    sources: tuple[Source, ...] = (
        scanner,
        UdevSource(bus.publish, on_overflow=lambda: scanner.request("udev events were lost")),
        kubelet_dir,
        dev_nodes,
        reprober,
        *((kernel_log,) if kernel_log is not None else ()),
    )
    return Wiring(sources, sinks)
