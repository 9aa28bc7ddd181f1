"""A short-lived command as an asyncio child (never a blocking call on the loop): its exit status and its
output (stdout and stderr together), killed past its deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Ran:
    # None: killed at its deadline.
    returncode: int | None
    output: str


async def run_child(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> Ran:
    """Raises OSError where the command cannot be started."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return Ran(None, "")
    return Ran(proc.returncode, out.decode(errors="replace"))
