"""`nvplug cdi generate`: the spec for this node, from one NVML scan, as the daemon would write it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from nvplug import config
from nvplug.base.atomic_write import write_atomically
from nvplug.cdi.cdi_spec import DIR_MODE, SPEC_MODE, CdiSpec
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
    publisher = SpecPublisher(replace(CdiSettings.from_config(cfg, dev_root), spec_dir=None))
    specs, skipped = publisher.specs(scan_snapshot(sysfs_root, proc_root))
    return NodeSpecs(specs, skipped, publisher.driver_problems())


def run(args: argparse.Namespace) -> int:
    from nvplug.nvml.nvml_errors import NvmlUnavailable

    try:
        cfg = config.load(args.config)
        found = node_specs(cfg, args.dev_root, args.sysfs_root, args.proc_root)
    except config.ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    except NvmlUnavailable as err:
        print(f"nvplug cdi generate: NVML unavailable: {err}", file=sys.stderr)
        return 1
    for uuid, why in found.skipped.items():
        print(f"nvplug cdi generate: {uuid} left out: {why}", file=sys.stderr)
    for problem in found.problems:
        print(f"nvplug cdi generate: {problem}", file=sys.stderr)
    gpu, *optional = found.specs
    for spec in optional:
        print(f"nvplug cdi generate: the daemon also writes {spec.file_name} ({len(spec.devices)} devices)",
              file=sys.stderr)  # fmt: skip
    if args.output is None:
        sys.stdout.buffer.write(gpu.render())
        return 0
    try:
        write_atomically(args.output, gpu.render(), SPEC_MODE, DIR_MODE)
    except OSError as err:
        print(f"nvplug cdi generate: cannot write {args.output}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {len(gpu.devices)} devices of kind {gpu.kind}", file=sys.stderr)
    return 0
