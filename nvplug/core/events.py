"""Typed events: what sources tell the core. Small, frozen, and free of I/O handles."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from nvplug.core.gpu import Gpu
from nvplug.core.health import Clears, Fault
from nvplug.core.mig import CapMinors
from nvplug.core.topology import Topology


@dataclass(frozen=True)
class ProbeResult:
    """One probe of one GPU: handle, UUID, PCI info, pending retirements and remaps."""

    source: ClassVar[str] = "nvml"

    uuid: str
    failure: str | None  # None: the probe passed
    # What prompted the probe, told to the operator when the GPU recovers.
    evidence: str = "probe"
    # What would clear the failure: a pending repair (retired pages, remapped rows) needs a reset.
    clears: Clears = Clears.PROBE
    # NVML's recovery action (field 230) as the probe read it; 0 when none or not reported.
    recovery_action: int = 0
    # What kind of failure: a GPU NVML cannot read is lost; a call that does not return, unmonitored.
    fault: Fault = Fault.OTHER
    # When its reads began (time.monotonic()): word on the GPU that arrived later may be newer than
    # what it read. None: no older than its own arrival.
    started: float | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None


@dataclass(frozen=True)
class InventoryFound:
    """A full scan: these GPUs are present, any other is gone, each probed once."""

    source: ClassVar[str] = "nvml"

    gpus: tuple[Gpu, ...]
    probes: tuple[ProbeResult, ...] = ()
    topology: Topology = field(default_factory=Topology)
    cap_minors: CapMinors = field(default_factory=CapMinors)
    # GPUs still counted by NVML but lost: ones we knew stay, Unhealthy, rather than vanish.
    lost: int = 0
    # Which load of the kernel driver this is; a new one means every GPU was reset. None: unknown.
    driver_instance: str | None = None
    # Devices (GPU or MIG UUIDs) that Allocate could not hand out, and why.
    unready: Mapping[str, str] = field(default_factory=dict)
    # The driver's version as NVML reports it (550.54.15); None where it cannot.
    driver_version: str | None = None
    # The CUDA version the driver supports, as NVML encodes it (12040 is 12.4).
    cuda_version: int | None = None
    # When the scan began (time.monotonic()): a GPU whose PCI device udev removed later was read before
    # it went, and is not brought back. None: no older than its own arrival.
    started: float | None = None


@dataclass(frozen=True)
class NvmlFailed:
    """NVML cannot be used at all; the error text is the library's."""

    source: ClassVar[str] = "nvml"

    reason: str


@dataclass(frozen=True)
class HealthReported:
    """Direct evidence of a fault of one GPU (lost, ECC, poison), with the reason."""

    source: ClassVar[str] = "nvml"

    uuid: str
    reason: str
    # ECC and poison need a reset; a GPU that only went unreachable clears on a passing probe.
    clears: Clears = Clears.RESET
    fault: Fault = Fault.OTHER


@dataclass(frozen=True)
class EvidenceFound:
    """Evidence that a GPU was repaired, from outside NVML: an operator's heal, a reset nvplug ran."""

    source: ClassVar[str] = "operator"

    uuid: str
    evidence: str


@dataclass(frozen=True)
class XidOccurred:
    """An XID critical error; the XID policy decides what it means."""

    source: ClassVar[str] = "nvml"

    uuid: str
    code: int
    gpu_instance: int | None = None
    compute_instance: int | None = None


@dataclass(frozen=True)
class RecoveryActionChanged:
    """NVML's GPU recovery action (field 230): 0 means nothing is needed any more."""

    source: ClassVar[str] = "nvml"

    uuid: str
    action: int


@dataclass(frozen=True)
class MigConfigChanged:
    """NVML says a GPU's MIG layout changed: its MIG devices must be read again."""

    source: ClassVar[str] = "nvml"

    uuid: str


@dataclass(frozen=True)
class HealthWatchChanged:
    """Whether health events can be received at all; `error` None means they can."""

    source: ClassVar[str] = "nvml"

    error: str | None


@dataclass(frozen=True)
class KubeletSocketCreated:
    """A (new) kubelet.sock appeared: the kubelet started or restarted."""

    source: ClassVar[str] = "kubelet_dir"


@dataclass(frozen=True)
class PluginSocketRemoved:
    """One of our own sockets vanished, as when the kubelet restarts."""

    source: ClassVar[str] = "kubelet_dir"

    path: str


@dataclass(frozen=True)
class NotesChanged:
    """A part's notes for the status line changed outside a dispatch (a retry wrote the CDI spec, a
    registration flipped, DRA's slices went out): work for the status report, never counted, no state."""

    source: ClassVar[str] = "daemon"


@dataclass(frozen=True)
class PciChanged:
    """A udev event for an NVIDIA (vendor 0x10DE) PCI device."""

    source: ClassVar[str] = "udev"

    action: str  # add, remove, bind, unbind or change
    bus_id: str  # normalised, e.g. 0000:18:00.0
    driver: str | None = None  # e.g. nvidia, once bound
    pci_id: str = ""  # VENDOR:DEVICE, e.g. 10DE:2330


