"""Opaque device configuration for this driver: NVIDIA's GpuConfig and MigDeviceConfig
(`resource.nvidia.com/v1beta1`), so that claims written for NVIDIA's DRA driver are read the same.

The scheduler copies the DeviceClass's `config[]` and the claim's into the allocation
(`status.allocation.devices.config[]`, each marked `source: FromClass` or `FromClaim`). Of the
entries for this driver that apply to a request (no `requests`, or one that names it), the class's
come first and later ones win, as NVIDIA's driver takes them. A parameters object is decoded
strictly: an unknown field, a wrong type or a value out of range fails that claim alone, with the
field's path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal

API_VERSION = "resource.nvidia.com/v1beta1"
GPU_CONFIG = "GpuConfig"
MIG_CONFIG = "MigDeviceConfig"
INTERVALS = ("Default", "Short", "Medium", "Long")
# Kubernetes' quantity suffixes, as bytes.
_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")

Strategy = Literal["TimeSlicing", "MPS"]


class OpaqueConfigError(ValueError):
    """A parameters object that NVIDIA's driver would refuse; the message names the field."""


@dataclass(frozen=True)
class ClaimMps:
    # None: each device's default (the equal split is not the driver's to make here).
    active_thread_percentage: int | None = None
    # MiB, for every device; `per_device_mib` (by index among the allocated devices, or UUID) overrides it.
    pinned_memory_mib: int | None = None
    per_device_mib: Mapping[str, int] | None = None


@dataclass(frozen=True)
class ClaimSharing:
    strategy: Strategy
    # TimeSlicing's interval; MPS has none.
    interval: str = "Default"
    mps: ClaimMps | None = None


@dataclass(frozen=True)
class DeviceConfig:
    """One decoded parameters object: its kind, and how its devices are shared (None: not at all), which
    prepare sets up (nvplug.dra.claim_setup)."""

    kind: str
    sharing: ClaimSharing | None = None
    # Where it came from, for the error a device of the wrong type gets.
    where: str = ""


def decode(parameters: Any, where: str) -> DeviceConfig:
    """A parameters object of NVIDIA's API. Raises OpaqueConfigError naming `where` and the field."""
    doc = _object(parameters, where)
    api = doc.get("apiVersion")
    if api != API_VERSION:
        raise OpaqueConfigError(f"{where}: apiVersion {api!r} is not {API_VERSION}")
    kind = doc.get("kind")
    if kind not in (GPU_CONFIG, MIG_CONFIG):
        raise OpaqueConfigError(f"{where}: kind {kind!r} is neither {GPU_CONFIG} nor {MIG_CONFIG}")
    _known(doc, ("apiVersion", "kind", "sharing"), where)
    raw = doc.get("sharing")
    sharing = None if raw is None else _sharing(raw, kind, f"{where}: sharing")
    return DeviceConfig(kind, sharing, where)


def _sharing(raw: Any, kind: str, where: str) -> ClaimSharing:
    doc = _object(raw, where)
    _known(doc, ("strategy", "timeSlicingConfig", "mpsConfig"), where)
    strategy = doc.get("strategy")
    if strategy == "Fabric":
        raise OpaqueConfigError(f"{where}.strategy: the Fabric sharing strategy is not enabled")
    if strategy not in ("TimeSlicing", "MPS"):
        raise OpaqueConfigError(f"{where}.strategy: unknown sharing strategy: {strategy!r} (TimeSlicing or MPS)")
    if strategy == "TimeSlicing":
        if kind == MIG_CONFIG:
            raise OpaqueConfigError(f"{where}.strategy: a MIG device is shared through MPS only, not TimeSlicing")
        if doc.get("mpsConfig") is not None:
            raise OpaqueConfigError(f"{where}: cannot use mpsConfig with the TimeSlicing strategy")
        sliced = _object(doc.get("timeSlicingConfig") or {}, f"{where}.timeSlicingConfig")
        _known(sliced, ("interval",), f"{where}.timeSlicingConfig")
        interval = sliced.get("interval", "Default")
        if interval not in INTERVALS:
            raise OpaqueConfigError(
                f"{where}.timeSlicingConfig.interval: unknown time-slice interval: {interval!r} "
                f"({', '.join(INTERVALS)})"
            )
        return ClaimSharing("TimeSlicing", str(interval))
    if doc.get("timeSlicingConfig") is not None:
        raise OpaqueConfigError(f"{where}: cannot use timeSlicingConfig with the MPS strategy")
    return ClaimSharing("MPS", mps=_mps(doc.get("mpsConfig") or {}, f"{where}.mpsConfig"))


