"""Doctor step: the NVIDIA kernel driver is loaded (its proc file says so, else its sysfs module)."""

from __future__ import annotations

from nvplug.cli.doctor.doctor_step import Check, DoctorContext


def check_driver(ctx: DoctorContext) -> Check:
    version_file = ctx.args.proc_root / "driver/nvidia/version"
    module = ctx.args.sysfs_root / "module/nvidia"
    try:
        first = version_file.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        first = None
    if first:
        return Check("PASS", "the NVIDIA kernel driver is loaded", [f"{version_file}: {first}"])
    if module.is_dir():
        try:
            version = (module / "version").read_text().strip()
        except OSError:
            version = "version unknown"
        return Check("PASS", "the NVIDIA kernel driver is loaded", [f"{module} exists ({version})"])
    return Check(
        "FAIL",
        "the NVIDIA kernel driver is not loaded",
        [f"neither {version_file} nor {module} exists"],
        "load it: `modprobe nvidia` (check `dmesg | grep -i -e nvrm -e nvidia` for why it did not load: "
        "a missing build for this kernel, Secure Boot refusing an unsigned module, or nouveau holding the GPU)",
    )
