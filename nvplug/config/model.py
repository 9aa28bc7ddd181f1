"""The config's model: frozen dataclasses whose fields declare the file's keys (see schema.py).

nvplug's own settings live under `nvplug:` (here); Config keeps them as flat fields, beside NVIDIA's
sections of k8s-device-plugin config v1 (nvidia_sections.py), which keep NVIDIA's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nvplug.config.nvidia_sections import Flags, Imex, Resources, SharedPolicy, Sharing
from nvplug.config.schema import declared, key
from nvplug.config.selectors import DeviceFilter, Selector, read_selectors, selector_texts
from nvplug.config.value_readers import (
    absolute_path,
    absolute_paths,
    boolean,
    choice,
    command_line,
    dns_subdomain,
    driver_name,
    int_range,
    kubeconfig_choice,
    listen_address,
    memory_size,
    off_or_absolute,
    positive_rate,
    positive_seconds,
    resource_name,
    resource_names,
    seconds_or_zero,
    xid_list,
)

DEFAULT_PATH = Path("/etc/nvplug/config.yaml")
# Root-only by default: a unix socket in the unit's RuntimeDirectory.
DEFAULT_STATUS_LISTEN = "unix:/run/nvplug/status.sock"
# Where runtimes read generated CDI specs; cleared at boot, as a generated spec should be.
DEFAULT_CDI_SPEC_DIR = "/var/run/cdi"
# Where the container runtimes read CDI specs (containerd's and CRI-O's cdi_spec_dirs, podman's), lowest
# priority first: a name in /var/run/cdi overrides /etc/cdi's.
DEFAULT_CDI_RUNTIME_DIRS = ("/etc/cdi", "/var/run/cdi")
# Node Feature Discovery's worker reads every file here; GFD's is `gfd`, ours `nvplug`.
DEFAULT_FEATURE_FILE = "/etc/kubernetes/node-feature-discovery/features.d/nvplug"
# The kubelet's PodResources API: which pod holds which device.
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
# DRA: NVIDIA's driver name, and where the kubelet looks for plugins.
DEFAULT_DRA_DRIVER = "gpu.nvidia.com"
DEFAULT_DRA_KUBECONFIG = "/etc/nvplug/kubeconfig"
# The kubelet's own kubeconfig (kubeadm's, then others'), and the certificate it rotates.
KUBELET_KUBECONFIGS = ("/etc/kubernetes/kubelet.conf", "/var/lib/kubelet/kubeconfig")
DEFAULT_KUBELET_CERTIFICATE = "/var/lib/kubelet/pki/kubelet-client-current.pem"
DEFAULT_PLUGINS_REGISTRY = "/var/lib/kubelet/plugins_registry"
DEFAULT_KUBELET_PLUGINS = "/var/lib/kubelet/plugins"
# MPS: each group's pipe and log directories, and the clients' shm, under here; every parent
# traversable by any UID, since a server runs as its client's UID (NVIDIA's #762).
DEFAULT_MPS_ROOT = "/run/nvplug/mps"
# The control binary, under the driver root.
MPS_CONTROL = "/usr/bin/nvidia-cuda-mps-control"
# NVIDIA's v1 sections, plus our own under `nvplug:`.
SECTIONS = ("version", "flags", "resources", "sharing", "imex", "nvplug")

AutoResetMode = Literal["off", "idle"]
MetricNaming = Literal["dcgm", "nvplug"]
# The pod labels' names: dcgm-exporter's, or those of its --use-old-namespace (pod_name, pod_namespace,
# container_name), which older dashboards filter on.
PodLabelNames = Literal["current", "legacy"]
# Where the kubelet keeps its pod and container log records, which name the pods of GPU processes.
DEFAULT_POD_LOG_ROOT = "/var/log"


@dataclass(frozen=True)
class HealthConfig:
    """nvplug.health: which XIDs count, and how Unhealthy GPUs are re-probed."""

    ignore_xids: frozenset[int] = field(
        default=frozenset(), metadata=key("ignoreXids", "XIDs that keep the GPU Healthy (logged only)", xid_list)
    )
    fatal_xids: frozenset[int] = field(
        default=frozenset(), metadata=key("fatalXids", "XIDs that make the GPU Unhealthy", xid_list)
    )
    # Re-probes of Unhealthy GPUs only: first after this long, doubling up to the maximum.
    reprobe_initial_seconds: float = field(
        default=30.0,
        metadata=key("reprobeInitialSeconds", "seconds to the first re-probe of an Unhealthy GPU", positive_seconds),
    )
    reprobe_max_seconds: float = field(
        default=600.0, metadata=key("reprobeMaxSeconds", "the longest wait between re-probes", positive_seconds)
    )
    # The driver prints every Xid there, also those NVML drops or fires before we start.
    kernel_log: bool = field(
        default=True, metadata=key("kernelLog", "read the driver's faults from the kernel log (/dev/kmsg)", boolean)
    )
    nvml_call_deadline_seconds: float = field(
        default=10.0,
        metadata=key("nvmlCallDeadlineSeconds", "an NVML call running longer is reported as hung", positive_seconds),
    )
    driver_hang_seconds: float = field(
        default=60.0,
        metadata=key("driverHangSeconds", "a GPU whose NVML call hangs this long turns Unhealthy", positive_seconds),
    )
    # At boot the kubelet fails the pods bound to the node if the GPUs are not listed when it admits them:
    # READY=1 (which the kubelet's start waits for) is held while the driver is not loaded yet.
    driver_wait_seconds: float = field(
        default=60.0,
        metadata=key(
            "driverWaitSeconds",
            "at start, how long READY=1 waits for a driver not loaded yet (0: not)",
            seconds_or_zero,
        ),
    )
    # Opt-in: a GPU whose faults ask only for a reset, and that nothing uses, is reset by nvplug.
    auto_reset: AutoResetMode = field(
        default="off",
        metadata=key("autoReset", "reset idle GPUs whose faults ask for a GPU reset", choice(AutoResetMode)),
    )
    auto_reset_quiet_seconds: float = field(
        default=60.0,
        metadata=key("autoResetQuietSeconds", "how long a GPU stays unused before nvplug resets it", positive_seconds),
    )
    allow_fabric_reset: bool = field(
        default=False,
        metadata=key("allowFabricReset", "also reset GPUs with NVLinks (Fabric Manager may need to act)", boolean),
    )
    validate_command: tuple[str, ...] = field(
        default=(),
        metadata=key("validateCommand", "a check that must pass after a reset (none by default)", command_line),
    )
    validate_timeout_seconds: float = field(
        default=600.0,
        metadata=key("validateTimeoutSeconds", "how long the check after a reset may run", positive_seconds),
    )
    resets_per_hour: int = field(
        default=3, metadata=key("resetsPerHour", "nvplug's own resets of one GPU per hour", int_range(1, 60, "a count"))
    )


TaintEffect = Literal["None", "NoSchedule", "NoExecute"]


@dataclass(frozen=True)
class TaintEffects:
    """nvplug.dra.taintEffect: the effect of each kind of device taint (NoExecute evicts the pods on it)."""

    # NVIDIA's DRA driver's defaults: the scheduler keeps new claims off a broken GPU, pods stay.
    xid: TaintEffect = field(
        default="NoSchedule", metadata=key("xid", "an Xid that takes the GPU out", choice(TaintEffect))
    )
    gpu_lost: TaintEffect = field(
        default="NoSchedule", metadata=key("gpuLost", "a GPU the driver cannot reach", choice(TaintEffect))
    )
    unmonitored: TaintEffect = field(
        default="None", metadata=key("unmonitored", "a GPU nvplug cannot check", choice(TaintEffect))
    )
    unhealthy: TaintEffect = field(
        default="NoSchedule",
        metadata=key("unhealthy", "any other fault (ECC, a pending repair, ...)", choice(TaintEffect)),
    )


@dataclass(frozen=True)
class TelemetryConfig:
    """nvplug.telemetry: GPU figures on /metrics, per GPU and per container."""

    # dcgm: dcgm-exporter's names and units before its 4.9.0 renames, for the dashboards built on them.
    naming: MetricNaming = field(
        default="dcgm", metadata=key("naming", "the metric names: dcgm or nvplug", choice(MetricNaming))
    )
    log_root: str = field(
        default=DEFAULT_POD_LOG_ROOT,
        metadata=key("podLogRoot", "where the kubelet's pods/ and containers/ log records are", absolute_path),
    )
    # dcgm-exporter's --kubernetes: each device's series once per container that holds it, with its pod's
    # labels. Off by default: a GPU shared by two pods then has two of each, and a sum over them counts it twice.
    pod_labels: bool = field(
        default=False,
        metadata=key("podLabels", "the dcgm naming's device series carry the pods that hold the device", boolean),
    )
    # dcgm-exporter's --kubernetes-enable-pod-uid: a pod made again under its name is told apart.
    pod_uid: bool = field(
        default=False, metadata=key("podUid", "the series with pod labels carry the pod's UID (pod_uid)", boolean)
    )
    pod_label_names: PodLabelNames = field(
        default="current",
        metadata=key(
            "podLabelNames",
            "current (pod, namespace, container) or legacy (pod_name, pod_namespace, container_name)",
            choice(PodLabelNames),
        ),
    )


@dataclass(frozen=True)
class DraConfig:
    """nvplug.dra: the DRA kubelet plugin, off by default."""

    enabled: bool = field(default=False, metadata=key("enabled", "run the DRA kubelet plugin", boolean))
    # NVIDIA's DRA driver's name, so that DeviceClasses written for it select nvplug's devices.
    driver_name: str = field(
        default=DEFAULT_DRA_DRIVER, metadata=key("driverName", "the DRA driver's name", driver_name)
    )
    # The Node object's name; None: this host's name, as the kubelet takes it.
    node_name: str | None = field(default=None, metadata=key("nodeName", "the Node object's name", dns_subdomain))
    # auto: nvplug's own kubeconfig where it exists, else the kubelet's credentials (the node's own identity).
    kubeconfig: str = field(
        default="auto",
        metadata=key(
            "kubeconfig", "credentials for publishing ResourceSlices: auto, kubelet or a path", kubeconfig_choice
        ),
    )
    # Where the kubelet's own kubeconfig is; None: the first of /etc/kubernetes/kubelet.conf (kubeadm) and
    # /var/lib/kubelet/kubeconfig.
    kubelet_kubeconfig: str | None = field(
        default=None, metadata=key("kubeletKubeconfig", "the kubelet's kubeconfig", absolute_path)
    )
    kubelet_certificate: str = field(
        default=DEFAULT_KUBELET_CERTIFICATE,
        metadata=key("kubeletCertificate", "the kubelet's current client certificate and key (one PEM)", absolute_path),
    )
    # The API server's load from this node: a change after a quiet spell is written at once, a run of them
    # is paced (and coalesced) to this many writes a second, with a burst of 2. A repair never waits.
    max_writes_per_second: float = field(
        default=1.0,
        metadata=key("maxWritesPerSecond", "ResourceSlice writes a second, at most, for changes", positive_rate),
    )
    # The GPUs offered through DRA (none listed, and no extendedResources: every GPU); the device plugin
    # offers the others.
    devices: tuple[Selector, ...] = field(
        default=(), metadata=key("devices", "the GPUs offered through DRA", read_selectors, show=selector_texts)
    )
    registry_dir: str = field(
        default=DEFAULT_PLUGINS_REGISTRY,
        metadata=key("registryDir", "where the kubelet finds plugins to register", absolute_path),
    )
    plugins_dir: str = field(
        default=DEFAULT_KUBELET_PLUGINS, metadata=key("pluginsDir", "where plugins' sockets live", absolute_path)
    )
    # DRA extended resources (KEP-5004): a DeviceClass with extendedResourceName maps a pod's
    # `nvidia.com/gpu: 1` to a claim, but only where the node's allocatable for it is 0. Every GPU whose
    # model's name (resources.gpus) is such a name goes to DRA, and the device plugin offers it with none.
    extended_resources: tuple[str, ...] = field(
        default=(),
        metadata=key("extendedResources", "resources DRA serves for pods that ask by name", resource_names),
    )
    # Not a key of the file: the GPUs (by UUID) a reload moves between the device plugin and DRA, offered
    # by neither while the side that gives them up says so (no GPU is ever offered twice).
    moving: frozenset[str] = frozenset()
    # Where the API server keeps device taints (DRADeviceTaints), an Unhealthy device stays in the pool, tainted.
    taint_effect: TaintEffects = field(
        default_factory=TaintEffects,
        metadata=key("taintEffect", "the effect of each kind of device taint", section=TaintEffects),
    )

    def needs_restart(self, other: DraConfig) -> list[str]:
        """The keys whose change from `other` takes a restart: a reload may move GPUs (devices,
        extendedResources) and change the taints' effects, not the plugin itself."""
        reloadable = {"devices", "extended_resources", "taint_effect"}
        return [
            k.name
            for name, k in declared(DraConfig)
            if name is not None and name not in reloadable and getattr(self, name) != getattr(other, name)
        ]


