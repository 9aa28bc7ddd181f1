"""The record of the MPS control daemons nvplug runs, kept in its state directory so that the next nvplug
adopts them instead of cutting their clients off.

A daemon outlives nvplug (a restart, an upgrade, a crash); the record says which process it is (its pid
and its start time, so that a pid the kernel gave to another process is not taken for it), what it runs
(the binary, the pipe directory) and the settings it was provisioned with. A record of another boot is
dropped: its processes died with that boot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvplug.base.checkpoint import CheckpointError, read_checkpoint, seal, write_checkpoint

log = logging.getLogger(__name__)

KIND = "nvplug.mps-daemons"
VERSION = 1
FILE = "mps-daemons.json"


@dataclass(frozen=True)
class DaemonSettings:
    """What a daemon was provisioned with: its devices, and the defaults set in it."""

    devices: tuple[str, ...]
    thread_percentage: int
    pinned_mib: tuple[int | None, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "devices": list(self.devices),
            "thread_percentage": self.thread_percentage,
            "pinned_mib": list(self.pinned_mib),
        }


@dataclass(frozen=True)
class DaemonRecord:
    group: str
    pid: int
    # Clock ticks after boot (/proc/<pid>/stat, field 22): with the pid, one process for the whole boot.
    started: int
    binary: str
    pipe_dir: str
    # The GPUs it holds in EXCLUSIVE_PROCESS: they keep that mode while it runs, whoever owns it.
    exclusive: tuple[str, ...]
    # None until its defaults are set: a daemon never provisioned has had no client.
    settings: DaemonSettings | None = None
    # The systemd unit it runs in; None: a session of its own.
    unit: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "started": self.started,
            "binary": self.binary,
            "pipe_dir": self.pipe_dir,
            "exclusive": list(self.exclusive),
            "settings": self.settings.as_dict() if self.settings is not None else None,
            "unit": self.unit,
        }


def _record(group: str, doc: object) -> DaemonRecord:
    if not isinstance(doc, dict):
        raise ValueError(f"group {group}: not an object")
    settings = doc.get("settings")
    try:
        return DaemonRecord(
            group,
            _int(doc["pid"]),
            _int(doc["started"]),
            str(doc["binary"]),
            str(doc["pipe_dir"]),
            tuple(str(u) for u in doc["exclusive"]),
            None
            if settings is None
            else DaemonSettings(
                tuple(str(u) for u in settings["devices"]),
                _int(settings["thread_percentage"]),
                tuple(None if m is None else _int(m) for m in settings["pinned_mib"]),
            ),
            None if doc.get("unit") is None else str(doc["unit"]),
        )
    except (KeyError, TypeError) as err:
        raise ValueError(f"group {group}: {type(err).__name__}: {err}") from err


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{value!r} is not an integer")
    return value


class DaemonRecords:
    """The records, one file for every group; written whole on each change (from any thread)."""

    def __init__(self, state_dir: Path, boot_id: str | None) -> None:
        self.path = state_dir / FILE
        self._boot_id = boot_id
        self._lock = threading.Lock()
        self._records: dict[str, DaemonRecord] = {}

    def load(self) -> Mapping[str, DaemonRecord]:
        """What an earlier nvplug of this boot recorded. A file that cannot be read is logged and set aside:
        its daemons are then not adopted, and are found by their pipe directories' pid files instead."""
        try:
            found = read_checkpoint(self.path, KIND, VERSION)
        except FileNotFoundError:
            return {}
        except (OSError, CheckpointError) as err:
            log.error("MPS daemons' record unusable, adopting none: %s", err)
            return {}
        if found.boot_id is not None and self._boot_id is not None and found.boot_id != self._boot_id:
            log.info("MPS daemons' record is of an earlier boot (%s): its daemons are gone", found.boot_id)
            self.save_all({})
            return {}
        groups = found.body.get("groups")
        if not isinstance(groups, dict):
            log.error("MPS daemons' record unusable, adopting none: %s: groups is not an object", self.path)
            return {}
        records: dict[str, DaemonRecord] = {}
        for name, doc in groups.items():
            try:
                records[name] = _record(name, doc)
            except ValueError as err:
                log.error("MPS daemons' record %s: %s; that daemon is not adopted", self.path, err)
        with self._lock:
            self._records = dict(records)
        return records

    def put(self, record: DaemonRecord) -> None:
        with self._lock:
            self._records[record.group] = record
            self._write()

    def drop(self, group: str) -> None:
        with self._lock:
            if self._records.pop(group, None) is not None:
                self._write()

    def save_all(self, records: Mapping[str, DaemonRecord]) -> None:
        with self._lock:
            self._records = dict(records)
            self._write()

    def _write(self) -> None:
        body = {"groups": {name: r.as_dict() for name, r in sorted(self._records.items())}}
        write_checkpoint(self.path, seal(KIND, VERSION, body, self._boot_id))
