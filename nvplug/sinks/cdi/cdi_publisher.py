"""The CDI sink: the spec for the node's state, written before the list that needs it.

The dispatcher runs `CdiSink` first of the sinks that lists depend on, right after each new
revision and before any ListAndWatch stream can run, so a new device is defined before it is
advertised. A device that leaves the inventory keeps its entry until every resource has
delivered a list without it (`delivered`): the kubelet may allocate what it last saw.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nvplug.base.backoff import Backoff, Schedule
from nvplug.cdi.cdi_spec import (
    CDI_READS,
    GPU_KIND,
    CdiSpec,
    DriverFiles,
    Edits,
    Roots,
    Unit,
    device_name,
    gpu_spec,
    imex_spec,
    mps_edits,
    optional_specs,
    shared_edits,
)
from nvplug.config import DEFAULT_CDI_RUNTIME_DIRS, Config, off_or_path
from nvplug.config.selectors import DeviceFilter
from nvplug.core.events import CdiChecked, Event, NotesChanged
from nvplug.core.gpu import uuid_of
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import Commit, Emit, HealthVerdict, Sink, StateUpdate
from nvplug.shaping.mps_groups import CLAIM_GROUP_PREFIX, client_limits
from nvplug.shaping.resource_plan import Resource
from nvplug.sinks.cdi import driver_files as driverfiles
from nvplug.sinks.cdi.cdi_files import SpecWriter, conflicts, read_specs

log = logging.getLogger("nvplug")


@dataclass(frozen=True)
class CdiSettings:
    """What the config and command line say about the spec."""

    spec_dir: Path | None  # None: no spec is written
    id_strategy: str = "uuid"
    roots: Roots = field(default_factory=Roots)
    # Where this process reads the driver's files: the driver root, or the plugin's view of it.
    read_root: Path = Path("/")
    # nvidiaCTKPath: nvidia-cdi-hook beside it, or it, where they exist.
    ctk_path: str = "/usr/bin/nvidia-ctk"
    optional: tuple[str, ...] = ()
    imex_channels: tuple[int, ...] = ()
    # A cdi strategy hands out the names, so a device without an entry must not be offered.
    enforce: bool = False
    # nvplug.devices: a GPU it leaves out is in no spec.
    devices: DeviceFilter = field(default_factory=DeviceFilter)
    # MPS: the root of the groups' directories, and whether clients get their limits as variables.
    mps_root: str = ""
    mps_client_limits: bool = False
    # nvplug.cdi.runtimeDirs: read for conflicts with another spec of our kind.
    runtime_dirs: tuple[Path, ...] = tuple(Path(d) for d in DEFAULT_CDI_RUNTIME_DIRS)

    @classmethod
    def from_config(cls, cfg: Config) -> CdiSettings:
        flags, plugin = cfg.flags, cfg.flags.plugin
        directory = off_or_path(cfg.cdi_spec_dir)
        # As NVIDIA's plugin: files are read through containerDriverRoot where this process has it.
        container_root = Path(plugin.container_driver_root)
        read_root = container_root if container_root.is_dir() else Path(flags.nvidia_driver_root)
        optional = tuple(
            c
            for c, on in (
                ("gds", flags.gds_enabled),
                ("mofed", flags.mofed_enabled),
                ("gdrcopy", flags.gdrcopy_enabled),
            )
            if on
        )
        return cls(
            directory,
            plugin.device_id_strategy,
            Roots(flags.nvidia_driver_root, flags.nvidia_dev_root),
            read_root,
            plugin.nvidia_ctk_path,
            optional,
            cfg.imex.channel_ids,
            any(s.startswith("cdi") for s in plugin.device_list_strategy),
            cfg.devices,
            cfg.mps_root,
            cfg.mps.client_limits,
            tuple(Path(d) for d in cfg.cdi_runtime_dirs),
        )

    def hook(self) -> str | None:
        ctk = Path(self.ctk_path)
        for candidate in (ctk.with_name("nvidia-cdi-hook"), ctk):
            if os.access(candidate, os.X_OK) and candidate.is_file():
                return str(candidate)
        return None


class SpecPublisher:
    def __init__(self, settings: CdiSettings) -> None:
        self.settings = settings
        self._writer = SpecWriter(settings.spec_dir) if settings.spec_dir is not None else None
        self._files: DriverFiles | None = None
        self._files_for: tuple[str | None, str | None] | None = None
        # The devices each resource's last delivered list held, by UUID.
        self._delivered: dict[str, dict[str, Unit]] = {}
        # The GPU spec's device names as last written: what resolves now.
        self._resolvable: set[str] = set()
        self.error: str | None = None
        self.conflicts: list[str] = []
        # CDI names of the optional classes and IMEX channels, which Allocate adds to every container.
        self.extra_names: tuple[str, ...] = ()

    def configure(self, settings: CdiSettings) -> bool:
        """A reloaded config; True if the spec must be made again. A spec in a directory no longer
        configured is removed, or runtimes would still resolve names from it."""
        if settings == self.settings:
            return False
        if settings.spec_dir != self.settings.spec_dir:
            if self._writer is not None:
                try:
                    self._writer.write([])
                except OSError as err:
                    log.warning("cannot remove the CDI spec from %s: %s", self._writer.directory, err)
            self._writer = SpecWriter(settings.spec_dir) if settings.spec_dir is not None else None
            self._resolvable = set()
            self.error = None
        self.settings = settings
        self._files = None
        return True

    def specs(self, snap: Snapshot) -> tuple[list[CdiSpec], dict[str, str]]:
        """Every spec for this state, and the devices left out of the GPU spec, with why."""
        s = self.settings
        files = self._driver_files(snap)
        hook = s.hook()
        shared = shared_edits(files, s.roots, driverfiles.control_nodes(Path(s.roots.dev)), hook)
        gpu, skipped = gpu_spec(self._units(snap), s.id_strategy, snap.cap_minors, s.roots, shared, self._mps(snap))
        specs = [gpu, *optional_specs(driverfiles.optional_nodes(Path(s.roots.dev), s.optional), s.roots)]
        imex = imex_spec(driverfiles.imex_nodes(Path(s.roots.dev), s.imex_channels), s.roots)
        if imex is not None:
            specs.append(imex)
        return specs, skipped

    def update(self, snap: Snapshot) -> dict[str, str]:
        """Write what changed; the devices whose names would not resolve, and why (when enforced)."""
        if self._writer is None:
            return {}
        specs, skipped = self.specs(snap)
        try:
            changed = self._writer.write(specs)
        except OSError as err:
            self._failed(str(err.strerror or err))
        else:
            self._resolvable = set(specs[0].devices)
            self.extra_names = tuple(n for spec in specs[1:] for n in spec.names())
            if self.error is not None:
                log.info("the CDI spec is written again in %s", self._writer.directory)
                self.error = None
            if changed:
                # Only then: this runs on every new revision, and a health change must stay cheap.
                self._check_conflicts(specs)
        if not self.settings.enforce:
            return {}
        unresolved: dict[str, str] = {}
        for gpu, mig in self._present(snap):
            uuid = uuid_of(gpu, mig)
            name = device_name(gpu, mig, self.settings.id_strategy)
            if name not in self._resolvable:
                why = skipped.get(uuid) or f"its CDI spec entry could not be written: {self.error}"
                unresolved[uuid] = f"no CDI device {GPU_KIND}={name}: {why}"
        return unresolved

    def status(self) -> dict[str, object]:
        """What /status says of the spec."""
        directory = self.settings.spec_dir
        return {
            "spec_dir": str(directory) if directory is not None else None,
            "devices": len(self._resolvable),
            "error": self.error,
            "conflicts": list(self.conflicts),
            "driver_problems": list(self.driver_problems()),
        }

    def delivered(self, resource: str, units: Iterable[Unit]) -> bool:
        """Whether what the resource's lists hold changed: a health change leaves it as it was."""
        held = {uuid_of(*unit): unit for unit in units}
        if self._delivered.get(resource) == held:
            return False
        self._delivered[resource] = held
        return True

    def forget(self, resource: str) -> None:
        self._delivered.pop(resource, None)

    def _failed(self, error: str) -> None:
        if error != self.error:
            log.error("%s; CDI names of new devices will not resolve until it is", error)
            self.error = error

    def _check_conflicts(self, specs: list[CdiSpec]) -> None:
        assert self._writer is not None
        files = read_specs([*self.settings.runtime_dirs, self._writer.directory])
        found = conflicts(files, self._writer.paths(), [s.kind for s in specs])
        for problem in found:
            if problem not in self.conflicts:
                log.warning("CDI conflict: %s", problem)
        self.conflicts = found

    def driver_problems(self) -> tuple[str, ...]:
        """What the last look at the driver's files could not find."""
        return self._files.problems if self._files is not None else ()

    def _driver_files(self, snap: Snapshot) -> DriverFiles:
        """Found again only for a new driver version or load: libraries do not change under a loaded driver."""
        key = (snap.driver_version, snap.driver_instance)
        if self._files is None or key != self._files_for:
            self._files = driverfiles.discover(self.settings.read_root, snap.driver_version)
            self._files_for = key
            if self._writer is not None:
                for problem in self._files.problems:
                    log.warning("CDI spec: %s", problem)
        return self._files

    def _mps(self, snap: Snapshot) -> dict[str, Edits]:
        """Each MPS device's view of its group, as Allocate hands it out: a CDI-only runtime gets it too.
        A DRA claim's group is in the claim's own spec, not in the node's."""
        s = self.settings
        out = {}
        for group in snap.mps.values():
            if group.group.startswith(CLAIM_GROUP_PREFIX):
                continue
            for n, uuid in enumerate(group.units):
                limits = None
                if s.mps_client_limits:
                    pinned = group.pinned_mib[n] if n < len(group.pinned_mib) else None
                    limits = client_limits(group.thread_percentage, (pinned,))
                out[uuid] = mps_edits(s.mps_root, group.group, limits)
        return out

    def _present(self, snap: Snapshot) -> list[Unit]:
        """The devices present that nvplug hands out."""
        gpus = [g for g in snap.gpus if not self.settings.devices.excludes(g)]
        return [unit for g in gpus for unit in [(g, None), *((g, m) for m in g.mig)]]

    def _units(self, snap: Snapshot) -> list[Unit]:
        """The devices present, then those gone but still in a list some resource last delivered."""
        units: dict[str, Unit] = {uuid_of(*unit): unit for unit in self._present(snap)}
        for held in self._delivered.values():
            for uuid, unit in held.items():
                units.setdefault(uuid, unit)
        return list(units.values())


