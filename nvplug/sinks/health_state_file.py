"""The health state file: Unhealthy devices and their faults, kept across restarts within one boot.

A GPU that an XID took out must not come back Healthy because nvplug restarted
(watchdog, upgrade, crash, `systemctl restart`). A new boot resets every GPU,
so a file from another boot is ignored. The file is a checkpoint (nvplug.base.checkpoint:
kind, version, boot id, checksum) written atomically whenever its content changes, by
a thread of its own while the daemon runs; one that is missing, corrupt or from a newer
nvplug is logged and ignored, never fatal. Files of format 1, from before the envelope, are read too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nvplug.base.checkpoint import Checkpoint, CheckpointError, seal, unseal, write_checkpoint
from nvplug.core.health import Clears, Fault, Health, HealthState, Recorded

log = logging.getLogger(__name__)

KIND = "nvplug.health"
# 1: {"format": 1, "boot_id", "devices"}, no envelope; 2: the same devices in the envelope.
FORMAT = 2
FILE_NAME = "health.json"
DEFAULT_DIR = Path("/var/lib/nvplug")
BOOT_ID = Path("sys/kernel/random/boot_id")


class StateFileError(CheckpointError):
    """A well-sealed file whose devices cannot be used; the reason says why."""


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


def encode(records: Mapping[str, Recorded], boot_id: str | None, saved: Saved | None = None) -> bytes:
    """The file's bytes; `saved` adds the kernel log cursor and nvplug's own resets."""
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
            "remedy": r.state.remedy,
            # Keys an older nvplug ignores; without them a record is of an OTHER fault.
            "fault": (r.state.fault or Fault.OTHER).value,
            "xid": r.state.xid,
        }
        for uuid, r in sorted(records.items())
    ]
    body: dict[str, Any] = {"devices": devices}
    # Keys an older nvplug reads the file without, and ignores.
    if saved is not None and saved.kernel_log_seq is not None:
        body["kernel_log_seq"] = saved.kernel_log_seq
    if saved is not None and saved.auto_resets:
        body["auto_resets"] = {uuid: list(times) for uuid, times in sorted(saved.auto_resets.items())}
    if saved is not None and saved.compute_modes:
        body["compute_modes"] = dict(sorted(saved.compute_modes.items()))
    return seal(KIND, FORMAT, body, boot_id)


def decode(data: bytes, path: Path | None = None) -> tuple[str | None, dict[str, Recorded]]:
    """(boot id, records). Raises CheckpointError for anything but a well-formed file of a known format."""
    boot, saved = decode_all(data, path)
    return boot, dict(saved.records)


def decode_all(data: bytes, path: Path | None = None) -> tuple[str | None, Saved]:
    """(boot id, everything the file holds), as decode()."""
    where = path or Path(FILE_NAME)
    found = unseal(data, where, KIND, FORMAT, legacy=_format_1)
    devices = found.body.get("devices")
    if not isinstance(devices, list):
        raise StateFileError(where, "boot_id or devices missing or of the wrong type")
    records = {}
    for n, entry in enumerate(devices):
        try:
            uuid, record = _record(entry)
        except (KeyError, TypeError, ValueError) as err:
            raise StateFileError(where, f"device {n}: {type(err).__name__}: {err}") from err
        records[uuid] = record
    seq = found.body.get("kernel_log_seq")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 0):
        raise StateFileError(where, f"kernel_log_seq is {seq!r}, not a record number")
    resets = found.body.get("auto_resets", {})
    if not isinstance(resets, dict) or not all(
        isinstance(times, list) and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in times)
        for times in resets.values()
    ):
        raise StateFileError(where, "auto_resets must map GPU UUIDs to lists of times")
    auto_resets = {str(uuid): tuple(float(t) for t in times) for uuid, times in resets.items()}
    modes = found.body.get("compute_modes", {})
    if not isinstance(modes, dict) or not all(
        isinstance(m, int) and not isinstance(m, bool) and 0 <= m <= 3 for m in modes.values()
    ):
        raise StateFileError(where, "compute_modes must map GPU UUIDs to compute modes 0-3")
    return found.boot_id, Saved(records, seq, auto_resets, {str(u): m for u, m in modes.items()})


def _format_1(doc: dict[str, Any]) -> Checkpoint:
    """A file from before the envelope: {"format": 1, "boot_id": ..., "devices": [...]}, no checksum."""
    version = doc.get("format")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"no format number (format: {version!r})")
    if version > FORMAT:
        raise ValueError(f"written by a newer nvplug (format {version}; this one reads up to {FORMAT})")
    if version > 1:
        raise ValueError(f"format {version} without its envelope (kind, version, sha256)")
    boot = doc.get("boot_id")
    if not isinstance(boot, (str, type(None))):
        raise ValueError("boot_id or devices missing or of the wrong type")
    return Checkpoint(KIND, version, boot, {"devices": doc.get("devices")}, sealed=False)


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
    optional = {k: entry.get(k) for k in ("evidence", "driver_instance", "remedy")}
    if not all(isinstance(v, (str, type(None))) for v in optional.values()):
        raise TypeError("evidence, driver_instance and remedy must be strings or null")
    xid = entry.get("xid")
    if xid is not None and (not isinstance(xid, int) or isinstance(xid, bool)):
        raise TypeError(f"xid is {xid!r}")
    state = HealthState(
        Health.UNHEALTHY,
        text["reason"],
        float(since),
        Clears(entry["clears"]),
        optional["evidence"],
        action,
        optional["driver_instance"],
        optional["remedy"],
        _fault(entry.get("fault")),
        xid,
    )
    return text["uuid"], Recorded(text["bus_id"], state)


def _fault(value: Any) -> Fault:
    """A record's fault kind; one this nvplug does not know (a newer one's), or none (an older one's), is OTHER:
    the fault itself must not be lost with it."""
    try:
        return Fault(value)
    except ValueError:
        return Fault.OTHER


@dataclass(frozen=True)
class Saved:
    """What the file holds: the Unhealthy devices, and the last kernel log record they take in."""

    records: Mapping[str, Recorded]
    kernel_log_seq: int | None = None
    # nvplug's own resets of each GPU this boot (wall-clock times): their budget holds across restarts.
    auto_resets: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    # The compute modes nvplug changed for MPS, as they were before: restored after a crash too.
    compute_modes: Mapping[str, int] = field(default_factory=dict)


# Under a storm of changes a write starts no sooner than this after the one before it started, so
# that N changes cost about one fsync per interval, not N. A change then waits for the interval, or
# the write in flight, and is in the next write: the file lags the state by at most the interval
# plus two writes. That is LAG_BOUND, all a crash can lose, while a write (fsync and all) takes 25 ms
# or less; /status shows the slowest.
WRITE_INTERVAL = 0.05
LAG_BOUND = 0.1


class StateFile:
    """The file, and the thread that writes it while the daemon runs: an fsync must not hold up the
    asyncio loop (a ListAndWatch message waits on it).

    Writes are never skipped and never reordered: one saver thread, each write taking the state as
    it is when the write starts, and a change that comes while one is in flight (or too soon after
    one) is written by the next, once the interval since the last start has passed.
    """

    def __init__(self, directory: Path, boot_id: str | None, interval: float = WRITE_INTERVAL) -> None:
        self.path = directory / FILE_NAME
        self._boot_id = boot_id
        self._interval = interval
        self._written: bytes | None = None
        self._failing: str | None = None
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state file")
        self._records: Callable[[], Saved] | None = None
        # A change not yet taken by a write; the next write's timer; the write under way.
        self._dirty = False
        self._pending: asyncio.Handle | None = None
        self._in_flight: asyncio.Future[None] | None = None
        self._last_start = -float("inf")
        self._closed = False
        # For /status: changes told, writes started, the longest a write took (fsync and all), seconds.
        self.changes = 0
        self.writes = 0
        self.slowest = 0.0
        # What the loaded file held beside the records: the kernel log record it had taken in (a
        # restart reads only the records after it), and nvplug's own resets.
        self.loaded = Saved({})

    @property
    def boot_id(self) -> str | None:
        return self._boot_id

    @property
    def failing(self) -> str | None:
        """Why the last write failed; None while they succeed."""
        return self._failing

    def follow(self, records: Callable[[], Saved]) -> None:
        """What a write takes: the records as they are when it starts."""
        self._records = records

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
            boot, saved = decode_all(data, self.path)
            records = dict(saved.records)
        except CheckpointError as err:
            log.warning("health state file %s ignored: %s", self.path, err.reason)
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
        self.loaded = saved
        return records

    def save(self, saved: Saved) -> None:
        """Write the records if they changed; a failure is logged (once) and retried at the next change.

        Synchronous, on the caller's thread: for when no save_soon() is under way (the start)."""
        data = encode(saved.records, self._boot_id, saved)
        if data == self._written:
            return
        began = time.monotonic()
        try:
            self._write(data)
        except OSError as err:
            text = f"cannot write the health state file {self.path}: {err}; a restart would forget Unhealthy GPUs"
            if text != self._failing:
                log.error("%s", text)
                self._failing = text
            return
        finally:
            self.slowest = max(self.slowest, time.monotonic() - began)
        if self._failing is not None:
            log.info("the health state file %s is written again", self.path)
            self._failing = None
        self._written = data

    def save_soon(self, records: Callable[[], Saved]) -> None:
        """From the loop thread: the records changed; `records` says what they are when a write starts.

        The first change after a quiet spell is taken at the end of this loop turn (calls within one
        turn make one write); later ones wait for the write in flight, then for the interval."""
        self._records = records
        self._dirty = True
        self.changes += 1
        if self._closed:
            self._dirty = False
            self.save(records())
            return
        if self._pending is None and self._in_flight is None:
            loop = asyncio.get_running_loop()
            delay = self._last_start + self._interval - loop.time()
            self._pending = loop.call_later(delay, self._start) if delay > 0 else loop.call_soon(self._start)

    async def written(self) -> str | None:
        """Until what the state holds now is on disk: a change nvplug must be able to undo after a
        crash (a compute mode) is recorded before it is made, whatever the interval. Why it could not
        be written; None: it is."""
        if self._closed or self._records is None:
            return self._failing
        while (in_flight := self._in_flight) is not None:  # it may have taken the records before this change
            await asyncio.shield(in_flight)
            if self._in_flight is in_flight:
                # Done, but its callback (which clears it) has not run yet: awaiting a done future does
                # not give the loop a turn, so without one this would spin with the loop held.
                await asyncio.sleep(0)
        self._dirty = True
        if self._pending is not None:
            self._pending.cancel()
        started = self._start()
        if started is not None:
            await asyncio.shield(started)
        return self._failing

    def close(self, records: Saved) -> None:
        """At the end: once the write in flight is done, these records (whatever a last event changed).
        Idempotent; a later save_soon() writes on the loop thread, as nothing is left to wait for it."""
        if self._pending is not None:
            self._pending.cancel()  # superseded by these records
            self._pending = None
        self._dirty = False
        self._saver.shutdown(wait=True)
        self._closed = True
        self.save(records)

    def _start(self) -> asyncio.Future[None] | None:
        """A write of the records as they are now, on the saver; the next follows once it is done."""
        self._pending = None
        if not self._dirty or self._records is None:
            return None
        self._dirty = False
        records = self._records()
        loop = asyncio.get_running_loop()
        self._last_start = loop.time()
        self.writes += 1
        self._in_flight = started = loop.run_in_executor(self._saver, self.save, records)
        started.add_done_callback(self._done)
        return started

    def _done(self, _: asyncio.Future[None]) -> None:
        self._in_flight = None
        if self._dirty and self._pending is None and not self._closed:
            loop = asyncio.get_running_loop()
            delay = max(0.0, self._last_start + self._interval - loop.time())
            self._pending = loop.call_later(delay, self._start)

    def _write(self, data: bytes) -> None:
        write_checkpoint(self.path, data)
