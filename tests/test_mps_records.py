"""The record of the MPS control daemons, and the process handle that adopts one: which process is the
recorded one, and what becomes of a record that cannot be believed."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from nvplug.mps.daemon_process import DaemonProcess, binary_name, start_ticks
from nvplug.mps.daemon_records import FILE, DaemonRecord, DaemonRecords, DaemonSettings

SETTINGS = DaemonSettings(("GPU-a", "GPU-b"), 25, (20389, None))


def record(pid: int, started: int, binary: str = "/usr/bin/nvidia-cuda-mps-control") -> DaemonRecord:
    return DaemonRecord("nvidia.com_gpu.mps", pid, started, binary, "/run/nvplug/mps/g/pipe", ("GPU-a",), SETTINGS)


def test_records_are_read_back_as_written_and_dropped(tmp_path: Path) -> None:
    records = DaemonRecords(tmp_path, "boot-1")
    records.put(record(10, 1234))
    records.put(DaemonRecord("claim-x", 11, 99, "/bin/mps", "/p", (), None))
    assert (tmp_path / FILE).stat().st_mode & 0o777 == 0o600  # root's alone, as every checkpoint
    again = DaemonRecords(tmp_path, "boot-1").load()
    assert again == {
        "nvidia.com_gpu.mps": record(10, 1234),
        "claim-x": DaemonRecord("claim-x", 11, 99, "/bin/mps", "/p", (), None),
    }
    records.drop("claim-x")
    assert set(DaemonRecords(tmp_path, "boot-1").load()) == {"nvidia.com_gpu.mps"}


def test_a_record_of_another_boot_or_a_damaged_one_adopts_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    DaemonRecords(tmp_path, "boot-1").put(record(10, 1234))
    with caplog.at_level(logging.INFO):
        assert DaemonRecords(tmp_path, "boot-2").load() == {}
    assert "of an earlier boot (boot-1)" in caplog.text
    assert json.loads((tmp_path / FILE).read_text())["groups"] == {}  # its processes died with that boot
    DaemonRecords(tmp_path, "boot-2").put(record(10, 1234))
    doc = json.loads((tmp_path / FILE).read_text())
    doc["groups"]["nvidia.com_gpu.mps"]["pid"] = 11  # edited by hand: the checksum says so
    (tmp_path / FILE).write_text(json.dumps(doc))
    with caplog.at_level(logging.ERROR):
        assert DaemonRecords(tmp_path, "boot-2").load() == {}
    assert "checksum mismatch" in caplog.text


def test_adopting_checks_the_process_is_the_recorded_one(tmp_path: Path) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None
    binary = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy(sleep, binary)
    proc = subprocess.Popen([str(binary), "60"], start_new_session=True)
    try:
        started = start_ticks(proc.pid)
        assert started is not None and binary_name(proc.pid) == binary.name
        # Another start time (a pid given to another process since), or another binary: not ours.
        assert DaemonProcess.adopt(proc.pid, started + 1, str(binary), tmp_path) is None
        assert DaemonProcess.adopt(proc.pid, started, "/usr/bin/other", tmp_path) is None
        adopted = DaemonProcess.adopt(proc.pid, started, str(binary), tmp_path)
        assert adopted is not None and adopted.adopted and adopted.alive

        async def end() -> str:
            adopted.kill()
            await asyncio.wait_for(adopted.wait(), 10)  # its exit seen through the pidfd, not polled
            return adopted.exit_text()

        said = asyncio.run(end())
        assert said.startswith("exited (adopted from an earlier nvplug") and not adopted.alive
        assert proc.wait(timeout=5) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert DaemonProcess.adopt(proc.pid, 1, str(binary), tmp_path) is None  # gone
