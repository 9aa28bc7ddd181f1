"""The YAML config: a superset of NVIDIA's k8s-device-plugin config file, version v1.

Every section of NVIDIA's v1 is read into typed, frozen dataclasses with NVIDIA's defaults
(`flags`, `resources`, `sharing`, `imex`; `flags.gfd` is checked and dropped, it configures
GPU Feature Discovery). nvplug's own settings live under `nvplug:`. Every unknown key, wrong
type and impossible value is an error that names the file, the key path and the line.

The file is composed into a YAML node tree (never constructed into Python objects), so
line numbers survive, and the walk over it counts every node it visits: aliases that
reuse a subtree many times over cannot make a small file expensive.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from nvplug.config.selectors import DeviceFilter, Selector, covers

DEFAULT_PATH = Path("/etc/nvplug/config.yaml")
# Root-only by default: a unix socket in the unit's RuntimeDirectory.
DEFAULT_STATUS_LISTEN = "unix:/run/nvplug/status.sock"
# Where runtimes read generated CDI specs; cleared at boot, as a generated spec should be.
DEFAULT_CDI_SPEC_DIR = "/var/run/cdi"
# Node Feature Discovery's worker reads every file here; GFD's is `gfd`, ours `nvplug`.
DEFAULT_FEATURE_FILE = "/etc/kubernetes/node-feature-discovery/features.d/nvplug"
# The kubelet's PodResources API: which pod holds which device.
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
# DRA: NVIDIA's driver name, and where the kubelet looks for plugins.
DEFAULT_DRA_DRIVER = "gpu.nvidia.com"
DEFAULT_DRA_KUBECONFIG = "/etc/nvplug/kubeconfig"
DEFAULT_PLUGINS_REGISTRY = "/var/lib/kubelet/plugins_registry"
DEFAULT_KUBELET_PLUGINS = "/var/lib/kubelet/plugins"
# CDI limits the name part of an annotation key (after the prefix's "/") to this.
MAX_ANNOTATION_NAME = 63
# What nvplug appends to the prefix: "nvplug_" and 16 hex digits.
ANNOTATION_KEY_LENGTH = 23
# NVIDIA's v1 sections, plus our own under `nvplug:`.
SECTIONS = ("version", "flags", "resources", "sharing", "imex", "nvplug")
MAX_BYTES = 1 << 20
MAX_XID = 1 << 16
# Aliases make a node tree a graph: nested ones ("billion laughs") turn a few lines into
# billions of nodes to walk. Real configs have a few hundred nodes.
MAX_NODES = 100_000
# PyYAML's composer recurses once per level; refuse well before Python's recursion limit.
MAX_DEPTH = 64
# Each replica is a device ID in every ListAndWatch message; beyond this the kubelet suffers.
MAX_REPLICAS = 1024
MAX_DEVICES = 1024

MigStrategy = Literal["none", "single", "mixed"]
DeviceListStrategy = Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]
DeviceIDStrategy = Literal["uuid", "index"]
SharedPolicy = Literal["distributed", "packed"]
DeviceDiscoveryStrategy = Literal["auto", "nvml", "tegra"]
SharingStrategy = Literal["none", "time-slicing", "mps"]
# Which devices a replicated resource covers: all of them, the first N, or a list of
# GPU indices ("0"), MIG indices ("0:1"), GPU UUIDs and MIG UUIDs.
Devices = Literal["all"] | int | tuple[str, ...]

GPU_RESOURCE = "nvidia.com/gpu"
# NVIDIA's short resource names ("gpu") are in this domain.
RESOURCE_DOMAIN = "nvidia.com"
SHARED_SUFFIX = ".shared"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class HealthConfig:
    ignore_xids: frozenset[int] = frozenset()
    fatal_xids: frozenset[int] = frozenset()
    # Re-probes of Unhealthy GPUs only: first after this long, doubling up to the maximum.
    reprobe_initial_seconds: float = 30.0
    reprobe_max_seconds: float = 600.0


@dataclass(frozen=True)
class PluginFlags:
    """`flags.plugin`: NVIDIA's device-plugin-only options."""

    # NVIDIA's default is off; a host service hands out the device nodes itself.
    pass_device_specs: bool = True
    device_list_strategy: tuple[DeviceListStrategy, ...] = ("envvar",)
    device_id_strategy: DeviceIDStrategy = "uuid"
    cdi_annotation_prefix: str = "cdi.k8s.io/"
    nvidia_ctk_path: str = "/usr/bin/nvidia-ctk"
    container_driver_root: str = "/driver-root"
    # Newer NVIDIA releases; None/empty: not set.
    kubelet_socket: str | None = None
    cdi_feature_flags: tuple[str, ...] = ()
    # How GetPreferredAllocation places replicas: spread over the least-used GPUs, or packed onto few.
    # None: not set (Config.shared_policy says what is in force).
    shared_devices_allocation_policy: SharedPolicy | None = None


@dataclass(frozen=True)
class Flags:
    """`flags`: options NVIDIA shares between the device plugin and GPU Feature Discovery."""

    mig_strategy: MigStrategy = "none"
    fail_on_init_error: bool = True
    mps_root: str | None = None
    nvidia_driver_root: str = "/"
    # When the file leaves it out: the driver root, as NVIDIA does.
    nvidia_dev_root: str = "/"
    gdrcopy_enabled: bool = False
    gds_enabled: bool = False
    mofed_enabled: bool = False
    use_node_feature_api: bool = False
    device_discovery_strategy: DeviceDiscoveryStrategy = "auto"
    plugin: PluginFlags = field(default_factory=PluginFlags)


