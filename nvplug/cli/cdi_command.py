"""`nvplug cdi generate`: the spec for this node, from one NVML scan, as the daemon would write it."""

from __future__ import annotations

import argparse
import sys

from nvplug import config
from nvplug.base.atomic_write import write_atomically
from nvplug.cdi.cdi_spec import DIR_MODE, SPEC_MODE
from nvplug.cli.node_cdi_specs import node_specs


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
        print(
            f"nvplug cdi generate: the daemon also writes {spec.file_name} ({len(spec.devices)} devices)",
            file=sys.stderr,
        )
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
