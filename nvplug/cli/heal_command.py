"""`nvplug heal GPU [--reset]`: the operator's side of POST /heal on the daemon's status socket."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys

from nvplug.status import status_client as statusclient

# A reset behind NVSwitches takes a while, and the daemon rescans after it.
RESET_WAIT = 180.0
HEAL_WAIT = 30.0


def _operator() -> str:
    """Who runs this, for the daemon's log: the sudo user behind root where there is one."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = ""
    sudo = os.environ.get("SUDO_USER")
    return f"{name} via sudo from {sudo}" if sudo and sudo != name else name


def run(args: argparse.Namespace) -> int:
    listen = statusclient.listen_address(args.status_listen, args.config)
    body = json.dumps({"gpu": args.gpu, "reset": args.reset, "operator": _operator()}).encode()
    try:
        code, text = statusclient.fetch(listen, "/heal", RESET_WAIT if args.reset else HEAL_WAIT, body)
    except (statusclient.StatusUnavailable, ValueError) as err:
        print(f"nvplug heal: {err}", file=sys.stderr)
        return 2
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        print(f"nvplug heal: {listen} answered HTTP {code}: {text.strip()[:300]}", file=sys.stderr)
        return 2
    print(doc.get("message", ""))
    return 0 if code == 200 and doc.get("outcome") == "healthy" else 1
