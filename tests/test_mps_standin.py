"""The nvidia-cuda-mps-control stand-in: real processes, real sockets, real user switches.

Tests run as root; the non-root cases run the client as UID 1001. Socket paths stay
short (a directory under /tmp), as unix socket paths must.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support import podman

from nvplug.testing import mps_control_standin as mps

USER = 1001
OTHER_USER = 1002
GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
GPU_B = "GPU-66666666-7777-8888-9999-000000000000"
MIG_C = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
CONNECTED = re.compile(r"^connected to MPS server (\d+) \(user (\d+), active thread percentage ([\d.]+), ")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: switches users")


@pytest.fixture(scope="module")
def binary() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="mpsbin", dir="/tmp"))
    root.chmod(0o755)  # UID 1001 runs the client from here
    try:
        yield mps.install(root / "bin", build_dir=root / "build")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Rig:
    """One daemon's directories under a short root, and the daemons started in it."""

    root: Path
    binary: Path
    pipe: Path
    log: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        env = mps.environ(self.pipe, self.log)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.pop("FAKE_MPS_CRASH_AFTER", None)
        env.pop("FAKE_MPS_COMMAND_LOG", None)
        env.update(extra)
        return env

    def foreground(self, env: Mapping[str, str] | None = None, user: int | None = None) -> subprocess.Popen[bytes]:
        proc = mps.start_foreground(
            self.binary, self.env() if env is None else env, stderr=self.root / "stderr.txt", user=user
        )
        self.procs.append(proc)
        return proc

    def ui(
        self, *commands: str, user: int | None = None, timeout: float = 10.0, pipe: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        return mps.client(pipe or self.pipe, *commands, binary=self.binary, env=self.env(), user=user, timeout=timeout)

    def fake(self, user: int | None = None, pipe: Path | None = None) -> subprocess.CompletedProcess[str]:
        return mps.fake_cuda_client(pipe or self.pipe, binary=self.binary, env=self.env(), user=user)

    def servers(self) -> list[int]:
        result = self.ui("get_server_list")
        assert result.returncode == 0, result
        return [int(line) for line in result.stdout.split()]

    def messages(self) -> list[str]:
        return [line.message for line in mps.control_log(self.log)]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        pid = mps.read_pid_file(self.pipe)
        if pid is not None and _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def rig(binary: Path) -> Iterator[Rig]:
    root = Path(tempfile.mkdtemp(prefix="mps", dir="/tmp"))
    root.chmod(0o755)
    r = Rig(root, binary, root / "pipe", root / "log")
    try:
        yield r
    finally:
        r.close()


def _alive(pid: int) -> bool:
    """Running and not a zombie (a daemonized process's zombie may linger unreaped in a container)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still alive after {timeout}s"
        time.sleep(0.02)


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def _connected(result: subprocess.CompletedProcess[str]) -> tuple[int, int, float]:
    assert result.returncode == 0, result
    match = CONNECTED.match(result.stdout)
    assert match, result.stdout
    return int(match[1]), int(match[2]), float(match[3])


def _is_static_elf(path: Path) -> bool:
    """No PT_INTERP program header: no dynamic loader needed (64-bit little-endian ELF)."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1
    phoff = int.from_bytes(data[32:40], "little")
    phentsize = int.from_bytes(data[54:56], "little")
    phnum = int.from_bytes(data[56:58], "little")
    types = [int.from_bytes(data[phoff + i * phentsize : phoff + i * phentsize + 4], "little") for i in range(phnum)]
    return 3 not in types  # PT_INTERP


# ------------------------------------------------------------------- build


def test_build_is_static_and_cached(tmp_path: Path) -> None:
    first = mps.build(tmp_path / "b")
    assert _is_static_elf(first)
    assert first.stat().st_mode & 0o777 == 0o755
    mtime = first.stat().st_mtime_ns
    assert mps.build(tmp_path / "b") == first
    assert first.stat().st_mtime_ns == mtime  # not rebuilt
    installed = mps.install(tmp_path / "bin", build_dir=tmp_path / "b")
    assert installed == tmp_path / "bin" / "nvidia-cuda-mps-control"
    assert installed.read_bytes() == first.read_bytes()
    assert os.access(installed, os.X_OK)


def test_build_failure_shows_compiler_error(tmp_path: Path) -> None:
    with pytest.raises(mps.MpsStandinBuildError, match="no-such-cc"):
        mps.build(tmp_path, cc="no-such-cc")
    fake_cc = tmp_path / "failing-cc"
    fake_cc.write_text("#!/bin/sh\necho 'fake_mps_control.c:1: error: broken' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    with pytest.raises(mps.MpsStandinBuildError, match="error: broken") as info:
        mps.build(tmp_path / "out", cc=str(fake_cc))
    assert "exit 1" in str(info.value)
    assert not (tmp_path / "out" / "nvidia-cuda-mps-control").exists()


def test_help(binary: Path) -> None:
    for flag in ("-h", "--help"):
        result = subprocess.run([str(binary), flag], capture_output=True, text=True, check=False, timeout=5)
        assert result.returncode == 0
        assert "-d" in result.stdout and "-f" in result.stdout and "CUDA_MPS_PIPE_DIRECTORY" in result.stdout
    bad = subprocess.run([str(binary), "--bogus"], capture_output=True, text=True, check=False, timeout=5)
    assert bad.returncode == 1
    assert "Unknown option: --bogus" in bad.stderr


# ------------------------------------------------------------- start, quit


def test_foreground_start_and_quit(rig: Rig) -> None:
    proc = rig.foreground()
    sock = rig.pipe / "control"
    assert stat.S_ISSOCK(sock.stat().st_mode)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o666
    assert mps.read_pid_file(rig.pipe) == proc.pid
    first = mps.control_log(rig.log)[0]
    assert (first.role, first.pid) == ("Control", proc.pid)
    assert first.message == f"Starting control daemon using socket {sock}"
    assert f"set env CUDA_MPS_PIPE_DIRECTORY={rig.pipe}" in rig.messages()[1]

    result = rig.ui("quit")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert proc.wait(timeout=5) == 0
    assert not sock.exists()
    assert not (rig.pipe / mps.PID_FILE).exists()
    assert rig.messages()[-2:] == ["Cmd:quit", "Exit"]
    # -f logs to stderr as well.
    assert f"Starting control daemon using socket {sock}" in (rig.root / "stderr.txt").read_text()


def test_sigterm_stops_like_quit(rig: Rig) -> None:
    proc = rig.foreground()
    server, _, _ = _connected(rig.fake())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0
    _wait_gone(server)
    assert not (rig.pipe / "control").exists()
    messages = rig.messages()
    assert f"Server {server} exited with status 0" in messages, messages
    assert messages[-1] == "Exit"


def test_daemon_mode_pid_file_and_quit(rig: Rig) -> None:
    started = time.monotonic()
    launcher = subprocess.run(
        [str(rig.binary), "-d"], env=rig.env(), capture_output=True, text=True, check=False, timeout=10
    )
    assert (launcher.returncode, launcher.stdout, launcher.stderr) == (0, "", "")
    assert time.monotonic() - started < 5
    pid = mps.read_pid_file(rig.pipe)
    assert pid is not None and _alive(pid)
    # Detached: a new session, not ours, and not a child of ours.
    assert os.getsid(pid) != os.getsid(0)
    assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2] != str(os.getpid())
    # Listening by the time -d returned: no waiting needed.
    assert rig.ui("get_default_active_thread_percentage").stdout == "100.0\n"

    again = subprocess.run(
        [str(rig.binary), "-d"], env=rig.env(), capture_output=True, text=True, check=False, timeout=10
    )
    assert again.returncode == 1
    assert "An instance of this daemon is already running" in again.stderr
    assert mps.read_pid_file(rig.pipe) == pid

    assert rig.ui("quit").returncode == 0
    _wait_gone(pid)
    assert not (rig.pipe / "control").exists()
    assert not (rig.pipe / mps.PID_FILE).exists()


def test_second_foreground_instance_refused(rig: Rig) -> None:
    rig.foreground()
    second = subprocess.run(
        [str(rig.binary), "-f"], env=rig.env(), capture_output=True, text=True, check=False, timeout=10
    )
    assert second.returncode == 1
    assert "An instance of this daemon is already running" in second.stderr
    assert rig.ui("get_server_list").returncode == 0


def test_client_without_daemon(rig: Rig) -> None:
    result = rig.ui("get_server_list")
    assert result.returncode == 1
    assert result.stdout == ""
    assert mps.NO_DAEMON_MESSAGE in result.stderr
    assert not rig.log.exists()  # the client creates nothing

    # A killed daemon leaves its socket behind; nothing answers there.
    proc = rig.foreground()
    proc.kill()
    proc.wait()
    assert (rig.pipe / "control").exists()
    stale = rig.ui("get_server_list")
    assert stale.returncode == 1
    assert mps.NO_DAEMON_MESSAGE in stale.stderr
    # A new daemon takes over the stale socket.
    rig.foreground()
    assert rig.ui("get_server_list").returncode == 0


# ----------------------------------------------------------------- defaults


def test_thread_percentage(rig: Rig) -> None:
    rig.foreground()
    assert rig.ui("get_default_active_thread_percentage").stdout == "100.0\n"
    result = rig.ui("set_default_active_thread_percentage 25", "get_default_active_thread_percentage")
    assert (result.returncode, result.stdout) == (0, "25.0\n")  # set prints nothing
    for bad in ("0", "101", "abc", "-5"):
        refused = rig.ui(f"set_default_active_thread_percentage {bad}")
        assert refused.returncode == 1
        assert refused.stdout.startswith("Error: invalid active thread percentage"), refused.stdout
    assert rig.ui("get_default_active_thread_percentage").stdout == "25.0\n"
    assert rig.ui("set_default_active_thread_percentage 12.5", "get_default_active_thread_percentage").stdout == (
        "12.5\n"
    )


def test_pinned_memory_by_index_and_uuid(rig: Rig) -> None:
    rig.foreground(rig.env(CUDA_VISIBLE_DEVICES=f"{GPU_A},{GPU_B},{MIG_C}"))
    assert rig.ui("get_default_device_pinned_mem_limit 0").stdout == "0\n"  # unset
    result = rig.ui(
        "set_default_device_pinned_mem_limit 0 4096M",
        f"set_default_device_pinned_mem_limit {GPU_B} 2G",
        f"set_default_device_pinned_mem_limit {MIG_C.lower()} 512m",
    )
    assert (result.returncode, result.stdout) == (0, "")
    answers = rig.ui(
        "get_default_device_pinned_mem_limit 0",
        f"get_default_device_pinned_mem_limit {GPU_A}",
        "get_default_device_pinned_mem_limit 1",
        f"get_default_device_pinned_mem_limit {GPU_B}",
        "get_default_device_pinned_mem_limit 2",
    )
    assert answers.stdout.split() == ["4096M", "4096M", "2G", "2G", "512M"]


def test_unknown_device_and_bad_values(rig: Rig) -> None:
    rig.foreground(rig.env(CUDA_VISIBLE_DEVICES=f"{GPU_A},{GPU_B}"))
    for command, error in (
        ("set_default_device_pinned_mem_limit 2 1G", "Error: invalid device 2"),
        ("set_default_device_pinned_mem_limit GPU-deadbeef 1G", "Error: invalid device GPU-deadbeef"),
        ("get_default_device_pinned_mem_limit 5", "Error: invalid device 5"),
        ("set_default_device_pinned_mem_limit 0 12X", "Error: invalid memory limit 12X"),
        ("set_default_device_pinned_mem_limit 0 1.5G", "Error: invalid memory limit 1.5G"),
        ("no_such_command", "Error: unknown command"),
    ):
        result = rig.ui(command)
        assert result.returncode == 1, command
        assert result.stdout.startswith(error), (command, result.stdout)
    # A failed command does not stop the ones after it; the status still says it failed.
    mixed = rig.ui("set_default_device_pinned_mem_limit 9 1G", "get_default_active_thread_percentage")
    assert mixed.returncode == 1
    assert mixed.stdout.splitlines()[1] == "100.0"
    assert rig.ui("get_default_device_pinned_mem_limit 0").stdout == "0\n"


# ------------------------------------------------------------------ servers


def test_fake_cuda_client_as_root(rig: Rig) -> None:
    rig.foreground()
    assert rig.servers() == []
    pid, uid, pct = _connected(rig.fake())
    assert (uid, pct) == (0, 100.0)
    assert rig.servers() == [pid]
    assert _uid_of(pid) == 0
    assert rig.ui(f"get_server_status {pid}").stdout == "ACTIVE\n"
    assert rig.ui(f"get_client_list {pid}").returncode == 0
    messages = rig.messages()
    assert "User did not send valid credentials" in messages  # the probe, as with the real driver
    assert any(re.fullmatch(r"NEW CLIENT \d+ from user 0: Server is not ready, push client to pending list", m)
               for m in messages)  # fmt: skip
    start = next(line for line in mps.control_log(rig.log) if line.message.startswith("Starting new server"))
    assert (start.message, start.pid) == (f"Starting new server {pid} for user 0", pid)
    assert f"NEW SERVER {pid}: Ready" in messages
    assert "Server has started" in [line.message for line in mps.server_log(rig.log) if line.pid == pid]

    again, _, _ = _connected(rig.fake())
    assert again == pid
    assert any(re.fullmatch(r"NEW CLIENT \d+ from user 0: Server already exists", m) for m in rig.messages())
    unknown = rig.ui("get_server_status 999999")
    assert unknown.returncode == 1 and unknown.stdout.startswith("Error: no MPS server with PID 999999")


def test_defaults_apply_to_servers_started_afterwards(rig: Rig) -> None:
    rig.foreground(rig.env(CUDA_VISIBLE_DEVICES=f"{GPU_A},{GPU_B}"))
    assert rig.ui("set_default_active_thread_percentage 50", "set_default_device_pinned_mem_limit 1 3G").returncode == 0
    first = rig.fake()
    pid, _, pct = _connected(first)
    assert pct == 50.0
    assert "pinned memory limits 1=3G)" in first.stdout
    assert rig.ui("set_default_active_thread_percentage 20", "set_default_device_pinned_mem_limit 1 1G").returncode == 0
    assert rig.ui(f"get_active_thread_percentage {pid}", f"get_device_pinned_mem_limit {pid} {GPU_B}").stdout == (
        "50.0\n3G\n"
    )
    assert _connected(rig.fake())[2] == 50.0  # the running server keeps its values

    assert rig.ui(f"shutdown_server {pid}").returncode == 0
    assert rig.servers() == []
    _wait_gone(pid)
    assert f"Server {pid} exited with status 0" in rig.messages()
    newer, _, pct = _connected(rig.fake())
    assert newer != pid and pct == 20.0
    assert rig.ui(f"get_device_pinned_mem_limit {newer} 1").stdout == "1G\n"
    server_lines = [line.message for line in mps.server_log(rig.log)]
    assert "Active Threads Percentage set to 50.0" in server_lines
    assert "Active Threads Percentage set to 20.0" in server_lines
    assert f"Device pinned memory limit for device 1 set to {3 << 30:#x} bytes" in server_lines


def test_non_root_client_with_traversable_parents(rig: Rig) -> None:
    # /tmp/mpsXXXX (0755) / pipe (0755): every parent searchable by anyone.
    rig.foreground()
    root_server, _, _ = _connected(rig.fake())
    pid, uid, _ = _connected(rig.fake(user=USER))
    assert uid == USER
    assert _uid_of(pid) == USER
    # One server at a time, as the real daemon: root's made way for user 1001's.
    assert rig.servers() == [pid]
    _wait_gone(root_server)
    messages = rig.messages()
    assert f"Server {root_server} for user 0 is shutting down to serve user {USER}" in messages
    assert f"Starting new server {pid} for user {USER}" in messages
    assert "Server encountered a fatal exception. Shutting down" not in messages
    # The UI works for a non-root user too.
    listed = rig.ui("get_server_list", user=USER)
    assert (listed.returncode, listed.stdout) == (0, f"{pid}\n")


def test_non_root_client_with_a_parent_of_mode_0700(rig: Rig) -> None:
    """NVIDIA k8s-device-plugin #762: the server, as the client's UID, cannot traverse a 0700 parent."""
    locked = rig.root / "locked"
    locked.mkdir(mode=0o700)
    rig.pipe = locked / "pipe"
    rig.foreground()
    # The client reaches the socket by another path, as a container does through its bind mount.
    visible = rig.root / "visible"
    visible.mkdir(mode=0o755)
    os.link(rig.pipe / "control", visible / "control")

    result = rig.fake(user=USER, pipe=visible)
    assert result.returncode == 1
    assert result.stdout == ""
    assert f"The MPS server for user {USER} failed to start" in result.stderr
    assert "cudaErrorMpsConnectionFailed" in result.stderr
    messages = rig.messages()
    start = next(m for m in messages if m.startswith("Starting new server"))
    server = int(start.split()[3])
    assert start == f"Starting new server {server} for user {USER}"
    assert "User did not send valid credentials" in messages
    fatal = messages.index("Server encountered a fatal exception. Shutting down")
    assert messages[fatal + 1] == f"Server {server} exited with status 1"
    denied = [line.message for line in mps.server_log(rig.log) if line.pid == server]
    assert f"Failed to connect to control daemon on socket {rig.pipe / 'control'}: Permission denied" in denied
    assert rig.servers() == []
    assert rig.ui("get_server_list", user=USER, pipe=visible).stdout == ""
    # Root traverses anything: its server starts through the same paths.
    pid, uid, _ = _connected(rig.fake(pipe=visible))
    assert uid == 0 and rig.servers() == [pid]


def test_daemon_without_setuid_capability(rig: Rig) -> None:
    rig.pipe.mkdir(mode=0o755)
    rig.log.mkdir(mode=0o755)
    os.chown(rig.pipe, OTHER_USER, OTHER_USER)
    os.chown(rig.log, OTHER_USER, OTHER_USER)
    proc = rig.foreground(user=OTHER_USER)
    result = rig.fake(user=USER)
    assert result.returncode == 1
    assert f"The MPS server for user {USER} could not be started" in result.stderr
    assert any(
        m.startswith(f"Failed to start server for user {USER}: cannot switch to uid {USER}")
        and m.endswith("Operation not permitted")
        for m in rig.messages()
    )
    assert proc.poll() is None  # logged and answered, not crashed
    assert rig.servers() == []
    # Its own user needs no switch.
    pid, uid, _ = _connected(rig.fake(user=OTHER_USER))
    assert uid == OTHER_USER and _uid_of(pid) == OTHER_USER


def test_start_and_shutdown_server_commands(rig: Rig) -> None:
    rig.foreground()
    assert rig.ui(f"start_server -uid {USER}").returncode == 0
    (pid,) = rig.servers()
    assert _uid_of(pid) == USER
    assert _connected(rig.fake(user=USER))[0] == pid  # reused
    assert rig.ui(f"shutdown_server {pid} -f").returncode == 0
    assert rig.servers() == []
    assert f"Server {pid} was terminated by signal 9" in rig.messages()
    missing = rig.ui(f"shutdown_server {pid}")
    assert missing.returncode == 1 and missing.stdout.startswith("Error: no MPS server")
    assert rig.ui("start_server -uid nobody").stdout.startswith("Error: invalid user id nobody")


def test_quit_stops_servers(rig: Rig) -> None:
    proc = rig.foreground()
    pid, _, _ = _connected(rig.fake(user=USER))
    assert rig.ui("quit -t 2").returncode == 0
    assert proc.wait(timeout=5) == 0
    _wait_gone(pid)
    messages = rig.messages()
    assert messages.index(f"Server {pid} exited with status 0") < messages.index("Exit")
    assert rig.ui("get_server_list").returncode == 1  # nothing there any more


# ---------------------------------------------------------------- robustness


def test_idle_and_partial_clients_do_not_block_others(rig: Rig) -> None:
    rig.foreground()
    with contextlib.ExitStack() as stack:
        idle = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        idle.connect(str(rig.pipe / "control"))
        partial = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        partial.connect(str(rig.pipe / "control"))
        partial.sendall(b"ui\nget_default_active_thr")  # and never the rest
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(lambda _: rig.ui("get_default_active_thread_percentage", timeout=10), range(32)))
        assert [r.stdout for r in results] == ["100.0\n"] * 32
        partial.sendall(b"ead_percentage\n")
        partial.settimeout(5)
        assert partial.recv(64) == b"| 100.0\n= 0\n"


