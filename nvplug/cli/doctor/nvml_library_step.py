"""Doctor step: libnvidia-ml.so.1 loads in this process, and from where."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from nvplug.cli.doctor.doctor_step import Check, DoctorContext

LIB_NAME = "libnvidia-ml.so.1"


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def library_path(lib: ctypes.CDLL) -> str | None:
    """Where the loader found `lib`: dladdr of one of its symbols, else /proc/self/maps."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        dladdr = libc.dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        dladdr.restype = ctypes.c_int
        info = _DlInfo()
        symbol = ctypes.cast(lib.nvmlInit_v2, ctypes.c_void_p)
        if dladdr(symbol, ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libnvidia-ml.so" in line:
                    return line.split(None, 5)[-1].strip()
    except OSError:
        pass
    return None


def check_library(ctx: DoctorContext) -> Check:
    try:
        lib = ctypes.CDLL(LIB_NAME)
    except OSError as err:
        search = os.environ.get("LD_LIBRARY_PATH")
        return Check(
            "FAIL",
            f"{LIB_NAME} does not load",
            [str(err), f"LD_LIBRARY_PATH={search}" if search else "LD_LIBRARY_PATH is not set"],
            "install the NVIDIA driver's NVML library (the `libnvidia-compute-<version>` / "
            "`nvidia-driver-cuda-libs` package, same version as the kernel module) and run `ldconfig`; "
            f"`ldconfig -p | grep {LIB_NAME}` must list it",
        )
    ctx.lib_loaded = True
    path = library_path(lib)
    evidence = [f"loaded from {path}" if path else "loaded (its path could not be read)"]
    if path and os.path.realpath(path) != path:
        evidence.append(f"which is {os.path.realpath(path)}")
    return Check("PASS", f"{LIB_NAME} loads", evidence)
