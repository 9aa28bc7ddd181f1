"""Loading the YAML config: a superset of NVIDIA's k8s-device-plugin config file, version v1.

The keys, their types, defaults and readers are declared once, on the model's fields (model.py, nvidia_sections.py);
this module reads a file through those declarations, adds the checks that cross keys, and writes
the config back as YAML. Every unknown key, wrong type and impossible value is an error that names
the file, the key path and the line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from nvplug.config.model import DEFAULT_PATH, SECTIONS, Config, HealthConfig, MpsLimits, TelemetryConfig
from nvplug.config.nvidia_sections import (
    GPU_RESOURCE,
    SHARED_SUFFIX,
    Flags,
    ReplicatedResource,
    ReplicatedResources,
    ResourcePattern,
    Resources,
    Sharing,
)
from nvplug.config.schema import Finish, Found, known_keys, read_grouped, shown
from nvplug.config.selectors import covers
from nvplug.config.value_readers import Devices, resource_name_problem
from nvplug.config.yaml_reader import MAX_BYTES, ConfigError, NodeMap, ReadContext, compose, is_null, scalar


def off_or_path(value: str) -> Path | None:
    """A path key that may be `off` (nvplug.cdi.specDir, labels.featureFile, podResources.socket)."""
    return None if value == "off" else Path(value)


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
    root = compose(text, source)
    if root is None:
        return Config(source=source)
    ctx = ReadContext(source)
    found = NodeMap(ctx, root, "").items(SECTIONS)
    version = found.get("version")
    if version is not None and not is_null(version) and scalar(version) != "v1":
        raise ctx.error(version, "version", f"{scalar(version)!r} is not supported; use v1")
    cfg = Config(source=source, **read_grouped(Config, ctx, root, found, _FINISH))
    cdi = [s for s in cfg.flags.plugin.device_list_strategy if s.startswith("cdi")]
    if cdi and cfg.cdi_spec_dir == "off":
        node = _key_node(ctx, found["nvplug"], "nvplug", known_keys(Config, "nvplug"), "cdi")
        raise ctx.error(
            node,
            "nvplug.cdi.specDir",
            f"is off, but flags.plugin.deviceListStrategy {cdi} hands out CDI names that nothing would define",
        )
    sliced = cfg.sharing.time_slicing.shared_devices_allocation_policy
    flagged = cfg.flags.plugin.shared_devices_allocation_policy
    if sliced is not None and flagged is not None and sliced != flagged:
        node = _key_node(ctx, found["sharing"], "sharing", known_keys(Sharing), "timeSlicing")
        raise ctx.error(
            node,
            "sharing.timeSlicing.sharedDevicesAllocationPolicy",
            f"{sliced} disagrees with flags.plugin.sharedDevicesAllocationPolicy: {flagged}",
        )
    if cfg.dra.extended_resources and not cfg.dra.enabled:
        node = _key_node(ctx, found["nvplug"], "nvplug", known_keys(Config, "nvplug"), "dra")
        raise ctx.error(node, "nvplug.dra.extendedResources", "needs nvplug.dra.enabled: true (DRA serves them)")
    # A GPU goes to DRA by its model's name: one no model can have (a typo) would give DRA nothing, and the
    # device plugin an empty resource of that name.
    models = list(dict.fromkeys([*(r.name for r in cfg.resources.gpus), GPU_RESOURCE]))
    unknown = [n for n in cfg.dra.extended_resources if n not in models]
    if unknown:
        node = _key_node(ctx, found["nvplug"], "nvplug", known_keys(Config, "nvplug"), "dra")
        why = (
            f"{unknown[0]} is no whole GPU's name (resources.gpus names {', '.join(models)}); "
            "a MIG device or a shared replica is not served by name"
        )
        raise ctx.error(node, "nvplug.dra.extendedResources", why)
    if cfg.dra.enabled and cfg.cdi_spec_dir == "off":
        node = _key_node(ctx, found["nvplug"], "nvplug", known_keys(Config, "nvplug"), "dra")
        raise ctx.error(
            node,
            "nvplug.dra.enabled",
            "needs the CDI spec (nvplug.cdi.specDir is off): NodePrepareResources hands out CDI device names",
        )
    if cfg.flags.mig_strategy == "mixed":
        # A resource holds whole GPUs or MIG devices, never both: Allocate hands out one kind.
        whole = {r.name: r for r in cfg.resources.gpus}
        for r in cfg.resources.mig:
            clash = whole.get(r.name) or (
                ResourcePattern("*", r.name, "the default") if r.name == GPU_RESOURCE else None
            )
            if clash is not None:
                raise ConfigError(
                    f"{r.where}.name: {r.name} also names whole GPUs ({clash.where}) under "
                    "flags.migStrategy: mixed; MIG devices need a name of their own"
                )
    mps_names = {r.advertised_name for r in cfg.sharing.mps.resources}
    for limits in cfg.mps.resources:
        if limits.name not in mps_names:
            known = ", ".join(sorted(mps_names)) or "none"
            raise ConfigError(
                f"{limits.where}.name: {limits.name} is no MPS resource of sharing.mps (those are: {known})"
            )
    return cfg


def to_yaml(cfg: Config) -> str:
    """The config as YAML in NVIDIA's keys, every default filled in; `parse` reads it back the same."""
    return yaml.safe_dump(as_dict(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True)


def as_dict(cfg: Config) -> dict[str, Any]:
    values = shown(cfg)
    return {section: "v1" if section == "version" else values[section] for section in SECTIONS}


def _key_node(ctx: ReadContext, node: yaml.Node, path: str, known: tuple[str, ...], key: str) -> yaml.Node:
    """The value node of one key of a mapping read before, for a message about it."""
    return NodeMap(ctx, node, path).items(known)[key]


# --- what a section's declared keys cannot say alone -----------------------------------


def _health(found: Found, values: dict[str, Any]) -> HealthConfig:
    cfg = HealthConfig(**values)
    both = cfg.ignore_xids & cfg.fatal_xids
    if both:
        raise found.error(f"XIDs {sorted(both)} are both in ignoreXids and fatalXids")
    if cfg.reprobe_max_seconds < cfg.reprobe_initial_seconds:
        raise found.error("reprobeMaxSeconds is below reprobeInitialSeconds")
    if cfg.driver_hang_seconds < cfg.nvml_call_deadline_seconds:
        raise found.error("driverHangSeconds is below nvmlCallDeadlineSeconds")
    return cfg


def _telemetry(found: Found, values: dict[str, Any]) -> TelemetryConfig:
    cfg = TelemetryConfig(**values)
    if cfg.pod_labels and cfg.naming != "dcgm":
        raise found.ctx.error(
            found.nodes["podLabels"],
            f"{found.path}.podLabels",
            "puts pod labels on the dcgm naming's series, as dcgm-exporter's --kubernetes does; nvplug's naming "
            "has nvplug_container_gpu_* per container instead",
        )
    if cfg.pod_label_names == "legacy" and cfg.naming != "dcgm":
        raise found.ctx.error(
            found.nodes["podLabelNames"],
            f"{found.path}.podLabelNames",
            "legacy names are dcgm-exporter's (--use-old-namespace), for the dcgm naming; nvplug's naming keeps "
            "pod, namespace and container",
        )
    return cfg


def _flags(found: Found, values: dict[str, Any]) -> Flags:
    # nvidiaDevRoot, when the file leaves it out: the driver root, as NVIDIA does.
    values.setdefault("nvidia_dev_root", values.get("nvidia_driver_root", Flags.nvidia_driver_root))
    return Flags(**values)


def _resources(found: Found, values: dict[str, Any]) -> Resources:
    # NVIDIA adds its default GPU resource to an empty list too.
    if not values.get("gpus"):
        values.pop("gpus", None)
    return Resources(**values)


def _resource_pattern(found: Found, values: dict[str, Any]) -> ResourcePattern:
    resource = ResourcePattern(**values, where=found.where)
    # First match wins: an entry whose every match an earlier one takes would name those devices
    # twice, and the second name would never be given.
    earlier: tuple[ResourcePattern, ...] = found.earlier
    first = next((r for r in earlier if covers(r.pattern, resource.pattern)), None)
    if first is not None:
        if first.name == resource.name:
            twice = "names the same devices again"
        else:
            twice = f"would give the devices it matches a second name, {resource.name}"
        raise found.ctx.error(
            found.node,
            f"{found.path}.pattern",
            f"{resource.pattern!r} {twice}: every one of them already matches {first.pattern!r} "
            f"({first.name}, {first.where}), and the first match wins",
        )
    return resource


def _sharing(found: Found, values: dict[str, Any]) -> Sharing:
    sharing = Sharing(**values)
    if not sharing.mps.resources:
        return sharing
    mps = _key_node(found.ctx, found.node, found.path, known_keys(Sharing), "mps")
    if sharing.time_slicing.resources:
        raise found.ctx.error(
            mps, f"{found.path}.mps", "time-slicing and MPS are mutually exclusive; configure one of them"
        )
    # NVIDIA forces it: one MPS client per container, whose limits are one replica's share.
    forced = NodeMap(found.ctx, mps, f"{found.path}.mps").items(known_keys(ReplicatedResources))
    flag = forced.get("failRequestsGreaterThanOne")
    if flag is not None and not is_null(flag) and not sharing.mps.fail_requests_greater_than_one:
        raise found.ctx.error(
            flag,
            f"{found.path}.mps.failRequestsGreaterThanOne",
            "must be true for MPS: a container gets one replica, and its limits",
        )
    return Sharing(sharing.time_slicing, replace(sharing.mps, fail_requests_greater_than_one=True))


def _mps_limits(found: Found, values: dict[str, Any]) -> MpsLimits:
    limits = MpsLimits(**values, where=found.where)
    earlier: tuple[MpsLimits, ...] = found.earlier
    if any(e.name == limits.name for e in earlier):
        raise found.ctx.error(found.nodes["name"], f"{found.path}.name", f"{limits.name} is listed twice")
    return limits


def _replicated_resource(found: Found, read: dict[str, Any]) -> ReplicatedResource:
    ctx, fields, item_path = found.ctx, found.nodes, found.path
    earlier: tuple[ReplicatedResource, ...] = found.earlier
    name = read["name"]
    read["where"] = found.where
    for other in (r for r in earlier if r.name == name):
        both = _overlap(other.devices, read.get("devices", "all"))
        if both:
            node = fields.get("devices", fields["name"])
            raise ctx.error(
                node,
                f"{item_path}.devices",
                f"{both} of {name} also shared by {other.where}: each device may be picked by one entry of a resource",
            )
    if "rename" not in read and found.enclosing.get("rename_by_default", False):
        read["rename"] = name + SHARED_SUFFIX
        problem = resource_name_problem(read["rename"])
        if problem:
            raise ctx.error(fields["name"], f"{item_path}.name", f"renamed by default to {read['rename']}: {problem}")
    resource = ReplicatedResource(**read)
    if resource.advertised_name in {r.advertised_name for r in earlier}:
        where = "rename" if "rename" in fields else "name"
        raise ctx.error(fields[where], f"{item_path}.{where}", f"{resource.advertised_name} is advertised twice")
    return resource


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


_FINISH: Mapping[type, Finish] = {
    HealthConfig: _health,
    TelemetryConfig: _telemetry,
    Flags: _flags,
    Resources: _resources,
    ResourcePattern: _resource_pattern,
    Sharing: _sharing,
    ReplicatedResource: _replicated_resource,
    MpsLimits: _mps_limits,
}
