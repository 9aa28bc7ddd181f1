"""Commands to a running MPS control daemon: its own binary in client mode, commands on standard input."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# A daemon that answers nothing within this long is hung: clients connecting to it would hang too.
ANSWER_SECONDS = 5.0


class MpsControlError(RuntimeError):
    """A command the daemon refused or did not answer; the message names the group and the command."""


@dataclass(frozen=True)
class ControlClient:
    """How to reach one group's daemon: the binary, and the pipe and log directories it uses."""

    binary: str
    pipe_dir: str
    log_dir: str
    group: str  # for messages

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_")}
        env.update(CUDA_MPS_PIPE_DIRECTORY=self.pipe_dir, CUDA_MPS_LOG_DIRECTORY=self.log_dir)
        env.update(extra or {})
        return env

    async def send(self, commands: Sequence[str], timeout: float = ANSWER_SECONDS) -> list[str]:
        """Each command's answer lines, all together; raises MpsControlError."""
        what = "; ".join(commands)
        try:
            proc = await asyncio.create_subprocess_exec(
                self.binary,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.environ(),
            )
        except OSError as err:
            raise MpsControlError(f"MPS group {self.group}: cannot run {self.binary}: {err.strerror or err}") from err
        talk = asyncio.ensure_future(proc.communicate("".join(f"{c}\n" for c in commands).encode()))
        done, _ = await asyncio.wait({talk}, timeout=timeout)
        if not done:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await talk
            raise MpsControlError(
                f"MPS group {self.group}: the control daemon did not answer {what!r} within {timeout:g} s"
            )
        out, said_err = talk.result()
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        problem = _refusal(lines) or (said_err.decode(errors="replace").strip() if proc.returncode else "")
        if proc.returncode or problem:
            said = problem or f"exit status {proc.returncode}"
            raise MpsControlError(f"MPS group {self.group}: {what!r} failed: {said}")
        return lines

    async def clients(self, servers: Sequence[int]) -> tuple[int, ...]:
        """The pids of these servers' clients (get_client_list). Raises MpsControlError."""
        lines = await self.send([f"get_client_list {pid}" for pid in servers]) if servers else []
        return _pids(self.group, "get_client_list", lines)

    async def servers(self) -> tuple[int, ...]:
        """The pids of the servers the daemon runs (get_server_list). Raises MpsControlError."""
        return _pids(self.group, "get_server_list", await self.send(["get_server_list"]))


def _pids(group: str, command: str, lines: Sequence[str]) -> tuple[int, ...]:
    try:
        return tuple(int(line) for line in lines)
    except ValueError:
        raise MpsControlError(f"MPS group {group}: {command} answered {list(lines)!r}") from None


def _refusal(lines: Sequence[str]) -> str | None:
    """An answer that says a command failed: the control tool prints these and still exits 0."""
    return next((line for line in lines if line.lower().startswith(("error", "invalid", "cannot"))), None)