# ------------------------------------------------------------------- hooks


def test_commands_recorded(rig: Rig) -> None:
    rig.foreground()
    rig.ui("set_default_active_thread_percentage 50", "get_server_list")
    rig.ui("get_default_active_thread_percentage", user=USER)
    rig.fake()  # a CUDA client is no command
    recorded = mps.commands(rig.log)
    assert [(r["uid"], r["command"]) for r in recorded] == [
        (0, "set_default_active_thread_percentage 50"),
        (0, "get_server_list"),
        (USER, "get_default_active_thread_percentage"),
    ]
    assert all(isinstance(r["pid"], int) and r["pid"] > 0 for r in recorded)


def test_command_log_path_from_environment(rig: Rig) -> None:
    path = rig.root / "elsewhere.jsonl"
    rig.foreground(rig.env(FAKE_MPS_COMMAND_LOG=str(path)))
    rig.ui('say "hi" \\ there\x01')
    # Quotes, backslashes and control characters survive the JSON encoding.
    assert [(r["uid"], r["command"]) for r in mps.commands(rig.log, path)] == [(0, 'say "hi" \\ there\x01')]
    assert not (rig.log / "commands.jsonl").exists()


def test_fake_crash(rig: Rig) -> None:
    proc = rig.foreground()
    server, _, _ = _connected(rig.fake())
    result = rig.ui("fake_crash")
    assert result.returncode == 1
    assert proc.wait(timeout=5) == -signal.SIGABRT
    # Left behind, as a crashed real daemon leaves them.
    assert stat.S_ISSOCK((rig.pipe / "control").stat().st_mode)
    assert mps.read_pid_file(rig.pipe) == proc.pid
    last = mps.control_log(rig.log)[-1]
    assert (last.role, last.pid) == ("Control", proc.pid)
    assert last.message == "Control daemon encountered a fatal exception (fake_crash). Aborting"
    assert mps.commands(rig.log)[-1]["command"] == "fake_crash"
    _wait_gone(server)  # its server sees the daemon go
    after = rig.ui("get_server_list")
    assert after.returncode == 1 and mps.NO_DAEMON_MESSAGE in after.stderr


