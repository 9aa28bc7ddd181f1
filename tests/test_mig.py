"""MIG facts without NVML: profile names and the capability minors."""

from __future__ import annotations

from pathlib import Path

import pytest

from nvplug.mig import parse_mig_minors, profile_name, read_mig_minors

H100 = 81559  # MiB, an H100 80GB HBM3
A100 = 40960  # MiB, an A100 40GB


@pytest.mark.parametrize(
    ("gi", "ci", "memory_mb", "total", "ofa", "name"),
    [
        (1, 1, 9856, H100, 0, "1g.10gb"),
        (1, 1, 9856, H100, 1, "1g.10gb.me"),
        (1, 1, 19968, H100, 0, "1g.20gb"),
        (2, 2, 19968, H100, 0, "2g.20gb"),
        (3, 3, 40192, H100, 0, "3g.40gb"),
        (4, 4, 40192, H100, 0, "4g.40gb"),
        (7, 7, 80896, H100, 1, "7g.80gb"),
        (2, 1, 19968, H100, 0, "1c.2g.20gb"),
        (1, 1, 4864, A100, 0, "1g.5gb"),
        (3, 3, 19968, A100, 0, "3g.20gb"),
    ],
)
def test_profile_names(gi: int, ci: int, memory_mb: int, total: int, ofa: int, name: str) -> None:
    assert profile_name(gi, ci, memory_mb, total, ofa) == name


def test_mig_minors_table(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "config 1",
            "monitor 2",
            "gpu0/gi1/access 12",
            "gpu0/gi1/ci0/access 13",
            "gpu1/gi2/access 161",
            "gpu1/gi2/ci0/access 162",
            "garbage",
            "gpu0/gix/access 9",
        ]
    )
    minors = parse_mig_minors(text)
    assert minors.nodes(0, 1, 0) == ("/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13")
    assert minors.nodes(1, 2, 0) == ("/dev/nvidia-caps/nvidia-cap161", "/dev/nvidia-caps/nvidia-cap162")
    assert minors.nodes(0, 2, 0) is None
    (tmp_path / "driver/nvidia-caps").mkdir(parents=True)
    (tmp_path / "driver/nvidia-caps/mig-minors").write_text(text)
    assert read_mig_minors(tmp_path) == minors
    assert read_mig_minors(tmp_path / "absent").nodes(0, 1, 0) is None
