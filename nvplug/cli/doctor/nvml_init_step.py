"""Doctor step: NVML initialises and counts the GPUs; their minors are left for the device-node step."""

from __future__ import annotations

import contextlib

from nvplug.cli.doctor.doctor_step import Check, DoctorContext
from nvplug.cli.doctor.nvml_library_step import LIB_NAME


def _nvml_fix(code: int | None) -> tuple[str, str]:
    """(what it means, the fix) for an nvmlInit error."""
    import pynvml  # type: ignore[import-untyped]

    fixes: dict[int, tuple[str, str]] = {
        pynvml.NVML_ERROR_NO_PERMISSION: (
            "no permission to the GPUs",
            "run nvplug as root (the unit does) and check /dev/nvidiactl and /dev/nvidia* are rw for root "
            "(a device cgroup or an LSM policy can also deny them)",
        ),
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
            "the NVML library and the kernel module are different driver versions",
            "reboot, or reload the driver (`rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia`) "
            "so that the kernel module matches the library (typical after a driver upgrade without a reboot)",
        ),
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
            "the NVIDIA kernel driver is not loaded",
            "load it: `modprobe nvidia`; `dmesg | grep -i nvrm` says why it failed",
        ),
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
            f"{LIB_NAME} was not found",
            "see step 2: install the driver's NVML library",
        ),
    }
    return fixes.get(
        code if code is not None else -1,
        (
            "NVML failed",
            "check `nvidia-smi` and `dmesg | grep -i nvrm`; reinstall the driver if nvidia-smi fails the same way",
        ),
    )


def check_nvml(ctx: DoctorContext) -> Check:
    try:
        import pynvml
    except ImportError as err:  # pragma: no cover - a broken install
        return Check("FAIL", "pynvml cannot be imported", [str(err)], "reinstall nvplug")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        code = getattr(err, "value", None)
        meaning, fix = _nvml_fix(code)
        return Check("FAIL", f"NVML does not initialise: {meaning}", [f"nvmlInit: {err} (NVML error {code})"], fix)
    try:
        evidence = []
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            evidence.append(f"driver {driver.decode() if isinstance(driver, bytes) else driver}")
        except pynvml.NVMLError as err:
            evidence.append(f"driver version unreadable: {err}")
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as err:
            return Check("FAIL", "NVML cannot count the GPUs", [f"nvmlDeviceGetCount: {err}"], _nvml_fix(None)[1])
        if count == 0:
            return Check(
                "FAIL",
                "NVML initialises but sees no GPU",
                [*evidence, "nvmlDeviceGetCount: 0"],
                "check `lspci -d 10de:` lists the GPUs and `dmesg | grep -i nvrm` for GPUs the driver refused "
                "(fallen off the bus, unsupported by this driver branch)",
            )
        problems = []
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                ctx.minors.append(int(pynvml.nvmlDeviceGetMinorNumber(handle)))
            except pynvml.NVMLError as err:
                problems.append(f"gpu {index}: {err}")
        ctx.nvml_ok = True
        evidence.append(f"{count} GPU{'s' if count != 1 else ''}")
        if problems:
            return Check(
                "WARN",
                "NVML initialises, but some GPUs cannot be read",
                evidence + problems,
                "see `nvidia-smi -q` and `dmesg | grep -i xid` for these GPUs",
            )
        return Check("PASS", "NVML initialises", evidence)
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
