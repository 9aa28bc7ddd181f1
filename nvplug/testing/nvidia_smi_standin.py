"""A stand-in for `nvidia-smi`, as `nvplug heal --reset` runs it: it records its arguments.

Each call appends its argv as one JSON line to $FAKE_NVIDIA_SMI_LOG. A reset
(`-r -i BUS_ID`) answers as the real tool does; $FAKE_NVIDIA_SMI_FAIL set makes
it fail the way the real one does when the GPU is busy, and so does a file `<log>.fail`.
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
            print(f"GPU {bus} is currently in use by another process.\n\n1 device is currently being used by one "
                  "or more other processes (e.g., Fabric Manager, CUDA application, graphics application such as "
                  "an X server, or a monitoring application such as another instance of nvidia-smi).")  # fmt: skip
            return 255
        print(f"GPU {bus} was successfully reset.\nAll done.")
        return 0
    print(f"nvidia-smi stand-in: {' '.join(argv)}: not simulated", file=sys.stderr)
    return 2


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
