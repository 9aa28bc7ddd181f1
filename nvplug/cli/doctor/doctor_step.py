"""What a `nvplug doctor` step is: a title, and a check of the DoctorContext that returns a Check."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nvplug import config

StepVerdict = Literal["PASS", "WARN", "FAIL"]


@dataclass(frozen=True)
class Check:
    verdict: StepVerdict
    summary: str
    evidence: list[str] = field(default_factory=list)
    fix: str | None = None


@dataclass
class DoctorContext:
    """The arguments, and what earlier steps found that later ones need (so not frozen: steps fill it in)."""

    args: argparse.Namespace
    lib_loaded: bool = False
    nvml_ok: bool = False
    minors: list[int] = field(default_factory=list)

    def dev_root(self) -> Path:
        """--dev-root, else the config's flags.nvidiaDevRoot as `nvplug run` takes it.

        A config that does not load gives the built-in one: step 8 says what is wrong with it.
        """
        if self.args.dev_root is not None:
            return Path(self.args.dev_root)
        return configured_dev_root(self.args.config)


def configured_dev_root(config_path: Path | None) -> Path:
    """The config's flags.nvidiaDevRoot; the built-in one where the config does not load."""
    try:
        cfg = config.load(config_path)
    except (config.ConfigError, OSError):
        cfg = config.Config()
    return Path(cfg.flags.nvidia_dev_root)


@dataclass(frozen=True)
class Step:
    title: str
    check: Callable[[DoctorContext], Check]


def loaded_config(ctx: DoctorContext) -> config.Config | Check:
    """The config for the steps that need it; a config that does not load is step 8's failure."""
    try:
        # The command line's paths over the config's, as the daemon takes them.
        return config.overridden(
            config.load(ctx.args.config),
            config.Overrides(cdi_runtime_dirs=ctx.args.cdi_runtime_dirs, nvidia_ctk_path=ctx.args.nvidia_ctk_path),
        )
    except config.ConfigError as err:
        return Check("WARN", "not checked: the config is invalid (step 8)", [str(err)])
