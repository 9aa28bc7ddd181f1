"""Checkpoint files: a JSON document in an envelope that says what it is, which boot wrote it, and that it is whole.

The envelope's fields sit beside the document's own, so whoever reads the file by hand (jq, an
older tool) finds the document's fields where they always were:

    {"kind": "nvplug.health", "version": 2, "boot_id": "...", "sha256": "...", "devices": [...]}

- kind: which checkpoint this is, so that one file is never read as another;
- version: the document's format; a reader refuses a newer one rather than guess at it;
- boot_id: the boot that wrote it (null: unknown); whether that matters is the reader's business;
- sha256: of the canonical JSON of all the rest, envelope included, so a file damaged behind our
  back (a disk, an editor) is refused instead of half believed.

A file from before the envelope (no kind) goes to the caller's reader of that older layout.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nvplug.base.atomic_write import write_atomically

ENVELOPE = ("kind", "version", "boot_id", "sha256")
# What a checkpoint says (which GPU failed, what was handed to whom) is for root only.
MODE = 0o600
DIR_MODE = 0o700


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: path says which file, reason says why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class Checkpoint:
    kind: str
    version: int
    boot_id: str | None
    # The document's own fields (the envelope's left out).
    body: Mapping[str, Any]
    # False: read from the layout before the envelope, which had no checksum.
    sealed: bool = True


# The reader of a kind's layout before the envelope: a Checkpoint, or ValueError saying why not.
Legacy = Callable[[dict[str, Any]], Checkpoint]


def canonical(doc: Mapping[str, Any]) -> bytes:
    """One encoding per value, whatever the file's layout: what the checksum is taken of."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def checksum(doc: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical({k: v for k, v in doc.items() if k != "sha256"})).hexdigest()


def seal(kind: str, version: int, body: Mapping[str, Any], boot_id: str | None) -> bytes:
    """The file's bytes: the envelope first, then the document; the same input gives the same bytes."""
    clash = sorted(set(body) & set(ENVELOPE))
    if clash:
        raise ValueError(f"{kind}: the document may not use the envelope's fields {clash}")
    doc: dict[str, Any] = {"kind": kind, "version": version, "boot_id": boot_id}
    doc["sha256"] = checksum({**doc, **body})
    return json.dumps({**doc, **body}, indent=1, allow_nan=False).encode() + b"\n"


def write_checkpoint(path: Path, sealed: bytes) -> None:
    """Write what seal() made: whole or not at all (a crash leaves the old file), readable by root only."""
    write_atomically(path, sealed, mode=MODE, dir_mode=DIR_MODE)


def unseal(data: bytes, path: Path, kind: str, version: int, legacy: Legacy | None = None) -> Checkpoint:
    """The checkpoint in data (read from path), verified; CheckpointError says why not."""
    try:
        doc = json.loads(data)
    except ValueError as err:
        raise CheckpointError(path, f"not JSON: {err}") from err
    if not isinstance(doc, dict):
        raise CheckpointError(path, "not a JSON object")
    if "kind" not in doc:
        if legacy is None:
            raise CheckpointError(path, f"no kind: not an nvplug checkpoint (expected {kind!r})")
        try:
            return legacy(doc)
        except ValueError as err:
            raise CheckpointError(path, str(err)) from err
    found, number, boot = doc["kind"], doc.get("version"), doc.get("boot_id")
    if found != kind:
        raise CheckpointError(path, f"a {found!r} checkpoint, not {kind!r}")
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise CheckpointError(path, f"no version number (version: {number!r})")
    # Before the checksum: a newer nvplug may take it differently.
    if number > version:
        raise CheckpointError(path, f"written by a newer nvplug (version {number}; this one reads up to {version})")
    stated = doc.get("sha256")
    try:
        actual = checksum(doc)
    except ValueError as err:  # NaN or Infinity: never written by seal()
        raise CheckpointError(path, f"not canonical JSON: {err}") from err
    if stated != actual:
        raise CheckpointError(
            path, f"checksum mismatch: sha256 {stated!r} recorded, {actual!r} found (damaged, or edited by hand)"
        )
    if not isinstance(boot, (str, type(None))):
        raise CheckpointError(path, f"boot_id is {boot!r}, not a string or null")
    body = {k: v for k, v in doc.items() if k not in ENVELOPE}
    return Checkpoint(kind, number, boot, body)


def read_checkpoint(path: Path, kind: str, version: int, legacy: Legacy | None = None) -> Checkpoint:
    """The verified checkpoint at path. OSError (FileNotFoundError included) is the caller's to tell apart."""
    return unseal(path.read_bytes(), path, kind, version, legacy)
