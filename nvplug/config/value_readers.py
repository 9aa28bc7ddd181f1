"""Readers of single config values from YAML nodes: the type, range and form each key accepts.

Every reader takes the parse's context, the value's node and its key path, and returns the value
or raises a ConfigError that names the file, the line and the key.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import yaml

from nvplug.config.yaml_reader import (
    BOOL_TAG,
    FLOAT_TAG,
    INT_TAG,
    STR_TAG,
    ReadContext,
    describe,
    sequence,
)

Reader = Callable[[ReadContext, yaml.Node, str], Any]

MAX_XID = 1 << 16
# Each replica is a device ID in every ListAndWatch message; beyond this the kubelet suffers.
MAX_REPLICAS = 1024
MAX_DEVICES = 1024
# NVIDIA's short resource names ("gpu") are in this domain.
RESOURCE_DOMAIN = "nvidia.com"
# CDI limits the name part of an annotation key (after the prefix's "/") to this.
MAX_ANNOTATION_NAME = 63
# What nvplug appends to the prefix: "nvplug_" and 16 hex digits.
ANNOTATION_KEY_LENGTH = 23

# Which devices a replicated resource covers: all of them, the first N, or a list of
# GPU indices ("0"), MIG indices ("0:1"), GPU UUIDs and MIG UUIDs.
Devices = Literal["all"] | int | tuple[str, ...]

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_UUID = r"([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}|[0-9a-fA-F]{32})"
GPU_UUID = re.compile(rf"GPU-{_UUID}")
_MIG_UUID = re.compile(rf"MIG-({_UUID}|GPU-{_UUID}/[0-9]+/[0-9]+)")
_GPU_INDEX = re.compile(r"[0-9]+")
MIG_INDEX = re.compile(r"([0-9]+):([0-9]+)")
# Go's time.ParseDuration format, which NVIDIA's durations use.
_GO_DURATION = re.compile(r"[-+]?(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+|0")


def string(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    value = any_string(ctx, node, path)
    if not value:
        raise ctx.error(node, path, "must not be empty")
    return value


def any_string(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    if not isinstance(node, yaml.ScalarNode) or node.tag != STR_TAG:
        raise ctx.error(node, path, f"must be a string, not {describe(node)}")
    return str(node.value)


def file_path(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    value = string(ctx, node, path)
    if "\0" in value:
        raise ctx.error(node, path, "must not contain a NUL character")
    return value


def absolute_path(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    value = file_path(ctx, node, path)
    if not value.startswith("/"):
        raise ctx.error(node, path, f"{value!r} is not an absolute path")
    return value


def _off_or(read: Callable[[ReadContext, yaml.Node, str], str], ctx: ReadContext, node: yaml.Node, path: str) -> str:
    """`off` as the key means it, though YAML 1.1 reads a bare `off` as false."""
    if isinstance(node, yaml.ScalarNode) and node.tag == BOOL_TAG and str(node.value).lower() == "off":
        return "off"
    return read(ctx, node, path)


def off_or_absolute(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    value = _off_or(file_path, ctx, node, path)
    if value != "off" and not value.startswith("/"):
        raise ctx.error(node, path, f"{value!r} is neither off nor an absolute path")
    return value


def kubeconfig_choice(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    """auto, kubelet (the kubelet's own credentials), or a kubeconfig's absolute path."""
    value = file_path(ctx, node, path)
    if value not in ("auto", "kubelet") and not value.startswith("/"):
        raise ctx.error(node, path, f"{value!r} is neither auto, kubelet nor an absolute path")
    return value


def boolean(ctx: ReadContext, node: yaml.Node, path: str) -> bool:
    if isinstance(node, yaml.ScalarNode) and node.tag == BOOL_TAG:
        # An explicit !!bool tag can sit on any word: only YAML's booleans count.
        value = yaml.constructor.SafeConstructor.bool_values.get(str(node.value).lower())
        if value is not None:
            return value
    raise ctx.error(node, path, f"must be true or false, not {describe(node)}")


def choice(options: Any) -> Reader:
    """A reader for one of the strings of a Literal type."""
    allowed: tuple[str, ...] = get_args(options)

    def read(ctx: ReadContext, node: yaml.Node, path: str) -> str:
        value = any_string(ctx, node, path)
        if value not in allowed:
            raise ctx.error(node, path, f"must be one of {', '.join(allowed)}; not {value!r}")
        return value

    return read


def choices(options: Any) -> Reader:
    """A reader for one or more different strings of a Literal type: a string, or a list of them."""
    one = choice(options)

    def read(ctx: ReadContext, node: yaml.Node, path: str) -> tuple[str, ...]:
        items = [(node, path)] if isinstance(node, yaml.ScalarNode) else sequence(ctx, node, path)
        if not items:
            raise ctx.error(node, path, f"must name at least one of {', '.join(get_args(options))}")
        return each_once(ctx, items, one)

    return read


def yaml_int(text: str) -> int | None:
    """The value of a YAML 1.1 int scalar; None for base-60 ("1:30"), which Go's YAML reads as a string."""
    text = text.replace("_", "")
    try:
        return int(text, 0)
    except ValueError:
        pass
    if re.fullmatch(r"[-+]?0[0-7]+", text):  # YAML 1.1 octal: 017
        return int(text, 8)
    return None


def integer(ctx: ReadContext, node: yaml.Node, path: str, what: str = "an integer") -> int:
    value = yaml_int(str(node.value)) if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG else None
    if value is None:
        raise ctx.error(node, path, f"must be {what}, not {describe(node)}")
    return value


def int_range(low: int, high: int, what: str) -> Reader:
    def read(ctx: ReadContext, node: yaml.Node, path: str) -> int:
        value = integer(ctx, node, path, what)
        if not low <= value <= high:
            raise ctx.error(node, path, f"must be from {low} to {high}, not {value}")
        return value

    return read


_MEMORY_SIZE = re.compile(r"([0-9]{1,9})([MG])")


def memory_size(ctx: ReadContext, node: yaml.Node, path: str) -> int:
    """A size in MiB, written as MPS takes it: `4096M` or `2G`."""
    text = str(node.value) if isinstance(node, yaml.ScalarNode) else ""
    found = _MEMORY_SIZE.fullmatch(text)
    if found is None or not isinstance(node, yaml.ScalarNode) or node.tag != STR_TAG:
        raise ctx.error(node, path, f"must be a size such as 4096M or 2G, not {describe(node)}")
    mib = int(found[1]) * (1024 if found[2] == "G" else 1)
    if mib <= 0:
        raise ctx.error(node, path, "must be above zero")
    return mib


def positive_seconds(ctx: ReadContext, node: yaml.Node, path: str) -> float:
    value = _seconds(ctx, node, path)
    if not 0 < value < 1e9:
        raise ctx.error(node, path, f"must be positive, not {node.value}")
    return value


def positive_rate(ctx: ReadContext, node: yaml.Node, path: str) -> float:
    """A rate per second, above zero."""
    return positive_seconds(ctx, node, path)


def seconds_or_zero(ctx: ReadContext, node: yaml.Node, path: str) -> float:
    value = _seconds(ctx, node, path)
    if not 0 <= value < 1e9:
        raise ctx.error(node, path, f"must be zero or positive, not {node.value}")
    return value


def _seconds(ctx: ReadContext, node: yaml.Node, path: str) -> float:
    value: float | None = None
    if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG:
        as_int = yaml_int(str(node.value))
        value = None if as_int is None else float(as_int)
    elif isinstance(node, yaml.ScalarNode) and node.tag == FLOAT_TAG:
        try:
            value = float(str(node.value).replace("_", ""))
        except ValueError:
            value = None
    if value is None:
        raise ctx.error(node, path, f"must be a number, not {describe(node)}")
    return value


def xid_list(ctx: ReadContext, node: yaml.Node, path: str) -> frozenset[int]:
    if not isinstance(node, yaml.SequenceNode):
        raise ctx.error(node, path, "must be a list of XID numbers")
    codes = set()
    for item, item_path in sequence(ctx, node, path):
        code = integer(ctx, item, item_path, "an XID number")
        if not 0 < code < MAX_XID:
            raise ctx.error(item, item_path, f"{code} is not an XID number")
        codes.add(code)
    return frozenset(codes)


def command_line(ctx: ReadContext, node: yaml.Node, path: str) -> tuple[str, ...]:
    """A command: a list of its arguments (empty: none), or one string split as a shell would (no
    shell runs it)."""
    if not isinstance(node, yaml.ScalarNode):
        return string_list(ctx, node, path)
    try:
        argv = tuple(shlex.split(string(ctx, node, path)))
    except ValueError as err:
        raise ctx.error(node, path, f"is not a command line: {err}") from err
    if not argv:
        raise ctx.error(node, path, "names no command")
    return argv


def string_list(ctx: ReadContext, node: yaml.Node, path: str) -> tuple[str, ...]:
    """A string or a list of strings, as NVIDIA's list-valued flags take."""
    if isinstance(node, yaml.ScalarNode):
        return (string(ctx, node, path),)
    return tuple(string(ctx, item, item_path) for item, item_path in sequence(ctx, node, path))


def go_duration(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    """A Go duration, as written (only checked: nothing of nvplug's takes one)."""
    if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG and yaml_int(str(node.value)) is not None:
        return str(node.value)  # nanoseconds
    if not _GO_DURATION.fullmatch(any_string(ctx, node, path)):
        raise ctx.error(node, path, f"must be a duration such as 60s or 1m30s, not {node.value!r}")
    return str(node.value)


def dns_subdomain(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    value = string(ctx, node, path)
    if len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value):
        raise ctx.error(node, path, f"{value!r} is not a DNS subdomain (lower case letters, digits, '-' and '.')")
    return value


def driver_name(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    value = dns_subdomain(ctx, node, path)
    # A driver name is also the domain of its device attributes, which allows 63 characters.
    if len(value) > 63:
        raise ctx.error(node, path, f"{value!r} is longer than 63 characters")
    return value


def listen_problem(value: str) -> str | None:
    """Why `value` is not `off`, `unix:/absolute/path` or `host:port` (no host: 127.0.0.1), or None."""
    if value == "off" or (value.startswith("unix:/") and "\0" not in value):
        return None
    _, colon, port = value.rpartition(":")
    # ASCII digits only: str.isdigit() also takes ² and Arabic-Indic digits.
    if colon and port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536:
        return None
    return f"{value!r} is not off, unix:/absolute/path or host:port"


def tcp_address(listen: str) -> tuple[str, int]:
    """The host and port of a `host:port` address, as a socket takes them: no host is the loopback, and an
    IPv6 address loses the brackets it is written in before its port ([::1]:9400). Raises ValueError."""
    host, colon, port = listen.rpartition(":")
    if not colon or not port.isascii() or not port.isdigit():
        raise ValueError(f"{listen!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


def listen_address(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    value = _off_or(string, ctx, node, path)
    problem = listen_problem(value)
    if problem is not None:
        raise ctx.error(node, path, problem)
    return value


def annotation_prefix(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    """`domain/` or `domain/start`: what comes after the "/" and our key's own part must fit CDI's 63."""
    value = string(ctx, node, path)
    domain, slash, start = value.partition("/")
    if not slash or not _DNS_SUBDOMAIN.fullmatch(domain):
        raise ctx.error(node, path, f"{value!r} is not a DNS domain followed by '/', like cdi.k8s.io/")
    if len(start) + ANNOTATION_KEY_LENGTH > MAX_ANNOTATION_NAME:
        raise ctx.error(
            node, path, f"{value!r} leaves annotation keys longer than {MAX_ANNOTATION_NAME} characters after the '/'"
        )
    return value


def channel_ids(ctx: ReadContext, node: yaml.Node, path: str) -> tuple[int, ...]:
    ids = tuple(integer(ctx, item, item_path, "a channel ID") for item, item_path in sequence(ctx, node, path))
    # NVIDIA's only valid settings so far.
    if ids not in ((), (0,)):
        raise ctx.error(node, path, f"must be [] or [0], not {list(ids)}")
    return ids


def resource_name_problem(full: str) -> str | None:
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


def resource_name(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    value = string(ctx, node, path)
    # NVIDIA's short form: "gpu" is nvidia.com/gpu.
    full = value if "/" in value else f"{RESOURCE_DOMAIN}/{value}"
    problem = resource_name_problem(full)
    if problem:
        raise ctx.error(node, path, f"{value!r} is not a valid extended resource name: {problem}")
    return full


def _device_ref(ctx: ReadContext, node: yaml.Node, path: str) -> str:
    """A GPU index, MIG index ("gpu:mig"), GPU UUID or MIG UUID, normalised."""
    if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG and ":" not in str(node.value):
        index = integer(ctx, node, path, "a device")
        if not 0 <= index < MAX_DEVICES:
            raise ctx.error(node, path, f"GPU index {index} is out of range 0-{MAX_DEVICES - 1}")
        return str(index)
    # A plain 0:1 is base 60 in YAML 1.1 but a string to NVIDIA's Go YAML: read its text.
    as_int = isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG
    text = str(node.value) if as_int else any_string(ctx, node, path)
    if _GPU_INDEX.fullmatch(text) and len(text) <= 4 and int(text) < MAX_DEVICES:
        return str(int(text))
    mig = MIG_INDEX.fullmatch(text)
    if mig and len(mig[1]) <= 4 and len(mig[2]) <= 4 and int(mig[1]) < MAX_DEVICES:
        return f"{int(mig[1])}:{int(mig[2])}"
    if GPU_UUID.fullmatch(text) or _MIG_UUID.fullmatch(text):
        return text
    raise ctx.error(node, path, f"{text!r} is not a GPU index, MIG index (0:1), GPU UUID or MIG UUID")


def shared_devices(ctx: ReadContext, node: yaml.Node, path: str) -> Devices:
    what = "'all', a number of devices or a list of GPU indices, MIG indices and UUIDs"
    if isinstance(node, yaml.ScalarNode) and node.tag == STR_TAG:
        if node.value == "all":
            return "all"
        raise ctx.error(node, path, f"must be {what}; not {node.value!r}")
    if isinstance(node, yaml.ScalarNode):
        count = integer(ctx, node, path, what)
        if not 1 <= count <= MAX_DEVICES:
            raise ctx.error(node, path, f"a number of devices must be from 1 to {MAX_DEVICES}, not {count}")
        return count
    items = sequence(ctx, node, path)
    if not items:
        raise ctx.error(node, path, "lists no devices; leave devices out to share all")
    return each_once(ctx, items, _device_ref, lambda ref: f"device {ref}")


def each_once(
    ctx: ReadContext,
    items: Sequence[tuple[yaml.Node, str]],
    item: Reader,
    named: Callable[[Any], str] = str,
) -> tuple[Any, ...]:
    """What `item` reads of each, each value once (after reading: `gpu` and nvidia.com/gpu are one); a
    value given again is refused at its own line, as `named` says it."""
    values: list[Any] = []
    for each, each_path in items:
        value = item(ctx, each, each_path)
        if value in values:
            raise ctx.error(each, each_path, f"{named(value)} is listed twice")
        values.append(value)
    return tuple(values)


def unique_list(item: Reader) -> Reader:
    """A list of what `item` reads, each value once."""
    return lambda ctx, node, path: each_once(ctx, sequence(ctx, node, path), item)


# Lists of absolute paths, of resource names (`gpu` is nvidia.com/gpu).
absolute_paths = unique_list(absolute_path)
resource_names = unique_list(resource_name)
