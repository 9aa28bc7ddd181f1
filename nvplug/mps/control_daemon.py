"""One MPS group's control daemon, run by nvplug as its child: started, provisioned, watched, restarted.

The daemon runs in the foreground (`-f`) so that its exit is the child's, seen at once. Its group's
devices are Healthy only once it answers with the group's defaults set: the defaults apply to the
servers started after them, and a server started before would take the whole GPU. A daemon that
exits or stops answering turns them Unhealthy at once; it is started again with the shared backoff.
Nothing polls it: it is probed when something says to (its control.log reports an error, an
Allocate hands its devices out, a reload, doctor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from nvplug.base.backoff import Backoff, sleep_unless
from nvplug.core.events import MpsGroupChanged
from nvplug.mps.control_client import ControlClient, MpsControlError
from nvplug.mps.mps_dirs import PID_FILE, MpsDirError, RootLayout
from nvplug.shaping.mps_groups import MpsGroup

log = logging.getLogger("nvplug.mps")

RESTART_BACKOFF = Backoff(first=1.0, maximum=60.0)
# A daemon up this long has earned a quick restart again; one that dies sooner backs off further.
STABLE_SECONDS = 60.0
# From the start to the first answer, and from `quit` to the exit.
START_SECONDS = 10.0
QUIT_SECONDS = 10.0
# How fast the first answer is asked for again while the daemon makes its socket.
FIRST_ANSWER = Backoff(first=0.02, maximum=0.5)


class ComputeModeError(RuntimeError):
    """A GPU's compute mode that could not be recorded or set; the message names the GPU."""


@dataclass(frozen=True)
class DaemonHooks:
    """What a daemon needs from the supervisor."""

    publish: Callable[[MpsGroupChanged], object]
    # The group's GPUs in EXCLUSIVE_PROCESS (recorded first), and released at the daemon's final stop.
    exclusive: Callable[[MpsGroup], Awaitable[None]]
    release: Callable[[MpsGroup], Awaitable[None]]
    # The MPS root made ready (once); and the group's directories made (its log is watched from then).
    root: Callable[[], Awaitable[None]]
    prepared: Callable[[MpsGroup], None]


