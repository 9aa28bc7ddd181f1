"""The invariant-checked soak, in its 60 s version (bench/soak.py runs 10 minutes by default)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"


def test_soak_60_seconds() -> None:
    seconds = os.environ.get("NVPLUG_SOAK_SECONDS", "60")
    result = subprocess.run(
        [sys.executable, str(SOAK), "--seconds", seconds], capture_output=True, text=True, timeout=float(seconds) + 120
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    checks = int(re.search(r"invariant checks passed: (\d+)", result.stdout).group(1))  # type: ignore[union-attr]
    faults = sum(
        int(n) for n in re.findall(r"\b[a-z_]+ (\d+)", result.stdout.split("faults injected:")[1].split("\n")[0])
    )
    assert checks > 100 and faults > 30, result.stdout
