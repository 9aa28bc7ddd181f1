"""One GPU's telemetry through pynvml: its figures, its MIG devices' memory, and the processes on it with
their memory and utilization. Every call blocks: run on the telemetry's own thread (sources/telemetry_reader.py).

A figure the driver lacks (or refuses on this GPU) is None; only a GPU NVML cannot find or reach fails the
read (NvmlUnavailable). Process utilization comes from the samples newer than the last read's, and the
GPU's activity (GPM, Hopper and later) from its counters between the last read's sample and this one's, so
each read covers exactly the window since the one before (its `Window`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import pynvml  # type: ignore[import-untyped]

from nvplug.core.telemetry import MIB, VIOLATION_POLICIES, GpuFigures, MigFigures, ProcessKind, ProcessUse, in_unit
from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.sources.nvml_discovery import as_text, session
from nvplug.sources.nvml_field_values import FieldRequest, FieldValue
from nvplug.sources.nvml_process_arrays import running_processes, unpacker, utilization_samples

T = TypeVar("T")

CLOCK_SM, CLOCK_MEM = 1, 2  # nvmlClockType_t
TEMPERATURE_GPU = 0
ALL_LINKS = 0xFFFFFFFF  # an NVLink field's scopeId for the sum over every link
# GpuFigures' figures that are a field each, and each one's type: the memory's temperature, and those that
# also have a call of their own, read so because one call a read costs the driver one round trip and the
# daemon one wrapper, where their ten calls cost ten.
FIELD_FIGURES: tuple[tuple[str, int, Callable[[float], int | bool]], ...] = (
    ("memory_temperature_c", pynvml.NVML_FI_DEV_MEMORY_TEMP, int),
    ("energy_mj", pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, int),
    ("pcie_replays", pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, int),
    ("ecc_sbe_volatile", pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, int),
    ("ecc_dbe_volatile", pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, int),
    ("ecc_sbe_aggregate", pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL, int),
    ("ecc_dbe_aggregate", pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL, int),
    ("retired_pages_sbe", pynvml.NVML_FI_DEV_RETIRED_SBE, int),
    ("retired_pages_dbe", pynvml.NVML_FI_DEV_RETIRED_DBE, int),
    ("retired_pages_pending", pynvml.NVML_FI_DEV_RETIRED_PENDING, bool),
    ("remapped_rows_correctable", pynvml.NVML_FI_DEV_REMAPPED_COR, int),
    ("remapped_rows_uncorrectable", pynvml.NVML_FI_DEV_REMAPPED_UNC, int),
    ("remapped_rows_pending", pynvml.NVML_FI_DEV_REMAPPED_PENDING, bool),
    ("remapped_rows_failure", pynvml.NVML_FI_DEV_REMAPPED_FAILURE, bool),
)
# The fields a read takes, in one call: FIELD_FIGURES, NVLink's data counts each way over every link, and
# each policy's violation time (ns since the driver loaded), as DCGM reads them.
FIELDS = FieldRequest(
    (
        *((field, 0) for _, field, _ in FIELD_FIGURES),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
        *((pynvml.NVML_FI_DEV_PERF_POLICY_POWER + at, 0) for at in range(len(VIOLATION_POLICIES))),  # 74 to 79
    )
)


@dataclass(frozen=True)
class Window:
    """Where a GPU's next read starts: the newest process utilization sample seen (µs), and this read's GPM
    samples, the GPU's or in MIG mode each GPU instance's (NVML's memory: the next read frees them, or
    `release` does when the GPU has gone)."""

    last_seen: int = 0
    gpm_sample: Any = None
    gpm_instances: tuple[tuple[int, Any], ...] = ()  # (GPU instance ID, sample)
    nvlink: tuple[int, int] | None = None  # NVLink KiB both ways, and when NVML read them (µs)


@dataclass(frozen=True)
class GpuRead:
    figures: GpuFigures
    mig: tuple[MigFigures, ...]
    processes: tuple[ProcessUse, ...]
    window: Window = Window()


# GPM's figures: the metric, the GpmActivity field, and the scale from NVML's unit to the field's (a percent
# is 1/100 of a ratio, a MiB/s 2^20 bytes/s).
GPM_METRICS: tuple[tuple[int, str, float], ...] = (
    (pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL, "gr_engine_active", 0.01),
    (pynvml.NVML_GPM_METRIC_SM_UTIL, "sm_active", 0.01),
    (pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, "sm_occupancy", 0.01),
    (pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, "tensor_active", 0.01),
    (pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, "dram_active", 0.01),
    (pynvml.NVML_GPM_METRIC_FP64_UTIL, "fp64_active", 0.01),
    (pynvml.NVML_GPM_METRIC_FP32_UTIL, "fp32_active", 0.01),
    (pynvml.NVML_GPM_METRIC_FP16_UTIL, "fp16_active", 0.01),
    (pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC, "pcie_tx_bytes_per_second", MIB),
    (pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, "pcie_rx_bytes_per_second", MIB),
)


class _MetricsRequest(ctypes.Structure):
    """nvmlGpmMetricsGet_t with room for GPM_METRICS only: NVML reads `numMetrics` entries, and pynvml's
    has room for every metric there is (23 KB to clear on every read)."""

    _fields_ = (
        ("version", ctypes.c_uint),
        ("numMetrics", ctypes.c_uint),
        ("sample1", pynvml.c_nvmlGpmSample_t),
        ("sample2", pynvml.c_nvmlGpmSample_t),
        ("metrics", pynvml.c_nvmlGpmMetric_t * len(GPM_METRICS)),
    )


def _metrics_template() -> bytes:
    """A request's bytes with its version and metrics set, made once: a read copies it (pynvml's metric
    structure sets and reads each member through a formatting hook)."""
    request = _MetricsRequest()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(GPM_METRICS)
    for at, (metric, _, _) in enumerate(GPM_METRICS):
        request.metrics[at].metricId = metric
    return bytes(request)


_METRICS_TEMPLATE = _metrics_template()
_METRIC_ANSWER = unpacker(pynvml.c_nvmlGpmMetric_t, ("nvmlReturn", "value"))


def read_gpu(uuid: str, since: Window) -> GpuRead:
    """Raises NvmlUnavailable when the GPU cannot be found or reached; then `since` is as it was, for the
    next read."""
    with session():
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            lost = _optional(lambda: pynvml.nvmlDeviceGetUUID(handle)) is None
        except pynvml.NVMLError as err:
            raise NvmlUnavailable(f"cannot read the telemetry of {uuid}: {err}") from err
        if lost:
            raise NvmlUnavailable(f"{uuid} does not answer")
        mig_handles = _mig_handles(handle)
        figures = _figures(handle, in_mig_mode=bool(mig_handles))
        counted = _fields(handle, since.nvlink, figures)
        migs = tuple(_mig_figures(mig, h) for mig, h in mig_handles.items())
        devices = mig_handles or {uuid: handle}
        samples, newest = _samples(handle, since.last_seen)
        processes = tuple(p for device, h in devices.items() for p in _processes(device, h, samples))
        # Last: nothing after it fails the read, so the samples it frees are never used again.
        if not mig_handles:
            activity, sample = _gpm(handle, since.gpm_sample, lambda s: pynvml.nvmlGpmSampleGet(handle, s))
            _free(*(s for _, s in since.gpm_instances))  # from when MIG mode was on
            figures.update(activity)
            return GpuRead(GpuFigures(**figures), migs, processes, Window(newest, sample, nvlink=counted))
        migs, kept = _instances_activity(handle, mig_handles, migs, since)
    return GpuRead(GpuFigures(**figures), migs, processes, Window(newest, gpm_instances=kept, nvlink=counted))


def release(window: Window) -> None:
    """Frees a window's GPM samples: its GPU has gone, and no read will start from them."""
    _free(window.gpm_sample, *(s for _, s in window.gpm_instances))


