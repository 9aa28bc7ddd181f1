"""Doctor step: the kubelet's device-plugin directory exists and nvplug can create its socket there
(and, with DRA on, the directories of the DRA plugin's sockets exist)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from nvplug.cli.doctor.doctor_step import Check, DoctorContext, loaded_config

# A running daemon follows a directory that went: nothing to restart.
_COMES_BACK = (
    "a node re-join or a kubelet reinstall may have wiped /var/lib/kubelet: once the kubelet makes it again, "
    "a running nvplug serves its sockets there and registers at once (no restart)"
)


def check_plugin_dir(ctx: DoctorContext) -> Check:
    directory: Path = ctx.args.device_plugin_dir
    if not directory.is_dir():
        return Check(
            "FAIL",
            "the device-plugin directory does not exist",
            [f"{directory}: not a directory"],
            "is the kubelet installed and is this its root dir? pass --device-plugin-dir "
            "(the kubelet's --root-dir + /device-plugins); the kubelet creates it when it starts; " + _COMES_BACK,
        )
    try:
        fd, name = tempfile.mkstemp(prefix=".nvplug-doctor-", dir=directory)
        os.close(fd)
        Path(name).unlink()
    except OSError as err:
        return Check(
            "FAIL",
            "the device-plugin directory is not writable",
            [f"creating a file in {directory}: {err}"],
            "nvplug creates its socket there: the directory must be writable by root; check for a read-only "
            "mount (`findmnt -T " + str(directory) + "`) or ReadWritePaths= in a local drop-in of nvplug.service",
        )
    evidence = [f"{directory}: created and removed a file"]
    missing = [f"{d}: not a directory (nvplug.dra.{key})" for key, d in _dra_dirs(ctx) if not d.is_dir()]
    if missing:
        return Check(
            "FAIL",
            "a directory of the DRA plugin's sockets does not exist",
            missing + evidence,
            "the kubelet makes plugins_registry and plugins when it starts (1.32 and later, with DRA); " + _COMES_BACK,
        )
    return Check("PASS", "the device-plugin directory is writable", evidence)


def _dra_dirs(ctx: DoctorContext) -> list[tuple[str, Path]]:
    """With DRA on, where its sockets go: the registry directory and the plugins directory."""
    cfg = loaded_config(ctx)
    if isinstance(cfg, Check) or not cfg.dra.enabled:
        return []  # an invalid config is step 8's to say
    return [("registryDir", Path(cfg.dra.registry_dir)), ("pluginsDir", Path(cfg.dra.plugins_dir))]
