"""The `nvplug` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from nvplug import __version__, config
from nvplug.cli import journal_logging as logs
from nvplug.cli.cdi_command import add_arguments as add_cdi
from nvplug.cli.cdi_command import run as run_cdi
from nvplug.cli.devices_command import add_arguments as add_devices
from nvplug.cli.devices_command import run as run_devices
from nvplug.cli.doctor.doctor_command import add_arguments as add_doctor
from nvplug.cli.doctor.doctor_command import run as run_doctor
from nvplug.cli.heal_command import add_arguments as add_heal
from nvplug.cli.heal_command import run as run_heal
from nvplug.daemon.lifecycle import Options, serve
from nvplug.shaping.resource_plan import check, unserved_sharing

log = logging.getLogger("nvplug")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvplug", description="Kubernetes device plugin for NVIDIA GPUs.")
    parser.add_argument("--version", action="version", version=f"nvplug {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the device plugin daemon")
    run.add_argument(
        "--device-plugin-dir",
        type=Path,
        default=Path("/var/lib/kubelet/device-plugins"),
        help="the kubelet's device-plugin directory (default: %(default)s)",
    )
    run.add_argument(
        "--dev-root",
        type=Path,
        default=None,
        help="root under which the driver's /dev nodes live (default: the config's flags.nvidiaDevRoot, /)",
    )
    run.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"config file (default: {config.DEFAULT_PATH}, built-in defaults if absent)",
    )
    run.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    run.add_argument("--sysfs-root", type=Path, default=Path("/sys"), help=argparse.SUPPRESS)
    run.add_argument("--proc-root", type=Path, default=Path("/proc"), help=argparse.SUPPRESS)
    run.add_argument("--status-listen", default=None,
                     help="serve /healthz, /status and /metrics here: off, unix:/path or host:port "
                          "(default: the config's nvplug.status.listen, unix:/run/nvplug/status.sock)")  # fmt: skip
    run.add_argument("--state-dir", type=Path, default=None,
                     help="where the health state file is kept across restarts (default: $STATE_DIRECTORY "
                          "as systemd sets it, else /var/lib/nvplug)")  # fmt: skip
    run.add_argument("--nfd-feature-file", type=Path, default=None,
                     help="write the node labels here (default: the config's nvplug.labels.featureFile)")  # fmt: skip
    run.add_argument("--pod-resources-socket", type=Path, default=None,
                     help="the kubelet's PodResources socket (default: the config's nvplug.podResources)")  # fmt: skip
    run.add_argument("--cdi-spec-dir", type=Path, default=None,
                     help="write the CDI spec here (default: the config's nvplug.cdi.specDir)")  # fmt: skip

    reload = sub.add_parser("reload", help="ask the running daemon to re-read its config (SIGHUP)")
    reload.add_argument(
        "--pid", type=int, default=None, help="the daemon's pid (default: $MAINPID, as systemd sets it)"
    )

    add_doctor(sub.add_parser("doctor", help="check the chain from the kernel driver to the kubelet, step by step"))
    add_devices(sub.add_parser("devices", help="list every GPU: health, what it is advertised as, NVLink peers"))
    add_heal(
        sub.add_parser(
            "heal",
            help="tell the daemon a GPU was repaired (it probes it), or reset it with --reset",
            description="A GPU whose fault needs a reset stays Unhealthy until evidence of one. `nvplug heal GPU` "
            "gives the operator's word as that evidence; `--reset` first checks that no process uses the GPU, "
            "then resets it with `nvidia-smi -r`. Either way a probe must pass. Exit 0 when the GPU is Healthy "
            "afterwards, 1 when it is not or the request was refused, 2 when the daemon cannot be asked.",
        )
    )

    add_cdi(sub.add_parser("cdi", help="the CDI spec for this node's devices"))

    demo = sub.add_parser("demo", help="run the daemon against a simulated 8-GPU node and show what it does")
    demo.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="the daemon's log level, shown interleaved (default: %(default)s)",
    )

    cfg = sub.add_parser("config", help="check a config file, or show the config in force")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    check = cfg_sub.add_parser("check", help="check FILE; exit 0 if it loads, 2 with its file, key and line if not")
    check.add_argument("file", type=Path, metavar="FILE")
    show = cfg_sub.add_parser("show", help="print the effective config, every default filled in, as YAML")
    show.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"config file (default: {config.DEFAULT_PATH}, built-in defaults if absent)",
    )
    return parser


def _config_command(args: argparse.Namespace) -> int:
    """`config check` and `config show`: no logging set up, the answer is the output."""
    path: Path | None = args.file if args.config_command == "check" else args.config
    try:
        cfg = _load(path)
    except config.ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if args.config_command == "check":
        print(f"{args.file}: ok")
    else:
        print(f"# nvplug config from {cfg.source}, every default filled in")
        sys.stdout.write(config.to_yaml(cfg))
    return 0


def _reload(pid: int | None) -> int:
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


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def _load(path: Path | None, warn: Callable[[str], None] = _stderr) -> config.Config:
    """The config, checked against the schema and against what nvplug can serve."""
    cfg = config.load(path)
    check(cfg)
    for name in unserved_sharing(cfg):
        warn(f"{cfg.source}: sharing.timeSlicing for {name} is ignored: no device of this config is named so")
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from nvplug.cli.demo_command import run_demo

        return run_demo(args.log_level)
    if args.command == "reload":
        return _reload(args.pid)
    if args.command == "doctor":
        return run_doctor(args)
    if args.command == "devices":
        return run_devices(args)
    if args.command == "heal":
        return run_heal(args)
    if args.command == "cdi":
        return run_cdi(args)
    if args.command == "config":
        return _config_command(args)
    logs.setup(args.log_level)
    try:
        cfg = _load(args.config, log.warning)
    except config.ConfigError as err:
        log.error("%s", err)
        return 2
    options = Options(
        plugin_dir=args.device_plugin_dir,
        dev_root=args.dev_root or Path(cfg.flags.nvidia_dev_root),
        sysfs_root=args.sysfs_root,
        config=cfg,
        config_path=args.config,
        proc_root=args.proc_root,
        status_listen=args.status_listen,
        state_dir=args.state_dir,
        cdi_spec_dir=args.cdi_spec_dir,
        feature_file=args.nfd_feature_file,
        pod_resources_socket=args.pod_resources_socket,
    )
    try:
        asyncio.run(serve(options))
    except Exception:
        log.exception("nvplug failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
