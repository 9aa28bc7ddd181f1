"""A process's children, from /proc: the daemon's NVML event process, for tests and benchmarks."""

from __future__ import annotations

from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """Empty once the process has gone."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return found
    for task in tasks:
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue  # the thread ended
    return found