def _free(*samples: Any) -> None:
    """GPM samples no read will use again (None: there was none)."""
    for sample in samples:
        if sample is not None:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlGpmSampleFree(sample)


def _with(figures: MigFigures, activity: Mapping[str, float]) -> MigFigures:
    return dataclasses.replace(figures, **cast(dict[str, Any], activity))


def _optional(read: Callable[[], T]) -> T | None:
    try:
        return read()
    except pynvml.NVMLError:
        return None


def _figures(handle: Any, in_mig_mode: bool) -> dict[str, Any]:
    """The figures of GpuFigures that take a call each: built into one GpuFigures with the rest of the read."""
    util = None if in_mig_mode else _optional(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle))
    memory = _optional(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    power = _optional(lambda: pynvml.nvmlDeviceGetPowerUsage(handle))

    def video(read: Callable[[Any], list[int]]) -> int | None:
        """The encoder's or decoder's utilization; NVML gives its sampling period beside it."""
        return _optional(lambda: int(read(handle)[0]))

    return dict(
        util_gpu=None if util is None else int(util.gpu),
        util_memory=None if util is None else int(util.memory),
        util_encoder=video(pynvml.nvmlDeviceGetEncoderUtilization),
        util_decoder=video(pynvml.nvmlDeviceGetDecoderUtilization),
        fb_used_mib=None if memory is None else int(memory.used) // MIB,
        fb_free_mib=None if memory is None else int(memory.free) // MIB,
        fb_total_mib=None if memory is None else int(memory.total) // MIB,
        temperature_c=_optional(lambda: int(pynvml.nvmlDeviceGetTemperature(handle, TEMPERATURE_GPU))),
        power_w=None if power is None else int(power) / 1000.0,
        sm_clock_mhz=_optional(lambda: int(pynvml.nvmlDeviceGetClockInfo(handle, CLOCK_SM))),
        memory_clock_mhz=_optional(lambda: int(pynvml.nvmlDeviceGetClockInfo(handle, CLOCK_MEM))),
        clock_event_reasons=_clock_event_reasons(handle),
    )


def _fields(handle: Any, previous: tuple[int, int] | None, figures: dict[str, Any]) -> tuple[int, int] | None:
    """FIELDS into `figures`: FIELD_FIGURES, NVLink's data counts each way and DCGM's field 449 over the
    window since `previous` (the KiB both ways over the seconds between NVML's two reads, over 1000, as DCGM
    works it out), and the violation times. What the driver does not give is left out; no 449 on a first
    read, after a reset, or without NVLink. Returns NVLink's count both ways and when NVML read it."""
    try:
        answers = FIELDS.read(handle)
    except pynvml.NVMLError:
        return None
    for (name, _, kind), value in zip(FIELD_FIGURES, answers, strict=False):
        _put(figures, name, value, kind)
    tx, rx, *violations = answers[len(FIELD_FIGURES) :]
    for policy, got in zip(VIOLATION_POLICIES, violations, strict=True):
        _put(figures, f"{policy}_violation_ns", got)
    if tx.value is None or rx.value is None:
        return None
    _put(figures, "nvlink_tx_kib", tx)
    _put(figures, "nvlink_rx_kib", rx)
    now = (int(tx.value) + int(rx.value), rx.timestamp)
    if previous is not None and now[1] > previous[1] and now[0] >= previous[0]:
        figures["nvlink_bandwidth_total"] = int((now[0] - previous[0]) / ((now[1] - previous[1]) / 1e6) / 1000)
    return now


def _put(figures: dict[str, Any], name: str, got: FieldValue, kind: Callable[[float], int | bool] = int) -> None:
    if got.value is not None:
        figures[name] = kind(got.value)


def _clock_event_reasons(handle: Any) -> int | None:
    """nvmlDeviceGetCurrentClocksEventReasons, or on a driver before R535 its old name."""
    found = _optional(lambda: int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)))
    if found is None:
        found = _optional(lambda: int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)))
    return found


