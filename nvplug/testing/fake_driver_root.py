"""Build a fake NVIDIA driver root: the driver's files as a host has them on disk, for tests.

nvplug's CDI code finds the driver's libraries through the root's
``ld.so.cache`` and its binaries, firmware and sockets by path.  So the
libraries here are real ELF shared objects with real SONAMEs, indexed by the
real ``ldconfig -r``: code tested against this root is tested against what
glibc writes, not against this module's idea of it.  Nothing needs a GPU or
root privileges; it needs ``cc`` and glibc's ``ldconfig``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BINARIES",
    "DEFAULT_VERSION",
    "DRIVER_LIBRARIES",
    "FIRMWARE",
    "LIB_DIR",
    "PERSISTENCED_SOCKET",
    "UNRELATED_LIBRARY",
    "DriverRootBuildError",
    "FakeDriverRoot",
    "build",
]

DEFAULT_VERSION = "550.54.15"
LIB_DIR = "usr/lib/x86_64-linux-gnu"
# (file stem, SONAME) of driver libraries: the file is f"{stem}.so.{version}".
DRIVER_LIBRARIES: tuple[tuple[str, str], ...] = (
    ("libcuda", "libcuda.so.1"),
    ("libnvidia-ml", "libnvidia-ml.so.1"),
    ("libnvidia-ptxjitcompiler", "libnvidia-ptxjitcompiler.so.1"),
    ("libnvidia-nvvm", "libnvidia-nvvm.so.4"),
    ("libcudadebugger", "libcudadebugger.so.1"),
    ("libnvidia-opencl", "libnvidia-opencl.so.1"),
    ("libnvidia-cfg", "libnvidia-cfg.so.1"),
)
# (file, SONAME) of a library in the same directory that is not the driver's:
# its version is not the driver's, so a consumer can show it is left out.
UNRELATED_LIBRARY: tuple[str, str] = ("libz-fake.so.1.2.13", "libz-fake.so.1")
BINARIES: tuple[str, ...] = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
# GSP firmware, under lib/firmware/nvidia/<version>/.
FIRMWARE: tuple[str, ...] = ("gsp_ga10x.bin", "gsp_tu10x.bin")
PERSISTENCED_SOCKET = "run/nvidia-persistenced/socket"

# A version goes into file names and a C string literal: keep it to what drivers use.
_VERSION_RE = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]*")
_SUN_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path) on Linux, NUL included


class DriverRootBuildError(RuntimeError):
    """``cc`` or ``ldconfig`` failed (or is missing); the message carries its stderr."""


@dataclass(frozen=True)
class FakeDriverRoot:
    """A root built by :func:`build`; paths inside it are relative to ``root``."""

    root: Path
    version: str

    def library(self, stem: str) -> Path:
        """The versioned file of a :data:`DRIVER_LIBRARIES` stem, e.g. ``.../libcuda.so.550.54.15``."""
        if stem not in dict(DRIVER_LIBRARIES):
            raise ValueError(f"not a fake driver library: {stem!r}")
        return self.root / LIB_DIR / f"{stem}.so.{self.version}"


def build(root: Path, version: str = DEFAULT_VERSION, *, persistenced_socket: bool = True) -> FakeDriverRoot:
    """Create (or refresh) a fake driver root of ``version`` under ``root``."""
    if not _VERSION_RE.fullmatch(version):
        raise ValueError(f"unusable driver version: {version!r}")
    root = Path(root).absolute()  # ldconfig -r resolves against its own cwd
    lib_dir = root / LIB_DIR
    lib_dir.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="nvplug-driverroot-") as tmp:
        for stem, soname in DRIVER_LIBRARIES:
            _compile_library(Path(tmp), lib_dir / f"{stem}.so.{version}", soname, f"nvplug fake {stem} {version}")
        file, soname = UNRELATED_LIBRARY
        _compile_library(Path(tmp), lib_dir / file, soname, f"nvplug fake {file}")

    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "ld.so.conf").write_text(f"/{LIB_DIR}\n")
    _run_ldconfig(root)

    bin_dir = root / "usr" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in BINARIES:
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\necho {name}\n")
        path.chmod(0o755)

    firmware_dir = root / "lib" / "firmware" / "nvidia" / version
    firmware_dir.mkdir(parents=True, exist_ok=True)
    for name in FIRMWARE:
        (firmware_dir / name).write_bytes(f"fake {name} {version}\n".encode())

    if persistenced_socket:
        _leave_socket(root / PERSISTENCED_SOCKET)
    return FakeDriverRoot(root, version)


def _compile_library(work: Path, out: Path, soname: str, marker: str) -> None:
    # The marker lets a test tell which file a mount or symlink really reached.
    source = work / f"{out.name}.c"
    source.write_text(f'__attribute__((used)) const char nvplug_fake_marker[] = "{marker}";\n')
    argv = ["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out), str(source)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise DriverRootBuildError(f"cannot run the C compiler: {exc}") from exc
    if proc.returncode != 0:
        raise DriverRootBuildError(f"cc failed to build {out.name} (exit {proc.returncode}):\n{proc.stderr}")


def _run_ldconfig(root: Path) -> None:
    # The real one, so the cache and SONAME links are exactly glibc's.
    found = shutil.which("ldconfig")
    candidates = [found] if found else []
    candidates += [p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)]
    if not candidates:
        raise DriverRootBuildError("ldconfig not found on PATH, /sbin or /usr/sbin")
    try:
        proc = subprocess.run([candidates[0], "-r", str(root)], capture_output=True, text=True, check=False)
    except OSError as exc:
        raise DriverRootBuildError(f"cannot run {candidates[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise DriverRootBuildError(f"{candidates[0]} -r {root} failed (exit {proc.returncode}):\n{proc.stderr}")
    if not (root / "etc" / "ld.so.cache").is_file():  # e.g. musl's ldconfig, which writes no cache
        raise DriverRootBuildError(f"{candidates[0]} -r {root} wrote no etc/ld.so.cache:\n{proc.stderr}")


def _leave_socket(path: Path) -> None:
    """Bind a unix socket at ``path`` and close it: the socket file stays, as a daemon's would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # bind fails on an existing file; a rebuild replaces it
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        if len(os.fsencode(path)) < _SUN_PATH_MAX:
            sock.bind(str(path))
            return
        # pytest's tmp_path can exceed sun_path: reach the directory through
        # its descriptor instead of chdir, which would race other threads.
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")
        finally:
            os.close(dir_fd)
