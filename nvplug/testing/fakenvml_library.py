"""Build the fake ``libnvidia-ml.so.1`` (``fakenvml.c``) and load it in a child process.

The fake is loaded by the real ``pynvml`` through ``LD_LIBRARY_PATH`` in a
child process started with :func:`environ`; the driver state it keeps across
processes (compute modes, :data:`STATE_FILE`) can be read here without loading it.
Faults are injected through ``fakenvml_control.Control``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from nvplug.testing import c_build
from nvplug.testing.c_build import CBuildError
from nvplug.testing.fakenvml_devices import ComputeMode

__all__ = [
    "DEFAULT_SCENARIO",
    "LIB_NAME",
    "SOURCE",
    "STATE_FILE",
    "FakeNvmlBuildError",
    "build",
    "environ",
    "persisted_compute_modes",
    "state_file",
]

_HERE = Path(__file__).resolve().parent
SOURCE: Path = _HERE / "fakenvml.c"
DEFAULT_SCENARIO: Path = _HERE / "default.scenario"
LIB_NAME = "libnvidia-ml.so.1"
_CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-pthread")

# The driver state file (compute modes by GPU UUID) in FAKE_NVML_STATE_DIR: STATE_FILE in the C.
STATE_FILE = "fakenvml.state"


class FakeNvmlBuildError(CBuildError):
    """The C compiler could not build the fake library."""


def build(dest_dir: Path, cc: str = "cc") -> Path:
    """Compile :data:`SOURCE` to ``dest_dir/libnvidia-ml.so.1`` unless an up-to-date build exists.

    Safe to call from concurrent processes: the library is written under a
    temporary name and renamed into place, and the source hash beside it is
    written only after the library.
    """
    return c_build.build(SOURCE, Path(dest_dir) / LIB_NAME, _CFLAGS, cc, FakeNvmlBuildError)


def environ(
    lib_dir: Path,
    scenario: Path,
    control: Path,
    base: Mapping[str, str] | None = None,
    state_dir: Path | None = None,
) -> dict[str, str]:
    """The environment for a child process that should load the fake instead of a real NVML.

    ``state_dir`` (``FAKE_NVML_STATE_DIR``) holds the driver state that outlives the
    processes, the GPUs' compute modes (:data:`STATE_FILE`); by default the control
    socket's directory, which is one per simulated node: its processes (a daemon, its
    restarts, a CLI with a control socket of its own beside it) share the state, other
    nodes do not.
    """
    env = dict(os.environ if base is None else base)
    previous = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = str(lib_dir) + (os.pathsep + previous if previous else "")
    env["FAKE_NVML_SCENARIO"] = str(scenario)
    env["FAKE_NVML_CONTROL"] = str(control)
    env["FAKE_NVML_STATE_DIR"] = str(Path(control).parent if state_dir is None else state_dir)
    return env


def state_file(env: Mapping[str, str]) -> Path | None:
    """The driver state file the library uses in ``env``, as the C resolves it; None: it keeps none.

    ``FAKE_NVML_STATE_DIR``/:data:`STATE_FILE` (an empty value: none), else :data:`STATE_FILE`
    beside ``FAKE_NVML_CONTROL``, else none (the state then lives in the process).
    """
    state_dir = env.get("FAKE_NVML_STATE_DIR")
    if state_dir is not None:
        return Path(state_dir) / STATE_FILE if state_dir else None
    control = env.get("FAKE_NVML_CONTROL")
    return Path(control).parent / STATE_FILE if control else None


def persisted_compute_modes(where: Mapping[str, str] | Path) -> dict[str, int]:
    """The compute modes in the driver state file, by GPU UUID, read without loading the library.

    ``where`` is an environment (see :func:`state_file`), the state directory or the
    file itself.  Only GPUs whose mode was set since the file was made are there (the
    others have their gpu line's ``compute_mode=``); no file is no entries.
    """
    if isinstance(where, Path):
        path: Path | None = where / STATE_FILE if where.is_dir() else where
    else:
        path = state_file(where)
    text = c_build.read_text(path) if path is not None else None
    modes: dict[str, int] = {}
    for line in (text or "").splitlines():
        words = line.split("#", 1)[0].split()
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if sep and key == "compute_mode" and value.isdigit() and int(value) < len(ComputeMode):
                modes[words[0]] = int(value)
    return modes