def test_crash_after_n_commands(rig: Rig) -> None:
    proc = rig.foreground(rig.env(FAKE_MPS_CRASH_AFTER="2"))
    result = rig.ui("get_default_active_thread_percentage", "get_server_list", "get_default_active_thread_percentage")
    assert result.stdout == "100.0\n"  # the first two answered, the third never
    assert result.returncode == 1
    assert proc.wait(timeout=5) == -signal.SIGABRT
    assert "fatal exception (FAKE_MPS_CRASH_AFTER reached)" in rig.messages()[-1]


def test_fake_hang(rig: Rig) -> None:
    proc = rig.foreground()
    with pytest.raises(subprocess.TimeoutExpired):
        rig.ui("fake_hang", timeout=1.0)
    with pytest.raises(subprocess.TimeoutExpired):
        rig.ui("get_default_active_thread_percentage", timeout=1.0)
    assert proc.poll() is None
    assert (rig.pipe / "control").exists()
    messages = rig.messages()
    assert messages[-1] == "Control daemon stops answering (fake_hang)"
    assert "Cmd:get_default_active_thread_percentage" not in messages


# -------------------------------------------------------------- container


@pytest.mark.skipif(podman.podman_available() is not None, reason=f"no containers: {podman.podman_available()}")
@pytest.mark.parametrize("parent_mode", [0o755, 0o700])
def test_client_in_a_busybox_container_as_uid_1001(rig: Rig, parent_mode: int) -> None:
    """The setup of NVIDIA's plugin: the pipe directory bind mounted into a non-root container.

    The container reaches the socket through its mount whatever the host parents' modes;
    the server, started on the host as UID 1001, needs them searchable (#762).
    """
    parent = rig.root / "mps"
    parent.mkdir(mode=parent_mode)
    parent.chmod(parent_mode)
    rig.pipe = parent / "pipe"
    rig.foreground()
    rig.pipe.chmod(0o755)
    script = (
        "cd /; echo get_server_list | /opt/mps/nvidia-cuda-mps-control; echo ui=$?; "
        "/opt/mps/nvidia-cuda-mps-control --fake-cuda-client; echo cuda=$?"
    )
    with podman.PodmanStore(rig.root / "pm") as store:
        image = podman.import_busybox(store)
        result = podman.run_container(
            store,
            image,
            script,
            extra_args=[
                "--user", f"{USER}:{USER}",
                "-v", f"{rig.pipe}:/mps/pipe",
                "-v", f"{rig.binary.parent}:/opt/mps:ro",
                "-e", "CUDA_MPS_PIPE_DIRECTORY=/mps/pipe",
            ],
        )  # fmt: skip
    assert result.returncode == 0, result.describe()
    assert "ui=0" in result.stdout, result.describe()
    if parent_mode == 0o755:
        assert "cuda=0" in result.stdout, result.describe()
        (pid,) = rig.servers()
        assert _uid_of(pid) == USER
        assert f"connected to MPS server {pid} (user {USER}," in result.stdout
    else:
        assert "cuda=1" in result.stdout, result.describe()
        assert f"The MPS server for user {USER} failed to start" in result.stderr
        assert "Server encountered a fatal exception. Shutting down" in rig.messages()
        assert rig.servers() == []
    first = mps.commands(rig.log)[0]
    assert (first["uid"], first["command"]) == (USER, "get_server_list")