@dataclass(frozen=True)
class ResourcePattern:
    """Devices whose product name (MIG: profile) matches `pattern` are advertised as `name`; first match wins.
    The pattern is NVIDIA's: `*` is any text, and it may match anywhere in the name (see selection.py)."""

    pattern: str
    name: str
    # Where the entry is in the file, for messages about it.
    where: str = field(default="", compare=False)


@dataclass(frozen=True)
class Resources:
    gpus: tuple[ResourcePattern, ...] = (ResourcePattern("*", GPU_RESOURCE),)
    # Empty: MIG devices get NVIDIA's names from their profile (nvidia.com/mig-1g.10gb).
    mig: tuple[ResourcePattern, ...] = ()


@dataclass(frozen=True)
class ReplicatedResource:
    name: str
    replicas: int
    # Filled in as `<name>.shared` when renameByDefault is on and no rename is given.
    rename: str | None = None
    devices: Devices = "all"
    # Where the entry is in the file, for messages about it.
    where: str = field(default="", compare=False)

    @property
    def advertised_name(self) -> str:
        return self.rename or self.name


@dataclass(frozen=True)
class ReplicatedResources:
    """`sharing.timeSlicing` or `sharing.mps`."""

    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    resources: tuple[ReplicatedResource, ...] = ()
    # Also accepted here, beside NVIDIA's flags.plugin.sharedDevicesAllocationPolicy; None: not set.
    shared_devices_allocation_policy: SharedPolicy | None = None


@dataclass(frozen=True)
class Sharing:
    time_slicing: ReplicatedResources = field(default_factory=ReplicatedResources)
    mps: ReplicatedResources = field(default_factory=ReplicatedResources)

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
    channel_ids: tuple[int, ...] = ()
    required: bool = False


@dataclass(frozen=True)
class DraConfig:
    """nvplug.dra: the DRA kubelet plugin, off by default."""

    enabled: bool = False
    # NVIDIA's DRA driver's name, so that DeviceClasses written for it select nvplug's devices.
    driver_name: str = DEFAULT_DRA_DRIVER
    # The Node object's name; None: this host's name, as the kubelet takes it.
    node_name: str | None = None
    kubeconfig: str = DEFAULT_DRA_KUBECONFIG
    # The GPUs offered through DRA (none listed: every GPU); the device plugin offers the others.
    devices: tuple[Selector, ...] = ()
    registry_dir: str = DEFAULT_PLUGINS_REGISTRY
    plugins_dir: str = DEFAULT_KUBELET_PLUGINS


@dataclass(frozen=True)
class Config:
    source: str = "built-in defaults"
    resource_name: str = GPU_RESOURCE
    health: HealthConfig = field(default_factory=HealthConfig)
    flags: Flags = field(default_factory=Flags)
    # nvplug.status.listen: where /healthz, /status and /metrics are served.
    status_listen: str = DEFAULT_STATUS_LISTEN
    # nvplug.cdi.specDir: where the CDI spec is written; "off": not at all.
    cdi_spec_dir: str = DEFAULT_CDI_SPEC_DIR
    # nvplug.labels: the NFD feature file ("off": none), and the optional health label.
    feature_file: str = DEFAULT_FEATURE_FILE
    unhealthy_count_label: bool = False
    # nvplug.podResources.socket: where the kubelet serves PodResources ("off": never ask).
    pod_resources_socket: str = DEFAULT_POD_RESOURCES_SOCKET
    # nvplug.devices: which GPUs are handed out at all.
    devices: DeviceFilter = field(default_factory=DeviceFilter)
    dra: DraConfig = field(default_factory=DraConfig)
    resources: Resources = field(default_factory=Resources)
    sharing: Sharing = field(default_factory=Sharing)
    imex: Imex = field(default_factory=Imex)

    @property
    def shared_policy(self) -> SharedPolicy:
        """NVIDIA's flags.plugin.sharedDevicesAllocationPolicy, or sharing.timeSlicing's; distributed if neither."""
        plugin = self.flags.plugin.shared_devices_allocation_policy
        return plugin or self.sharing.time_slicing.shared_devices_allocation_policy or "distributed"


def load(path: Path | None) -> Config:
    """`None` means the default path, which may be absent; an explicit path must exist."""
    explicit = path is not None
    path = path or DEFAULT_PATH
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{path}: no such config file") from None
        return Config()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from err
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES} bytes; refusing to parse")
    return parse(raw.decode("utf-8", errors="replace"), str(path))


