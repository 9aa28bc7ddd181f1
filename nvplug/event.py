"""Typed events: what sources tell the core. Small, frozen, and free of I/O handles."""

from __future__ import annotations

from dataclasses import dataclass

from .gpu import Gpu
from .health import Health


@dataclass(frozen=True)
class InventoryFound:
    """A full discovery: these GPUs are present, any other is gone."""

    gpus: tuple[Gpu, ...]


@dataclass(frozen=True)
class NvmlFailed:
    """NVML cannot be used at all; the error text is the library's."""

    reason: str


@dataclass(frozen=True)
class HealthReported:
    """Evidence about one GPU's health, with the reason an operator will read."""

    uuid: str
    health: Health
    reason: str


@dataclass(frozen=True)
class KubeletSocketCreated:
    """A (new) kubelet.sock appeared: the kubelet started or restarted."""


@dataclass(frozen=True)
class PluginSocketRemoved:
    """One of our own sockets vanished, as when the kubelet restarts."""

    path: str


Event = InventoryFound | NvmlFailed | HealthReported | KubeletSocketCreated | PluginSocketRemoved
