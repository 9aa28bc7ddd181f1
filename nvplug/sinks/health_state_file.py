"""The health state file: Unhealthy devices and their faults, kept across restarts within one boot.

A GPU that an XID took out must not come back Healthy because nvplug restarted
(watchdog, upgrade, crash, `systemctl restart`). A new boot resets every GPU,
so a file from another boot is ignored. The file is written atomically (temp
file, fsync, rename) whenever its content changes; one that is missing,
corrupt or from a newer nvplug is logged and ignored, never fatal.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nvplug.base.atomic_write import write_atomically
from nvplug.core.health import Clears, Health, HealthState, Recorded

# The name it had before the layout by role: it is part of every log line.
log = logging.getLogger("nvplug.statefile")

FORMAT = 1
FILE_NAME = "health.json"
DEFAULT_DIR = Path("/var/lib/nvplug")
BOOT_ID = Path("sys/kernel/random/boot_id")


class StateFileError(ValueError):
    """The file cannot be used; the message says why."""


def state_dir(explicit: Path | None, environ: Mapping[str, str]) -> Path:
    """$STATE_DIRECTORY (systemd's, from StateDirectory=; the first of several), else --state-dir, else the default."""
    from_systemd = environ.get("STATE_DIRECTORY", "").split(":")[0]
    if from_systemd:
        return Path(from_systemd)
    return explicit or DEFAULT_DIR


def read_boot_id(proc_root: Path) -> str | None:
    try:
        return (proc_root / BOOT_ID).read_text().strip() or None
    except OSError:
        return None


def encode(records: Mapping[str, Recorded], boot_id: str | None) -> bytes:
    devices = [
        {
            "uuid": uuid,
            "bus_id": r.bus_id,
            "reason": r.state.reason,
            "since": r.state.since,
            "clears": (r.state.clears or Clears.RESET).value,
            "evidence": r.state.evidence,
            "recovery_action": r.state.recovery_action,
            "driver_instance": r.state.driver_instance,
        }
        for uuid, r in sorted(records.items())
    ]
    doc = {"format": FORMAT, "boot_id": boot_id, "devices": devices}
    return json.dumps(doc, indent=1).encode() + b"\n"


def decode(data: bytes) -> tuple[str | None, dict[str, Recorded]]:
    """(boot id, records). Raises StateFileError for anything but a well-formed file of a known format."""
    try:
        doc = json.loads(data)
    except ValueError as err:
        raise StateFileError(f"not JSON: {err}") from err
    if not isinstance(doc, dict):
        raise StateFileError("not a JSON object")
    version = doc.get("format")
    if not isinstance(version, int) or isinstance(version, bool):
        raise StateFileError(f"no format number (format: {version!r})")
    if version > FORMAT:
        raise StateFileError(f"written by a newer nvplug (format {version}; this one reads up to {FORMAT})")
    boot = doc.get("boot_id")
    devices = doc.get("devices")
    if not isinstance(boot, (str, type(None))) or not isinstance(devices, list):
        raise StateFileError("boot_id or devices missing or of the wrong type")
    records = {}
    for n, entry in enumerate(devices):
        try:
            uuid, record = _record(entry)
        except (KeyError, TypeError, ValueError) as err:
            raise StateFileError(f"device {n}: {type(err).__name__}: {err}") from err
        records[uuid] = record
    return boot, records


def _record(entry: Any) -> tuple[str, Recorded]:
    if not isinstance(entry, dict):
        raise TypeError("not an object")
    text = {k: entry[k] for k in ("uuid", "bus_id", "reason")}
    if not all(isinstance(v, str) and v for v in text.values()):
        raise ValueError("uuid, bus_id and reason must be non-empty strings")
    since, action = entry["since"], entry.get("recovery_action", 0)
    if not isinstance(since, (int, float)) or isinstance(since, bool):
        raise TypeError(f"since is {since!r}")
    if not isinstance(action, int) or isinstance(action, bool):
        raise TypeError(f"recovery_action is {action!r}")
    optional = {k: entry.get(k) for k in ("evidence", "driver_instance")}
    if not all(isinstance(v, (str, type(None))) for v in optional.values()):
        raise TypeError("evidence and driver_instance must be strings or null")
    state = HealthState(
        Health.UNHEALTHY,
        text["reason"],
        float(since),
        Clears(entry["clears"]),
        optional["evidence"],
        action,
        optional["driver_instance"],
    )
    return text["uuid"], Recorded(text["bus_id"], state)


class StateFile:
    def __init__(self, directory: Path, boot_id: str | None) -> None:
        self.path = directory / FILE_NAME
        self._boot_id = boot_id
        self._written: bytes | None = None
        self._failing: str | None = None

    def load(self) -> dict[str, Recorded]:
        """The faults recorded in this boot; nothing (and a log line saying why) otherwise."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            log.info("no health state file at %s: every GPU starts from its first scan", self.path)
            return {}
        except OSError as err:
            log.warning("health state file %s unreadable, ignored: %s", self.path, err)
            return {}
        try:
            boot, records = decode(data)
        except StateFileError as err:
            log.warning("health state file %s ignored: %s", self.path, err)
            return {}
        self._written = data
        if self._boot_id is None:
            log.warning("health state file %s ignored: this boot's id is unreadable", self.path)
            return {}
        if boot != self._boot_id:
            log.info("health state file %s is from another boot: ignored (a reboot resets every GPU)", self.path)
            return {}
        for uuid, r in records.items():
            log.warning("%s (%s) was Unhealthy before this start: %s", uuid, r.bus_id, r.state.reason)
        return records

    def save(self, records: Mapping[str, Recorded]) -> None:
        """Write the records if they changed; a failure is logged (once) and retried at the next change."""
        data = encode(records, self._boot_id)
        if data == self._written:
            return
        try:
            self._write(data)
        except OSError as err:
            text = f"cannot write the health state file {self.path}: {err}; a restart would forget Unhealthy GPUs"
            if text != self._failing:
                log.error("%s", text)
                self._failing = text
            return
        if self._failing is not None:
            log.info("the health state file %s is written again", self.path)
            self._failing = None
        self._written = data

    def _write(self, data: bytes) -> None:
        write_atomically(self.path, data)