def parse(text: str, source: str) -> Config:
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{source}: larger than {MAX_BYTES} bytes; refusing to parse")
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from err
    if root is None:
        return Config(source=source)
    ctx = _ReadContext(source)
    found = _Map(ctx, root, "").items(SECTIONS)
    version = found.get("version")
    if version is not None and not _is_null(version) and _scalar(version) != "v1":
        raise ctx.error(version, "version", f"{_scalar(version)!r} is not supported; use v1")
    own = _nvplug(ctx, found["nvplug"]) if "nvplug" in found else {}
    cfg = Config(
        source=source,
        **own,
        flags=_flags(ctx, found["flags"], "flags") if "flags" in found else Flags(),
        resources=_resources(ctx, found["resources"], "resources") if "resources" in found else Resources(),
        sharing=_sharing(ctx, found["sharing"], "sharing") if "sharing" in found else Sharing(),
        imex=_imex(ctx, found["imex"], "imex") if "imex" in found else Imex(),
    )
    cdi = [s for s in cfg.flags.plugin.device_list_strategy if s.startswith("cdi")]
    if cdi and cfg.cdi_spec_dir == "off":
        node = _Map(ctx, found["nvplug"], "nvplug").items(NVPLUG_KEYS)["cdi"]
        raise ctx.error(node, "nvplug.cdi.specDir", f"is off, but flags.plugin.deviceListStrategy {cdi} hands out "
                        "CDI names that nothing would define")  # fmt: skip
    sliced = cfg.sharing.time_slicing.shared_devices_allocation_policy
    flagged = cfg.flags.plugin.shared_devices_allocation_policy
    if sliced is not None and flagged is not None and sliced != flagged:
        node = _Map(ctx, found["sharing"], "sharing").items(("timeSlicing", "mps"))["timeSlicing"]
        raise ctx.error(node, "sharing.timeSlicing.sharedDevicesAllocationPolicy",
                        f"{sliced} disagrees with flags.plugin.sharedDevicesAllocationPolicy: {flagged}")  # fmt: skip
    if cfg.dra.enabled and cfg.cdi_spec_dir == "off":
        node = _Map(ctx, found["nvplug"], "nvplug").items(NVPLUG_KEYS)["dra"]
        raise ctx.error(node, "nvplug.dra.enabled", "needs the CDI spec (nvplug.cdi.specDir is off): "
                        "NodePrepareResources hands out CDI device names")  # fmt: skip
    if cfg.flags.mig_strategy == "mixed":
        # A resource holds whole GPUs or MIG devices, never both: Allocate hands out one kind.
        whole = {r.name: r for r in cfg.resources.gpus}
        for r in cfg.resources.mig:
            clash = whole.get(r.name) or (
                ResourcePattern("*", r.name, "the default") if r.name == GPU_RESOURCE else None
            )
            if clash is not None:
                raise ConfigError(f"{r.where}.name: {r.name} also names whole GPUs ({clash.where}) under "
                                  "flags.migStrategy: mixed; MIG devices need a name of their own")  # fmt: skip
    if cfg.sharing.mps.resources and cfg.flags.mig_strategy == "mixed":
        node = _Map(ctx, found["sharing"], "sharing").items(("timeSlicing", "mps"))["mps"]
        raise ctx.error(node, "sharing.mps", "MPS sharing does not work with flags.migStrategy: mixed")
    return cfg