def _mps(raw: Any, where: str) -> ClaimMps:
    doc = _object(raw, where)
    keys = ("defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit", "defaultPerDevicePinnedMemoryLimit")
    _known(doc, keys, where)
    percentage = doc.get("defaultActiveThreadPercentage")
    if percentage is not None:
        if not isinstance(percentage, int) or isinstance(percentage, bool):
            raise OpaqueConfigError(f"{where}.defaultActiveThreadPercentage: {percentage!r} is not an integer")
        if not 0 <= percentage <= 100:
            raise OpaqueConfigError(f"{where}.defaultActiveThreadPercentage: {percentage} is not between 0 and 100")
    pinned = doc.get("defaultPinnedDeviceMemoryLimit")
    per_key = f"{where}.defaultPerDevicePinnedMemoryLimit"
    per_device = _object(doc.get("defaultPerDevicePinnedMemoryLimit") or {}, per_key)
    return ClaimMps(
        percentage,
        None if pinned is None else mebibytes(pinned, f"{where}.defaultPinnedDeviceMemoryLimit"),
        {str(k): mebibytes(v, f"{per_key}[{k}]") for k, v in per_device.items()} or None,
    )


def mebibytes(value: Any, where: str) -> int:
    """A Kubernetes quantity (`10Gi`, `512Mi`, `1G`) in whole MiB, at least 1, as the MPS limits take it."""
    text = str(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    found = _QUANTITY.fullmatch(text) if text is not None else None
    if found is None:
        raise OpaqueConfigError(f"{where}: {value!r} is not a quantity (e.g. 10Gi, 512Mi)")
    try:
        mib = int(Decimal(found.group(1)) * _SUFFIXES[found.group(2) or ""] // 2**20)
    except ArithmeticError as err:  # decimal's InvalidOperation and Overflow: 1e40, 1e999999999
        raise OpaqueConfigError(f"{where}: {value!r} is not a quantity nvplug can take") from err
    if mib < 1:
        raise OpaqueConfigError(f"{where}: {value!r} is too low: a limit is at least 1Mi")
    return mib


def applicable(allocation: Mapping[str, Any], driver: str) -> list[tuple[tuple[str, ...], Any, str]]:
    """This driver's opaque entries of the allocation, the class's first: (requests, parameters, where)."""
    entries = [e for e in (allocation.get("devices") or {}).get("config") or [] if isinstance(e, dict)]
    out = []
    for source in ("FromClass", "FromClaim"):
        for n, entry in enumerate(entries):
            opaque = entry.get("opaque") or {}
            if entry.get("source") != source or opaque.get("driver") != driver:
                continue
            where = f"config[{n}] ({'the DeviceClass' if source == 'FromClass' else 'the claim'})"
            out.append((tuple(str(r) for r in entry.get("requests") or ()), opaque.get("parameters"), where))
    return out


def for_request(entries: Sequence[tuple[tuple[str, ...], Any, str]], request: str) -> DeviceConfig | None:
    """The config that applies to a request (`req` or its subrequest `req/sub`): the last entry for it."""
    parent = request.split("/")[0]
    chosen = None
    for requests, parameters, where in entries:
        if not requests or request in requests or parent in requests:
            chosen = (parameters, where)
    return None if chosen is None else decode(*chosen)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise OpaqueConfigError(f"{where}: must be an object, not {type(value).__name__}")
    return value


def _known(doc: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(doc) - set(keys))
    if unknown:
        raise OpaqueConfigError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(keys)})")
