"""A stand-in for `nvidia-smi`, as `nvplug heal --reset` and the DRA driver run it: it records its arguments.

Each call appends its argv as one JSON line to $FAKE_NVIDIA_SMI_LOG. A reset
(`-r -i BUS_ID`) answers as the real tool does; $FAKE_NVIDIA_SMI_FAIL set makes
it fail the way the real one does when the GPU is busy, and so does a file `<log>.fail`.
`compute-policy -i UUID --set-timeslice N` (N 0-3, as NVIDIA's DRA driver runs it) keeps each GPU's
interval in `<log>.timeslices.json`, where `time_slices()` reads it; a file `<log>.fail-timeslice`
makes it fail as a GPU that does not support it does.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

LOG_ENV = "FAKE_NVIDIA_SMI_LOG"
FAIL_ENV = "FAKE_NVIDIA_SMI_FAIL"


def main(argv: Sequence[str]) -> int:
    log = os.environ.get(LOG_ENV)
    if log:
        with Path(log).open("a") as out:
            out.write(json.dumps(list(argv)) + "\n")
    if len(argv) == 3 and argv[0] == "-r" and argv[1] == "-i":
        bus = argv[2]
        if os.environ.get(FAIL_ENV) or (log and Path(f"{log}.fail").exists()):
            print(
                f"GPU {bus} is currently in use by another process.\n\n1 device is currently being used by one "
                "or more other processes (e.g., Fabric Manager, CUDA application, graphics application such as "
                "an X server, or a monitoring application such as another instance of nvidia-smi)."
            )
            return 255
        print(f"GPU {bus} was successfully reset.\nAll done.")
        return 0
    if len(argv) == 5 and tuple(argv[:2]) == ("compute-policy", "-i") and argv[3] == "--set-timeslice" and log:
        return _set_timeslice(Path(log), argv[2], argv[4])
    print(f"nvidia-smi stand-in: {' '.join(argv)}: not simulated", file=sys.stderr)
    return 2


def _set_timeslice(log: Path, uuid: str, value: str) -> int:
    if value not in ("0", "1", "2", "3"):
        print(f"Invalid timeslice value: {value}. Valid values are 0-3.", file=sys.stderr)
        return 2
    if Path(f"{log}.fail-timeslice").exists():
        print(f"Setting timeslice for GPU {uuid} is not supported.", file=sys.stderr)
        return 3
    if not uuid.startswith("GPU-"):
        print(f"No devices were found matching {uuid}", file=sys.stderr)
        return 6
    state = time_slices(log)
    state[uuid] = int(value)
    Path(f"{log}.timeslices.json").write_text(json.dumps(state))
    print(f"Set timeslice to {value} for GPU {uuid}.")
    return 0


def time_slices(log: Path) -> dict[str, int]:
    """Each GPU's interval as the last compute-policy call set it, by UUID (absent: never set)."""
    try:
        return {str(k): int(v) for k, v in json.loads(Path(f"{log}.timeslices.json").read_text()).items()}
    except FileNotFoundError:
        return {}


def install(bin_dir: Path, log: Path) -> Path:
    """An `nvidia-smi` executable in `bin_dir` that runs this module with this Python, logging to `log`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "nvidia-smi"
    module = "nvplug.testing.nvidia_smi_standin"
    path.write_text(f'#!/bin/sh\n{LOG_ENV}="${{{LOG_ENV}:-{log}}}" exec {sys.executable} -m {module} "$@"\n')
    path.chmod(0o755)
    return path


def calls(log: Path) -> list[list[str]]:
    """Every recorded argv, oldest first."""
    try:
        return [json.loads(line) for line in log.read_text().splitlines() if line]
    except FileNotFoundError:
        return []


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
