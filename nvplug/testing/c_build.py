"""Compiling the test doubles written in C (the fake NVML library, the stand-in MPS control binary).

A build is cached beside its output by a hash of the source, the compiler and the flags, and is
safe from concurrent processes: the output is written under a temporary name and renamed into
place, and its hash is written only after it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path


class CBuildError(RuntimeError):
    """The compiler could not be run, or failed; `stderr` holds what it said."""

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(f"{message}\n{stderr}".rstrip())
        self.stderr = stderr


def build(source: Path, output: Path, cflags: Sequence[str], cc: str, error: type[CBuildError] = CBuildError) -> Path:
    """`source` compiled to `output` (mode 0755) unless an up-to-date build is there; raises `error`."""
    output.parent.mkdir(parents=True, exist_ok=True)
    stamp = output.with_name(f"{output.name}.sha256")
    digest = hashlib.sha256(source.read_bytes() + repr((cc, tuple(cflags))).encode()).hexdigest()
    if output.is_file() and read_text(stamp) == digest:
        return output
    with temp_in(output.parent, output.name, ".tmp") as tmp:
        try:
            proc = subprocess.run(
                [cc, *cflags, "-o", str(tmp), str(source)], capture_output=True, text=True, check=False
            )
        except OSError as exc:
            raise error(f"cannot run C compiler {cc!r}: {exc}") from exc
        if proc.returncode != 0:
            raise error(f"{cc} failed to build {source} (exit {proc.returncode})", proc.stderr)
        tmp.chmod(0o755)
        tmp.replace(output)
    with temp_in(output.parent, output.name, ".sha256.tmp") as tmp:
        tmp.write_text(digest)
        tmp.replace(stamp)
    return output


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


@contextlib.contextmanager
def temp_in(directory: Path, name: str, suffix: str) -> Iterator[Path]:
    """A fresh file name in `directory`, removed afterwards unless it was renamed away."""
    fd, made = tempfile.mkstemp(prefix=f".{name}.", suffix=suffix, dir=directory)
    os.close(fd)
    path = Path(made)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
