"""Doctor step: the kubelet's device-plugin directory exists and nvplug can create its socket there."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from nvplug.cli.doctor.doctor_step import Check, DoctorContext


def check_plugin_dir(ctx: DoctorContext) -> Check:
    directory: Path = ctx.args.device_plugin_dir
    if not directory.is_dir():
        return Check(
            "FAIL",
            "the device-plugin directory does not exist",
            [f"{directory}: not a directory"],
            "is the kubelet installed and is this its root dir? pass --device-plugin-dir "
            "(the kubelet's --root-dir + /device-plugins); the kubelet creates it when it starts",
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
    return Check("PASS", "the device-plugin directory is writable", [f"{directory}: created and removed a file"])
