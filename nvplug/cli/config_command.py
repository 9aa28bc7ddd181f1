"""`nvplug config check FILE` and `nvplug config show`: no logging set up, the answer is the output."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from nvplug import config
from nvplug.shaping.resource_plan import unserved_sharing


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def load_checked(path: Path | None, warn: Callable[[str], None] = _stderr) -> config.Config:
    """The config, checked against the schema and against what nvplug can serve."""
    cfg = config.load(path)
    for name in unserved_sharing(cfg):
        warn(f"{cfg.source}: sharing.{_strategy_key(cfg)} for {name} is ignored: no device of this config is named so")
    return cfg


def _strategy_key(cfg: config.Config) -> str:
    return "mps" if cfg.sharing.strategy == "mps" else "timeSlicing"


def run_check(args: argparse.Namespace) -> int:
    try:
        load_checked(args.file)
    except config.ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"{args.file}: ok")
    return 0


def run_show(args: argparse.Namespace) -> int:
    try:
        cfg = load_checked(args.config)
    except config.ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"# nvplug config from {cfg.source}, every default filled in")
    sys.stdout.write(config.to_yaml(cfg))
    return 0