def _gpm(handle: Any, previous: Any, take: Callable[[Any], object]) -> tuple[dict[str, float], Any]:
    """The activity between the previous read's GPM sample and one taken now (`take` fills it: the GPU's,
    or a GPU instance's), and that sample; the previous one is freed. None to give where the GPU has no GPM
    (before Hopper), or on a first read: a window needs two samples."""
    sample = None
    try:
        # A GPU that gave a sample last time has GPM: it is asked only on a first read.
        if previous is not None or pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
            sample = pynvml.nvmlGpmSampleAlloc()
            take(sample)
    except pynvml.NVMLError:
        _free(sample)
        sample = None
    activity: dict[str, float] = {}
    if sample is not None and previous is not None:
        request = _MetricsRequest.from_buffer_copy(_METRICS_TEMPLATE)
        request.sample1, request.sample2 = previous, sample
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlGpmMetricsGet(request)
            answers = _METRIC_ANSWER.iter_unpack(bytes(request.metrics))
            for (returned, value), (_, field, scale) in zip(answers, GPM_METRICS, strict=True):
                if returned == pynvml.NVML_SUCCESS:
                    activity[field] = in_unit(value, scale)
    _free(previous)
    return activity, sample


def _instances_activity(
    handle: Any, mig_handles: dict[str, Any], migs: tuple[MigFigures, ...], since: Window
) -> tuple[tuple[MigFigures, ...], tuple[tuple[int, Any], ...]]:
    """In MIG mode: each MIG device's figures with its GPU instance's activity, and each instance's sample.
    The samples of instances the layout no longer has, and the whole GPU's from before, are freed."""
    instances = {
        mig: gi
        for mig, h in mig_handles.items()
        if (gi := _optional(lambda: int(pynvml.nvmlDeviceGetGpuInstanceId(h)))) is not None  # noqa: B023
    }
    previous = dict(since.gpm_instances)
    taken = {
        gi: _gpm(handle, previous.pop(gi, None), lambda s: pynvml.nvmlGpmMigSampleGet(handle, gi, s))  # noqa: B023
        for gi in sorted(set(instances.values()))
    }
    _free(since.gpm_sample, *previous.values())
    with_activity = tuple(_with(m, taken[instances[m.uuid]][0]) if m.uuid in instances else m for m in migs)
    return with_activity, tuple((gi, sample) for gi, (_, sample) in taken.items() if sample is not None)


