"""The MPS groups' control.log, followed with inotify on the loop: a line that reports trouble is told
once, with its group; what was there before the watch, or is written after it ends, is not."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from nvplug.mps.control_log_watch import CONTROL_LOG, ControlLogWatch
from nvplug.testing.loop_thread import LoopThread

TIMEOUT = 15.0


def test_trouble_written_to_control_log_is_told_with_its_group(tmp_path: Path) -> None:
    logs = tmp_path / "mps-a" / "log"
    logs.mkdir(parents=True)
    log = logs / CONTROL_LOG
    log.write_text("[...] ERROR from an earlier daemon\n")
    told: queue.Queue[tuple[str, str]] = queue.Queue()
    with LoopThread(TIMEOUT) as loop:
        watch = ControlLogWatch(lambda group, line: told.put((group, line)))
        loop.call(lambda: watch.watch("a", str(logs)))
        try:
            with log.open("a") as f:
                f.write("[...] New client connected\n")
            with log.open("a") as f:
                f.write("[...] Server failed: fatal exception\n")
            assert told.get(timeout=5) == ("a", "[...] Server failed: fatal exception")
            loop.call(lambda: watch.unwatch("a"))
            other = tmp_path / "mps-b" / "log"
            other.mkdir(parents=True)
            loop.call(lambda: watch.watch("b", str(other)))
            with log.open("a") as f:
                f.write("[...] another error\n")
            (other / CONTROL_LOG).write_text("[...] cannot start\n")
            # One inotify descriptor, read in order: b's line comes after anything a's would have.
            assert told.get(timeout=5) == ("b", "[...] cannot start")
            assert told.empty()
        finally:
            loop.run(watch.stop())


def test_a_missing_log_directory_is_said_and_left(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    absent = tmp_path / "absent"
    with LoopThread(TIMEOUT) as loop:
        watch = ControlLogWatch(lambda group, line: None)
        try:
            loop.call(lambda: watch.watch("a", str(absent)))
            loop.call(lambda: watch.unwatch("a"))
        finally:
            loop.run(watch.stop())
    expected = f"cannot watch {absent}: No such file or directory; its daemon's errors are seen when it exits"
    assert expected in caplog.messages
