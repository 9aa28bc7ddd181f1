"""The devices nvplug offers through DRA, named and described as NVIDIA's DRA driver publishes them,
so that DeviceClasses and CEL selectors written for `gpu.nvidia.com` select them unchanged."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from nvplug.config import TaintEffects
from nvplug.core.gpu import NO_NUMA_NODE, Gpu, MigDevice, uuid_of
from nvplug.core.snapshot import Snapshot
from nvplug.dra.device_taints import Taint, taints_for
from nvplug.shaping.resource_plan import Naming, device_health

GPU_TYPE = "gpu"
MIG_TYPE = "mig"
# The standard attributes (resource.kubernetes.io) for a PCI address, beside NVIDIA's own pcieBusID, and
# for what a claim aligns a GPU with a NIC or CPUs on: its PCIe root complex and its NUMA node.
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"
# The API's limits: a string attribute's length, and a device's attributes and capacities together.
MAX_STRING = 64
MAX_FIELDS = 32
# The taints' effects where the config says nothing: NVIDIA's DRA driver's.
NVIDIA_EFFECTS = TaintEffects()

# An attribute value as the API types it: ("string", "gpu"), ("int", 3), ("version", "12.4.0"), ("bool", True).
Value = tuple[str, str | int | bool]


@dataclass(frozen=True)
class DraDevice:
    """One device of the node's pool: a whole GPU, or a MIG device when the MIG strategy offers those."""

    name: str
    gpu: Gpu
    mig: MigDevice | None
    healthy: bool
    # Why it is not healthy, for a claim that names it.
    reason: str
    attributes: Mapping[str, Value]
    capacity: Mapping[str, str]
    # What its slice says of its health, where the API server keeps taints.
    taints: tuple[Taint, ...] = ()

    @property
    def uuid(self) -> str:
        return uuid_of(self.gpu, self.mig)


def offered(snapshot: Snapshot, naming: Naming, effects: TaintEffects = NVIDIA_EFFECTS) -> list[DraDevice]:
    """The pool: each GPU given to DRA whole, or its MIG devices under migStrategy single or mixed."""
    out = []
    unchecked = hung_gpus(snapshot)
    for gpu in snapshot.gpus:
        if not naming.dra_owns(gpu):
            continue
        units = gpu.mig if gpu.mig_enabled and naming.strategy != "none" else (None,)
        for mig in units:
            health = device_health(snapshot, gpu, mig)
            if health is None:
                continue
            if health.healthy:
                # A claim's MPS group serves it: its daemon down is its fault too (a probe-class one).
                health = snapshot.mps_units.get(uuid_of(gpu, mig), health)
            attributes = _common(snapshot, gpu) | (_mig_attributes(gpu, mig) if mig else _gpu_attributes(gpu))
            out.append(
                DraDevice(
                    name=device_name(gpu, mig),
                    gpu=gpu,
                    mig=mig,
                    healthy=health.healthy,
                    reason=health.reason,
                    attributes=attributes,
                    capacity=_capacity(gpu, mig),
                    taints=taints_for(health, gpu.uuid in unchecked or None in unchecked, effects),
                )
            )
    return out


def hung_gpus(snapshot: Snapshot) -> set[str | None]:
    """The GPUs an NVML call on hangs, by UUID; None in it: a call that names no GPU (every GPU unchecked)."""
    by_index = {g.index: g.uuid for g in snapshot.gpus}
    # A call names its GPU by UUID, or (a scan) by index.
    return {c.uuid or (by_index.get(c.index) if c.index is not None else None) for c in snapshot.hung_calls.values()}


def device_name(gpu: Gpu, mig: MigDevice | None) -> str:
    """`gpu-<minor>`, `gpu-<minor>-mig-<profile>-<gi>-<ci>`: DNS labels, as NVIDIA's driver names them."""
    base = f"gpu-{gpu.minor if gpu.minor is not None else gpu.index}"
    if mig is None:
        return base
    profile = re.sub(r"[^a-z0-9-]", "-", mig.profile.lower().replace(".", ""))
    return f"{base}-mig-{profile}-{mig.gpu_instance}-{mig.compute_instance}"


def semver(text: str | None) -> str | None:
    """`550.54.15`, `9.0` -> `9.0.0`; what NVIDIA's driver publishes as a version (leading zeros dropped)."""
    if not text:
        return None
    parts = text.split(".")
    if len(parts) > 3 or not all(p.isascii() and p.isdigit() for p in parts):
        return None
    return ".".join(str(int(p)) for p in [*parts, "0", "0"][:3])


def _common(snapshot: Snapshot, gpu: Gpu) -> dict[str, Value]:
    """What a GPU and its MIG devices share: the model, the driver, the PCI address."""
    out: dict[str, Value] = {}
    strings = (
        ("productName", gpu.name),
        ("brand", gpu.brand),
        ("architecture", gpu.architecture),
        ("pcieBusID", gpu.bus_id),
        (PCI_BUS_ID, gpu.bus_id),
    )
    for key, text in strings:
        if text:
            out[key] = ("string", text[:MAX_STRING])
    if gpu.pcie_root:
        out[PCIE_ROOT] = ("string", gpu.pcie_root)
    # None for a GPU without NUMA affinity: -1 would match every other such device in matchAttribute.
    if gpu.numa_node != NO_NUMA_NODE:
        out[NUMA_NODE] = ("int", gpu.numa_node)
    cc = gpu.compute_capability
    cuda = snapshot.cuda_version
    versions = (
        ("cudaComputeCapability", semver(f"{cc[0]}.{cc[1]}") if cc else None),
        ("driverVersion", semver(snapshot.driver_version)),
        ("cudaDriverVersion", semver(f"{cuda // 1000}.{cuda % 1000 // 10}") if cuda else None),
    )
    for key, version in versions:
        if version:
            out[key] = ("version", version)
    return out


def _gpu_attributes(gpu: Gpu) -> dict[str, Value]:
    out: dict[str, Value] = {"type": ("string", GPU_TYPE), "uuid": ("string", gpu.uuid), "index": ("int", gpu.index)}
    if gpu.minor is not None:
        out["minor"] = ("int", gpu.minor)
    return out


def _mig_attributes(gpu: Gpu, mig: MigDevice) -> dict[str, Value]:
    out: dict[str, Value] = {
        "type": ("string", MIG_TYPE),
        "uuid": ("string", mig.uuid),
        "profile": ("string", mig.profile),
        "parentUUID": ("string", gpu.uuid),
        "parentIndex": ("int", gpu.index),
        # The MIG device's place on its GPU: the `gpu:mig` index the device plugin uses.
        "index": ("int", gpu.mig.index(mig)),
    }
    if gpu.minor is not None:
        out["parentMinor"] = ("int", gpu.minor)
    return out


def _capacity(gpu: Gpu, mig: MigDevice | None) -> dict[str, str]:
    memory = mig.memory_mib if mig is not None else gpu.memory_mib
    out = {"memory": f"{memory}Mi"} if memory else {}
    attrs = mig.attributes if mig is not None else None
    if attrs is not None:
        out |= {
            "multiprocessors": str(attrs.multiprocessors),
            "copyEngines": str(attrs.copy_engines),
            "decoders": str(attrs.decoders),
            "encoders": str(attrs.encoders),
            "jpegEngines": str(attrs.jpeg_engines),
            "ofaEngines": str(attrs.ofa_engines),
        }
    return out


def without_effect_none(device: DraDevice) -> DraDevice:
    """The device without its taints of effect None, for a server that takes no such effect (before 1.35)."""
    return replace(device, taints=tuple(t for t in device.taints if t.effect != "None"))
