"""Logging set-up: one line per event, timestamps when not under journald."""

from __future__ import annotations

import logging
import sys


def setup(level: str = "info") -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # grpc and watchdog are chatty at debug; their problems still show at warning.
    for noisy in ("grpc", "watchdog", "asyncio"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.INFO))
