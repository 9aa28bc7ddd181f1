"""`nvplug reload`: SIGHUP to the running daemon, which re-reads its config."""

from __future__ import annotations

import argparse
import os
import signal
import sys


def run(args: argparse.Namespace) -> int:
    pid: int | None = args.pid
    if pid is None:
        mainpid = os.environ.get("MAINPID", "")
        if not mainpid.isdigit():
            print("nvplug reload: no --pid and no $MAINPID", file=sys.stderr)
            return 2
        pid = int(mainpid)
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as err:
        print(f"nvplug reload: cannot signal pid {pid}: {err.strerror}", file=sys.stderr)
        return 1
    return 0
