"""The CDI specs the daemon would write for this node now, from one NVML scan: for `nvplug cdi
generate` and for doctor's check that every CDI name resolves."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from nvplug import config
from nvplug.cdi.cdi_spec import CdiSpec
from nvplug.sinks.cdi.cdi_publisher import CdiSettings, SpecPublisher
from nvplug.sources.nvml_snapshot import scan_snapshot


@dataclass(frozen=True)
class NodeSpecs:
    """The specs the daemon would write for this node now; the devices left out and the driver files
    not found, each with why."""

    specs: list[CdiSpec]
    skipped: dict[str, str]
    problems: tuple[str, ...]


def node_specs(cfg: config.Config, dev_root: Path | None, sysfs_root: Path, proc_root: Path) -> NodeSpecs:
    # Without a spec directory: nothing written, nothing logged; the caller says what it found.
    cfg = config.overridden(cfg, config.Overrides(nvidia_dev_root=dev_root))
    publisher = SpecPublisher(replace(CdiSettings.from_config(cfg), spec_dir=None))
    specs, skipped = publisher.specs(scan_snapshot(sysfs_root, proc_root))
    return NodeSpecs(specs, skipped, publisher.driver_problems())