class ControlDaemon:
    """The endpoint of one group: its child process and what the node state knows of it."""

    def __init__(self, group: MpsGroup, binary: str, layout: RootLayout, hooks: DaemonHooks) -> None:
        self.group = group
        self.binary = binary
        self._layout = layout
        self._hooks = hooks
        root = str(layout.root)
        self.client = ControlClient(binary, group.pipe_dir(root), group.log_dir(root), group.name)
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._probe = asyncio.Event()
        self._stopping = asyncio.Event()
        self._stderr: deque[str] = deque(maxlen=5)
        self.restarts = 0
        self.up_since: float | None = None
        self.last_error: str | None = None
        # At its last answer: the servers it ran (one per client UID), their clients, and when.
        self.servers: tuple[int, ...] = ()
        self.clients = 0
        self.probed_at: float | None = None
        self._after: asyncio.Future[None] | None = None
        self._stderr_task: asyncio.Task[None] | None = None
        # How its first start ended: None once it answered with its defaults set, else why not.
        self._first: asyncio.Future[str | None] | None = None

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    def start(self, after: asyncio.Future[None] | None = None) -> None:
        """From now on; after `after` (the group's earlier daemon stopping: they share directories)."""
        self._after = after
        if self._task is None:
            self._first = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(), name=f"mps {self.group.name}")

    async def started(self, timeout: float) -> str | None:
        """Once its first start ends: None if it answers with its defaults set, else why not."""
        first = self._first
        if first is None:
            return "it was not started"
        done, _ = await asyncio.wait({first}, timeout=timeout)
        return first.result() if done else f"no answer with its defaults set within {timeout:g} s"

    def _first_ended(self, why: str | None) -> None:
        if self._first is not None and not self._first.done():
            self._first.set_result(why)

    def probe_soon(self, why: str) -> None:
        """Something says the daemon may be in trouble: ask it now."""
        if self.up_since is not None and not self._probe.is_set():
            log.debug("%s: probing: %s", self.group.describe(), why)
            self._probe.set()

    async def stop(self) -> None:
        """`quit`, then the child's exit (killed if it does not), then the compute modes back."""
        self._stopping.set()
        self._first_ended("it was stopped")
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._end_child(graceful=True)
        await self._hooks.release(self.group)
        await asyncio.to_thread(self._layout.remove_group, self.group)

    async def _run(self) -> None:
        if self._after is not None:
            await asyncio.wait({self._after})
        schedule = RESTART_BACKOFF.schedule()
        while not self._stopping.is_set():
            began = time.monotonic()
            try:
                await self._bring_up()
            except (MpsDirError, MpsControlError, ComputeModeError, OSError) as err:
                reason = str(err)
            except Exception as err:  # a bug must not end the supervision: the group stays down, retried
                log.exception("%s: starting its control daemon failed", self.group.describe())
                reason = f"nvplug failed to start it: {type(err).__name__}: {err}"
            else:
                self._first_ended(None)
                reason = await self._watch()
            self._first_ended(reason)
            self.up_since = None
            self.last_error = reason
            await self._end_child(graceful=False)
            if self._stopping.is_set():
                return
            if time.monotonic() - began > STABLE_SECONDS:
                schedule.reset()
            delay = schedule.next()
            log.error("%s is down: %s; starting it again in %.3g s", self.group.describe(), reason, delay)
            self._report(False, f"its MPS control daemon is down: {reason}")
            await sleep_unless(self._stopping, delay)
            self.restarts += 1

    async def _bring_up(self) -> None:
        group = self.group
        await self._hooks.root()
        pid_file = Path(self.client.pipe_dir).parent / PID_FILE
        await asyncio.to_thread(kill_leftover, pid_file, self.binary)
        await asyncio.to_thread(self._layout.prepare_group, group)
        self._hooks.prepared(group)
        await self._hooks.exclusive(group)
        env = self.client.environ({"CUDA_VISIBLE_DEVICES": ",".join(group.uuids)})
        self._stderr.clear()
        self._proc = await asyncio.create_subprocess_exec(
            self.binary,
            "-f",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # a signal to nvplug's process group is not one to the daemon
        )
        self._stderr_task = asyncio.create_task(self._read_stderr(self._proc), name=f"mps {group.name} stderr")
        await asyncio.to_thread(self._write_pid, self._proc.pid)
        await self._first_answer()
        commands = [f"set_default_active_thread_percentage {group.thread_percentage}"]
        commands += [
            f"set_default_device_pinned_mem_limit {n} {mib}M"
            for n, mib in enumerate(group.pinned_mib)
            if mib is not None
        ]
        await self.client.send(commands)
        await self._check_answer()
        self.up_since = time.time()
        self.last_error = None
        log.info(
            "%s: control daemon pid %d up, %d%% of the SMs per client%s",
            group.describe(),
            self._proc.pid,
            group.thread_percentage,
            _pinned_text(group),
        )
        self._report(True, "its MPS control daemon answers, its defaults set")

    async def _first_answer(self) -> None:
        """The daemon makes its socket a moment after it starts: ask until it answers or exits."""
        deadline = time.monotonic() + START_SECONDS
        schedule = FIRST_ANSWER.schedule()
        while True:
            proc = self._proc
            if proc is None or proc.returncode is not None:
                raise MpsControlError(f"MPS group {self.group.name}: the control daemon {self._exit_text()}")
            try:
                await self.client.send(["get_server_list"], timeout=max(0.1, deadline - time.monotonic()))
                return
            except MpsControlError as err:
                if time.monotonic() + schedule.policy.first >= deadline:
                    raise MpsControlError(f"{err} (no answer {START_SECONDS:g} s after its start)") from err
            await asyncio.sleep(schedule.next())

    async def _check_answer(self) -> None:
        """The probe: the thread percentage read back, as this group set it."""
        lines = await self.client.send(["get_default_active_thread_percentage", "get_server_list"])
        try:
            value = float(lines[0])
            servers = tuple(int(line) for line in lines[1:])
        except (IndexError, ValueError):
            raise MpsControlError(
                f"MPS group {self.group.name}: get_default_active_thread_percentage and "
                f"get_server_list answered {lines!r}"
            ) from None
        clients = await self.client.send([f"get_client_list {pid}" for pid in servers]) if servers else []
        self.servers, self.clients, self.probed_at = servers, len(clients), time.time()
        if round(value) != self.group.thread_percentage:
            raise MpsControlError(
                f"MPS group {self.group.name}: the daemon runs with {value:g}% of the SMs per "
                f"client, not {self.group.thread_percentage}%"
            )

    async def _watch(self) -> str:
        """Until the daemon exits or fails a probe: why it is down."""
        proc = self._proc
        assert proc is not None
        exited = asyncio.ensure_future(proc.wait())
        try:
            while True:
                asked = asyncio.ensure_future(self._probe.wait())
                done, _ = await asyncio.wait({exited, asked}, return_when=asyncio.FIRST_COMPLETED)
                asked.cancel()
                if exited in done:
                    return f"it {self._exit_text()}"
                self._probe.clear()
                try:
                    await self._check_answer()
                except MpsControlError as err:
                    if proc.returncode is not None:
                        return f"it {self._exit_text()}"
                    return str(err)
        finally:
            exited.cancel()

    async def _end_child(self, graceful: bool) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None and graceful:
            with contextlib.suppress(MpsControlError):
                await self.client.send(["quit"])
            done, _ = await asyncio.wait({asyncio.ensure_future(proc.wait())}, timeout=QUIT_SECONDS)
            if not done:
                log.warning(
                    "%s: the control daemon did not quit within %g s: killed", self.group.describe(), QUIT_SECONDS
                )
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its servers too
            await proc.wait()
        self._proc = None

    async def _read_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        async for line in proc.stderr:
            text = line.decode(errors="replace").strip()
            if text:
                self._stderr.append(text)

    def _exit_text(self) -> str:
        proc = self._proc
        code = proc.returncode if proc is not None else None
        if code is None:
            how = "is gone"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        said = f" ({' / '.join(self._stderr)})" if self._stderr else ""
        return how + said

    def _write_pid(self, pid: int) -> None:
        (Path(self.client.pipe_dir).parent / PID_FILE).write_text(f"{pid}\n")

    def _report(self, ready: bool, reason: str) -> None:
        group = self.group
        event = MpsGroupChanged(
            group.name,
            group.resource,
            group.uuids,
            ready,
            reason,
            self.pid,
            self.restarts,
            group.thread_percentage,
            group.pinned_mib,
        )
        self._hooks.publish(event)


def _pinned_text(group: MpsGroup) -> str:
    limits = [f"{mib}M" for mib in group.pinned_mib if mib is not None]
    return f", pinned memory {', '.join(limits)} per device" if limits else ""


def kill_leftover(pid_file: Path, binary: str) -> int | None:
    """A daemon a crashed nvplug left running (its pid file, a live process of its binary): killed,
    with its servers. Its pid; None if there was none."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        exe = str(Path(f"/proc/{pid}/exe").readlink())
        # A binary replaced since it started (a driver upgrade) reads as "<path> (deleted)".
        if Path(exe.removesuffix(" (deleted)")).name != Path(binary).name:
            return None  # the pid is another process's now
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        return None
    log.warning("killed the MPS control daemon pid %d (%s) that an earlier nvplug left running", pid, exe)
    return pid
