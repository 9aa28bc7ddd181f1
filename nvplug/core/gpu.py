"""The static facts about one GPU, as discovered."""

from __future__ import annotations

from dataclasses import dataclass

NO_NUMA_NODE = -1


@dataclass(frozen=True)
class MigAttributes:
    """What NVML's device attributes say of a MIG device: its slices, SMs and engines."""

    gi_slices: int
    ci_slices: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int


@dataclass(frozen=True)
class MigDevice:
    """One MIG device: a GPU instance with one compute instance, on its parent GPU."""

    uuid: str
    gpu_instance: int
    compute_instance: int
    profile: str  # e.g. 1g.10gb, 1g.10gb.me, 3g.40gb
    memory_mib: int | None = None
    attributes: MigAttributes | None = None


@dataclass(frozen=True)
class Gpu:
    """One physical GPU. Fields the driver cannot report are None."""

    uuid: str
    index: int
    bus_id: str
    minor: int | None = None
    numa_node: int = NO_NUMA_NODE
    name: str | None = None
    memory_mib: int | None = None
    compute_capability: tuple[int, int] | None = None
    # MIG mode as the driver reports it now, and the MIG devices it holds.
    mig_enabled: bool = False
    mig: tuple[MigDevice, ...] = ()
    # Whether the GPU can do MIG at all (NVML reports a MIG mode for it).
    mig_capable: bool = False
    # As NVIDIA's tools spell them (Tesla, Nvidia; Hopper, Ada Lovelace): DRA device attributes.
    brand: str | None = None
    architecture: str | None = None
    # The PCIe root complex it sits under, as sysfs names it (`pci0000:15`): a NIC under the same
    # root is the one to pair it with.
    pcie_root: str | None = None

    @property
    def label(self) -> str:
        """How logs and errors name this GPU."""
        return f"gpu {self.index} {self.uuid} ({self.bus_id})"

    @property
    def device_node(self) -> str | None:
        return None if self.minor is None else f"/dev/nvidia{self.minor}"


def uuid_of(gpu: Gpu, mig: MigDevice | None) -> str:
    """The UUID of a device as a container sees it: the MIG device's, or the whole GPU's."""
    return mig.uuid if mig is not None else gpu.uuid


def normalize_bus_id(bus_id: str) -> str:
    """NVML writes `00000000:18:00.0`; sysfs and logs use `0000:18:00.0`."""
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    if not rest:
        return bus_id
    return f"{int(domain, 16):04x}:{rest}"
