"""The YAML config: a superset of NVIDIA's device-plugin config, version v1.

NVIDIA's sections are accepted as they are (their full schema comes later);
nvplug's own keys live under `nvplug:` and are checked here. Every problem is
reported with the file, the key path and the line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_PATH = Path("/etc/nvplug/config.yaml")
# NVIDIA's v1 sections, plus our own under `nvplug:`.
SECTIONS = ("version", "flags", "resources", "sharing", "imex", "nvplug")
MAX_BYTES = 1 << 20
MAX_XID = 1 << 16


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
class Config:
    source: str = "built-in defaults"
    resource_name: str = "nvidia.com/gpu"
    health: HealthConfig = field(default_factory=HealthConfig)


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
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from err
    if root is None:
        return Config(source=source)
    top = _Mapping(root, source, "")
    health = HealthConfig()
    for key, node in top.items(SECTIONS):
        if key == "version" and _scalar(node) != "v1":
            raise _error(source, node, "version", f"{_scalar(node)!r} is not supported; use v1")
        if key == "nvplug":
            for sub, sub_node in _Mapping(node, source, "nvplug").items(("health",)):
                if sub == "health":
                    health = _health(_Mapping(sub_node, source, "nvplug.health"))
    return Config(source=source, health=health)


def _health(section: _Mapping) -> HealthConfig:
    values: dict[str, Any] = {}
    keys = {
        "ignoreXids": ("ignore_xids", section.xid_list),
        "fatalXids": ("fatal_xids", section.xid_list),
        "reprobeInitialSeconds": ("reprobe_initial_seconds", section.positive_number),
        "reprobeMaxSeconds": ("reprobe_max_seconds", section.positive_number),
    }
    for key, node in section.items(tuple(keys)):
        name, read = keys[key]
        values[name] = read(key, node)
    cfg = HealthConfig(**values)
    both = cfg.ignore_xids & cfg.fatal_xids
    if both:
        raise ConfigError(f"{section.source}: nvplug.health: XIDs {sorted(both)} are both in ignoreXids and fatalXids")
    if cfg.reprobe_max_seconds < cfg.reprobe_initial_seconds:
        raise ConfigError(f"{section.source}: nvplug.health: reprobeMaxSeconds is below reprobeInitialSeconds")
    return cfg


def _scalar(node: yaml.Node) -> str:
    return str(node.value) if isinstance(node, yaml.ScalarNode) else "<not a scalar>"


def _error(source: str, node: yaml.Node, path: str, message: str) -> ConfigError:
    return ConfigError(f"{source}, line {node.start_mark.line + 1}: {path}: {message}")


class _Mapping:
    """A YAML mapping node that knows its file and key path, for error messages."""

    def __init__(self, node: yaml.Node, source: str, path: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            where = path or "the top level"
            raise ConfigError(f"{source}, line {node.start_mark.line + 1}: {where} must be a mapping")
        self.node = node
        self.source = source
        self.path = path

    def items(self, known: tuple[str, ...]) -> list[tuple[str, yaml.Node]]:
        seen: set[str] = set()
        out = []
        for key_node, value in self.node.value:
            key = _scalar(key_node)
            path = f"{self.path}.{key}" if self.path else key
            if key not in known:
                raise _error(self.source, key_node, path, f"unknown key; known keys here: {', '.join(known)}")
            if key in seen:
                raise _error(self.source, key_node, path, "given twice")
            seen.add(key)
            out.append((key, value))
        return out

    def _typed(self, key: str, node: yaml.Node, convert: Callable[[str], Any], what: str) -> Any:
        path = f"{self.path}.{key}"
        if not isinstance(node, yaml.ScalarNode) or node.tag not in {
            "tag:yaml.org,2002:int",
            "tag:yaml.org,2002:float",
        }:
            raise _error(self.source, node, path, f"must be {what}, not {_scalar(node)!r}")
        try:
            return convert(node.value)
        except ValueError:
            raise _error(self.source, node, path, f"must be {what}, not {node.value!r}") from None

    def positive_number(self, key: str, node: yaml.Node) -> float:
        value = float(self._typed(key, node, float, "a number"))
        if not 0 < value < 1e9:
            raise _error(self.source, node, f"{self.path}.{key}", f"must be positive, not {node.value}")
        return value

    def xid_list(self, key: str, node: yaml.Node) -> frozenset[int]:
        path = f"{self.path}.{key}"
        if not isinstance(node, yaml.SequenceNode):
            raise _error(self.source, node, path, "must be a list of XID numbers")
        codes = set()
        for item in node.value:
            code = int(self._typed(key, item, lambda v: int(v, 0), "an XID number"))
            if not 0 < code < MAX_XID:
                raise _error(self.source, item, path, f"{code} is not an XID number")
            codes.add(code)
        return frozenset(codes)