# Retrying a spec that could not be written: nothing else may change for hours.
RETRY_BACKOFF = Backoff(first=1.0, maximum=300.0)


class CdiSink(Sink):
    """The spec kept equal to the node: written at each revision, retried on a timer while it cannot be.

    Devices whose CDI names would not resolve are fed back as `CdiChecked`, applied before any
    list goes out, so that they are not offered Healthy; so are the spec's optional names, which
    Allocate adds to every container.
    """

    name = "cdi"
    # What a spec is made of; no device's health. Before the fleet, whose Allocate hands out its names.
    reads = CDI_READS
    before_list = True

    def __init__(
        self,
        settings: Callable[[Config], CdiSettings],
        cfg: Config,
        feed: Emit,
    ) -> None:
        self._settings = settings
        self.publisher = SpecPublisher(settings(cfg))
        # Applies an event at once, as the dispatcher does with what `update` returns.
        self._feed = feed
        self._snapshot: Snapshot | None = None
        # The optional names as last fed back: the snapshot kept for a retry may be older than that.
        self._extra: tuple[str, ...] = ()
        self._retry: asyncio.TimerHandle | None = None
        self._retrying: Schedule = RETRY_BACKOFF.schedule()

    def update(self, update: StateUpdate) -> Sequence[Event]:
        if not update.revised:
            return ()
        return self._publish(update.snapshot)

    def delivered(self, resource: str, devices: Resource) -> None:
        """A list went out: entries of devices it no longer holds may leave the spec now."""
        if self.publisher.delivered(resource, devices.units):
            self._republish()

    def forget(self, resource: str) -> None:
        """A resource stopped: what it last delivered no longer holds CDI entries in place."""
        self.publisher.forget(resource)

    def prepare(self, cfg: Config) -> Commit:
        settings = self._settings(cfg)

        async def commit(snapshot: Snapshot) -> None:
            # The spec for the new names first, then the Allocate that hands them out.
            if self.publisher.configure(settings):
                for event in self._publish(snapshot):
                    self._feed(event)

        return commit

    @property
    def enforced_error(self) -> str | None:
        """Why the spec is not written, where a cdi strategy hands out its names: nothing resolves then."""
        return self.publisher.error if self.publisher.settings.enforce else None

    def notes(self) -> list[str]:
        error = self.publisher.error
        return [f"CDI spec not written: {error}"] if error else []

    def verdict(self) -> HealthVerdict:
        """Unhealthy while a cdi strategy hands out names the unwritten spec cannot resolve."""
        return HealthVerdict(self.enforced_error is None, tuple(self.notes()))

    def status(self) -> dict[str, object]:
        return self.publisher.status()

    async def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None

    def _publish(self, snap: Snapshot) -> list[Event]:
        self._snapshot = snap
        unresolved = self.publisher.update(snap)
        if self.publisher.error is None:
            self._retrying.reset()
        elif self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(self._retrying.next(), self._retry_due)
        extra = self.publisher.extra_names
        if unresolved == snap.unresolved and extra == self._extra:
            return []
        self._extra = extra
        return [CdiChecked(unresolved, extra)]

    def _republish(self) -> None:
        """Outside a dispatch (a timer, a delivered list): what it finds is fed to the state at once."""
        if self._snapshot is None:
            return
        for event in self._publish(self._snapshot):
            self._feed(event)

    def _retry_due(self) -> None:
        self._retry = None
        self._republish()
        self._feed(NotesChanged())  # its error is gone: the status line says so
