"""`nvplug mps prepare|cleanup`: the MPS root's tmpfs, mounted where the whole host sees it.

nvplug-mps.service runs these before and after nvplug.service, in the host's mount namespace: a
tmpfs the sandboxed daemon mounted would live in its unit's own, where no container's /dev/shm
could reach it. Without MPS in the config (sharing.mps, or nvplug.dra, whose claims may ask for it),
prepare does nothing; cleanup removes what is there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nvplug import config
from nvplug.mps.mps_dirs import MpsDirError, RootLayout


def _layout(args: argparse.Namespace, always: bool = False) -> RootLayout | None:
    try:
        cfg = config.load(args.config)
    except config.ConfigError as err:
        print(f"nvplug mps: {err}; nothing done (the daemon says so too)", file=sys.stderr)
        return None
    if not always and cfg.sharing.strategy != "mps" and not cfg.dra.enabled:
        return None  # nothing runs MPS: the device plugin's config has none, and no DRA claim can ask for it
    return RootLayout(Path(cfg.mps_root), Path(args.sysfs_root) / "fs/selinux/enforce")


def run_prepare(args: argparse.Namespace) -> int:
    layout = _layout(args)
    if layout is None:
        return 0
    try:
        prepared = layout.prepare_root()
    except MpsDirError as err:
        print(f"nvplug mps prepare: {err}", file=sys.stderr)
        return 1
    for note in prepared.notes:
        print(f"nvplug mps prepare: {note}", file=sys.stderr)
    print(f"nvplug mps prepare: {layout.root} ready, the clients' shm at {layout.shm}")
    return 0


def run_cleanup(args: argparse.Namespace) -> int:
    # Whatever the config says now: one changed since the prepare must not leave the tmpfs mounted.
    layout = _layout(args, always=True)
    if layout is None:
        return 0
    failed = layout.remove_root()
    if failed:
        print(f"nvplug mps cleanup: {failed}", file=sys.stderr)
        return 1
    return 0
