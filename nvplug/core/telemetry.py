"""What a GPU is doing, as NVML says on a scrape: its figures, its MIG devices' memory, the processes on it,
and the pod each process runs in. Pure: the reads are sources/telemetry_reader.py's.

A figure the driver does not give (an older driver, a GPU in MIG mode, a MIG device) is None, and its
series is left out rather than shown as 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

ProcessKind = Literal["compute", "graphics", "mps"]
MIB = 1 << 20
# NVML's performance policies 0 to 5, in order: a read gives each one's violation time as `<policy>_violation_ns`.
VIOLATION_POLICIES = ("power", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability")


def in_unit(value: float, scale: float) -> float:
    """`value` times `scale`, as exact as the text shows it: a fraction divides by its inverse, so that 35 %
    is 0.35 (35 * 0.01 is 0.35000000000000003)."""
    return value * scale if scale >= 1 else value / round(1 / scale)


@dataclass(frozen=True, kw_only=True)
class GpmActivity:
    """GPM (Hopper and later) over the window since the last read, of a GPU or of a MIG device's GPU
    instance: the share of time each unit was busy (0 to 1), and PCIe throughput in bytes/s. None on a
    first read (a window takes two) and before Hopper."""

    gr_engine_active: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    dram_active: float | None = None
    fp64_active: float | None = None
    fp32_active: float | None = None
    fp16_active: float | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None


@dataclass(frozen=True)
class GpuFigures(GpmActivity):
    """One read of one GPU. Memory in MiB, utilization in percent, power in W, energy in mJ, clocks in MHz."""

    util_gpu: int | None = None
    util_memory: int | None = None
    util_encoder: int | None = None
    util_decoder: int | None = None
    fb_used_mib: int | None = None
    fb_free_mib: int | None = None
    fb_total_mib: int | None = None
    temperature_c: int | None = None
    memory_temperature_c: int | None = None  # the HBM's; None where the GPU has none
    power_w: float | None = None
    energy_mj: int | None = None
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    # nvmlClocksEventReasons bits (what holds the clocks down: idle, power cap, thermal).
    clock_event_reasons: int | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    pcie_replays: int | None = None
    # NVLink data over all links since the GPU's last reset, each way; None on a GPU without NVLink.
    nvlink_tx_kib: int | None = None
    nvlink_rx_kib: int | None = None
    # Both ways over the window since the last read, in DCGM's unit for its field 449: KiB/s over 1000.
    nvlink_bandwidth_total: int | None = None
    # How long each performance policy has held the clocks below the applications clocks since the driver
    # loaded (ns): NVML's violation times.
    power_violation_ns: int | None = None
    thermal_violation_ns: int | None = None
    sync_boost_violation_ns: int | None = None
    board_limit_violation_ns: int | None = None
    low_utilization_violation_ns: int | None = None
    reliability_violation_ns: int | None = None


@dataclass(frozen=True)
class MigFigures(GpmActivity):
    """A MIG device's framebuffer, and its GPU instance's activity: NVML gives a MIG device no other figure."""

    uuid: str
    fb_used_mib: int | None = None
    fb_free_mib: int | None = None
    fb_total_mib: int | None = None


class ProcessUse(NamedTuple):
    """A process on a GPU or one of its MIG devices (`device`: that device's UUID). A tuple, where the rest
    of the model is frozen dataclasses: a scrape makes hundreds, and a dataclass costs 2 µs each."""

    pid: int
    device: str
    kind: ProcessKind
    # None: NVML does not know (usedGpuMemory NOT_AVAILABLE, as for MPS clients without the privilege).
    used_mib: float | None = None
    # Mean percent over the samples since the last read; None where NVML has none (MIG: it gives none).
    sm_util: float | None = None
    memory_util: float | None = None


@dataclass(frozen=True)
class GpuReading:
    """The last read of a GPU that worked, and what went wrong since (the series stay, marked stale)."""

    uuid: str
    read_at: float  # wall clock, seconds
    figures: GpuFigures
    mig: tuple[MigFigures, ...] = ()
    processes: tuple[ProcessUse, ...] = ()
    # The read that failed or did not answer in time after `read_at`: its figures are older than asked.
    stale: str | None = None


class ProcessContainer(NamedTuple):
    """The container a process runs in, from its cgroup and the kubelet's records; empty names when it
    runs in no pod (a host process) or in one the records do not name. A tuple, as ProcessUse: a render
    groups hundreds of processes by it."""

    namespace: str = ""
    pod: str = ""
    container: str = ""
    pod_uid: str = ""
    container_id: str = ""  # the runtime's, where the cgroup path has it


HOST = ProcessContainer()


@dataclass(frozen=True)
class Telemetry:
    """What a scrape shows: each GPU's reading, and the container of each process in them."""

    readings: tuple[GpuReading, ...] = ()
    containers: dict[int, ProcessContainer] = field(default_factory=dict)
    # Each pod's UID by namespace and name, from the kubelet's records: for the pods that hold a device.
    pod_uids: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def container_of(self, pid: int) -> ProcessContainer:
        return self.containers.get(pid, HOST)