@dataclass(frozen=True)
class CdiChecked:
    """The CDI spec was written (or not): devices whose CDI names would not resolve, and why; and
    the names every container also gets (its optional classes, IMEX channels)."""

    source: ClassVar[str] = "nvplug"

    unresolved: Mapping[str, str] = field(default_factory=dict)
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeviceNodesChanged:
    """The NVIDIA device nodes under the dev root changed: these exist now, as a container names them."""

    source: ClassVar[str] = "dev"

    present: frozenset[str]  # e.g. /dev/nvidia3, /dev/nvidia-caps/nvidia-cap21


@dataclass(frozen=True)
class WatchedDirChanged:
    """A directory we serve sockets in (device plugins, plugins_registry, the DRA plugin's) went or came back."""

    source: ClassVar[str] = "kubelet_dir"

    path: str
    exists: bool


@dataclass(frozen=True)
class KernelXid:
    """An Xid the driver printed to the kernel log (`NVRM: Xid (PCI:0000:18:00): 79, ...`)."""

    source: ClassVar[str] = "kernel_log"

    bus_id: str  # normalised, with the function the line leaves out: 0000:18:00.0
    code: int
    message: str  # the record's text after "NVRM: "
    seq: int
    # From the log as it stood when we started: before this start, perhaps before this driver load.
    replayed: bool = False
    # Xid 154: the recovery action it changed to; None for other codes or where it cannot be read.
    recovery_action: int | None = None


@dataclass(frozen=True)
class GpuFellOffBus:
    """`NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.`, which may come with no Xid 79 and no NVML event."""

    source: ClassVar[str] = "kernel_log"

    bus_id: str
    seq: int
    replayed: bool = False


@dataclass(frozen=True)
class DriverLoaded:
    """`NVRM: loading NVIDIA UNIX ... Kernel Module ...`: faults printed before it were of the previous load."""

    source: ClassVar[str] = "kernel_log"

    version: str
    seq: int
    replayed: bool = False


@dataclass(frozen=True)
class GpuNamedInLog:
    """`NVRM: GPU at PCI:0000:03:00: GPU-<uuid>`: the driver ties an address to a UUID."""

    source: ClassVar[str] = "kernel_log"

    bus_id: str
    uuid: str
    seq: int
    replayed: bool = False


@dataclass(frozen=True)
class SwitchXid:
    """An NVSwitch SXid (`nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 12028, ...`): a fabric signal, no GPU fault."""

    source: ClassVar[str] = "kernel_log"

    switch: str  # nvidia-nvswitch3
    bus_id: str
    code: int
    message: str
    seq: int
    replayed: bool = False


@dataclass(frozen=True)
class KernelLogLost:
    """Records the reader never saw: the ring buffer overran it (EPIPE), or `seq` jumped."""

    source: ClassVar[str] = "kernel_log"

    count: int | None  # None where unknown
    why: str


@dataclass(frozen=True)
class KernelLogState:
    """Whether the kernel log can be read; `error` None means it can."""

    source: ClassVar[str] = "kernel_log"

    error: str | None


@dataclass(frozen=True)
class NvmlCallHung:
    """An NVML call past its deadline (reported), past the hang limit (its GPU Unhealthy), or returned."""

    source: ClassVar[str] = "nvml"

    number: int  # tells one hung call from another
    call: str  # scan, probe, processes
    uuid: str | None  # the GPU it is for, where known
    index: int | None  # the GPU a scan was reading, where its UUID is not known
    since: float  # wall-clock seconds
    seconds: float
    past_limit: bool  # past nvplug.health.driverHangSeconds
    returned: bool = False


@dataclass(frozen=True)
class AutoResetStep:
    """A step of nvplug's own reset of a GPU (nvplug.health.autoReset), taken or refused."""

    source: ClassVar[str] = "auto_reset"

    uuid: str
    # waiting, refused, reset, checked, failed, budget spent
    step: str
    detail: str
    at: float  # wall-clock seconds


@dataclass(frozen=True)
class MpsGroupChanged:
    """An MPS group's control daemon: up and answering with its defaults set, or not (and why)."""

    source: ClassVar[str] = "mps"

    group: str
    resource: str
    units: tuple[str, ...]  # the UUIDs of its GPUs or its MIG device
    ready: bool
    reason: str
    pid: int | None = None
    restarts: int = 0
    # The defaults its servers start with: the SMs' share, and MiB of device memory per unit.
    thread_percentage: int = 100
    pinned_mib: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class MpsGroupRemoved:
    """An MPS group the config or the inventory no longer has, its daemon stopped."""

    source: ClassVar[str] = "mps"

    group: str


@dataclass(frozen=True)
class ComputeModeRecorded:
    """The compute mode a GPU had before nvplug set it for MPS (to restore it, after a crash too); None: restored."""

    source: ClassVar[str] = "mps"

    uuid: str
    original: int | None


Event = (
    InventoryFound
    | ProbeResult
    | NvmlFailed
    | HealthReported
    | EvidenceFound
    | XidOccurred
    | RecoveryActionChanged
    | MigConfigChanged
    | HealthWatchChanged
    | KubeletSocketCreated
    | PluginSocketRemoved
    | NotesChanged
    | PciChanged
    | CdiChecked
    | DeviceNodesChanged
    | WatchedDirChanged
    | KernelXid
    | GpuFellOffBus
    | DriverLoaded
    | GpuNamedInLog
    | SwitchXid
    | KernelLogLost
    | KernelLogState
    | NvmlCallHung
    | AutoResetStep
    | MpsGroupChanged
    | MpsGroupRemoved
    | ComputeModeRecorded
)
