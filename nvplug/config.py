"""The YAML config: a superset of NVIDIA's device-plugin config, version v1.

This is the skeleton the full schema grows on: it loads the file, knows the
top-level sections and reports problems by file, key and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

DEFAULT_PATH = Path("/etc/nvplug/config.yaml")
# NVIDIA's v1 sections, plus our own under `nvplug:`.
SECTIONS = ("version", "flags", "resources", "sharing", "imex", "nvplug")
MAX_BYTES = 1 << 20


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Config:
    source: str = "built-in defaults"
    resource_name: str = "nvidia.com/gpu"


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
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{source}, line {root.start_mark.line + 1}: the top level must be a mapping")
    for key_node, value_node in root.value:
        key = key_node.value
        line = key_node.start_mark.line + 1
        if key not in SECTIONS:
            raise ConfigError(f"{source}, line {line}: unknown key {key!r}; known keys: {', '.join(SECTIONS)}")
        if key == "version" and value_node.value != "v1":
            raise ConfigError(f"{source}, line {line}: version {value_node.value!r} is not supported; use v1")
    return Config(source=source)
