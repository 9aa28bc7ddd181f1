"""The NVML adapter: discovery through pynvml (the nvidia-ml-py binding).

Every call here blocks, so callers run it off the event loop. Optional queries
that an older driver lacks degrade one field; they never fail discovery.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import pynvml  # type: ignore[import-untyped]

from nvplug.core.events import ProbeResult
from nvplug.core.gpu import NO_NUMA_NODE, Gpu, MigAttributes, MigDevice, normalize_bus_id
from nvplug.core.health import Clears, Fault
from nvplug.core.mig import CapMinors, profile_name, read_mig_minors
from nvplug.core.topology import Link, PcieLevel, Topology
from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.sources.nvml_field_values import FieldRequest

log = logging.getLogger(__name__)

T = TypeVar("T")

# The driver simply lacks these; not worth more than a debug line.
_ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


RECOVERY_ACTION = FieldRequest(((230, 0),))  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION


@dataclass(frozen=True)
class Discovery:
    gpus: tuple[Gpu, ...]
    # Fields this driver does not report: expected on older drivers.
    absent: tuple[str, ...] = ()
    # Fields that failed to read and GPUs skipped: worth a warning.
    problems: tuple[str, ...] = ()
    driver_version: str | None = None
    topology: Topology = field(default_factory=Topology)
    cap_minors: CapMinors = field(default_factory=CapMinors)
    # GPUs NVML counts but whose identity is unreadable because they are lost.
    lost: int = 0
    # Which load of the kernel driver this is; None where sysfs cannot tell.
    driver_instance: str | None = None
    # The CUDA version the driver supports, as NVML encodes it (12040 is 12.4).
    cuda_version: int | None = None


@dataclass(frozen=True)
class Scan:
    discovery: Discovery
    probes: tuple[ProbeResult, ...]


@dataclass(frozen=True)
class Enumerated:
    """A GPU as a scan's first calls name it (its handle, its UUID): enough to subscribe to its events."""

    index: int
    uuid: str
    label: str


