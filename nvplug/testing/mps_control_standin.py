"""Build and drive a stand-in for NVIDIA's ``nvidia-cuda-mps-control`` (``fake_mps_control.c``).

Real MPS needs a GPU. The stand-in is one static C binary (libc only), so that its
client mode also runs in a busybox-only container as a non-root UID. It has the real
tool's command line:

* ``nvidia-cuda-mps-control -d``: the control daemon in the background. It returns 0
  once ``<pipe>/control`` listens (1 and a message if not, for instance "An instance of
  this daemon is already running") and writes ``<pipe>/nvidia-cuda-mps-control.pid``.
* ``nvidia-cuda-mps-control -f``: the daemon in the foreground, as a supervisor runs it;
  its log lines go to stderr too. SIGTERM or SIGINT stop it as ``quit`` does.
* ``nvidia-cuda-mps-control``: the client. It reads commands from stdin, one a line, and
  prints each answer on stdout. With no daemon at the pipe directory (no socket, or a
  dead daemon's) it prints "Cannot find MPS control daemon process" on stderr and exits 1.
  It exits 1 as well if any command got an error answer (a line starting ``Error:``).
* ``-h`` / ``--help``.

Environment: ``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``),
``CUDA_MPS_LOG_DIRECTORY`` (default ``/var/log/nvidia-mps``) and ``CUDA_VISIBLE_DEVICES``
(the daemon's devices, GPU-/MIG- UUIDs or indices; unset means one device). In commands
a device is a position in that list or one of its entries (a UUID).

Commands, answered as the real daemon does where its answers are known:

* ``get_default_active_thread_percentage`` prints ``100.0`` (one decimal);
  ``set_default_active_thread_percentage N`` (1 to 100) prints nothing.
* ``set_default_device_pinned_mem_limit <dev> <value>`` (an integer and ``M`` or ``G``)
  prints nothing; ``get_default_device_pinned_mem_limit <dev>`` prints the value as it was
  set (``4096M``, ``2G``) or ``0`` when unset.
* ``get_server_list`` (one PID a line), ``get_server_status <pid>`` (``ACTIVE``,
  ``INITIALIZING`` or ``SHUTTING_DOWN``), ``get_client_list <pid>`` (the pids of the held clients below),
  ``get_active_thread_percentage <pid>``, ``get_device_pinned_mem_limit <pid> <dev>``
  (the values a server started with), ``start_server -uid <uid>``, ``shutdown_server
  <pid> [-f]`` (answered once the server has exited), ``quit [-t <seconds>]`` (stops the
  servers, removes the socket and pid file, logs ``Exit`` and exits 0), ``help``.
* Anything else, or a bad argument: ``Error: ...``.

Defaults apply to servers started afterwards only. As with the real daemon there is one
server at a time: a client of another UID makes the current server exit, then gets its own.

Test hooks:

* ``nvidia-cuda-mps-control --fake-cuda-client`` connects like a CUDA application. The
  daemon forks a server that switches to the client's UID and GID (setgroups, setgid,
  setuid, as the real daemon does) and connects back to ``<pipe>/control`` as that user,
  so it needs search permission on every parent of the pipe directory. On success the
  client prints ``connected to MPS server <pid> (user <uid>, active thread percentage
  <p>, pinned memory limits <dev>=<value>,...|none)`` and exits 0. If the server cannot
  get there, control.log gets the lines of NVIDIA k8s-device-plugin issue #762 ("Server
  encountered a fatal exception. Shutting down", "Server <pid> exited with status 1"),
  server.log says why, and the client prints an error on stderr and exits 1. A daemon
  without CAP_SETUID logs "Failed to start server for user ..." and answers an error.
* ``nvidia-cuda-mps-control --fake-cuda-client --hold [FILE]`` connects the same way and then
  stays connected, with FILE (made if missing; a segment in the clients' shm) open, as a CUDA
  process holds its context: it prints ``holding the connection``, and ``get_client_list``
  lists it. If the daemon goes away it prints ``cudaErrorMpsConnectionFailed: the MPS server
  went away`` and exits 1, as a real client fails: :class:`HeldClient`.
* Every UI command is recorded as a JSON line ``{"uid": .., "pid": .., "monotonic": ..,
  "command": ".."}`` (CLOCK_MONOTONIC seconds, the machine's clock, as ``time.monotonic()``)
  in ``<log dir>/commands.jsonl`` or ``$FAKE_MPS_COMMAND_LOG``: :func:`commands`.
* ``fake_crash``: the daemon writes a fatal line to control.log and aborts (SIGABRT),
  leaving its socket and pid file behind. ``FAKE_MPS_CRASH_AFTER=<n>`` in the daemon's
  environment: commands 1 to n are answered, command n+1 crashes it the same way.
* ``fake_hang``: the daemon stops answering anything, that command included; it stays
  alive with its socket open, so clients connect and then wait for ever.
* ``control.log`` and ``server.log`` use the real format, ``[YYYY-MM-DD HH:MM:SS.mmm
  Control   PID] message``: :func:`control_log`, :func:`server_log`.

Unix socket paths must stay under 108 bytes: keep pipe directories short (under /tmp).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nvplug.testing import c_build
from nvplug.testing.c_build import CBuildError

__all__ = [
    "BINARY_NAME",
    "CONTROL_SOCKET",
    "NO_DAEMON_MESSAGE",
    "PID_FILE",
    "SOURCE",
    "HeldClient",
    "LogLine",
    "MpsStandinBuildError",
    "build",
    "client",
    "commands",
    "control_log",
    "environ",
    "fake_cuda_client",
    "install",
    "read_pid_file",
    "server_log",
    "start_foreground",
    "wait_listening",
]

_HERE = Path(__file__).resolve().parent
SOURCE: Path = _HERE / "fake_mps_control.c"
BINARY_NAME = "nvidia-cuda-mps-control"
CONTROL_SOCKET = "control"
PID_FILE = "nvidia-cuda-mps-control.pid"
NO_DAEMON_MESSAGE = "Cannot find MPS control daemon process"
_CFLAGS = ("-static", "-O2", "-Wall", "-Wextra")
_LOG_LINE = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3}) (\w+) +(\d+)\] (.*)$")


class MpsStandinBuildError(CBuildError):
    """The C compiler could not build the stand-in."""


@dataclasses.dataclass(frozen=True)
class LogLine:
    """One line of control.log or server.log: ``[time role pid] message``."""

    time: str
    role: str  # Control, Server or Other
    pid: int
    message: str


def build(dest_dir: Path, cc: str = "cc") -> Path:
    """Compile :data:`SOURCE` to ``dest_dir/nvidia-cuda-mps-control`` unless an up-to-date build exists.

    The build is keyed by a hash of the source, the compiler and its flags. Safe for
    concurrent callers: the binary is written under a temporary name and renamed into
    place, and its hash is written only after it.
    """
    return c_build.build(SOURCE, Path(dest_dir) / BINARY_NAME, _CFLAGS, cc, MpsStandinBuildError)


def install(bin_dir: Path, *, build_dir: Path | None = None, cc: str = "cc") -> Path:
    """An executable ``nvidia-cuda-mps-control`` in ``bin_dir`` (mode 0755): a copy of :func:`build`'s.

    ``build_dir`` is where it is built and cached (default: a hidden directory in
    ``bin_dir``); share one between installs to compile once.
    """
    bin_dir = Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    built = build(build_dir if build_dir is not None else bin_dir / f".{BINARY_NAME}.build", cc)
    path = bin_dir / BINARY_NAME
    with c_build.temp_in(bin_dir, BINARY_NAME, ".tmp") as tmp:
        shutil.copyfile(built, tmp)
        tmp.chmod(0o755)
        tmp.replace(path)
    return path


def environ(
    pipe_dir: Path,
    log_dir: Path | None = None,
    devices: Sequence[str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """An environment naming the daemon's pipe directory (and log directory and devices, if given)."""
    env = dict(os.environ if base is None else base)
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe_dir)
    if log_dir is not None:
        env["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env


def client(
    pipe_dir: Path,
    *commands: str,
    binary: Path | None = None,
    env: Mapping[str, str] | None = None,
    user: int | None = None,
    timeout: float = 10.0,
) -> subprocess.CompletedProcess[str]:
    """Run the client mode with ``commands`` on stdin, one a line; output captured as text.

    ``binary`` defaults to ``nvidia-cuda-mps-control`` on the PATH of ``env``; ``env``
    defaults to this process's; ``CUDA_MPS_PIPE_DIRECTORY`` is always ``pipe_dir``.
    ``user`` runs it as that UID (and the same GID). A daemon that does not answer
    raises :class:`subprocess.TimeoutExpired` after ``timeout`` seconds.
    """
    stdin = "".join(f"{command}\n" for command in commands)
    return _run(pipe_dir, (), stdin, binary, env, user, timeout)


def fake_cuda_client(
    pipe_dir: Path,
    *,
    binary: Path | None = None,
    env: Mapping[str, str] | None = None,
    user: int | None = None,
    timeout: float = 10.0,
) -> subprocess.CompletedProcess[str]:
    """Run ``nvidia-cuda-mps-control --fake-cuda-client`` (as ``user``, if given), like :func:`client`."""
    return _run(pipe_dir, ("--fake-cuda-client",), None, binary, env, user, timeout)


class HeldClient:
    """A fake CUDA client that stays connected (``--fake-cuda-client --hold``), until :meth:`close`."""

    def __init__(self, pipe_dir: Path, held_file: Path | None = None, *, binary: Path | None = None) -> None:
        env = environ(pipe_dir)
        args = [str(_binary(binary, env)), "--fake-cuda-client", "--hold", *([str(held_file)] if held_file else [])]
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        # Its two lines: the server it got, then that it holds on (a failure ends stdout instead).
        self.said = [self.proc.stdout.readline().strip(), self.proc.stdout.readline().strip()]
        if self.said[1] != "holding the connection":
            _, err = self.proc.communicate(timeout=10)
            raise RuntimeError(f"the fake CUDA client did not connect: {self.said} {err.strip()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def connected(self) -> bool:
        """Still holding its connection: a client whose daemon went away has exited 1."""
        return self.proc.poll() is None

    def close(self) -> str:
        """Ended (SIGTERM, as a workload ends); what it said on stderr."""
        if self.proc.poll() is None:
            self.proc.terminate()
        _, err = self.proc.communicate(timeout=10)
        return err


def _run(
    pipe_dir: Path,
    args: Sequence[str],
    stdin: str | None,
    binary: Path | None,
    env: Mapping[str, str] | None,
    user: int | None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """The binary with `args`, `stdin` as its input (None: /dev/null), output captured as text."""
    run_env = environ(pipe_dir, base=env)
    feed: dict[str, Any] = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
    return subprocess.run(
        [str(_binary(binary, run_env)), *args],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **feed,
        **_as_user(user),
    )


def wait_listening(pipe_dir: Path, timeout: float = 10.0) -> None:
    """Wait until something accepts connections on ``<pipe_dir>/control``; :class:`TimeoutError` if not."""
    path = str(Path(pipe_dir) / CONTROL_SOCKET)
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(path)
                return
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"nothing listens on {path} after {timeout}s") from exc
        time.sleep(0.02)


def start_foreground(
    binary: Path,
    env: Mapping[str, str],
    *,
    stderr: Path | None = None,
    timeout: float = 10.0,
    user: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``binary -f`` with ``env`` and wait until its socket listens.

    Its stderr (the log lines again) is appended to the file ``stderr``, or dropped: a
    pipe nobody reads would fill up and block the daemon. The caller owns the process:
    wait for it, or kill it. If it exits before it listens, :class:`RuntimeError` says
    with which status.
    """
    with contextlib.ExitStack() as stack:
        err = stack.enter_context(open(stderr, "ab")) if stderr is not None else subprocess.DEVNULL
        proc = subprocess.Popen(
            [str(binary), "-f"],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            **_as_user(user),
        )
    pipe_dir = Path(env.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{binary} -f exited with {proc.returncode} before it listened")
        try:
            wait_listening(pipe_dir, timeout=0.05)
        except TimeoutError:
            if time.monotonic() >= deadline:
                proc.kill()
                proc.wait()
                raise
        else:
            return proc


def read_pid_file(pipe_dir: Path) -> int | None:
    """The PID in ``<pipe_dir>/nvidia-cuda-mps-control.pid``, or None without one."""
    text = c_build.read_text(Path(pipe_dir) / PID_FILE)
    return int(text) if text else None


def commands(log_dir: Path, path: Path | None = None) -> list[dict[str, Any]]:
    """Every UI command the daemon got, oldest first (``path``: a ``FAKE_MPS_COMMAND_LOG`` instead)."""
    log = Path(path) if path is not None else Path(log_dir) / "commands.jsonl"
    try:
        text = log.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line]


def control_log(log_dir: Path) -> list[LogLine]:
    """The lines of ``<log_dir>/control.log`` (none if it does not exist)."""
    return _parse_log(Path(log_dir) / "control.log")


def server_log(log_dir: Path) -> list[LogLine]:
    """The lines of ``<log_dir>/server.log`` (none if it does not exist)."""
    return _parse_log(Path(log_dir) / "server.log")


def _parse_log(path: Path) -> list[LogLine]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = []
    for raw in text.splitlines():
        match = _LOG_LINE.match(raw)
        if match is None:
            raise ValueError(f"{path}: not an MPS log line: {raw!r}")
        lines.append(LogLine(match[1], match[2], int(match[3]), match[4]))
    return lines


def _binary(binary: Path | None, env: Mapping[str, str]) -> Path:
    if binary is not None:
        return Path(binary)
    found = shutil.which(BINARY_NAME, path=env.get("PATH"))
    if found is None:
        raise FileNotFoundError(f"{BINARY_NAME} is not on PATH; pass binary= or install() it first")
    return Path(found)


def _as_user(user: int | None) -> dict[str, Any]:
    # Group too, and no supplementary groups: a container user's credentials.
    return {} if user is None else {"user": user, "group": user, "extra_groups": []}
