"""`nvplug run`: the device plugin daemon, as the systemd unit starts it."""

from __future__ import annotations

import argparse
import asyncio
import logging

from nvplug import config
from nvplug.base.malloc_tuning import keep_freed_memory
from nvplug.cli import journal_logging as logs
from nvplug.cli.config_command import load_checked
from nvplug.daemon.lifecycle import serve
from nvplug.daemon.options import Options

log = logging.getLogger("nvplug")


def run(args: argparse.Namespace) -> int:
    logs.setup(args.log_level)
    try:
        cfg = load_checked(args.config, log.warning)
    except config.ConfigError as err:
        log.error("%s", err)
        return 2
    overrides = config.Overrides(
        nvidia_dev_root=args.dev_root,
        nvidia_ctk_path=args.nvidia_ctk_path,
        status_listen=args.status_listen,
        cdi_spec_dir=args.cdi_spec_dir,
        cdi_runtime_dirs=args.cdi_runtime_dirs,
        feature_file=args.nfd_feature_file,
        pod_resources_socket=args.pod_resources_socket,
        mps_root=args.mps_root,
        pod_log_root=args.pod_log_root,
    )
    options = Options(
        plugin_dir=args.device_plugin_dir,
        sysfs_root=args.sysfs_root,
        config=config.overridden(cfg, overrides),
        config_path=args.config,
        proc_root=args.proc_root,
        state_dir=args.state_dir,
        kernel_log=args.kernel_log,
        overrides=overrides,
    )
    if not keep_freed_memory():
        log.debug("not glibc: malloc gives freed memory back as it likes")
    try:
        asyncio.run(serve(options))
    except Exception:
        log.exception("nvplug failed")
        return 1
    return 0
