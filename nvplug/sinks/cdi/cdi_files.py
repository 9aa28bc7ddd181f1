"""Spec files on disk: ours written atomically, everyone's read back for conflicts and names."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from nvplug.base.atomic_write import write_atomically
from nvplug.cdi.cdi_spec import DIR_MODE, SPEC_MODE, CdiSpec, qualified

log = logging.getLogger(__name__)

SPEC_SUFFIXES = (".json", ".yaml", ".yml")
# Bigger than any real spec; a bigger file is not read whole.
MAX_SPEC_BYTES = 16 << 20


class SpecWriter:
    """Our specs in one directory: only those that changed are written, those no longer made removed."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        # What each file holds now, as written: an equal spec is neither rendered nor written again.
        self._written: dict[str, CdiSpec] = {}

    def paths(self) -> list[Path]:
        return [self.directory / name for name in self._written]

    def write(self, specs: Sequence[CdiSpec]) -> bool:
        """True if a file changed. Raises OSError naming the file; what was written before stays recorded."""
        wanted = {s.file_name: s for s in specs}
        changed = False
        for name, spec in wanted.items():
            if self._written.get(name) != spec:
                path = self.directory / name
                try:
                    write_atomically(path, spec.render(), SPEC_MODE, DIR_MODE)
                except OSError as err:
                    raise OSError(err.errno, f"cannot write the CDI spec {path}: {err.strerror or err}") from err
                self._written[name] = spec
                changed = True
        for name in [n for n in self._written if n not in wanted]:
            with contextlib.suppress(FileNotFoundError):
                (self.directory / name).unlink()
            del self._written[name]
            changed = True
        return changed


@dataclass(frozen=True)
class SpecFile:
    """A spec as a runtime would read it: its kind and device names; `error` if it cannot be read."""

    path: Path
    kind: str = ""
    names: tuple[str, ...] = ()
    error: str | None = None

    def qualified(self) -> list[str]:
        return [qualified(self.kind, n) for n in self.names]


def read_specs(dirs: Iterable[Path]) -> list[SpecFile]:
    """Every spec file in `dirs`, in the runtimes' order of priority (lowest first)."""
    found: list[SpecFile] = []
    for directory in dict.fromkeys(dirs):
        try:
            entries = sorted(p for p in directory.iterdir() if p.suffix in SPEC_SUFFIXES and not p.name.startswith("."))
        except OSError:
            continue
        found += [_read(p) for p in entries]
    return found


def _read(path: Path) -> SpecFile:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            return SpecFile(path, error=f"larger than {MAX_SPEC_BYTES} bytes")
        doc = json.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)
    except (OSError, ValueError, yaml.YAMLError) as err:
        return SpecFile(path, error=str(err).splitlines()[0] if str(err) else type(err).__name__)
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str):
        return SpecFile(path, error="no kind")
    devices = doc.get("devices")
    names = [d.get("name") for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []
    return SpecFile(path, doc["kind"], tuple(n for n in names if isinstance(n, str)))


def conflicts(files: Sequence[SpecFile], ours: Sequence[Path], kinds: Iterable[str]) -> list[str]:
    """Foreign specs that define one of our kinds: two definitions of a name make runtimes refuse it
    (in one directory) or pick one (across directories), and neither is what an operator wants."""
    own = {p.resolve() for p in ours}
    mine = {f.kind: set(f.names) for f in files if f.path.resolve() in own}
    problems = []
    for f in files:
        if f.error is not None or f.kind not in kinds or f.path.resolve() in own:
            continue
        both = sorted(set(f.names) & mine.get(f.kind, set()))
        clash = f"defines {len(both)} of the same names ({', '.join(both[:3])}{', ...' if len(both) > 3 else ''})"
        problems.append(
            f"{f.path} also defines CDI kind {f.kind}"
            + (f" and {clash}" if both else "")
            + "; remove it, or leave the kind to one generator"
        )
    return problems
