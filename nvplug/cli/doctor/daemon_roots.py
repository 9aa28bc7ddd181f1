"""Where doctor reads the node: each root as its command line gives it, else where the running daemon
reads (its /status shows its roots), else the option's own default.

Without this, doctor asked a daemon started with --sysfs-root and the like, but read the machine's
/sys, /proc and /dev beside it: two different nodes in one report.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nvplug.cli.cli_arguments import DEV_ROOT, DEVICE_PLUGIN_DIR, HIDDEN, PROC_ROOT, SYSFS_ROOT
from nvplug.cli.doctor.doctor_step import configured_dev_root
from nvplug.status import status_client as statusclient

# The options resolved so, with the defaults doctor falls back to; ROOTS are doctor's own of them.
RESOLVED = (DEVICE_PLUGIN_DIR, DEV_ROOT, PROC_ROOT, SYSFS_ROOT)
ROOTS = (
    DEVICE_PLUGIN_DIR.unset_until_resolved(
        f"the kubelet's device-plugin directory (default: the running daemon's, else {DEVICE_PLUGIN_DIR.default})"
    ),
    DEV_ROOT.unset_until_resolved(
        "root under which /dev/nvidia* live (default: the running daemon's, else the config's flags.nvidiaDevRoot, /)"
    ),
    PROC_ROOT.unset_until_resolved(
        f"where the driver's proc files live (default: the running daemon's, else {PROC_ROOT.default})"
    ),
    SYSFS_ROOT.unset_until_resolved(HIDDEN),
)


def resolve_roots(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """The arguments with every root set, and `--flag path` for each of the daemon's that differs
    from where doctor would have read alone (so the report says it)."""
    unset = [arg for arg in RESOLVED if getattr(args, arg.dest) is None]
    daemon = _daemon_roots(args) if unset else {}
    resolved = dict(vars(args))
    taken = []
    for arg in unset:
        # --dev-root has no default of its own: the config's flags.nvidiaDevRoot is.
        alone = Path(arg.default) if arg.default is not None else configured_dev_root(args.config)
        given = daemon.get(arg.dest)
        if given is None:
            resolved[arg.dest] = arg.default
            continue
        resolved[arg.dest] = Path(given)
        if Path(given) != alone:
            taken.append(f"{arg.flag} {given}")
    return argparse.Namespace(**resolved), taken


def _daemon_roots(args: argparse.Namespace) -> dict[str, str]:
    """The running daemon's roots by option name; none where no daemon answers (step 7 says why) or
    its /status has none (a daemon from before they were shown)."""
    try:
        doc = statusclient.status(statusclient.listen_address(args.status_listen, args.config))
    except (statusclient.StatusUnavailable, ValueError):
        return {}
    roots = doc.get("roots")
    if not isinstance(roots, dict):
        return {}
    return {str(name): path for name, path in roots.items() if isinstance(path, str) and path}
