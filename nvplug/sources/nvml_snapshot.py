"""One NVML scan folded into a Snapshot, for the commands that answer without the daemon."""

from __future__ import annotations

from pathlib import Path

from nvplug.core.events import InventoryFound
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import Snapshot


def scan_snapshot(sysfs_root: Path, proc_root: Path) -> Snapshot:
    """The node as one scan sees it, through the same state code the daemon uses. Raises NvmlUnavailable."""
    from nvplug.sources.nvml_discovery import Nvml

    found = Nvml(sysfs_root, proc_root).scan().discovery
    state = NodeState()
    state.apply(
        InventoryFound(
            found.gpus,
            topology=found.topology,
            cap_minors=found.cap_minors,
            driver_instance=found.driver_instance,
            driver_version=found.driver_version,
            cuda_version=found.cuda_version,
        )
    )
    return state.current