def _mig_handles(handle: Any) -> dict[str, Any]:
    """The MIG devices of a GPU in MIG mode, by UUID; none when it is not."""
    mode = _optional(lambda: pynvml.nvmlDeviceGetMigMode(handle))
    if mode is None or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
        return {}
    out: dict[str, Any] = {}
    for index in range(_optional(lambda: int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))) or 0):
        mig = _optional(lambda: pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index))  # noqa: B023
        uuid = None if mig is None else _optional(lambda: as_text(pynvml.nvmlDeviceGetUUID(mig)))  # noqa: B023
        if uuid is not None:
            out[uuid] = mig
    return out


def _mig_figures(uuid: str, handle: Any) -> MigFigures:
    memory = _optional(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle))
    if memory is None:
        return MigFigures(uuid)
    return MigFigures(uuid, int(memory.used) // MIB, int(memory.free) // MIB, int(memory.total) // MIB)


_LISTS: tuple[tuple[ProcessKind, str], ...] = (
    ("compute", "nvmlDeviceGetComputeRunningProcesses_v3"),
    ("graphics", "nvmlDeviceGetGraphicsRunningProcesses_v3"),
    ("mps", "nvmlDeviceGetMPSComputeRunningProcesses_v3"),
)


def _processes(device: str, handle: Any, samples: dict[int, tuple[float, float]] | None) -> list[ProcessUse]:
    """Each process once (the first list that has it: an MPS server is a compute process, its clients are
    MPS ones), with its share over the window: 0 where it left no sample (NVML samples only the busy)."""
    seen: dict[int, ProcessUse] = {}
    for kind, function in _LISTS:
        for pid, used in _optional(lambda: running_processes(function, handle)) or ():  # noqa: B023
            if pid in seen:
                continue
            sm, mem = (None, None) if samples is None else samples.get(pid, (0.0, 0.0))
            seen[pid] = ProcessUse(pid, device, kind, None if used is None else used / MIB, sm, mem)
    return list(seen.values())


def _samples(handle: Any, last_seen: int) -> tuple[dict[int, tuple[float, float]] | None, int]:
    """Each process's mean SM and memory utilization over the samples after `last_seen`, and the newest
    sample's time. None: NVML gives no per-process utilization here (MIG, an older driver)."""
    try:
        found = list(utilization_samples(handle, last_seen))
    except pynvml.NVMLError as err:
        if err.value == pynvml.NVML_ERROR_NOT_FOUND:
            return {}, last_seen  # nothing newer: no process was busy since
        return None, last_seen
    sums: dict[int, list[float]] = {}
    newest = last_seen
    for pid, stamp, sm, mem in found:
        total = sums.setdefault(pid, [0.0, 0.0, 0.0])
        total[0] += sm
        total[1] += mem
        total[2] += 1
        newest = max(newest, stamp)
    return {pid: (sm / n, mem / n) for pid, (sm, mem, n) in sums.items()}, newest
