"""The MPS root's directories on a real file system: modes, the parent check, SELinux labels (through
a stand-in chcon on PATH), the tmpfs (root only), and what a stop leaves."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvplug.core.gpu import Gpu
from nvplug.mps.mps_dirs import DAEMON_PID_FILE, MpsDirError, RootLayout
from nvplug.shaping.mps_groups import MpsGroup

GROUP = MpsGroup("nvidia.com_gpu", "nvidia.com/gpu", ((Gpu("GPU-1", 0, "0000:18:00.0"), None),), 50, (40960,))


@pytest.fixture
def top() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="nvp-dirs-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shm = path / "mps" / "shm"
    if shm.is_mount():
        subprocess.run(["umount", "-l", str(shm)], check=False)
    shutil.rmtree(path, ignore_errors=True)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_the_root_its_group_and_a_stop(top: Path) -> None:
    layout = RootLayout(top / "mps", top / "enforce")
    assert layout.prepare_root() == [] and layout.shm.is_mount()
    assert mode(top / "mps") == 0o755 and mode(layout.shm) == 0o1777
    layout.prepare_group(GROUP)
    pipe, logs = top / "mps" / GROUP.name / "pipe", top / "mps" / GROUP.name / "log"
    assert mode(pipe) == 0o755 and mode(logs) == 0o755
    # What a crashed daemon left in its pipe directory is gone before the next one starts.
    (pipe / "control").write_text("")
    (logs / "control.log").write_text("[...] Exit\n")
    layout.prepare_group(GROUP)
    assert list(pipe.iterdir()) == []
    (pipe / DAEMON_PID_FILE).write_text("1\n")
    assert layout.remove_root() is None
    assert not layout.shm.exists() and not pipe.exists()
    assert (logs / "control.log").read_text() == "[...] Exit\n"


def test_a_parent_no_uid_can_pass_is_refused_before_anything_is_made(top: Path) -> None:
    closed = top / "closed"
    closed.mkdir(mode=0o700)
    closed.chmod(0o700)
    layout = RootLayout(closed / "mps", top / "enforce")
    with pytest.raises(MpsDirError, match=rf"{closed} is mode 0700: MPS servers run as their clients' UIDs"):
        layout.prepare_root()
    assert not (closed / "mps").exists()


def test_a_root_owned_by_another_uid_is_refused(top: Path) -> None:
    (top / "mps").mkdir()
    os.chown(top / "mps", 1001, 1001)
    with pytest.raises(MpsDirError, match="owned by UID 1001"):
        RootLayout(top / "mps", top / "enforce").prepare_root()


def test_selinux_labels_where_it_enforces(top: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = top / "bin"
    bin_dir.mkdir()
    calls = top / "chcon.calls"
    chcon = bin_dir / "chcon"
    chcon.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    chcon.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    enforce = top / "enforce"
    enforce.write_text("0\n")
    layout = RootLayout(top / "mps", enforce)
    layout.prepare_group(GROUP)
    assert not calls.exists()  # permissive, or no SELinux: nothing to label
    enforce.write_text("1\n")
    assert layout.prepare_group(GROUP) == []
    assert calls.read_text().split() == ["-R", "-t", "container_file_t", str(top / "mps" / GROUP.name / "pipe")]
    chcon.write_text("#!/bin/sh\necho 'chcon: failed to change context' >&2\nexit 1\n")
    (notes,) = layout.prepare_group(GROUP)
    assert "cannot label" in notes and "container_file_t: chcon: failed to change context" in notes


def test_a_leftover_daemon_whose_binary_was_replaced_is_killed_all_the_same(tmp_path: Path) -> None:
    """A driver upgrade (or a test reinstalling the stand-in) replaces the binary under a running daemon:
    /proc/<pid>/exe then reads `<path> (deleted)`, and the leftover must still be found and killed."""
    from nvplug.mps.control_daemon import kill_leftover

    binary = tmp_path / "nvidia-cuda-mps-control"
    sleep = shutil.which("sleep")
    assert sleep is not None
    shutil.copy(sleep, binary)
    proc = subprocess.Popen([str(binary), "60"], start_new_session=True)
    try:
        binary.unlink()
        shutil.copy(sleep, binary)  # the new file at the same path
        assert str(Path(f"/proc/{proc.pid}/exe").readlink()).endswith(" (deleted)")
        pid_file = tmp_path / DAEMON_PID_FILE
        pid_file.write_text(f"{proc.pid}\n")
        assert kill_leftover(pid_file, str(binary)) == proc.pid
        assert proc.wait(timeout=5) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
