"""A control daemon's process, whether this nvplug started it or adopted it from an earlier one.

The daemon is started in a session of its own, with no pipe to nvplug (its stderr goes to a file in its
log directory), so that nothing of nvplug's going (a signal to its process group, its stderr closed)
reaches it; under systemd, in a unit of its own (daemon_units.py), out of nvplug's cgroup. Its exit is
seen on the loop through a pidfd, which works the same for a process that is not nvplug's child: nothing
waits in a thread and nothing polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from collections import deque
from collections.abc import Mapping
from pathlib import Path

from nvplug.mps.control_client import ControlClient, MpsControlError
from nvplug.mps.daemon_units import start_unit

log = logging.getLogger("nvplug.mps")

STDERR_FILE = "control.stderr"
# How long a daemon told to quit has before it is killed.
QUIT_SECONDS = 10.0
# The lines of its stderr its exit is told with.
STDERR_TAIL = 5


def start_ticks(pid: int, proc: Path = Path("/proc")) -> int | None:
    """When the process started, in clock ticks after boot (field 22 of its stat); None if it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The name (field 2) may hold spaces and parentheses: the fields after it follow the last ")".
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def binary_name(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The name of the binary the process runs; None if it cannot be read. A binary replaced since it
    started (a driver upgrade) reads as "<path> (deleted)": its name is the same."""
    try:
        exe = str((proc / str(pid) / "exe").readlink())
    except OSError:
        return None
    return Path(exe.removesuffix(" (deleted)")).name


class DaemonProcess:
    def __init__(
        self, pid: int, pidfd: int, child: subprocess.Popen[bytes] | None, stderr: Path, unit: str | None = None
    ) -> None:
        self.pid = pid
        # The systemd unit it runs in; None: a session of its own.
        self.unit = unit
        self._pidfd = pidfd
        # Ours to reap, with an exit status; None: adopted, not our child, its status unknown.
        self._child = child
        self._stderr = stderr
        self._exited: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def spawn(cls, binary: str, env: Mapping[str, str], log_dir: Path) -> DaemonProcess:
        """Started in the foreground (`-f`), as a child nvplug's end does not reach. Blocking: run it in a thread."""
        stderr = log_dir / STDERR_FILE
        with stderr.open("wb") as err:  # this daemon's lines alone: the one before it is gone
            child = subprocess.Popen(
                [binary, "-f"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=dict(env),
                start_new_session=True,
                close_fds=True,
            )
        try:
            pidfd = os.pidfd_open(child.pid)
        except OSError:
            child.kill()
            child.wait()
            raise
        return cls(child.pid, pidfd, child, stderr)

    @classmethod
    def in_unit(cls, unit: str, binary: str, env: Mapping[str, str], log_dir: Path, description: str) -> DaemonProcess:
        """Started in a transient unit of its own (its output in the journal). Blocking: run it in a thread.
        Raises UnitError (an OSError)."""
        pid = start_unit(unit, binary, env, description)
        return cls(pid, os.pidfd_open(pid), None, log_dir / STDERR_FILE, unit)

    @classmethod
    def adopt(cls, pid: int, started: int, binary: str, log_dir: Path, unit: str | None = None) -> DaemonProcess | None:
        """The process `pid` if it is still the one recorded (same start, same binary); None if not."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        # Checked once the pidfd holds the pid: it cannot be given to another process from now on.
        if start_ticks(pid) != started or binary_name(pid) != Path(binary).name:
            os.close(pidfd)
            return None
        return cls(pid, pidfd, None, log_dir / STDERR_FILE, unit)

    @property
    def adopted(self) -> bool:
        """Not this nvplug's child: adopted, or in a unit of its own; its exit status is not ours to read."""
        return self._child is None

    @property
    def returncode(self) -> int | None:
        return self._child.returncode if self._child is not None else None

    @property
    def alive(self) -> bool:
        return self._pidfd >= 0 and not (self._exited is not None and self._exited.done())

    async def wait(self) -> None:
        """Until it exits (reaped, if it is our child)."""
        if self._exited is None:
            loop = asyncio.get_running_loop()
            self._exited = loop.create_future()
            self._loop = loop
            if self._pidfd < 0:
                self._exited.set_result(None)
            else:
                loop.add_reader(self._pidfd, self._on_exit)
        await asyncio.shield(self._exited)

    def _on_exit(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._pidfd)
        if self._child is not None:
            self._child.poll()  # reaped: no zombie left behind
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(None)

    def kill(self) -> None:
        """SIGKILL to it and its servers (its process group), unless it is gone already."""
        if not self.alive:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        # The group outlives its leader while a server runs; its id is not reused meanwhile.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    async def end(self, client: ControlClient | None, what: str) -> None:
        """Told to quit through `client` (None: killed at once), killed if it has not gone within
        QUIT_SECONDS or does not take the quit, then closed. `what` names it in the log."""
        exited = asyncio.ensure_future(self.wait())
        if client is not None:
            try:
                await client.send(["quit"])
            except MpsControlError as err:
                if not exited.done():
                    log.warning("%s: quit failed (%s): killed", what, err)
            else:
                done, _ = await asyncio.wait({exited}, timeout=QUIT_SECONDS)
                if not done:
                    log.warning("%s did not quit within %g s: killed", what, QUIT_SECONDS)
        self.kill()  # its servers too; nothing if it is gone
        await exited
        self.close()

    def leave(self) -> None:
        """nvplug stops: the daemon runs on, unwatched; the next nvplug adopts it."""
        if self._loop is not None and self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
        self.close()

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def exit_text(self) -> str:
        code = self.returncode
        if self.unit is not None and not self.alive:
            how = f"exited (its unit {self.unit}: journalctl -u {self.unit})"
        elif self.adopted and not self.alive:
            how = "exited (adopted from an earlier nvplug: its status is not ours to read)"
        elif code is None:
            how = "is gone"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        tail = self.stderr_tail()
        return how + (f" ({' / '.join(tail)})" if tail else "")

    def stderr_tail(self) -> list[str]:
        try:
            with self._stderr.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        return list(deque((line.strip() for line in lines if line.strip()), maxlen=STDERR_TAIL))
