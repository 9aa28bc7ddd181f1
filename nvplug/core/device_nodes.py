"""The driver's /dev nodes: the control nodes every container gets, and where a node lives on the host."""

from __future__ import annotations

from pathlib import Path

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


def host_path(dev_root: Path, path: str) -> str:
    """Where a container's /dev/... node lives on the host: under the driver's dev root."""
    return str(dev_root / path.lstrip("/"))
