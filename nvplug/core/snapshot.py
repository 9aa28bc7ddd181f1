"""The node's picture: an immutable Snapshot of inventory plus health per GPU, under one revision number.

NodeState (node_state.py) folds events into the next Snapshot, each with the Changes it made; sinks
read it, and name the fields they depend on (NODE_FIELDS, or its parts INVENTORY, HEALTH, REVISED)
to be called only when one changed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property
from types import MappingProxyType

from nvplug.core.gpu import Gpu
from nvplug.core.health import HealthState, Recorded
from nvplug.core.mig import CapMinors
from nvplug.core.mps_state import MpsGroupState, unit_health
from nvplug.core.topology import Topology

# Snapshot fields that are counts for operators, not the node's picture: they bump no revision.
COUNTERS = frozenset({"xids", "xid_codes", "xids_matched", "kernel_log_seq", "kernel_log_lost", "switch_errors"})


@dataclass(frozen=True)
class SwitchErrors:
    """The SXids of one NVSwitch this boot: counted and shown, no GPU fault."""

    switch: str
    count: int
    last_code: int
    last_message: str


@dataclass(frozen=True)
class LoggedFault:
    """A fault the kernel log printed for a GPU that no scan has found yet."""

    reason: str
    seq: int
    remedy: str | None = None
    xid: int | None = None


@dataclass(frozen=True)
class HungCall:
    """An NVML call past its deadline that has not returned."""

    call: str
    uuid: str | None
    index: int | None
    since: float  # wall-clock seconds

    @property
    def subject(self) -> str:
        """The call and its GPU: `scan (gpu 2)`, `probe (GPU-...)`."""
        gpu = self.uuid or (f"gpu {self.index}" if self.index is not None else "no GPU yet")
        return f"{self.call} ({gpu})"

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.since))
        return f"NVML has not returned from {self.subject} since {since}"


def find_gpu(gpus: tuple[Gpu, ...], uuid: str | None = None, bus_id: str | None = None) -> Gpu | None:
    return next((g for g in gpus if g.uuid == uuid or g.bus_id == bus_id), None)


def devices_of(health: Mapping[str, HealthState], gpu: Gpu) -> Iterator[tuple[str, HealthState]]:
    """The GPU's own health, then each of its MIG devices'."""
    for uuid in (gpu.uuid, *(m.uuid for m in gpu.mig)):
        state = health.get(uuid)
        if state is not None:
            yield uuid, state


def _frozen(mapping: Mapping[str, HealthState] | None = None) -> Mapping[str, HealthState]:
    return MappingProxyType(dict(mapping or {}))


class GpuLookups:
    """The lookups a snapshot and its draft share, over their own `gpus` and `health`."""

    gpus: tuple[Gpu, ...]
    health: Mapping[str, HealthState]

    def gpu(self, uuid: str) -> Gpu | None:
        return find_gpu(self.gpus, uuid=uuid)

    def by_bus_id(self, bus_id: str) -> Gpu | None:
        return find_gpu(self.gpus, bus_id=bus_id)

    def devices_of(self, gpu: Gpu) -> Iterator[tuple[str, HealthState]]:
        return devices_of(self.health, gpu)


@dataclass(frozen=True)
class Snapshot(GpuLookups):
    revision: int
    gpus: tuple[Gpu, ...] = ()
    health: Mapping[str, HealthState] = field(default_factory=_frozen)
    # Why NVML cannot be used right now; None while it works.
    nvml_error: str | None = None
    # Why health events cannot be received right now; None while they can.
    health_watch_error: str | None = None
    # Links between GPUs, read with the inventory.
    topology: Topology = field(default_factory=Topology)
    # The /dev/nvidia-caps minors of the MIG instances, read with the inventory.
    cap_minors: CapMinors = field(default_factory=CapMinors)
    # Which load of the kernel driver the last scan saw; None: unknown.
    driver_instance: str | None = None
    # Devices the last scan found Allocate could not hand out, and why.
    unready: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Devices whose CDI names would not resolve (the spec could not be written), and why.
    unresolved: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # The driver's version and its CUDA version (12040: 12.4) as the last scan read them; None: unknown.
    driver_version: str | None = None
    cuda_version: int | None = None
    # Faults from the state file for devices not seen yet in this run, by UUID.
    restored: Mapping[str, Recorded] = field(default_factory=lambda: MappingProxyType({}))
    # The NVIDIA device nodes the dev watch listed last; None while nothing watches them.
    device_nodes: frozenset[str] | None = None
    # Why the kernel log cannot be read; None while it can (or is not read).
    kernel_log_error: str | None = None
    # The newest kernel log record taken in, and how many the reader is known to have missed.
    kernel_log_seq: int | None = None
    kernel_log_lost: int = 0
    # Faults the kernel log printed for GPUs not found yet, by bus id.
    logged: Mapping[str, LoggedFault] = field(default_factory=lambda: MappingProxyType({}))
    # NVSwitch SXids by the switch's bus id.
    switch_errors: Mapping[str, SwitchErrors] = field(default_factory=lambda: MappingProxyType({}))
    # NVML calls past their deadline, by the call's number.
    hung_calls: Mapping[int, HungCall] = field(default_factory=lambda: MappingProxyType({}))
    # Xids taken in per GPU this run, each once however many sources reported it.
    xids: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # The same per code, (code, count) the last one taken in last: telemetry's per-code counts and last Xid.
    xid_codes: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=lambda: MappingProxyType({}))
    # Xids that both NVML and the kernel log reported, taken in once.
    xids_matched: int = 0
    # nvplug's own resets: the last step per GPU UUID, and the times of the resets this boot.
    auto_reset: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    auto_resets: Mapping[str, tuple[float, ...]] = field(default_factory=lambda: MappingProxyType({}))
    # The MPS groups' daemons by group.
    mps: Mapping[str, MpsGroupState] = field(default_factory=lambda: MappingProxyType({}))
    # The compute modes GPUs had before nvplug set EXCLUSIVE_PROCESS for MPS, by UUID: restored on stop.
    compute_modes: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    # The CDI names every container also gets (the spec's optional classes, IMEX channels), as last written.
    cdi_extra: tuple[str, ...] = ()

    @cached_property
    def mps_units(self) -> Mapping[str, HealthState]:
        """Each MPS device's daemon health by its UUID: derived once per snapshot, looked up per device."""
        return unit_health(self.mps)

    def unhealthy(self) -> tuple[Gpu, ...]:
        """GPUs that are Unhealthy or hold an Unhealthy MIG device."""
        return tuple(g for g in self.gpus if not all(s.healthy for _, s in self.devices_of(g)))

    def reprobe_due(self) -> tuple[Gpu, ...]:
        """GPUs a passing probe could heal: unreachable ones, and those whose reset evidence is in."""
        return tuple(g for g in self.gpus if any(not s.healthy and s.probe_clears for _, s in self.devices_of(g)))

    @property
    def kernel_log_cursor(self) -> int | None:
        """The last kernel log record a restart need not read again: none a fault still waits on."""
        if self.logged:
            return min(f.seq for f in self.logged.values()) - 1
        return self.kernel_log_seq

    def records(self) -> dict[str, Recorded]:
        """Every Unhealthy device with its fault, and the restored ones not seen yet: the state file's content."""
        out = dict(self.restored)
        for gpu in self.gpus:
            out.update((uuid, Recorded(gpu.bus_id, s)) for uuid, s in self.devices_of(gpu) if not s.healthy)
        return out


