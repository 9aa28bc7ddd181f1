"""Logging: one line per event; syslog priorities when stderr is the journal."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

# What journald reads from a leading <N> on a stream line.
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


class JournalFormatter(logging.Formatter):
    """`<N>logger: message`, one journal entry per record, a traceback included."""

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        priority = next((p for level, p in _PRIORITY.items() if record.levelno >= level), 7)
        # journald splits a stream at newlines: keep a traceback in the one entry.
        return f"<{priority}>" + super().format(record).replace("\n", " ⏎ ")


def journal_stream(environ: Mapping[str, str], fd: int) -> bool:
    """Whether `fd` is the stream that systemd connected to the journal ($JOURNAL_STREAM is dev:inode)."""
    try:
        device, inode = (int(v) for v in environ.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(fd)
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (device, inode)


def setup(level: str = "info", environ: Mapping[str, str] | None = None) -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    handler = logging.StreamHandler(sys.stderr)
    if journal_stream(os.environ if environ is None else environ, sys.stderr.fileno()):
        handler.setFormatter(JournalFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # grpc and asyncio are chatty at debug; their problems still show at warning.
    for noisy in ("grpc", "asyncio"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.INFO))