def to_yaml(cfg: Config) -> str:
    """The config as YAML in NVIDIA's keys, every default filled in; `parse` reads it back the same."""
    return yaml.safe_dump(as_dict(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True)


def as_dict(cfg: Config) -> dict[str, Any]:
    f, p = cfg.flags, cfg.flags.plugin
    plugin = {
        "passDeviceSpecs": p.pass_device_specs,
        "deviceListStrategy": list(p.device_list_strategy),
        "deviceIDStrategy": p.device_id_strategy,
        "cdiAnnotationPrefix": p.cdi_annotation_prefix,
        "nvidiaCTKPath": p.nvidia_ctk_path,
        "containerDriverRoot": p.container_driver_root,
        "kubeletSocket": p.kubelet_socket,
        "cdiFeatureFlags": list(p.cdi_feature_flags),
        "sharedDevicesAllocationPolicy": p.shared_devices_allocation_policy,
    }
    flags = {
        "migStrategy": f.mig_strategy,
        "failOnInitError": f.fail_on_init_error,
        "mpsRoot": f.mps_root,
        "nvidiaDriverRoot": f.nvidia_driver_root,
        "nvidiaDevRoot": f.nvidia_dev_root,
        "gdrcopyEnabled": f.gdrcopy_enabled,
        "gdsEnabled": f.gds_enabled,
        "mofedEnabled": f.mofed_enabled,
        "useNodeFeatureAPI": f.use_node_feature_api,
        "deviceDiscoveryStrategy": f.device_discovery_strategy,
        "plugin": _drop_none(plugin),
    }
    h = cfg.health
    return {
        "version": "v1",
        "flags": _drop_none(flags),
        "resources": {
            "gpus": [{"pattern": r.pattern, "name": r.name} for r in cfg.resources.gpus],
            "mig": [{"pattern": r.pattern, "name": r.name} for r in cfg.resources.mig],
        },
        "sharing": {
            "timeSlicing": _replicated_dict(cfg.sharing.time_slicing),
            "mps": _replicated_dict(cfg.sharing.mps),
        },
        "imex": {"channelIDs": list(cfg.imex.channel_ids), "required": cfg.imex.required},
        "nvplug": {
            "status": {"listen": cfg.status_listen},
            "cdi": {"specDir": cfg.cdi_spec_dir},
            "labels": {"featureFile": cfg.feature_file, "unhealthyCount": cfg.unhealthy_count_label},
            "podResources": {"socket": cfg.pod_resources_socket},
            "devices": {
                "include": [s.value for s in cfg.devices.include],
                "exclude": [s.value for s in cfg.devices.exclude],
            },
            "dra": _drop_none(
                {
                    "enabled": cfg.dra.enabled,
                    "driverName": cfg.dra.driver_name,
                    "nodeName": cfg.dra.node_name,
                    "kubeconfig": cfg.dra.kubeconfig,
                    "devices": [s.value for s in cfg.dra.devices],
                    "registryDir": cfg.dra.registry_dir,
                    "pluginsDir": cfg.dra.plugins_dir,
                }
            ),
            "health": {
                "ignoreXids": sorted(h.ignore_xids),
                "fatalXids": sorted(h.fatal_xids),
                "reprobeInitialSeconds": h.reprobe_initial_seconds,
                "reprobeMaxSeconds": h.reprobe_max_seconds,
            },
        },
    }


def _replicated_dict(rr: ReplicatedResources) -> dict[str, Any]:
    def one(r: ReplicatedResource) -> dict[str, Any]:
        devices = list(r.devices) if isinstance(r.devices, tuple) else r.devices
        return _drop_none({"name": r.name, "rename": r.rename, "devices": devices, "replicas": r.replicas})

    return _drop_none(
        {
            "renameByDefault": rr.rename_by_default,
            "failRequestsGreaterThanOne": rr.fail_requests_greater_than_one,
            "sharedDevicesAllocationPolicy": rr.shared_devices_allocation_policy,
            "resources": [one(r) for r in rr.resources],
        }
    )


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


# --- the sections ---------------------------------------------------------------------


NVPLUG_KEYS = ("health", "status", "cdi", "labels", "podResources", "devices", "dra")


def _nvplug(ctx: _ReadContext, node: yaml.Node) -> dict[str, Any]:
    """Config fields from `nvplug:`, only those it sets."""
    found = _Map(ctx, node, "nvplug").items(NVPLUG_KEYS)
    own: dict[str, Any] = {}
    if "health" in found:
        own["health"] = _health(ctx, found["health"], "nvplug.health")
    if "status" in found:
        status = _Map(ctx, found["status"], "nvplug.status").items(("listen",))
        if "listen" in status:
            own["status_listen"] = _listen(ctx, status["listen"], "nvplug.status.listen")
    if "cdi" in found:
        own.update(_Map(ctx, found["cdi"], "nvplug.cdi").read({"specDir": ("cdi_spec_dir", _off_or_absolute)}))
    if "podResources" in found:
        own.update(
            _Map(ctx, found["podResources"], "nvplug.podResources").read(
                {"socket": ("pod_resources_socket", _off_or_absolute)}
            )
        )
    if "devices" in found:
        selectors = {"include": ("include", _selectors), "exclude": ("exclude", _selectors)}
        own["devices"] = DeviceFilter(**_Map(ctx, found["devices"], "nvplug.devices").read(selectors))
    if "dra" in found:
        keys = {
            "enabled": ("enabled", _bool),
            "driverName": ("driver_name", _driver_name),
            "nodeName": ("node_name", _dns_subdomain),
            "kubeconfig": ("kubeconfig", _absolute),
            "devices": ("devices", _selectors),
            "registryDir": ("registry_dir", _absolute),
            "pluginsDir": ("plugins_dir", _absolute),
        }
        own["dra"] = DraConfig(**_Map(ctx, found["dra"], "nvplug.dra").read(keys))
    if "labels" in found:
        own.update(
            _Map(ctx, found["labels"], "nvplug.labels").read(
                {"featureFile": ("feature_file", _off_or_absolute), "unhealthyCount": ("unhealthy_count_label", _bool)}
            )
        )
    return own


def _dns_subdomain(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    value = _str(ctx, node, path)
    if len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value):
        raise ctx.error(node, path, f"{value!r} is not a DNS subdomain (lower case letters, digits, '-' and '.')")
    return value


def _driver_name(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    value = _dns_subdomain(ctx, node, path)
    # A driver name is also the domain of its device attributes, which allows 63 characters.
    if len(value) > 63:
        raise ctx.error(node, path, f"{value!r} is longer than 63 characters")
    return value


def _absolute(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    value = _path(ctx, node, path)
    if not value.startswith("/"):
        raise ctx.error(node, path, f"{value!r} is not an absolute path")
    return value


def _off_or_absolute(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    value = _path(ctx, node, path)
    if value != "off" and not value.startswith("/"):
        raise ctx.error(node, path, f"{value!r} is neither off nor an absolute path")
    return value


def _selectors(ctx: _ReadContext, node: yaml.Node, path: str) -> tuple[Selector, ...]:
    """GPU indices, GPU UUIDs, PCI bus ids and product patterns; each names whole GPUs."""
    out: list[Selector] = []
    for item, item_path in _sequence(ctx, node, path):
        if isinstance(item, yaml.ScalarNode) and item.tag == INT_TAG:
            index = _int(ctx, item, item_path, "a GPU index")
            if not 0 <= index < MAX_DEVICES:
                raise ctx.error(item, item_path, f"GPU index {index} is out of range 0-{MAX_DEVICES - 1}")
            text = str(index)
        else:
            text = _str(ctx, item, item_path)
        if text.startswith("MIG-") or _MIG_INDEX.fullmatch(text):
            raise ctx.error(item, item_path, f"{text!r} is a MIG device; nvplug.devices picks whole GPUs")
        if text.startswith("GPU-") and not _GPU_UUID.fullmatch(text):
            raise ctx.error(item, item_path, f"{text!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
        selector = Selector.parse(text)
        if selector.kind == "index" and int(selector.value) >= MAX_DEVICES:
            raise ctx.error(item, item_path, f"GPU index {selector.value} is out of range 0-{MAX_DEVICES - 1}")
        if selector in out:
            raise ctx.error(item, item_path, f"{selector} is listed twice")
        out.append(selector)
    return tuple(out)


def _listen(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    """`off`, `unix:/absolute/path` or `host:port`."""
    value = _str(ctx, node, path)
    if value == "off" or (value.startswith("unix:/") and "\0" not in value):
        return value
    host, _, port = value.rpartition(":")
    # ASCII digits only: str.isdigit() also takes ² and Arabic-Indic digits.
    if host and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536:
        return value
    raise ctx.error(node, path, f"{value!r} is not off, unix:/absolute/path or host:port")


def _health(ctx: _ReadContext, node: yaml.Node, path: str) -> HealthConfig:
    section = _Map(ctx, node, path)
    values = section.read(
        {
            "ignoreXids": ("ignore_xids", _xid_list),
            "fatalXids": ("fatal_xids", _xid_list),
            "reprobeInitialSeconds": ("reprobe_initial_seconds", _positive_seconds),
            "reprobeMaxSeconds": ("reprobe_max_seconds", _positive_seconds),
        }
    )
    cfg = HealthConfig(**values)
    both = cfg.ignore_xids & cfg.fatal_xids
    if both:
        raise ctx.error(node, path, f"XIDs {sorted(both)} are both in ignoreXids and fatalXids")
    if cfg.reprobe_max_seconds < cfg.reprobe_initial_seconds:
        raise ctx.error(node, path, "reprobeMaxSeconds is below reprobeInitialSeconds")
    return cfg


def _flags(ctx: _ReadContext, node: yaml.Node, path: str) -> Flags:
    values = _Map(ctx, node, path).read(
        {
            "migStrategy": ("mig_strategy", _choice(MigStrategy)),
            "failOnInitError": ("fail_on_init_error", _bool),
            "mpsRoot": ("mps_root", _path),
            "nvidiaDriverRoot": ("nvidia_driver_root", _path),
            "nvidiaDevRoot": ("nvidia_dev_root", _path),
            "gdrcopyEnabled": ("gdrcopy_enabled", _bool),
            "gdsEnabled": ("gds_enabled", _bool),
            "mofedEnabled": ("mofed_enabled", _bool),
            "useNodeFeatureAPI": ("use_node_feature_api", _bool),
            "deviceDiscoveryStrategy": ("device_discovery_strategy", _choice(DeviceDiscoveryStrategy)),
            "plugin": ("plugin", _plugin_flags),
            # GPU Feature Discovery's options: checked so typos show, then dropped.
            "gfd": ("gfd", _gfd),
        }
    )
    values.pop("gfd", None)
    values.setdefault("nvidia_dev_root", values.get("nvidia_driver_root", Flags.nvidia_driver_root))
    return Flags(**values)


def _plugin_flags(ctx: _ReadContext, node: yaml.Node, path: str) -> PluginFlags:
    values = _Map(ctx, node, path).read(
        {
            "passDeviceSpecs": ("pass_device_specs", _bool),
            "deviceListStrategy": ("device_list_strategy", _device_list_strategy),
            "deviceIDStrategy": ("device_id_strategy", _choice(DeviceIDStrategy)),
            "cdiAnnotationPrefix": ("cdi_annotation_prefix", _annotation_prefix),
            "nvidiaCTKPath": ("nvidia_ctk_path", _path),
            "containerDriverRoot": ("container_driver_root", _path),
            "kubeletSocket": ("kubelet_socket", _path),
            "cdiFeatureFlags": ("cdi_feature_flags", _str_list),
            "sharedDevicesAllocationPolicy": ("shared_devices_allocation_policy", _choice(SharedPolicy)),
        }
    )
    return PluginFlags(**values)


def _annotation_prefix(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    """`domain/` or `domain/start`: what comes after the "/" and our key's own part must fit CDI's 63."""
    value = _str(ctx, node, path)
    domain, slash, start = value.partition("/")
    if not slash or not _DNS_SUBDOMAIN.fullmatch(domain):
        raise ctx.error(node, path, f"{value!r} is not a DNS domain followed by '/', like cdi.k8s.io/")
    if len(start) + ANNOTATION_KEY_LENGTH > MAX_ANNOTATION_NAME:
        raise ctx.error(node, path, f"{value!r} leaves annotation keys longer than {MAX_ANNOTATION_NAME} "
                        f"characters after the '/'")  # fmt: skip
    return value


def _gfd(ctx: _ReadContext, node: yaml.Node, path: str) -> None:
    _Map(ctx, node, path).read(
        {
            "oneshot": ("oneshot", _bool),
            "noTimestamp": ("no_timestamp", _bool),
            "sleepInterval": ("sleep_interval", _duration),
            "outputFile": ("output_file", _text),
            "machineTypeFile": ("machine_type_file", _text),
        }
    )


def _resources(ctx: _ReadContext, node: yaml.Node, path: str) -> Resources:
    values = _Map(ctx, node, path).read({"gpus": ("gpus", _resource_list), "mig": ("mig", _resource_list)})
    # NVIDIA adds its default GPU resource to an empty list too.
    if not values.get("gpus"):
        values.pop("gpus", None)
    return Resources(**values)


def _resource_list(ctx: _ReadContext, node: yaml.Node, path: str) -> tuple[ResourcePattern, ...]:
    out: list[ResourcePattern] = []
    for item, item_path in _sequence(ctx, node, path):
        values = _Map(ctx, item, item_path).read(
            {"pattern": ("pattern", _str), "name": ("name", _resource_name)}, required=("pattern", "name")
        )
        resource = ResourcePattern(**values, where=f"{ctx.source}, line {item.start_mark.line + 1}: {item_path}")
        # First match wins: an entry whose every match an earlier one takes would name those devices
        # twice, and the second name would never be given.
        earlier = next((r for r in out if covers(r.pattern, resource.pattern)), None)
        if earlier is not None:
            if earlier.name == resource.name:
                twice = "names the same devices again"
            else:
                twice = f"would give the devices it matches a second name, {resource.name}"
            raise ctx.error(
                item,
                f"{item_path}.pattern",
                f"{resource.pattern!r} {twice}: every one of them already matches {earlier.pattern!r} "
                f"({earlier.name}, {earlier.where}), and the first match wins",
            )
        out.append(resource)
    return tuple(out)


def _sharing(ctx: _ReadContext, node: yaml.Node, path: str) -> Sharing:
    values = _Map(ctx, node, path).read({"timeSlicing": ("time_slicing", _replicated), "mps": ("mps", _replicated)})
    sharing = Sharing(**values)
    if sharing.time_slicing.resources and sharing.mps.resources:
        mps = _Map(ctx, node, path).items(("timeSlicing", "mps"))["mps"]
        raise ctx.error(mps, f"{path}.mps", "time-slicing and MPS are mutually exclusive; configure one of them")
    return sharing


def _replicated(ctx: _ReadContext, node: yaml.Node, path: str) -> ReplicatedResources:
    section = _Map(ctx, node, path)
    values = section.read(
        {
            "renameByDefault": ("rename_by_default", _bool),
            "failRequestsGreaterThanOne": ("fail_requests_greater_than_one", _bool),
            "resources": ("resources", _no_check),
            "sharedDevicesAllocationPolicy": ("shared_devices_allocation_policy", _choice(SharedPolicy)),
        }
    )
    rename_by_default = bool(values.get("rename_by_default", False))
    resources: list[ReplicatedResource] = []
    advertised: set[str] = set()
    listed = section.items(
        ("renameByDefault", "failRequestsGreaterThanOne", "resources", "sharedDevicesAllocationPolicy")
    ).get("resources")
    items = [] if listed is None or _is_null(listed) else _sequence(ctx, listed, f"{path}.resources")
    for item, item_path in items:
        entry = _Map(ctx, item, item_path)
        read = entry.read(
            {
                "name": ("name", _resource_name),
                "rename": ("rename", _resource_name),
                "devices": ("devices", _devices),
                "replicas": ("replicas", _int_range(1, MAX_REPLICAS, "a number of replicas")),
            },
            required=("name", "replicas"),
        )
        fields = entry.items(("name", "rename", "devices", "replicas"))
        name = read["name"]
        read["where"] = f"{ctx.source}, line {item.start_mark.line + 1}: {item_path}"
        for other in (r for r in resources if r.name == name):
            both = _overlap(other.devices, read.get("devices", "all"))
            if both:
                node = fields.get("devices", fields["name"])
                raise ctx.error(node, f"{item_path}.devices", f"{both} of {name} also shared by {other.where}: "
                                "each device may be picked by one entry of a resource")  # fmt: skip
        if "rename" not in read and rename_by_default:
            read["rename"] = name + SHARED_SUFFIX
            problem = _resource_name_problem(read["rename"])
            if problem:
                raise ctx.error(
                    fields["name"], f"{item_path}.name", f"renamed by default to {read['rename']}: {problem}"
                )
        resource = ReplicatedResource(**read)
        if resource.advertised_name in advertised:
            where = "rename" if "rename" in fields else "name"
            raise ctx.error(fields[where], f"{item_path}.{where}", f"{resource.advertised_name} is advertised twice")
        advertised.add(resource.advertised_name)
        resources.append(resource)
    values["resources"] = tuple(resources)
    return ReplicatedResources(**values)


def _overlap(first: Devices, second: Devices) -> str | None:
    """What two entries' `devices` both pick, where the file alone tells; the rest is checked on the GPUs."""
    if first == "all" or second == "all":
        return "every device"
    if isinstance(first, int) and isinstance(second, int):
        return f"the first {min(first, second)} devices"
    if isinstance(first, tuple) and isinstance(second, tuple):
        common = [ref for ref in first if ref in second]
        if common:
            return f"device {common[0]}"
    return None


def _imex(ctx: _ReadContext, node: yaml.Node, path: str) -> Imex:
    values = _Map(ctx, node, path).read({"channelIDs": ("channel_ids", _channel_ids), "required": ("required", _bool)})
    return Imex(**values)


def _channel_ids(ctx: _ReadContext, node: yaml.Node, path: str) -> tuple[int, ...]:
    ids = tuple(_int(ctx, item, item_path, "a channel ID") for item, item_path in _sequence(ctx, node, path))
    # NVIDIA's only valid settings so far.
    if ids not in ((), (0,)):
        raise ctx.error(node, path, f"must be [] or [0], not {list(ids)}")
    return ids


# --- readers for values -----------------------------------------------------------------

INT_TAG = "tag:yaml.org,2002:int"
FLOAT_TAG = "tag:yaml.org,2002:float"
STR_TAG = "tag:yaml.org,2002:str"
BOOL_TAG = "tag:yaml.org,2002:bool"
NULL_TAG = "tag:yaml.org,2002:null"

Reader = Callable[["_ReadContext", yaml.Node, str], Any]

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_UUID = r"([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}|[0-9a-fA-F]{32})"
_GPU_UUID = re.compile(rf"GPU-{_UUID}")
_MIG_UUID = re.compile(rf"MIG-({_UUID}|GPU-{_UUID}/[0-9]+/[0-9]+)")
_GPU_INDEX = re.compile(r"[0-9]+")
_MIG_INDEX = re.compile(r"([0-9]+):([0-9]+)")
# Go's time.ParseDuration format, which NVIDIA's durations use.
_GO_DURATION = re.compile(r"[-+]?(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+|0")


def _no_check(ctx: _ReadContext, node: yaml.Node, path: str) -> None:
    """For keys a section reads itself, after the others."""


def _str(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    value = _text(ctx, node, path)
    if not value:
        raise ctx.error(node, path, "must not be empty")
    return value


def _text(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    if not isinstance(node, yaml.ScalarNode) or node.tag != STR_TAG:
        raise ctx.error(node, path, f"must be a string, not {_describe(node)}")
    return str(node.value)


def _path(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    value = _str(ctx, node, path)
    if "\0" in value:
        raise ctx.error(node, path, "must not contain a NUL character")
    return value


def _bool(ctx: _ReadContext, node: yaml.Node, path: str) -> bool:
    if isinstance(node, yaml.ScalarNode) and node.tag == BOOL_TAG:
        # An explicit !!bool tag can sit on any word: only YAML's booleans count.
        value = yaml.constructor.SafeConstructor.bool_values.get(str(node.value).lower())
        if value is not None:
            return value
    raise ctx.error(node, path, f"must be true or false, not {_describe(node)}")


def _choice(options: Any) -> Reader:
    """A reader for one of the strings of a Literal type."""
    allowed: tuple[str, ...] = get_args(options)

    def read(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
        value = _text(ctx, node, path)
        if value not in allowed:
            raise ctx.error(node, path, f"must be one of {', '.join(allowed)}; not {value!r}")
        return value

    return read


def _yaml_int(text: str) -> int | None:
    """The value of a YAML 1.1 int scalar; None for base-60 ("1:30"), which Go's YAML reads as a string."""
    text = text.replace("_", "")
    try:
        return int(text, 0)
    except ValueError:
        pass
    if re.fullmatch(r"[-+]?0[0-7]+", text):  # YAML 1.1 octal: 017
        return int(text, 8)
    return None


def _int(ctx: _ReadContext, node: yaml.Node, path: str, what: str = "an integer") -> int:
    value = _yaml_int(str(node.value)) if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG else None
    if value is None:
        raise ctx.error(node, path, f"must be {what}, not {_describe(node)}")
    return value


def _int_range(low: int, high: int, what: str) -> Reader:
    def read(ctx: _ReadContext, node: yaml.Node, path: str) -> int:
        value = _int(ctx, node, path, what)
        if not low <= value <= high:
            raise ctx.error(node, path, f"must be from {low} to {high}, not {value}")
        return value

    return read


def _positive_seconds(ctx: _ReadContext, node: yaml.Node, path: str) -> float:
    value: float | None = None
    if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG:
        as_int = _yaml_int(str(node.value))
        value = None if as_int is None else float(as_int)
    elif isinstance(node, yaml.ScalarNode) and node.tag == FLOAT_TAG:
        try:
            value = float(str(node.value).replace("_", ""))
        except ValueError:
            value = None
    if value is None:
        raise ctx.error(node, path, f"must be a number, not {_describe(node)}")
    if not 0 < value < 1e9:
        raise ctx.error(node, path, f"must be positive, not {node.value}")
    return value


def _xid_list(ctx: _ReadContext, node: yaml.Node, path: str) -> frozenset[int]:
    if not isinstance(node, yaml.SequenceNode):
        raise ctx.error(node, path, "must be a list of XID numbers")
    codes = set()
    for item, item_path in _sequence(ctx, node, path):
        code = _int(ctx, item, item_path, "an XID number")
        if not 0 < code < MAX_XID:
            raise ctx.error(item, item_path, f"{code} is not an XID number")
        codes.add(code)
    return frozenset(codes)


def _str_list(ctx: _ReadContext, node: yaml.Node, path: str) -> tuple[str, ...]:
    """A string or a list of strings, as NVIDIA's list-valued flags take."""
    if isinstance(node, yaml.ScalarNode):
        return (_str(ctx, node, path),)
    return tuple(_str(ctx, item, item_path) for item, item_path in _sequence(ctx, node, path))


def _device_list_strategy(ctx: _ReadContext, node: yaml.Node, path: str) -> tuple[str, ...]:
    items = [(node, path)] if isinstance(node, yaml.ScalarNode) else _sequence(ctx, node, path)
    if not items:
        raise ctx.error(node, path, f"must name at least one of {', '.join(get_args(DeviceListStrategy))}")
    read = _choice(DeviceListStrategy)
    out: list[str] = []
    for item, item_path in items:
        value = read(ctx, item, item_path)
        if value in out:
            raise ctx.error(item, item_path, f"{value} is given twice")
        out.append(value)
    return tuple(out)


def _duration(ctx: _ReadContext, node: yaml.Node, path: str) -> None:
    if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG and _yaml_int(str(node.value)) is not None:
        return  # nanoseconds
    if not _GO_DURATION.fullmatch(_text(ctx, node, path)):
        raise ctx.error(node, path, f"must be a duration such as 60s or 1m30s, not {node.value!r}")


def _resource_name_problem(full: str) -> str | None:
    """Why `full` is not a valid Kubernetes extended resource name, or None."""
    prefix, _, name = full.partition("/")
    if "/" in name:
        return "has more than one '/'"
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        return "the kubernetes.io domain is reserved for Kubernetes' own resources"
    if len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix):
        return f"{prefix!r} is not a DNS subdomain (lower case letters, digits, '-' and '.'; at most 253)"
    if len(name) > 63 or not _QUALIFIED_NAME.fullmatch(name):
        return (
            f"{name!r} is not a valid name (letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit; at most 63)"
        )
    return None


def _resource_name(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    value = _str(ctx, node, path)
    # NVIDIA's short form: "gpu" is nvidia.com/gpu.
    full = value if "/" in value else f"{RESOURCE_DOMAIN}/{value}"
    problem = _resource_name_problem(full)
    if problem:
        raise ctx.error(node, path, f"{value!r} is not a valid extended resource name: {problem}")
    return full


def _device_ref(ctx: _ReadContext, node: yaml.Node, path: str) -> str:
    """A GPU index, MIG index ("gpu:mig"), GPU UUID or MIG UUID, normalised."""
    if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG and ":" not in str(node.value):
        index = _int(ctx, node, path, "a device")
        if not 0 <= index < MAX_DEVICES:
            raise ctx.error(node, path, f"GPU index {index} is out of range 0-{MAX_DEVICES - 1}")
        return str(index)
    # A plain 0:1 is base 60 in YAML 1.1 but a string to NVIDIA's Go YAML: read its text.
    text = str(node.value) if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG else _text(ctx, node, path)
    if _GPU_INDEX.fullmatch(text) and len(text) <= 4 and int(text) < MAX_DEVICES:
        return str(int(text))
    mig = _MIG_INDEX.fullmatch(text)
    if mig and len(mig[1]) <= 4 and len(mig[2]) <= 4 and int(mig[1]) < MAX_DEVICES:
        return f"{int(mig[1])}:{int(mig[2])}"
    if _GPU_UUID.fullmatch(text) or _MIG_UUID.fullmatch(text):
        return text
    raise ctx.error(node, path, f"{text!r} is not a GPU index, MIG index (0:1), GPU UUID or MIG UUID")


def _devices(ctx: _ReadContext, node: yaml.Node, path: str) -> Devices:
    what = "'all', a number of devices or a list of GPU indices, MIG indices and UUIDs"
    if isinstance(node, yaml.ScalarNode) and node.tag == STR_TAG:
        if node.value == "all":
            return "all"
        raise ctx.error(node, path, f"must be {what}; not {node.value!r}")
    if isinstance(node, yaml.ScalarNode):
        count = _int(ctx, node, path, what)
        if not 1 <= count <= MAX_DEVICES:
            raise ctx.error(node, path, f"a number of devices must be from 1 to {MAX_DEVICES}, not {count}")
        return count
    items = _sequence(ctx, node, path)
    if not items:
        raise ctx.error(node, path, "lists no devices; leave devices out to share all")
    refs: list[str] = []
    for item, item_path in items:
        ref = _device_ref(ctx, item, item_path)
        if ref in refs:
            raise ctx.error(item, item_path, f"device {ref} is listed twice")
        refs.append(ref)
    return tuple(refs)


# --- the node walk -------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader's composer with a nesting limit, so deep nesting is an error, not a RecursionError."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH and parent is not None:
                problem = f"nested deeper than {MAX_DEPTH} levels"
                raise yaml.composer.ComposerError(None, None, problem, parent.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _ReadContext:
    """One parse: the file name for messages, and the count of nodes visited so far."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.visited = 0

    def error(self, node: yaml.Node, path: str, message: str) -> ConfigError:
        return _error(self.source, node, path, message)

    def visit(self, node: yaml.Node, path: str) -> None:
        self.visited += 1
        if self.visited > MAX_NODES:
            raise self.error(
                node, path or "top level", f"more than {MAX_NODES} YAML nodes (aliases expanded); refusing to read on"
            )


def _scalar(node: yaml.Node) -> str:
    return str(node.value) if isinstance(node, yaml.ScalarNode) else "<not a scalar>"


def _is_null(node: yaml.Node | None) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == NULL_TAG


def _describe(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value)


def _error(source: str, node: yaml.Node, path: str, message: str) -> ConfigError:
    return ConfigError(f"{source}, line {node.start_mark.line + 1}: {path}: {message}")


def _sequence(ctx: _ReadContext, node: yaml.Node, path: str) -> list[tuple[yaml.Node, str]]:
    """The items of a list with their paths (`path[i]`), each counted as visited."""
    ctx.visit(node, path)
    if not isinstance(node, yaml.SequenceNode):
        raise ctx.error(node, path, f"must be a list, not {_describe(node)}")
    out = []
    for i, item in enumerate(node.value):
        item_path = f"{path}[{i}]"
        ctx.visit(item, item_path)
        out.append((item, item_path))
    return out


class _Map:
    """A YAML mapping node that knows its file and key path, for error messages. Null is empty."""

    def __init__(self, ctx: _ReadContext, node: yaml.Node, path: str) -> None:
        ctx.visit(node, path)
        if not isinstance(node, yaml.MappingNode) and not _is_null(node):
            where = path or "the top level"
            raise ConfigError(f"{ctx.source}, line {node.start_mark.line + 1}: {where} must be a mapping")
        self.ctx = ctx
        self.node = node
        self.path = path

    def items(self, known: tuple[str, ...]) -> dict[str, yaml.Node]:
        """The value node of each key, in file order; unknown and repeated keys are errors."""
        out: dict[str, yaml.Node] = {}
        pairs = self.node.value if isinstance(self.node, yaml.MappingNode) else []
        for key_node, value in pairs:
            key = _scalar(key_node)
            path = f"{self.path}.{key}" if self.path else key
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise self.ctx.error(key_node, path, "YAML merge keys (<<) are not supported; write the keys out")
            if key not in known:
                raise self.ctx.error(key_node, path, f"unknown key; known keys here: {', '.join(known)}")
            if key in out:
                raise self.ctx.error(key_node, path, "given twice")
            out[key] = value
        return out

    def read(self, spec: Mapping[str, tuple[str, Reader]], required: tuple[str, ...] = ()) -> dict[str, Any]:
        """Each key's value through its reader, under its field name; a null value keeps the default."""
        found = self.items(tuple(spec))
        values: dict[str, Any] = {}
        for key, (name, reader) in spec.items():
            path = f"{self.path}.{key}" if self.path else key
            node = found.get(key)
            if node is None or _is_null(node):
                if key in required:
                    raise self.ctx.error(node or self.node, path, "required, and not given")
                continue
            self.ctx.visit(node, path)
            values[name] = reader(self.ctx, node, path)
        return values
