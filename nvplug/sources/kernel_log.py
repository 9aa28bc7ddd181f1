"""The kernel log as a fault source: the NVIDIA driver's lines in /dev/kmsg.

The driver prints every Xid to the kernel log, whether or not an NVML client listens, and a GPU
that fell off the bus may show up nowhere else. /dev/kmsg gives one record per read and starts at
the oldest record still in the ring buffer, so `start` reads what is there (the log since boot,
as far as it reaches) into `backlog`, for the daemon to apply before the first list; what comes
after is read on the loop (a reader on the non-blocking fd) and published.

Tests and the simulated node give a FIFO of records in the same format instead; its chunks
need not end at a record, which `RecordSplitter` takes care of.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from nvplug.core.events import Event, KernelLogLost, KernelLogState
from nvplug.core.kernel_log_backlog import settle
from nvplug.core.kernel_log_records import RecordError, RecordSplitter, classify, parse_record
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import BlockingRunsOn, Publish

log = logging.getLogger(__name__)

# /dev/kmsg answers EINVAL to a buffer smaller than the record; a FIFO is drained in one read.
READ_SIZE = 64 * 1024
# Reads per wake-up, so a flood cannot starve the loop; the reader is level-triggered.
MAX_PER_WAKEUP = 512
# After a read error we cannot explain, wait this long before reading again instead of spinning.
ERROR_PAUSE_S = 5.0

Drained = Literal["drained", "more", "closed"]


def _errno_text(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


class KernelLogSource:
    """Reads the kernel log's records at `path` and turns the driver's lines into events.

    After `start`: `backlog` holds the events of the records already there (replayed), ending
    with `KernelLogState`; `lost` counts records known lost, `overruns` the times the ring
    buffer overran the reader, `unparsed` the records that did not parse.
    """

    name = "the kernel log"
    blocking: BlockingRunsOn = "loop reader"
    without: str | None = "faults reach nvplug from NVML only"

    def __init__(self, path: Path, publish: Publish) -> None:
        self.path = path
        self._publish = publish
        self.backlog: tuple[Event, ...] = ()
        self.lost = 0
        self.overruns = 0
        self.unparsed = 0
        self.records = 0
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False
        self._resume: asyncio.TimerHandle | None = None
        self._error: str | None = None
        self._splitter = RecordSplitter()
        self._last_seq: int | None = None
        # Where events go: the backlog while `start` reads it, the bus after.
        self._emit: Callable[[Event], None] = self._publish_safely
        self._replayed = False

    def fileno(self) -> int:
        """The open fd (-1 when closed); only for inspection, never read it."""
        return self._fd

    async def first_events(self, snapshot: Snapshot) -> Sequence[Event]:
        """What the log said before we started (FirstEvents): counted from the first list on."""
        return settle(self.backlog, snapshot.kernel_log_seq)

    def start(self) -> None:
        if self._fd >= 0:
            return
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            self._unreadable(exc)
            return
        backlog: list[Event] = []
        self._emit, self._replayed = backlog.append, True
        try:
            state = self._drain(None)
        except OSError as exc:
            self._close()
            self._unreadable(exc, backlog)
            return
        finally:
            self._emit, self._replayed = self._publish_safely, False
        if state == "closed":
            self._close()
            self.backlog = (*backlog, KernelLogState(self._closed_text()))
            log.warning("%s; %s", self._closed_text(), self.without)
            return
        self.backlog = (*backlog, KernelLogState(None))
        self._loop = asyncio.get_running_loop()
        self._add_reader()
        driver = sum(1 for event in backlog if not isinstance(event, KernelLogLost))
        log.info(
            "reading the kernel log at %s: %d records there already, %d of them the driver's",
            self.path,
            self.records,
            driver,
        )

    async def stop(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._close()

    def handle_read_error(self, exc: OSError) -> bool:
        """A read that failed: True where reading goes on at once (the ring buffer overran us)."""
        if exc.errno == errno.EPIPE:
            # The kernel moved us on to the oldest record left; the seq jump will say how many.
            self.overruns += 1
            why = "the kernel log's ring buffer overran the reader (EPIPE)"
            log.warning("%s at %s: records were lost", why, self.path)
            self._emit(KernelLogLost(None, why))
            return True
        return exc.errno == errno.EINTR

    def _drain(self, limit: int | None) -> Drained:
        """Reads until EAGAIN, end of file or `limit` reads; raises an OSError it cannot go on from."""
        reads = 0
        while limit is None or reads < limit:
            try:
                chunk = os.read(self._fd, READ_SIZE)
            except BlockingIOError:
                # Nothing more for now: a record waiting for a continuation line is whole.
                self._handle(self._splitter.flush())
                return "drained"
            except OSError as exc:
                if self.handle_read_error(exc):
                    continue
                raise
            reads += 1
            if not chunk:
                self._handle(self._splitter.flush(eof=True))
                return "closed"
            self._handle(self._splitter.feed(chunk))
        return "more"

    def _handle(self, texts: list[str]) -> None:
        for text in texts:
            try:
                record = parse_record(text)
            except RecordError as exc:
                self.unparsed += 1
                log.debug("skipped a kernel log record: %s", exc)
                continue
            self.records += 1
            self._check_seq(record.seq)
            event = classify(record, self._replayed)
            if event is not None:
                self._emit(event)

    def _check_seq(self, seq: int) -> None:
        last, self._last_seq = self._last_seq, seq
        if last is None or seq == last + 1:
            return
        if seq > last + 1:
            missing = seq - last - 1
            self.lost += missing
            why = f"seq jumped from {last} to {seq}"
            log.warning("lost %d kernel log record(s) at %s: %s", missing, self.path, why)
            self._emit(KernelLogLost(missing, why))
        else:
            # Not a loss: a writer that started over (a stand-in), or the same record again.
            log.info("the kernel log's seq went back from %d to %d at %s", last, seq, self.path)

    def _on_readable(self) -> None:
        try:
            state = self._drain(MAX_PER_WAKEUP)
        except OSError as exc:
            self._read_failed(exc)
            return
        except Exception:
            log.exception("reading the kernel log at %s failed; reading on", self.path)
            return
        if self._error is not None:
            self._error = None
            log.info("reading the kernel log at %s again", self.path)
            self._publish_safely(KernelLogState(None))
        if state == "closed":
            self._close()
            log.warning("%s; %s", self._closed_text(), self.without)
            self._publish_safely(KernelLogState(self._closed_text()))

    def _read_failed(self, exc: OSError) -> None:
        error = f"cannot read the kernel log at {self.path}: {_errno_text(exc)}"
        self._remove_reader()
        assert self._loop is not None  # a reader only runs after start
        self._resume = self._loop.call_later(ERROR_PAUSE_S, self._resume_reading)
        if self._error is None:
            self._error = error
            log.warning("%s; trying again every %.0fs", error, ERROR_PAUSE_S)
            self._publish_safely(KernelLogState(error))

    def _resume_reading(self) -> None:
        self._resume = None
        if self._fd >= 0:
            self._add_reader()

    def _publish_safely(self, event: Event) -> None:
        try:
            self._publish(event)
        except Exception:
            log.exception("publishing %s failed", event)

    def _unreadable(self, exc: OSError, backlog: list[Event] | None = None) -> None:
        error = f"cannot read the kernel log at {self.path}: {_errno_text(exc)}"
        hint = ""
        if exc.errno in (errno.EPERM, errno.EACCES):
            hint = " (it needs CAP_SYSLOG where kernel.dmesg_restrict=1, and a unit without ProtectKernelLogs=yes)"
        log.warning("%s%s; %s", error, hint, self.without)
        self.backlog = (*(backlog or ()), KernelLogState(error))

    def _closed_text(self) -> str:
        return f"the kernel log at {self.path} closed"

    def _add_reader(self) -> None:
        assert self._loop is not None
        self._loop.add_reader(self._fd, self._on_readable)
        self._reading = True

    def _remove_reader(self) -> None:
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._reading = False

    def _close(self) -> None:
        self._remove_reader()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
