"""One MPS group's control daemon: started, provisioned, watched, restarted; and left running when nvplug stops.

The daemon runs in the foreground (`-f`), in a session of its own, and its exit is seen at once through a
pidfd (daemon_process.py). Its group's devices are Healthy only once it answers with the group's defaults
set: the defaults apply to the servers started after them, and a server started before would take the
whole GPU. A daemon that exits or stops answering turns them Unhealthy at once; it is started again with
the shared backoff. Nothing polls it: it is probed when something says to (its control.log reports an
error, an Allocate hands its devices out, a reload, doctor).

Its clients' contexts live in it: when nvplug stops (a restart, an upgrade, a crash) the daemon runs on,
recorded in the state directory (daemon_records.py), and the next nvplug adopts it: the same process, its
pipe directory, answering with the defaults it was recorded with. Only a config that removes or changes
its group stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from nvplug.base.backoff import Backoff, sleep_unless
from nvplug.core.events import MpsGroupChanged
from nvplug.mps.control_client import ControlClient, MpsControlError
from nvplug.mps.daemon_process import DaemonProcess, binary_name, start_ticks
from nvplug.mps.daemon_records import DaemonRecord, DaemonRecords, DaemonSettings
from nvplug.mps.daemon_units import unit_name
from nvplug.mps.leftover_daemon import LeftoverDaemon
from nvplug.mps.mps_dirs import DAEMON_PID_FILE, MpsDirError, RootLayout
from nvplug.shaping.mps_groups import LOG, MpsGroup

log = logging.getLogger("nvplug.mps")

RESTART_BACKOFF = Backoff(first=1.0, maximum=60.0)
# A daemon up this long has earned a quick restart again; one that dies sooner backs off further.
STABLE_SECONDS = 60.0
# From the start to the first answer.
START_SECONDS = 10.0
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
    """The endpoint of one group: its process and what the node state knows of it."""

    def __init__(
        self,
        group: MpsGroup,
        binary: str,
        layout: RootLayout,
        hooks: DaemonHooks,
        records: DaemonRecords,
        recorded: DaemonRecord | None = None,
        in_unit: bool = False,
    ) -> None:
        self.group = group
        # Whether it runs in a systemd unit of its own (nvplug is a service), or in a session of its own.
        self._in_unit = in_unit
        self.binary = binary
        self._layout = layout
        self._hooks = hooks
        self._records = records
        # What an earlier nvplug recorded of this group's daemon: adopted at the first start if it still fits.
        self._recorded = recorded
        self.adopting = recorded is not None
        root = str(layout.root)
        self.client = ControlClient(binary, group.pipe_dir(root), group.log_dir(root), group.name)
        self._proc: DaemonProcess | None = None
        self._task: asyncio.Task[None] | None = None
        self._probe = asyncio.Event()
        self._stopping = asyncio.Event()
        self.restarts = 0
        # When this nvplug adopted the running daemon; None: it started it.
        self.adopted_at: float | None = None
        # The settings an adopted daemon runs with when the config's differ: it has clients, and restarts
        # with the config's once a probe finds none.
        self.kept: DaemonSettings | None = None
        self.up_since: float | None = None
        self.last_error: str | None = None
        # At its last answer: the servers it ran (one per client UID), their clients, and when.
        self.servers: tuple[int, ...] = ()
        self.clients = 0
        self.probed_at: float | None = None
        self._after: asyncio.Future[None] | None = None
        # How its first start ended: None once it answered with its defaults set, else why not.
        self._first: asyncio.Future[str | None] | None = None

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.alive else None

    @property
    def settings(self) -> DaemonSettings:
        """What the config asks the daemon to run with."""
        group = self.group
        return DaemonSettings(group.uuids, group.thread_percentage, group.pinned_mib)

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
        """Its group is gone or changed: `quit`, then its exit (killed if it does not), then the compute
        modes back and the record dropped."""
        await self._end_supervision("it was stopped")
        await self._end_child(graceful=True)
        await self._hooks.release(self.group)
        await asyncio.to_thread(self._layout.remove_group, self.group)
        await asyncio.to_thread(self._records.drop, self.group.name)

    async def leave(self) -> None:
        """nvplug stops: the daemon runs on for its clients, with its compute modes and its record, for the
        next nvplug to adopt."""
        await self._end_supervision("nvplug stopped")
        if self._proc is not None:
            self._proc.leave()
            self._proc = None

    async def _end_supervision(self, why: str) -> None:
        self._stopping.set()
        self._first_ended(why)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

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
        if await self._adopt():
            return
        # A daemon no record names (nvplug killed between its start and its record, or the record lost or
        # unreadable): it goes, unless it has clients. Then the group stays down, and is tried again.
        pid_file = Path(self.client.pipe_dir) / DAEMON_PID_FILE
        unrecorded = await asyncio.to_thread(running_daemon, pid_file, self.binary)
        if unrecorded is not None:
            try:
                clients = await self.client.clients(await self.client.servers())
            except MpsControlError:
                clients = ()  # it does not answer: nobody is served by it
            if clients:
                raise MpsControlError(
                    f"MPS group {self.group.name}: a control daemon (pid {unrecorded}) that nvplug has no record of "
                    f"serves its pipe directory with clients (pids {', '.join(map(str, clients))}): left running, "
                    "not replaced; `nvplug mps stop --force` (with nvplug stopped) ends it"
                )
            await asyncio.to_thread(kill_leftover, pid_file, self.binary)
        await asyncio.to_thread(self._layout.prepare_group, group)
        self._hooks.prepared(group)
        await self._hooks.exclusive(group)
        env = self.client.environ({"CUDA_VISIBLE_DEVICES": ",".join(group.uuids)})
        self._proc = proc = await asyncio.to_thread(self._spawn, env)
        await self._first_answer()
        commands = [f"set_default_active_thread_percentage {group.thread_percentage}"]
        commands += [
            f"set_default_device_pinned_mem_limit {n} {mib}M"
            for n, mib in enumerate(group.pinned_mib)
            if mib is not None
        ]
        await self.client.send(commands)
        await self._check_answer()
        await asyncio.to_thread(self._records.put, replace(self._record(proc), settings=self.settings))
        self.up_since = time.time()
        self.adopted_at = None
        self.kept = None
        self.last_error = None
        log.info(
            "%s: control daemon pid %d up, %d%% of the SMs per client%s",
            group.describe(),
            proc.pid,
            group.thread_percentage,
            _pinned_text(group),
        )
        self._report(True, "its MPS control daemon answers, its defaults set")

    def _spawn(self, env: Mapping[str, str]) -> DaemonProcess:
        """Started and recorded at once (in a thread): whatever becomes of this nvplug, the next one finds it."""
        log_dir = Path(self.client.log_dir)
        if self._in_unit:
            # What the daemon reads (the CUDA variables); nvplug's own environment is the unit's business.
            cuda = {key: value for key, value in env.items() if key.startswith("CUDA_")}
            what = f"nvplug's MPS control daemon of group {self.group.name}"
            proc = DaemonProcess.in_unit(unit_name(self.group.name), self.binary, cuda, log_dir, what)
        else:
            proc = DaemonProcess.spawn(self.binary, env, log_dir)
        self._records.put(self._record(proc))
        return proc

    def _record(self, proc: DaemonProcess) -> DaemonRecord:
        return DaemonRecord(
            self.group.name,
            proc.pid,
            start_ticks(proc.pid) or 0,
            self.binary,
            self.client.pipe_dir,
            tuple(g.uuid for g in self.group.exclusive_gpus),
            unit=proc.unit,
        )

    async def _adopt(self) -> bool:
        """The daemon an earlier nvplug recorded, if it is still that process and answers with the defaults
        it was recorded with: supervised from now on, its clients untouched. False: start one."""
        record, self._recorded = self._recorded, None
        if record is None:
            return False
        what = f"{self.group.describe()}: the control daemon pid {record.pid} an earlier nvplug started"
        if record.pipe_dir != self.client.pipe_dir:
            # The MPS root moved: that daemon's servers hold the group's GPUs (EXCLUSIVE_PROCESS), so the
            # group's new one can start only once it is gone; with clients it is not, and its record stays.
            moved = LeftoverDaemon(record, Path(record.pipe_dir).parent / LOG)
            if not await moved.settle():
                self._recorded = record
                moved.leave()
                pids = ", ".join(map(str, moved.clients))
                raise MpsControlError(
                    f"{what} serves {record.pipe_dir}, not {self.client.pipe_dir}, with clients (pids {pids}): "
                    "left running; the group starts once they leave"
                )
            log.info("%s served %s, not %s: it is gone", what, record.pipe_dir, self.client.pipe_dir)
            return False
        proc = await asyncio.to_thread(
            DaemonProcess.adopt, record.pid, record.started, record.binary, Path(self.client.log_dir), record.unit
        )
        if proc is None:
            log.warning("%s is gone: starting a new one", what)
            return False
        self._proc = proc
        settings = record.settings
        try:
            if settings is None:
                raise MpsControlError("it was never given its defaults")
            await self._check_answer(settings.thread_percentage)
        except MpsControlError as err:
            log.warning("%s cannot be adopted (%s): replaced", what, err)
            await self._end_child(graceful=False)
            return False
        if settings != self.settings:
            if not self.clients:
                log.info("%s runs with an earlier config's settings and has no client: replaced", what)
                await self._end_child(graceful=True)
                return False
            self.kept = settings
            log.warning(
                "%s runs with an earlier config's settings (%d%% of the SMs per client) and has %d clients: "
                "kept as it is until they leave",
                what,
                settings.thread_percentage,
                self.clients,
            )
        self._hooks.prepared(self.group)
        await self._hooks.exclusive(self.group)
        self.adopted_at = time.time()
        self.up_since = _started_at(record.started)
        self.last_error = None
        log.info("%s adopted: it answers with its defaults set, %d clients", what, self.clients)
        self._report(True, "its MPS control daemon answers, its defaults set (adopted after a restart of nvplug)")
        return True

    async def _first_answer(self) -> None:
        """The daemon makes its socket a moment after it starts: ask until it answers or exits."""
        deadline = time.monotonic() + START_SECONDS
        schedule = FIRST_ANSWER.schedule()
        while True:
            proc = self._proc
            if proc is None or not proc.alive or proc.returncode is not None:
                raise MpsControlError(f"MPS group {self.group.name}: the control daemon {self._exit_text()}")
            try:
                await self.client.send(["get_server_list"], timeout=max(0.1, deadline - time.monotonic()))
                return
            except MpsControlError as err:
                if time.monotonic() + schedule.policy.first >= deadline:
                    raise MpsControlError(f"{err} (no answer {START_SECONDS:g} s after its start)") from err
            await asyncio.sleep(schedule.next())

    async def _check_answer(self, percentage: int | None = None) -> None:
        """The probe: the thread percentage read back, as this group set it (or as `percentage`, recorded)."""
        if percentage is None:
            percentage = self.kept.thread_percentage if self.kept is not None else self.group.thread_percentage
        lines = await self.client.send(["get_default_active_thread_percentage", "get_server_list"])
        try:
            value = float(lines[0])
            servers = tuple(int(line) for line in lines[1:])
        except (IndexError, ValueError):
            raise MpsControlError(
                f"MPS group {self.group.name}: get_default_active_thread_percentage and "
                f"get_server_list answered {lines!r}"
            ) from None
        clients = await self.client.clients(servers)
        self.servers, self.clients, self.probed_at = servers, len(clients), time.time()
        if round(value) != percentage:
            raise MpsControlError(
                f"MPS group {self.group.name}: the daemon runs with {value:g}% of the SMs per client, not {percentage}%"
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
                    if not proc.alive:
                        return f"it {self._exit_text()}"
                    return str(err)
                if self.kept is not None and not self.clients:
                    # Gracefully: a client may connect between this answer and the quit; none can be cut off.
                    await self._end_child(graceful=True)
                    return "its clients left: it starts again with the config's settings"
        finally:
            exited.cancel()

    async def _end_child(self, graceful: bool) -> None:
        proc = self._proc
        if proc is None:
            return
        await proc.end(self.client if graceful else None, f"{self.group.describe()}: the control daemon")
        self._proc = None

    def _exit_text(self) -> str:
        return self._proc.exit_text() if self._proc is not None else "is gone"

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


def _started_at(ticks: int) -> float:
    """The wall-clock time of a start `ticks` clock ticks after boot."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def running_daemon(pid_file: Path, binary: str) -> int | None:
    """The daemon the pid file it writes names, if that pid is a live process of its binary; else None."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    # A binary replaced since it started (a driver upgrade) reads as "<path> (deleted)": binary_name strips it.
    return pid if binary_name(pid) == Path(binary).name else None


def kill_leftover(pid_file: Path, binary: str) -> int | None:
    """A daemon no record names, found by the pid file it writes: killed, with its servers. Its pid; None if
    there was none."""
    pid = running_daemon(pid_file, binary)
    if pid is None:
        return None
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        return None
    log.warning("killed the MPS control daemon pid %d that nvplug had no record of", pid)
    return pid