@dataclass(frozen=True)
class MpsLimits:
    """One entry of nvplug.mps.resources: the defaults an MPS resource's servers start with."""

    # The advertised name (the rename, if the sharing entry has one).
    name: str = field(metadata=key("name", "the MPS resource these limits are for", resource_name, required=True))
    # None: the equal split, 100 / replicas.
    active_thread_percentage: int | None = field(
        default=None,
        metadata=key("activeThreadPercentage", "each server's share of the SMs", int_range(1, 100, "a percentage")),
    )
    # MiB per device; None: the equal split, the device's memory / replicas.
    pinned_memory_limit: int | None = field(
        default=None,
        metadata=key(
            "pinnedMemoryLimit",
            "each server's device memory, e.g. 4096M or 2G",
            memory_size,
            show=lambda mib: f"{mib}M",
        ),
    )
    where: str = field(default="", compare=False)


@dataclass(frozen=True)
class MpsConfig:
    """nvplug.mps: how nvplug runs the MPS control daemons of sharing.mps."""

    # None: NVIDIA's flags.mpsRoot if given, else DEFAULT_MPS_ROOT (Config.mps_root).
    root: str | None = field(
        default=None, metadata=key("root", "where the MPS pipes, logs and shm live", absolute_path)
    )
    # None: the driver root's /usr/bin/nvidia-cuda-mps-control.
    control_path: str | None = field(
        default=None, metadata=key("controlPath", "the nvidia-cuda-mps-control binary", absolute_path)
    )
    client_limits: bool = field(
        default=False,
        metadata=key("clientLimits", "also hand each container its limits as CUDA_MPS_* variables", boolean),
    )
    restart_with_clients: bool = field(
        default=False,
        metadata=key("restartWithClients", "let a reload restart a daemon whose GPUs have clients", boolean),
    )
    resources: tuple[MpsLimits, ...] = field(
        default=(), metadata=key("resources", "limits per MPS resource", entries=MpsLimits)
    )

    def limits(self, name: str) -> MpsLimits:
        return next((r for r in self.resources if r.name == name), MpsLimits(name))