@contextlib.contextmanager
def session() -> Iterator[None]:
    """One reference on NVML's init count; a scan at count zero sees hot-added GPUs."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(f"NVML initialisation failed: {err}") from err
    try:
        yield
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as err:
            log.warning("nvmlShutdown failed: %s", err)


def probe_gpu(uuid: str, evidence: str) -> ProbeResult:
    """Handle valid, UUID and PCI info readable, nothing pending that needs a reset."""
    started = time.monotonic()
    return replace(_probe_gpu(uuid, evidence), started=started)


def _probe_gpu(uuid: str, evidence: str) -> ProbeResult:
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        read_back = as_text(pynvml.nvmlDeviceGetUUID(handle))
        if read_back != uuid:
            return ProbeResult(uuid, f"UUID reads back as {read_back}", evidence)
        pynvml.nvmlDeviceGetPciInfo(handle)
        return _pending_repair(uuid, handle, evidence)
    except pynvml.NVMLError as err:
        # Unreachable: answering again is the evidence it needs.
        return ProbeResult(uuid, str(err), evidence, fault=Fault.LOST)


def _pending_repair(uuid: str, handle: Any, evidence: str) -> ProbeResult:
    """What the driver still wants fixed, which takes a reset; checks the driver lacks count as passed."""
    notes = _Notes()
    action = notes.optional(lambda: recovery_action(handle), "", "recovery action") or 0
    failure = None
    if notes.optional(lambda: int(pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)), "", "page retirement status"):
        failure = "page retirement pending"
    rows = notes.optional(lambda: pynvml.nvmlDeviceGetRemappedRows(handle), "", "remapped rows")
    if failure is None and rows is not None and rows[3]:
        failure = "row remapping failed"
    if failure is None and rows is not None and rows[2]:
        failure = "row remap pending"
    if failure is None and action:
        failure = f"NVML recovery action pending ({action})"
    if failure is not None:
        return ProbeResult(uuid, failure, evidence, Clears.RESET, action)
    if notes.problems:
        return ProbeResult(uuid, "; ".join(notes.problems), evidence, Clears.PROBE, action)
    return ProbeResult(uuid, None, evidence)


def recovery_action(handle: Any) -> int:
    """Field 230; NVMLError where the driver does not report it."""
    return int(RECOVERY_ACTION.one(handle))


def _read_topology(found: list[tuple[Gpu, Any]], notes: _Notes) -> Topology:
    """NVLinks per pair (direct, or both ends on the NVSwitch fabric) and the PCIe path."""
    by_bus = {gpu.bus_id: gpu.uuid for gpu, _ in found}
    direct: dict[tuple[str, str], int] = {}
    to_switch: dict[str, int] = {}
    for gpu, handle in found:
        for remote in _nvlink_peers(gpu, handle, notes):
            peer = by_bus.get(remote)
            if peer is None:
                # Not a GPU we see: an NVSwitch, whose GPUs all reach each other.
                to_switch[gpu.uuid] = to_switch.get(gpu.uuid, 0) + 1
            elif peer != gpu.uuid:
                direct[(gpu.uuid, peer)] = direct.get((gpu.uuid, peer), 0) + 1
    links: dict[tuple[str, str], Link] = {}
    for (a, ha), (b, hb) in itertools.combinations(found, 2):
        level = notes.optional(functools.partial(_common_ancestor, ha, hb), a.label, "PCIe topology")
        # Each end counts the same links; take the larger count in case one end cannot tell.
        nvlinks = max(direct.get((a.uuid, b.uuid), 0), direct.get((b.uuid, a.uuid), 0))
        nvlinks += min(to_switch.get(a.uuid, 0), to_switch.get(b.uuid, 0))
        links[(a.uuid, b.uuid)] = Link(nvlinks, level if level is not None else PcieLevel.SYSTEM)
    return Topology.of(links)


def _read_mig(handle: Any, label: str, total_mib: int | None, notes: _Notes) -> tuple[MigDevice, ...]:
    """The MIG devices of a GPU in MIG mode; one that cannot be read is skipped and said."""
    count = notes.optional(lambda: int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)), label, "MIG device count")
    devices = []
    for index in range(count or 0):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError as err:
            if err.value != pynvml.NVML_ERROR_NOT_FOUND:  # an empty slot is normal
                notes.problems.append(f"{label}: MIG device {index} unreadable: {err}")
            continue
        try:
            attrs = pynvml.nvmlDeviceGetAttributes(mig)
            memory = int(attrs.memorySizeMB)
            attributes = MigAttributes(
                gi_slices=int(attrs.gpuInstanceSliceCount),
                ci_slices=int(attrs.computeInstanceSliceCount),
                multiprocessors=int(attrs.multiprocessorCount),
                copy_engines=int(attrs.sharedCopyEngineCount),
                decoders=int(attrs.sharedDecoderCount),
                encoders=int(attrs.sharedEncoderCount),
                jpeg_engines=int(attrs.sharedJpegCount),
                ofa_engines=int(attrs.sharedOfaCount),
            )
            profile = profile_name(
                attributes.gi_slices, attributes.ci_slices, memory, total_mib or memory, attributes.ofa_engines
            )
            devices.append(
                MigDevice(
                    uuid=as_text(pynvml.nvmlDeviceGetUUID(mig)),
                    gpu_instance=int(pynvml.nvmlDeviceGetGpuInstanceId(mig)),
                    compute_instance=int(pynvml.nvmlDeviceGetComputeInstanceId(mig)),
                    profile=profile,
                    memory_mib=memory,
                    attributes=attributes,
                )
            )
        except pynvml.NVMLError as err:
            notes.problems.append(f"{label}: MIG device {index} unreadable: {err}")
    return tuple(devices)


def _common_ancestor(a: Any, b: Any) -> PcieLevel:
    return PcieLevel(int(pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)))


def _nvlink_peers(gpu: Gpu, handle: Any, notes: _Notes) -> list[str]:
    """Bus ids at the far end of each active NVLink of this GPU."""
    peers = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except pynvml.NVMLError as err:
            # Past the last link, or no NVLink at all: both end the walk.
            if err.value not in (*_ABSENT, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                notes.problems.append(f"{gpu.label}: NVLink {link} unreadable: {err}")
            break
        peers.append(normalize_bus_id(as_text(remote.busId)))
    return peers


def as_text(value: Any) -> str:
    """What pynvml returns as bytes or str (it depends on its version), as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    def __init__(self, sysfs_root: Path = Path("/sys"), proc_root: Path = Path("/proc")) -> None:
        self._sysfs_root = sysfs_root
        self._proc_root = proc_root
        # Which GPU a scan is reading now (index, UUID once read): what a hung scan waits on.
        self.reading: tuple[int | None, str | None] = (None, None)

    def scan(self, enumerated: Callable[[Sequence[Enumerated]], None] = lambda gpus: None) -> Scan:
        """Read every GPU and probe each once, in one NVML session. `enumerated` is handed the GPUs as soon
        as they are counted and named, before any call that reads one of them (a call that may hang in a
        failing GPU): its event watch starts there. Raises NvmlUnavailable."""
        try:
            with session():
                enumerated(self._enumerate())
                discovery = self._read_all()
                probes = []
                for gpu in discovery.gpus:
                    self.reading = (gpu.index, gpu.uuid)
                    probes.append(probe_gpu(gpu.uuid, "scan"))
        finally:
            self.reading = (None, None)
        return Scan(discovery, tuple(probes))

    def probe(self, uuid: str, evidence: str) -> ProbeResult:
        with session():
            return probe_gpu(uuid, evidence)

    def processes(self, uuid: str) -> tuple[int, ...]:
        """The pids of compute and graphics processes on the GPU (its MIG devices' too). Raises NvmlUnavailable."""
        with session():
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                found = [
                    *pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
                    *pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
                ]
            except pynvml.NVMLError as err:
                raise NvmlUnavailable(f"cannot list the processes on {uuid}: {err}") from err
        return tuple(sorted({int(p.pid) for p in found}))

    def mps_clients(self, uuid: str) -> tuple[int, ...]:
        """The pids of the MPS clients on the GPU (its MIG devices' too). Raises NvmlUnavailable."""
        with session():
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                found = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
            except pynvml.NVMLError as err:
                raise NvmlUnavailable(f"cannot list the MPS clients on {uuid}: {err}") from err
        return tuple(sorted({int(p.pid) for p in found}))

    def compute_mode(self, uuid: str) -> int:
        """The GPU's compute mode (0 default, 2 prohibited, 3 exclusive process). Raises NvmlUnavailable."""
        with session():
            try:
                return int(pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid)))
            except pynvml.NVMLError as err:
                raise NvmlUnavailable(f"cannot read the compute mode of {uuid}: {err}") from err

    def set_compute_mode(self, uuid: str, mode: int) -> None:
        """Raises NvmlUnavailable."""
        with session():
            try:
                pynvml.nvmlDeviceSetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid), mode)
            except pynvml.NVMLError as err:
                raise NvmlUnavailable(f"cannot set the compute mode of {uuid} to {mode}: {err}") from err

    def _enumerate(self) -> list[Enumerated]:
        """Each GPU's UUID by index; one that cannot be named is left to _read_all, which says why."""
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError:
            return []
        found = []
        for index in range(count):
            self.reading = (index, None)
            with contextlib.suppress(pynvml.NVMLError):
                uuid = as_text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index)))
                found.append(Enumerated(index, uuid, f"gpu {index} {uuid}"))
        return found

    def _read_all(self) -> Discovery:
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as err:
            raise NvmlUnavailable(f"NVML cannot count devices: {err}") from err
        notes = _Notes()
        driver = notes.optional(lambda: as_text(pynvml.nvmlSystemGetDriverVersion()), "NVML", "driver version")
        cuda = notes.optional(lambda: int(pynvml.nvmlSystemGetCudaDriverVersion_v2()), "NVML", "CUDA driver version")
        found: list[tuple[Gpu, Any]] = []
        lost = 0
        for index in range(count):
            self.reading = (index, None)
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                found.append((self._read_gpu(index, handle, notes), handle))
            except pynvml.NVMLError as err:
                lost += err.value == pynvml.NVML_ERROR_GPU_IS_LOST
                notes.problems.append(f"gpu {index}: skipped, its identity cannot be read: {err}")
        topology = _read_topology(found, notes)
        gpus = tuple(gpu for gpu, _ in found)
        minors = read_mig_minors(self._proc_root) if any(g.mig for g in gpus) else CapMinors()
        return Discovery(
            gpus,
            notes.summarize_absent(),
            tuple(notes.problems),
            driver,
            topology,
            minors,
            lost,
            self.driver_instance(),
            cuda,
        )

    def driver_instance(self) -> str | None:
        """The inode of /sys/module/nvidia: sysfs numbers each new node afresh, so a reloaded
        driver (which resets every GPU) shows a new one."""
        try:
            return str((self._sysfs_root / "module/nvidia").stat().st_ino)
        except OSError:
            return None

    def _read_gpu(self, index: int, handle: Any, notes: _Notes) -> Gpu:
        uuid = as_text(pynvml.nvmlDeviceGetUUID(handle))
        bus_id = normalize_bus_id(as_text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
        label = f"gpu {index} {uuid} ({bus_id})"

        def opt(read: Callable[[], T], what: str) -> T | None:
            return notes.optional(read, label, what)

        memory = opt(lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // (1 << 20), "memory")
        cc = opt(lambda: pynvml.nvmlDeviceGetCudaComputeCapability(handle), "compute capability")
        numa = self._sysfs_numa(bus_id)
        if numa is None:
            numa = opt(lambda: int(pynvml.nvmlDeviceGetNumaNodeId(handle)), "NUMA node")
        mode = opt(lambda: pynvml.nvmlDeviceGetMigMode(handle), "MIG mode")
        enabled = mode is not None and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        mig = _read_mig(handle, label, memory, notes) if enabled else None
        brand = opt(lambda: int(pynvml.nvmlDeviceGetBrand(handle)), "brand")
        arch = opt(lambda: int(pynvml.nvmlDeviceGetArchitecture(handle)), "architecture")
        return Gpu(
            uuid=uuid,
            index=index,
            bus_id=bus_id,
            minor=opt(lambda: int(pynvml.nvmlDeviceGetMinorNumber(handle)), "minor number"),
            numa_node=NO_NUMA_NODE if numa is None or numa < 0 else numa,
            name=opt(lambda: as_text(pynvml.nvmlDeviceGetName(handle)), "name"),
            memory_mib=memory,
            compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
            mig_enabled=mig is not None,
            mig=mig or (),
            mig_capable=mode is not None,
            brand=None if brand is None else _BRANDS.get(brand, "Unknown"),
            architecture=None if arch is None else _ARCHITECTURES.get(arch, "Unknown"),
            pcie_root=self._sysfs_pcie_root(bus_id),
        )

    def _sysfs_pcie_root(self, bus_id: str) -> str | None:
        """The first directory under /sys/devices on the way to the device: its root complex. The link
        in /sys/bus/pci/devices leads there through every bridge and switch in between."""
        devices = self._sysfs_root / "devices"
        try:
            path = (self._sysfs_root / "bus/pci/devices" / bus_id).resolve(strict=True)
            first = path.relative_to(devices.resolve(strict=True)).parts[0]
        except (OSError, ValueError, IndexError):
            return None
        return first if first.startswith("pci") and path.name == bus_id else None

    def _sysfs_numa(self, bus_id: str) -> int | None:
        """The kernel's view, which is what the Topology Manager uses too."""
        path = self._sysfs_root / "bus/pci/devices" / bus_id / "numa_node"
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            return None


# nvmlBrandType_t and nvmlDeviceArchitecture_t as NVIDIA's Go library names them (its DRA driver's attributes).
_BRANDS = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}
_ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}


class _Notes:
    """Collects what discovery could not read, so each GPU gets one log line."""

    def __init__(self) -> None:
        self.absent: dict[str, list[str]] = {}
        self.problems: list[str] = []

    def optional(self, read: Callable[[], T], subject: str, what: str) -> T | None:
        try:
            return read()
        except pynvml.NVMLError as err:
            if err.value in _ABSENT:
                self.absent.setdefault(subject, []).append(what)
            else:
                prefix = f"{subject}: " if subject else ""
                self.problems.append(f"{prefix}{what} unreadable: {err}")
            return None

    def summarize_absent(self) -> tuple[str, ...]:
        return tuple(f"{subject}: not reported by the driver: {', '.join(w)}" for subject, w in self.absent.items())
