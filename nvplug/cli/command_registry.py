"""Every `nvplug` subcommand, declared once: its name, help, arguments and what runs it.

main() builds the parser from COMMANDS and calls the chosen command's run. A command
with subcommands of its own (`cdi generate`, `config check|show`) has no run: its
subcommands do.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from nvplug import __version__
from nvplug.cli import (
    cdi_command,
    config_command,
    devices_command,
    heal_command,
    mps_command,
    reload_command,
    run_command,
    top_command,
)
from nvplug.cli.cli_arguments import (
    ASKS_THE_DAEMON,
    CDI_RUNTIME_DIRS,
    CDI_SPEC_DIR,
    CONFIG,
    CONFIG_OR_BUILT_IN,
    DEV_ROOT,
    DEVICE_PLUGIN_DIR,
    HIDDEN,
    LOG_LEVEL,
    NFD_FEATURE_FILE,
    NVIDIA_CTK_PATH,
    POD_LOGS,
    POD_RESOURCES_SOCKET,
    PROC_ROOT,
    STATE_DIR,
    STATUS_LISTEN,
    SYSFS_ROOT,
    Argument,
)
from nvplug.cli.doctor import daemon_roots, doctor_command

Run = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    arguments: tuple[Argument, ...] = ()
    run: Run | None = None
    description: str | None = None
    subcommands: tuple[Command, ...] = ()

    def __post_init__(self) -> None:
        if (self.run is None) == (not self.subcommands):
            raise ValueError(f"nvplug {self.name}: a command has either a run or subcommands")


def _demo(args: argparse.Namespace) -> int:
    # nvplug.testing (a fake NVML, a kubelet stand-in) is loaded for the demo alone.
    from nvplug.cli.demo_command import run_demo

    return run_demo(args.log_level)


COMMANDS: tuple[Command, ...] = (
    Command(
        "run",
        "run the device plugin daemon",
        (
            DEVICE_PLUGIN_DIR,
            DEV_ROOT.worded(
                "root under which the driver's /dev nodes live (default: the config's flags.nvidiaDevRoot, /)"
            ),
            CONFIG_OR_BUILT_IN,
            LOG_LEVEL,
            SYSFS_ROOT,
            PROC_ROOT,
            STATUS_LISTEN.worded(
                "serve /healthz, /status and /metrics here: off, unix:/path or host:port "
                "(default: the config's nvplug.status.listen, unix:/run/nvplug/status.sock)"
            ),
            STATE_DIR,
            NFD_FEATURE_FILE.worded("write the node labels here (default: the config's nvplug.labels.featureFile)"),
            POD_RESOURCES_SOCKET.worded(
                "the kubelet's PodResources socket (default: the config's nvplug.podResources)"
            ),
            CDI_SPEC_DIR.worded("write the CDI spec here (default: the config's nvplug.cdi.specDir)"),
            CDI_RUNTIME_DIRS,
            NVIDIA_CTK_PATH,
            Argument("--kernel-log", HIDDEN, Path, Path("/dev/kmsg")),
            Argument(
                "--mps-root",
                "where the MPS pipes, logs and shm live (default: the config's nvplug.mps.root, /run/nvplug/mps)",
                Path,
            ),
            Argument(
                "--pod-log-root",
                "where the kubelet's pods/ and containers/ log records are (default: the config's "
                "nvplug.telemetry.podLogRoot, /var/log)",
                Path,
            ),
        ),
        run_command.run,
    ),
    Command(
        "reload",
        "ask the running daemon to re-read its config (SIGHUP)",
        (Argument("--pid", "the daemon's pid (default: $MAINPID, as systemd sets it)", int),),
        reload_command.run,
    ),
    Command(
        "doctor",
        "check the chain from the kernel driver to the kubelet, step by step",
        (
            *ASKS_THE_DAEMON,
            *daemon_roots.ROOTS,
            CDI_SPEC_DIR.worded("where nvplug writes its CDI spec (default: the config's)"),
            CDI_RUNTIME_DIRS,
            NVIDIA_CTK_PATH,
            NFD_FEATURE_FILE.worded("nvplug's NFD feature file (default: the config's)"),
            POD_RESOURCES_SOCKET.worded("the kubelet's PodResources (default: the config's)"),
            Argument(
                "--brief",
                "ask only the running daemon and print one line; exit 0 healthy, 1 a problem, "
                "2 unknown (a Node Problem Detector custom plugin)",
                action="store_true",
            ),
        ),
        doctor_command.run,
    ),
    Command(
        "devices",
        "list every GPU: health, what it is advertised as, NVLink peers",
        (
            Argument("--json", "print JSON: the GPUs as /status has them, and the source", action="store_true"),
            Argument(
                "--labels",
                "print the node labels nvplug writes for Node Feature Discovery (the feature file's content)",
                action="store_true",
            ),
            *ASKS_THE_DAEMON,
            SYSFS_ROOT,
            PROC_ROOT,
        ),
        devices_command.run,
    ),
    Command(
        "top",
        "the GPUs, their utilization, memory, temperature and health, and the pods using them, once a second",
        (
            Argument("--count", "draw this many times, then stop (default: until ^C on a terminal, else once)", int),
            Argument("--interval", "seconds between draws", float, 1.0),
            *ASKS_THE_DAEMON,
        ),
        top_command.run,
    ),
    Command(
        "heal",
        "tell the daemon a GPU was repaired (it probes it), or reset it with --reset",
        (
            Argument("gpu", "the GPU: its index, UUID or PCI bus id, as `nvplug devices` shows", metavar="GPU"),
            Argument(
                "--reset",
                "reset it with `nvidia-smi -r -i BUS_ID` (refused while processes use it)",
                action="store_true",
            ),
            *ASKS_THE_DAEMON,
        ),
        heal_command.run,
        description="A GPU whose fault needs a reset stays Unhealthy until evidence of one. `nvplug heal GPU` "
        "gives the operator's word as that evidence; `--reset` first checks that no process uses the GPU, "
        "then resets it with `nvidia-smi -r`. Either way a probe must pass. Exit 0 when the GPU is Healthy "
        "afterwards, 1 when it is not or the request was refused, 2 when the daemon cannot be asked.",
    ),
    Command(
        "cdi",
        "the CDI spec for this node's devices",
        subcommands=(
            Command(
                "generate",
                "print the CDI spec for this node (or write it with --output), as the daemon writes it",
                (
                    Argument("--output", "write the GPU spec here (atomically, mode 0644)", Path),
                    CONFIG,
                    DEV_ROOT,
                    SYSFS_ROOT,
                    PROC_ROOT,
                ),
                cdi_command.run,
                description="One NVML scan of this node, then the spec nvplug writes for it: kind "
                "k8s.device-plugin.nvidia.com/gpu, names by flags.plugin.deviceIDStrategy. The optional classes "
                "(IMEX channels, GDS, MOFED, GDRCopy) are specs of their own, which the daemon writes beside it.",
            ),
        ),
    ),
    Command(
        "mps",
        "the MPS root's tmpfs, as systemd prepares and removes it around the daemon",
        subcommands=(
            Command(
                "prepare",
                "make the MPS root and mount the clients' shm tmpfs (nothing without sharing.mps)",
                (CONFIG_OR_BUILT_IN, SYSFS_ROOT),
                mps_command.run_prepare,
            ),
            Command(
                "cleanup",
                "unmount the shm tmpfs and remove the pipe directories; the logs stay",
                (CONFIG_OR_BUILT_IN, SYSFS_ROOT),
                mps_command.run_cleanup,
            ),
            Command(
                "stop",
                "quit the MPS control daemons nvplug left running and give their GPUs their compute modes back "
                "(nvplug stopped first; refused while a daemon has clients, unless --force)",
                (
                    CONFIG_OR_BUILT_IN,
                    STATE_DIR,
                    STATUS_LISTEN.worded("where a running nvplug would answer (default: the config's)"),
                    SYSFS_ROOT,
                    PROC_ROOT,
                    POD_LOGS,
                    Argument("--force", "quit them even with clients connected: the clients fail", action="store_true"),
                ),
                mps_command.run_stop,
                description="A stop or restart of nvplug leaves its MPS control daemons running for their clients, "
                "and the next nvplug adopts them. This is the teardown: for a node leaving MPS, or the "
                "package's removal.",
            ),
        ),
    ),
    Command(
        "demo",
        "run the daemon against a simulated 8-GPU node and show what it does",
        # Not the shared --log-level: how much of the daemon a demo shows, quiet unless asked.
        (
            replace(
                LOG_LEVEL, help="the daemon's log level, shown interleaved (default: %(default)s)", default="warning"
            ),
        ),
        _demo,
    ),
    Command(
        "config",
        "check a config file, or show the config in force",
        subcommands=(
            Command(
                "check",
                "check FILE; exit 0 if it loads, 2 with its file, key and line if not",
                (Argument("file", parse=Path, metavar="FILE"),),
                config_command.run_check,
            ),
            Command(
                "show",
                "print the effective config, every default filled in, as YAML",
                (CONFIG_OR_BUILT_IN,),
                config_command.run_show,
            ),
        ),
    ),
)


def _add(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], command: Command) -> None:
    parser = subparsers.add_parser(command.name, help=command.help, description=command.description)
    for argument in command.arguments:
        argument.add_to(parser)
    if command.subcommands:
        # `{name}_command`: the dest argparse names in "the following arguments are required".
        nested = parser.add_subparsers(dest=f"{command.name}_command", required=True)
        for sub in command.subcommands:
            _add(nested, sub)
    else:
        parser.set_defaults(run=command.run)


def build_parser(commands: tuple[Command, ...] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvplug", description="Kubernetes device plugin for NVIDIA GPUs.")
    parser.add_argument("--version", action="version", version=f"nvplug {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in commands:
        _add(subparsers, command)
    return parser
