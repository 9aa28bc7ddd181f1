"""The MPS root: a pipe and a log directory per group, and one tmpfs for the clients' /dev/shm.

A control daemon starts each client UID's server as that UID, and the server must reach the pipe
directory: every parent has to be traversable by any UID (NVIDIA's #762 and bottlerocket #4673
came from a 0700 parent). The root and what is under it stay writable by root alone. Where SELinux
enforces, containers may only use the directories labelled container_file_t (NVIDIA's #1105).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nvplug.shaping.mps_groups import LOG, PIPE, MpsGroup, shm_dir

log = logging.getLogger("nvplug.mps")

DIR_MODE = 0o755
# The pid file a control daemon writes in its pipe directory (nvplug's own record is daemon_records.py's).
DAEMON_PID_FILE = "nvidia-cuda-mps-control.pid"
# As /dev/shm: any client UID makes its segments there, and removes only its own.
SHM_MODE = 0o1777
CONTAINER_LABEL = "container_file_t"


class MpsDirError(OSError):
    """A directory the daemons need that cannot be made or reached; the message names it."""


@dataclass(frozen=True)
class RootLayout:
    """Where the MPS files live, and how the host treats them (SELinux from the sysfs root)."""

    root: Path
    selinux_enforce: Path = Path("/sys/fs/selinux/enforce")
    proc_mounts: Path = Path("/proc/self/mountinfo")

    @property
    def shm(self) -> Path:
        return Path(shm_dir(str(self.root)))

    def prepare_root(self) -> list[str]:
        """The root and the shm tmpfs (mounted unless it is: nvplug-mps.service's, or one an earlier
        nvplug left, with the clients' segments in it). What it fell short of, for the log and status."""
        notes: list[str] = []
        _check_parents(self.root)  # before anything is made under a parent no server could pass
        _make_dir(self.root, DIR_MODE)
        _check_parents(self.root)
        if not (self.shm.is_dir() and self.shm.is_mount()):
            self.shm.mkdir(mode=SHM_MODE, exist_ok=True)
            failed = _mount_tmpfs(self.shm)
            if failed:
                notes.append(f"{self.shm} is a plain directory: {failed}")
        self.shm.chmod(SHM_MODE)
        notes += self._label([self.shm])
        return notes

    def prepare_group(self, group: MpsGroup) -> list[str]:
        """A group's pipe and log directories, emptied of what a crashed daemon left."""
        base = self.root / group.name
        _make_dir(base, DIR_MODE)
        pipe, logs = base / PIPE, base / LOG
        # A dead daemon's socket and pid file would make the next one refuse to start.
        if pipe.exists():
            shutil.rmtree(pipe)
        _make_dir(pipe, DIR_MODE)
        _make_dir(logs, DIR_MODE)
        return self._label([pipe])

    def remove_group(self, group: MpsGroup) -> None:
        """A stopped group's pipe directory; its log stays, for whoever asks why it stopped."""
        shutil.rmtree(self.root / group.name / PIPE, ignore_errors=True)

    def remove_root(self) -> str | None:
        """The operator's teardown: the tmpfs unmounted (whoever mounted it) and every pipe directory
        removed; the logs stay. Why not; None: done."""
        if self.shm.is_mount():
            done = subprocess.run(["umount", str(self.shm)], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return f"cannot unmount {self.shm}: {done.stderr.strip() or done.returncode}"
        if not self.root.is_dir():
            return None
        with contextlib.suppress(OSError):
            self.shm.rmdir()
        for group in self.root.iterdir():
            shutil.rmtree(group / PIPE, ignore_errors=True)
        return None

    def _label(self, paths: Sequence[Path]) -> list[str]:
        if not _enforcing(self.selinux_enforce):
            return []
        notes = []
        for path in paths:
            done = subprocess.run(
                ["chcon", "-R", "-t", CONTAINER_LABEL, str(path)], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                notes.append(f"cannot label {path} {CONTAINER_LABEL}: {done.stderr.strip() or done.returncode}")
        return notes


def _make_dir(path: Path, mode: int) -> None:
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        info = path.lstat()
        if not stat.S_ISDIR(info.st_mode):
            raise MpsDirError(f"{path} is not a directory")
        if info.st_uid != os.geteuid():
            raise MpsDirError(f"{path} is owned by UID {info.st_uid}, not by nvplug's: refusing to use it")
        path.chmod(mode)
    except MpsDirError:
        raise
    except OSError as err:
        raise MpsDirError(f"cannot make {path}: {err.strerror or err}") from err


def _check_parents(root: Path) -> None:
    """Every parent of the root that exists traversable by any UID: a server runs as its client's
    UID. Resolved: a symlinked parent's target must be passable too."""
    for parent in root.parents:
        try:
            mode = parent.resolve().stat().st_mode
        except FileNotFoundError:
            continue  # made 0755 by us
        except OSError as err:
            raise MpsDirError(f"cannot read {parent}: {err.strerror or err}") from err
        if not mode & stat.S_IXOTH:
            raise MpsDirError(
                f"{parent} is mode {stat.S_IMODE(mode):04o}: MPS servers run as their clients' UIDs and "
                f"cannot pass it to reach {root}; make it traversable (chmod o+x) or set nvplug.mps.root elsewhere"
            )


def _mount_tmpfs(path: Path) -> str | None:
    """A tmpfs half the size of memory, as /dev/shm has by default. Why it failed; None: mounted."""
    options = f"mode={SHM_MODE:o},nosuid,nodev,size=50%"
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "nvplug-mps-shm", str(path)],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot mount a tmpfs: {err}"
    if done.returncode != 0:
        return f"cannot mount a tmpfs: {done.stderr.strip() or f'mount exited {done.returncode}'}"
    return None


def _enforcing(path: Path) -> bool:
    try:
        return path.read_text().strip() == "1"
    except OSError:
        return False
