"""Per-claim CDI specs: what a claim adds to its devices (an MPS group's pipe, shm and env), in a
transient spec of its own beside the node's, named as NVIDIA's DRA driver names them.

The kind is `k8s.gpu.nvidia.com/claim`, each device `<claim uid>-<device>`, the file
`k8s.gpu.nvidia.com-claim_<claim uid>.json` (CDI's name for a transient spec). A claim's container
gets the node spec's name of each device (its nodes, and the driver's files, which follow the node's
driver) and the claim's name beside it. A claim with no edits of its own has no spec.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from nvplug.base.atomic_write import write_atomically
from nvplug.cdi.cdi_spec import DIR_MODE, SPEC_MODE, CdiSpec, Edits, qualified

VENDOR = "k8s.gpu.nvidia.com"
CLAIM_KIND = f"{VENDOR}/claim"
_PREFIX = f"{VENDOR}-claim_"
_FILE = re.compile(re.escape(_PREFIX) + r"(.+)\.json")


def spec_file(uid: str) -> str:
    return f"{_PREFIX}{uid}.json"


def claim_device_name(uid: str, device: str) -> str:
    return f"{uid}-{device}"


@dataclass(frozen=True)
class WrittenSpec:
    path: Path
    # Each device's qualified name in it, by the device's name in the pool.
    names: Mapping[str, str]


class ClaimSpecs:
    """The claims' specs in the node spec's directory (None: none is written)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def write(self, uid: str, edits: Mapping[str, Edits]) -> WrittenSpec:
        """The claim's spec, written atomically. Raises OSError naming the file."""
        if self.directory is None:
            raise OSError(f"no CDI spec directory is configured for the claim's spec {spec_file(uid)}")
        spec = CdiSpec(CLAIM_KIND, {claim_device_name(uid, d): e for d, e in edits.items()})
        path = self.directory / spec_file(uid)
        try:
            write_atomically(path, spec.render(), SPEC_MODE, DIR_MODE)
        except OSError as err:
            raise OSError(err.errno, f"cannot write the claim's CDI spec {path}: {err.strerror or err}") from err
        return WrittenSpec(path, {d: qualified(CLAIM_KIND, claim_device_name(uid, d)) for d in edits})

    @staticmethod
    def remove(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            Path(path).unlink()

    def orphans(self, owned: Iterable[str]) -> list[Path]:
        """The claims' specs in the directory that no claim in `owned` (UIDs) prepared."""
        if self.directory is None or not self.directory.is_dir():
            return []
        keep = set(owned)
        found = (_FILE.fullmatch(p.name) for p in sorted(self.directory.iterdir()))
        return [self.directory / m.group(0) for m in found if m is not None and m.group(1) not in keep]
