"""A control daemon an earlier nvplug recorded for a group this one does not run (the config or the claims
changed while nvplug was down): it quits once it has no client, and is kept, and said, until then."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from nvplug.mps.control_client import ControlClient, MpsControlError
from nvplug.mps.daemon_process import DaemonProcess
from nvplug.mps.daemon_records import DaemonRecord

log = logging.getLogger("nvplug.mps")


class LeftoverDaemon:
    def __init__(self, record: DaemonRecord, log_dir: Path) -> None:
        self.record = record
        self._log_dir = log_dir
        self.client = ControlClient(record.binary, record.pipe_dir, str(log_dir), record.group)
        self.proc: DaemonProcess | None = None
        # Its clients' pids when last asked.
        self.clients: tuple[int, ...] = ()
        # Whether the recorded process was found running (False: it was gone already).
        self.found = False

    def describe(self) -> str:
        return f"MPS group {self.record.group}'s control daemon (pid {self.record.pid})"

    async def settle(self, force: bool = False) -> bool:
        """True: it is gone (quit now, killed if it does not answer, or gone already). False: it has clients,
        and runs on (unless `force`: the operator's teardown, which cuts them off)."""
        if self.proc is None:
            record = self.record
            self.proc = await asyncio.to_thread(
                DaemonProcess.adopt, record.pid, record.started, record.binary, self._log_dir, record.unit
            )
            if self.proc is None:
                return True
            self.found = True
        proc = self.proc
        try:
            self.clients = await self.client.clients(await self.client.servers())
        except MpsControlError as err:
            log.warning("%s does not answer (%s): killed", self.describe(), err)
            await self._end(proc, None)
            return True
        if self.clients and not force:
            return False
        if self.clients:
            log.warning("%s quits with clients connected (pids %s)", self.describe(), ", ".join(map(str, self.clients)))
        else:
            log.info("%s has no client: it quits", self.describe())
        await self._end(proc, self.client)
        return True

    async def wait(self) -> None:
        """Until it exits (it was adopted: settle first)."""
        if self.proc is not None:
            await self.proc.wait()

    def leave(self) -> None:
        """Another owner takes it (its group is wanted again), or nvplug stops: it runs on."""
        if self.proc is not None:
            self.proc.leave()
            self.proc = None

    async def _end(self, proc: DaemonProcess, client: ControlClient | None) -> None:
        await proc.end(client, self.describe())
        self.proc = None
