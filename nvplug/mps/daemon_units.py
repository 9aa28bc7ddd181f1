"""Under systemd, each MPS control daemon runs in a transient unit of its own, out of nvplug's cgroup.

`systemctl stop`, `restart` and `kill` of nvplug.service signal every process in its cgroup
(KillMode=control-group): a daemon started as nvplug's child would die with it, and its clients' contexts
with it. A transient service (`systemd-run`, which asks PID 1 for one) lives in its own cgroup until it
exits, and is gone at reboot, as its clients are. Its capability bounding set is nvplug's own: the daemon
can do no more than before, and under nvplug's ProtectProc=invisible its /proc entry stays readable to
nvplug (a process whose capabilities are a subset of the reader's), which adoption checks.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

UNIT_PREFIX = "nvplug-mps-"
# The unit that mounts the clients' shm where the host sees it (`nvplug mps prepare`, also as its reload).
SHM_UNIT = "nvplug-mps.service"
SYSTEMCTL_SECONDS = 30.0

# Capability numbers to names (linux/capability.h), for CapabilityBoundingSet=.
CAPABILITIES = (
    "cap_chown",
    "cap_dac_override",
    "cap_dac_read_search",
    "cap_fowner",
    "cap_fsetid",
    "cap_kill",
    "cap_setgid",
    "cap_setuid",
    "cap_setpcap",
    "cap_linux_immutable",
    "cap_net_bind_service",
    "cap_net_broadcast",
    "cap_net_admin",
    "cap_net_raw",
    "cap_ipc_lock",
    "cap_ipc_owner",
    "cap_sys_module",
    "cap_sys_rawio",
    "cap_sys_chroot",
    "cap_sys_ptrace",
    "cap_sys_pacct",
    "cap_sys_admin",
    "cap_sys_boot",
    "cap_sys_nice",
    "cap_sys_resource",
    "cap_sys_time",
    "cap_sys_tty_config",
    "cap_mknod",
    "cap_lease",
    "cap_audit_write",
    "cap_audit_control",
    "cap_setfcap",
    "cap_mac_override",
    "cap_mac_admin",
    "cap_syslog",
    "cap_wake_alarm",
    "cap_block_suspend",
    "cap_audit_read",
    "cap_perfmon",
    "cap_bpf",
    "cap_checkpoint_restore",
)


class UnitError(OSError):
    """A daemon's unit that could not be started; the message names the unit and says why."""


def systemd_service(environ: Mapping[str, str], run_dir: Path = Path("/run/systemd/system")) -> bool:
    """Whether nvplug runs as a systemd service (started by PID 1, with an invocation id), where units can be
    made. A daemon run by hand, or by a test under a service manager of its own, starts its children itself."""
    return bool(environ.get("INVOCATION_ID")) and os.getppid() == 1 and run_dir.is_dir() and _tool("systemd-run")


def unit_name(group: str) -> str:
    """The group's unit: its name kept where a unit name allows it (groups are `<resource>` or `claim-<uid>`)."""
    return UNIT_PREFIX + re.sub(r"[^A-Za-z0-9:_.-]", "_", group) + ".service"


def bounding_set(status: Path = Path("/proc/self/status")) -> list[str]:
    """This process's capability bounding set, by name."""
    try:
        line = next(line for line in status.read_text().splitlines() if line.startswith("CapBnd:"))
        mask = int(line.split()[1], 16)
    except (OSError, StopIteration, IndexError, ValueError):
        return []
    return [name for bit, name in enumerate(CAPABILITIES) if mask >> bit & 1]


def start_unit(unit: str, binary: str, env: Mapping[str, str], description: str) -> int:
    """`binary -f` in the unit, with `env`; its main pid. Blocking: run it in a thread. Raises UnitError."""
    # One of the name left failed, or running and not adopted (it was found wanting): not ours to keep.
    _systemctl("stop", unit)
    _systemctl("reset-failed", unit)
    caps = bounding_set()
    command = [
        "systemd-run",
        f"--unit={unit}",
        f"--description={description}",
        "--service-type=exec",  # returns once the binary runs: its pid is the unit's main pid
        "--collect",  # gone once it exits, whatever its status
        "--quiet",
        "--property=KillMode=mixed",  # a stop: SIGTERM (as `quit`) to the daemon, then its servers killed
        *([f"--property=CapabilityBoundingSet={' '.join(caps)}"] if caps else []),
        *(f"--setenv={key}={value}" for key, value in sorted(env.items())),
        "--",
        binary,
        "-f",
    ]
    done = _run(command)
    if done.returncode != 0:
        raise UnitError(f"{unit}: systemd-run failed: {done.stderr.strip() or f'exit status {done.returncode}'}")
    shown = _run(["systemctl", "show", "--property=MainPID", "--value", unit])
    pid = int(shown.stdout.strip()) if shown.stdout.strip().isdigit() else 0
    if pid == 0:
        raise UnitError(f"{unit}: started, but it has no main process (it exited at once: journalctl -u {unit})")
    return pid


def reload_shm_unit() -> str | None:
    """`nvplug mps prepare` run again by SHM_UNIT, outside nvplug's mount namespace. Blocking. Why it
    failed; None: done."""
    try:
        done = _run(["systemctl", "reload", SHM_UNIT])
    except UnitError as err:
        return str(err)
    return None if done.returncode == 0 else f"systemctl reload {SHM_UNIT}: {done.stderr.strip() or done.returncode}"


def _systemctl(*args: str) -> None:
    _run(["systemctl", *args])


def _run(command: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=SYSTEMCTL_SECONDS, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UnitError(f"{' '.join(command[:2])}: {err}") from err


def _tool(name: str) -> bool:
    return shutil.which(name) is not None
