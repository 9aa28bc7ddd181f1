"""NVIDIA's sections of the config (k8s-device-plugin config v1): `flags`, `resources`, `sharing`, `imex`.

Frozen dataclasses whose fields declare the file's keys (see schema.py), with NVIDIA's defaults;
`flags.gfd` is checked and dropped, it configures GPU Feature Discovery. nvplug's own keys are model.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from nvplug.config.schema import Key, key
from nvplug.config.value_readers import (
    MAX_REPLICAS,
    Devices,
    annotation_prefix,
    any_string,
    boolean,
    channel_ids,
    choice,
    choices,
    file_path,
    go_duration,
    int_range,
    resource_name,
    shared_devices,
    string,
    string_list,
)

MigStrategy = Literal["none", "single", "mixed"]
DeviceListStrategy = Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]
DeviceIDStrategy = Literal["uuid", "index"]
SharedPolicy = Literal["distributed", "packed"]
DeviceDiscoveryStrategy = Literal["auto", "nvml", "tegra"]
SharingStrategy = Literal["none", "time-slicing", "mps"]

GPU_RESOURCE = "nvidia.com/gpu"
SHARED_SUFFIX = ".shared"


@dataclass(frozen=True)
class PluginFlags:
    """`flags.plugin`: NVIDIA's device-plugin-only options."""

    # NVIDIA's default is off; a host service hands out the device nodes itself.
    pass_device_specs: bool = field(
        default=True, metadata=key("passDeviceSpecs", "hand out the GPUs' device nodes with each allocation", boolean)
    )
    device_list_strategy: tuple[DeviceListStrategy, ...] = field(
        default=("envvar",),
        metadata=key("deviceListStrategy", "how containers are told their devices", choices(DeviceListStrategy)),
    )
    device_id_strategy: DeviceIDStrategy = field(
        default="uuid", metadata=key("deviceIDStrategy", "name devices by UUID or index", choice(DeviceIDStrategy))
    )
    cdi_annotation_prefix: str = field(
        default="cdi.k8s.io/",
        metadata=key("cdiAnnotationPrefix", "the prefix of CDI annotation keys", annotation_prefix),
    )
    nvidia_ctk_path: str = field(
        default="/usr/bin/nvidia-ctk", metadata=key("nvidiaCTKPath", "the nvidia-ctk binary", file_path)
    )
    container_driver_root: str = field(
        default="/driver-root",
        metadata=key("containerDriverRoot", "where the driver root is inside NVIDIA's container", file_path),
    )
    # Newer NVIDIA releases; None/empty: not set.
    kubelet_socket: str | None = field(
        default=None, metadata=key("kubeletSocket", "the kubelet's device plugin socket", file_path)
    )
    cdi_feature_flags: tuple[str, ...] = field(
        default=(), metadata=key("cdiFeatureFlags", "NVIDIA's feature flags for generating CDI specs", string_list)
    )
    # How GetPreferredAllocation places replicas: spread over the least-used GPUs, or packed onto few.
    # None: not set (Config.shared_policy says what is in force).
    shared_devices_allocation_policy: SharedPolicy | None = field(
        default=None,
        metadata=key("sharedDevicesAllocationPolicy", "spread replicas over GPUs or pack them", choice(SharedPolicy)),
    )


@dataclass(frozen=True)
class GfdOptions:
    """`flags.gfd`: GPU Feature Discovery's options, checked so typos show, then dropped."""

    oneshot: bool = field(default=False, metadata=key("oneshot", "label once and exit", boolean))
    no_timestamp: bool = field(default=False, metadata=key("noTimestamp", "leave out the timestamp label", boolean))
    sleep_interval: str | None = field(
        default=None, metadata=key("sleepInterval", "time between labellings", go_duration)
    )
    output_file: str | None = field(default=None, metadata=key("outputFile", "where GFD writes its labels", any_string))
    machine_type_file: str | None = field(
        default=None, metadata=key("machineTypeFile", "where the machine type is read", any_string)
    )


@dataclass(frozen=True)
class Flags:
    """`flags`: options NVIDIA shares between the device plugin and GPU Feature Discovery."""

    mig_strategy: MigStrategy = field(
        default="none", metadata=key("migStrategy", "how MIG devices are offered", choice(MigStrategy))
    )
    fail_on_init_error: bool = field(
        default=True, metadata=key("failOnInitError", "NVIDIA's exit when NVML fails; nvplug always retries", boolean)
    )
    mps_root: str | None = field(
        default=None, metadata=key("mpsRoot", "NVIDIA's: where MPS control daemons keep their state", file_path)
    )
    nvidia_driver_root: str = field(
        default="/", metadata=key("nvidiaDriverRoot", "where the driver is installed", file_path)
    )
    # When the file leaves it out: the driver root, as NVIDIA does.
    nvidia_dev_root: str = field(
        default="/", metadata=key("nvidiaDevRoot", "where the driver's /dev nodes are", file_path)
    )
    gdrcopy_enabled: bool = field(default=False, metadata=key("gdrcopyEnabled", "hand out the GDRCopy device", boolean))
    gds_enabled: bool = field(default=False, metadata=key("gdsEnabled", "hand out GPUDirect Storage", boolean))
    mofed_enabled: bool = field(
        default=False, metadata=key("mofedEnabled", "hand out the MOFED (RDMA) devices", boolean)
    )
    use_node_feature_api: bool = field(
        default=False, metadata=key("useNodeFeatureAPI", "NVIDIA's: publish labels as NodeFeature objects", boolean)
    )
    device_discovery_strategy: DeviceDiscoveryStrategy = field(
        default="auto",
        metadata=key("deviceDiscoveryStrategy", "NVIDIA's: how GPUs are found", choice(DeviceDiscoveryStrategy)),
    )
    plugin: PluginFlags = field(
        default_factory=PluginFlags, metadata=key("plugin", "device-plugin-only options", section=PluginFlags)
    )

    dropped_keys: ClassVar[tuple[Key, ...]] = (
        Key("gfd", "GPU Feature Discovery's options, checked and dropped", section=GfdOptions),
    )