@dataclass(frozen=True)
class Change:
    """One thing an event changed or meant, for the log and later for metrics."""

    what: str
    gpu: Gpu | None = None
    reason: str = ""


# Every field of the node's picture, and named parts of it that sinks depend on (Sink.reads).
NODE_FIELDS = tuple(f.name for f in fields(Snapshot) if f.name != "revision")
# Fields that bump no revision, yet wake the sinks that read them: no list changes with them (Allocate
# adds the CDI spec's optional names to every container).
UNLISTED = frozenset({"cdi_extra"})
# Whatever changes the picture: every field but the counters and the unlisted.
REVISED = frozenset(NODE_FIELDS) - COUNTERS - UNLISTED
# What the node has: the GPUs and their MIG devices, links, device nodes, the driver.
INVENTORY = frozenset(
    {"gpus", "topology", "cap_minors", "driver_instance", "driver_version", "cuda_version", "device_nodes"}
)
# Whether each device may be used: its health, and what Allocate could not hand out.
HEALTH = frozenset({"health", "restored", "unready", "unresolved", "nvml_error", "health_watch_error", "hung_calls"})


def differs(new: object, old: object) -> bool:
    """Whether a field's value changed. Most fields are the very object the base had: no
    comparison of a whole inventory for them."""
    return new is not old and new != old


def changed_between(older: Snapshot, newer: Snapshot) -> frozenset[str]:
    """The fields (of NODE_FIELDS) in which two snapshots differ: what a sink may depend on."""
    return frozenset(name for name in NODE_FIELDS if differs(getattr(newer, name), getattr(older, name)))
