"""The command line's arguments: one shape for all, and the options several subcommands share.

A shared option is declared here once, with its one flag, type, default and old spellings;
a subcommand may word its help in its own terms (`worded`), never give it another default.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nvplug import config
from nvplug.status.status_client import DEFAULT_LISTEN

HIDDEN = argparse.SUPPRESS  # as a help: accepted, left out of --help


@dataclass(frozen=True)
class Argument:
    """One argparse argument: `--flag` (an option) or `name` (a positional)."""

    flag: str
    help: str | None = None
    parse: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    action: str | None = None
    aliases: tuple[str, ...] = ()  # old spellings: accepted, always hidden from --help

    @property
    def dest(self) -> str:
        """Its attribute in the parsed arguments: `--sysfs-root` is `sysfs_root`."""
        return self.flag.lstrip("-").replace("-", "_")

    def worded(self, help: str | None, *, metavar: str | None = None) -> Argument:
        """The same option (flag, type, default) in one subcommand's words."""
        return replace(self, help=help, metavar=metavar or self.metavar)

    def unset_until_resolved(self, help: str | None) -> Argument:
        """The same option for a command that first looks elsewhere (`nvplug doctor`: the running
        daemon) when it is not given: None in the parsed arguments, so the command can tell; the
        command falls back to this option's default itself."""
        return replace(self, help=help, default=None)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        settings: dict[str, Any] = {
            key: value
            for key, value in (
                ("action", self.action),
                ("type", self.parse),
                ("default", self.default),
                ("metavar", self.metavar),
                ("choices", self.choices),
            )
            if value is not None
        }
        parser.add_argument(self.flag, help=self.help, **settings)
        for alias in self.aliases:
            # SUPPRESS as the default: the alias sets the value only when it is given.
            parser.add_argument(alias, dest=self.dest, help=HIDDEN, **{**settings, "default": argparse.SUPPRESS})


# --- shared by several subcommands ---------------------------------------------------------------

CONFIG = Argument("--config", f"config file (default: {config.DEFAULT_PATH})", Path)
# A command that starts from the config says what it does without the file.
CONFIG_OR_BUILT_IN = CONFIG.worded(f"config file (default: {config.DEFAULT_PATH}, built-in defaults if absent)")

# Where the kernel's files are read; tests point them at a fake tree.
SYSFS_ROOT = Argument("--sysfs-root", HIDDEN, Path, Path("/sys"), aliases=("--sys-root",))
PROC_ROOT = Argument("--proc-root", HIDDEN, Path, Path("/proc"))
# None: the config's flags.nvidiaDevRoot, which follows flags.nvidiaDriverRoot.
DEV_ROOT = Argument("--dev-root", "default: the config's flags.nvidiaDevRoot", Path)

DEVICE_PLUGIN_DIR = Argument(
    "--device-plugin-dir",
    "the kubelet's device-plugin directory (default: %(default)s)",
    Path,
    Path("/var/lib/kubelet/device-plugins"),
)
# None for each: the config's nvplug.* key of the same name.
CDI_SPEC_DIR = Argument("--cdi-spec-dir", parse=Path)


# Overrides for a node kept under one root (a simulated one): the runtimes' spec directories, the hook.
def absolute_dirs(text: str) -> tuple[Path, ...]:
    """DIR,DIR: absolute paths, as the config's nvplug.cdi.runtimeDirs takes them."""
    dirs = tuple(Path(p) for p in text.split(",") if p)
    relative = [str(d) for d in dirs if not d.is_absolute()]
    if relative:
        raise argparse.ArgumentTypeError(f"{', '.join(relative)}: not an absolute path")
    return dirs


CDI_RUNTIME_DIRS = Argument(
    "--cdi-runtime-dirs",
    "where the container runtimes read CDI specs, comma-separated (default: the config's nvplug.cdi.runtimeDirs)",
    absolute_dirs,
    metavar="DIR,DIR",
)
NVIDIA_CTK_PATH = Argument("--nvidia-ctk-path", "default: the config's flags.plugin.nvidiaCTKPath", Path)
NFD_FEATURE_FILE = Argument("--nfd-feature-file", parse=Path)
POD_RESOURCES_SOCKET = Argument("--pod-resources-socket", parse=Path)


def listen_address(text: str) -> str:
    """As the config's nvplug.status.listen takes it."""
    problem = config.listen_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


# None: the config's nvplug.status.listen (the daemon serves there, the other commands ask there).
STATUS_LISTEN = Argument("--status-listen", parse=listen_address)
STATE_DIR = Argument(
    "--state-dir",
    "where the health state file and the MPS daemons' record are kept across restarts (default: "
    "$STATE_DIRECTORY as systemd sets it, else /var/lib/nvplug)",
    Path,
)
POD_LOGS = Argument(
    "--pod-logs",
    "the kubelet's pod log directories, named <namespace>_<pod>_<UID>: where a pod's name is found "
    "(default: /var/log/pods)",
    Path,
    default=Path("/var/log/pods"),
    metavar="DIR",
)
LOG_LEVEL = Argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))

# What every command that asks the daemon takes.
ASKS_THE_DAEMON = (
    STATUS_LISTEN.worded(
        "the daemon's status endpoint, unix:/path or HOST:PORT "
        f"(default: the config's nvplug.status.listen, else {DEFAULT_LISTEN})",
        metavar="ADDR",
    ),
    CONFIG,
)