@dataclass(frozen=True)
class ResourcePattern:
    """Devices whose product name (MIG: profile) matches `pattern` are advertised as `name`; first match wins.
    The pattern is NVIDIA's: `*` is any text, and it may match anywhere in the name (see selection.py)."""

    pattern: str = field(metadata=key("pattern", "the product name or MIG profile to match", string, required=True))
    name: str = field(metadata=key("name", "the resource the devices are advertised as", resource_name, required=True))
    # Where the entry is in the file, for messages about it.
    where: str = field(default="", compare=False)


@dataclass(frozen=True)
class Resources:
    gpus: tuple[ResourcePattern, ...] = field(
        default=(ResourcePattern("*", GPU_RESOURCE),),
        metadata=key("gpus", "resource names of whole GPUs", entries=ResourcePattern),
    )
    # Empty: MIG devices get NVIDIA's names from their profile (nvidia.com/mig-1g.10gb).
    mig: tuple[ResourcePattern, ...] = field(
        default=(), metadata=key("mig", "resource names of MIG devices", entries=ResourcePattern)
    )


@dataclass(frozen=True)
class ReplicatedResource:
    # NVIDIA's order in the file is name, rename, devices, replicas; the fields keep theirs for callers.
    name: str = field(metadata=key("name", "the resource to share", resource_name, required=True))
    replicas: int = field(
        metadata=key(
            "replicas",
            "how many replicas of each device",
            int_range(1, MAX_REPLICAS, "a number of replicas"),
            required=True,
            last=True,
        )
    )
    # Filled in as `<name>.shared` when renameByDefault is on and no rename is given.
    rename: str | None = field(
        default=None, metadata=key("rename", "the name the replicas are advertised as", resource_name)
    )
    devices: Devices = field(default="all", metadata=key("devices", "which devices are shared", shared_devices))
    # Where the entry is in the file, for messages about it.
    where: str = field(default="", compare=False)

    @property
    def advertised_name(self) -> str:
        return self.rename or self.name


@dataclass(frozen=True)
class ReplicatedResources:
    """`sharing.timeSlicing` or `sharing.mps`."""

    rename_by_default: bool = field(
        default=False, metadata=key("renameByDefault", "advertise replicas as <name>.shared", boolean)
    )
    fail_requests_greater_than_one: bool = field(
        default=False, metadata=key("failRequestsGreaterThanOne", "refuse requests for more than one replica", boolean)
    )
    # Read after the other keys, as they always were; config show writes them last.
    resources: tuple[ReplicatedResource, ...] = field(
        default=(),
        metadata=key("resources", "the shared resources", entries=ReplicatedResource, late=True, shown_last=True),
    )
    # Also accepted here, beside NVIDIA's flags.plugin.sharedDevicesAllocationPolicy; None: not set.
    shared_devices_allocation_policy: SharedPolicy | None = field(
        default=None,
        metadata=key("sharedDevicesAllocationPolicy", "spread replicas over GPUs or pack them", choice(SharedPolicy)),
    )


@dataclass(frozen=True)
class Sharing:
    time_slicing: ReplicatedResources = field(
        default_factory=ReplicatedResources,
        metadata=key("timeSlicing", "GPUs shared by time-slicing", section=ReplicatedResources),
    )
    mps: ReplicatedResources = field(
        default_factory=ReplicatedResources, metadata=key("mps", "GPUs shared through MPS", section=ReplicatedResources)
    )

    @property
    def strategy(self) -> SharingStrategy:
        if self.mps.resources:
            return "mps"
        if self.time_slicing.resources:
            return "time-slicing"
        return "none"

    @property
    def replicated(self) -> ReplicatedResources:
        """The settings of the strategy in force (time-slicing's when none is)."""
        return self.mps if self.strategy == "mps" else self.time_slicing


@dataclass(frozen=True)
class Imex:
    channel_ids: tuple[int, ...] = field(
        default=(), metadata=key("channelIDs", "the IMEX channels handed out", channel_ids)
    )
    required: bool = field(default=False, metadata=key("required", "fail when the IMEX channels are missing", boolean))