@dataclass(frozen=True)
class Config:
    """The whole config. Dotted keys sit in groups of the file; groups and sections are read in field order."""

    source: str = "built-in defaults"
    # config show has always written nvplug.health after nvplug's other keys.
    health: HealthConfig = field(
        default_factory=HealthConfig,
        metadata=key("nvplug.health", "how XIDs and re-probes judge GPUs", section=HealthConfig, shown_last=True),
    )
    flags: Flags = field(default_factory=Flags, metadata=key("flags", "NVIDIA's flags", section=Flags))
    # Null is refused here, as it always was; the other keys take null for their default.
    status_listen: str = field(
        default=DEFAULT_STATUS_LISTEN,
        metadata=key(
            "nvplug.status.listen", "where /healthz, /status and /metrics are served", listen_address, direct=True
        ),
    )
    # dcgm-exporter's port is 9400; off by default: the unit must allow AF_INET first (docs/telemetry.md).
    metrics_listen: str = field(
        default="off",
        metadata=key(
            "nvplug.status.metricsListen", "where /metrics alone is served too: off or host:port", listen_address
        ),
    )
    cdi_spec_dir: str = field(
        default=DEFAULT_CDI_SPEC_DIR,
        metadata=key("nvplug.cdi.specDir", "where the CDI spec is written; off: not at all", off_or_absolute),
    )
    # Read for conflicts (another spec of nvplug's kind) and for the names a runtime would resolve.
    cdi_runtime_dirs: tuple[str, ...] = field(
        default=DEFAULT_CDI_RUNTIME_DIRS,
        metadata=key("nvplug.cdi.runtimeDirs", "where the container runtimes read CDI specs", absolute_paths),
    )
    feature_file: str = field(
        default=DEFAULT_FEATURE_FILE,
        metadata=key("nvplug.labels.featureFile", "the NFD feature file; off: none", off_or_absolute),
    )
    unhealthy_count_label: bool = field(
        default=False, metadata=key("nvplug.labels.unhealthyCount", "label the count of Unhealthy GPUs", boolean)
    )
    pod_resources_socket: str = field(
        default=DEFAULT_POD_RESOURCES_SOCKET,
        metadata=key(
            "nvplug.podResources.socket", "where the kubelet serves PodResources; off: never ask", off_or_absolute
        ),
    )
    devices: DeviceFilter = field(
        default_factory=DeviceFilter,
        metadata=key("nvplug.devices", "which GPUs are handed out at all", section=DeviceFilter),
    )
    dra: DraConfig = field(
        default_factory=DraConfig, metadata=key("nvplug.dra", "the DRA kubelet plugin", section=DraConfig)
    )
    mps: MpsConfig = field(
        default_factory=MpsConfig, metadata=key("nvplug.mps", "the MPS control daemons", section=MpsConfig)
    )
    telemetry: TelemetryConfig = field(
        default_factory=TelemetryConfig,
        metadata=key("nvplug.telemetry", "GPU figures on /metrics", section=TelemetryConfig),
    )
    resources: Resources = field(
        default_factory=Resources, metadata=key("resources", "the resource names devices get", section=Resources)
    )
    sharing: Sharing = field(
        default_factory=Sharing, metadata=key("sharing", "replicas of shared devices", section=Sharing)
    )
    imex: Imex = field(default_factory=Imex, metadata=key("imex", "IMEX channels", section=Imex))

    @property
    def mps_root(self) -> str:
        return self.mps.root or self.flags.mps_root or DEFAULT_MPS_ROOT

    @property
    def mps_control(self) -> str:
        return self.mps.control_path or str(Path(self.flags.nvidia_driver_root) / MPS_CONTROL.lstrip("/"))

    @property
    def shared_policy(self) -> SharedPolicy:
        """NVIDIA's flags.plugin.sharedDevicesAllocationPolicy, or sharing.timeSlicing's; distributed if neither."""
        plugin = self.flags.plugin.shared_devices_allocation_policy
        return plugin or self.sharing.time_slicing.shared_devices_allocation_policy or "distributed"
