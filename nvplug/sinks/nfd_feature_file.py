"""The NFD feature file: node labels for Node Feature Discovery's worker, kept current by events.

NFD's worker turns each `key=value` line of a file in its features.d directory into a
node label. The daemon rewrites the file in the step that applies a new state, only
when a label changed: a label that changes for nothing costs the API server and the
scheduler work for nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from nvplug.base.atomic_write import write_atomically
from nvplug.config import Config, off_or_path
from nvplug.core.events import Event
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import Commit, Sink, StateUpdate
from nvplug.sinks.gfd_labels import LABEL_READS, Machine, node_labels, render

log = logging.getLogger("nvplug")

DMI_PRODUCT_NAME = Path("class/dmi/id/product_name")
# Every runtime and NFD must read it; it holds nothing secret.
FILE_MODE = 0o644


def read_machine(sysfs_root: Path, bus_ids: Iterable[str]) -> Machine:
    """The DMI product name, and the PCI class of each GPU (a VGA or a 3D controller)."""
    try:
        product: str | None = (sysfs_root / DMI_PRODUCT_NAME).read_text()
    except OSError:
        product = None
    classes = {}
    for bus_id in bus_ids:
        try:
            classes[bus_id] = int((sysfs_root / "bus/pci/devices" / bus_id / "class").read_text().strip(), 16)
        except (OSError, ValueError):
            continue
    return Machine(product, classes)


def feature_file_path(cfg: Config) -> Path | None:
    """The config's nvplug.labels.featureFile (--nfd-feature-file is written onto it); None when off."""
    return off_or_path(cfg.feature_file)


def label_reads(cfg: Config) -> frozenset[str]:
    """What the labels depend on: health too only when they count the Unhealthy GPUs."""
    return LABEL_READS | {"health"} if cfg.unhealthy_count_label else LABEL_READS


class FeatureFile(Sink):
    """The labels of each new revision, written when they changed; a reload may move or drop the file."""

    name = "labels"

    def __init__(self, cfg: Config, sysfs_root: Path) -> None:
        self._cfg = cfg
        self.reads = label_reads(cfg)
        self.path = feature_file_path(cfg)
        self._sysfs_root = sysfs_root
        self._machine: Machine | None = None
        self._machine_for: tuple[str, ...] = ()
        self.labels: dict[str, str] = {}
        self._written: dict[str, str] | None = None
        self.error: str | None = None

    def update(self, update: StateUpdate) -> Sequence[Event]:
        if update.revised:
            self.write(update.snapshot, self._cfg)
        return ()

    def prepare(self, cfg: Config) -> Commit:
        path = feature_file_path(cfg)

        async def commit(snapshot: Snapshot) -> None:
            # Strategy and sharing are in the labels.
            self._cfg = cfg
            self.reads = label_reads(cfg)
            self.configure(path)
            self.write(snapshot, cfg)

        return commit

    def status(self) -> dict[str, object]:
        return {"file": None if self.path is None else str(self.path), "error": self.error, "labels": self.labels}

    def configure(self, path: Path | None) -> None:
        """A reloaded config: a file no longer configured is removed, or NFD would keep its labels."""
        if path == self.path:
            return
        if self.path is not None and self._written is not None:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as err:
                log.warning("cannot remove the old NFD feature file %s: %s", self.path, err.strerror)
        self.path = path
        self._written = None
        self.error = None

    def write(self, snap: Snapshot, cfg: Config) -> None:
        """Write the labels for this state if they differ from what the file holds."""
        self.labels = node_labels(snap, cfg, self._machine_of(snap), cfg.unhealthy_count_label)
        if self.path is None or self.labels == self._written:
            return
        try:
            if not self.path.parent.is_dir():
                raise FileNotFoundError(f"{self.path.parent} does not exist (is Node Feature Discovery installed?)")
            write_atomically(self.path, render(self.labels), FILE_MODE)
        except OSError as err:
            text = f"cannot write the NFD feature file {self.path}: {err.strerror or err}"
            if text != self.error:
                log.warning("%s; node labels are not updated", text)
                self.error = text
            return
        if self.error is not None:
            log.info("the NFD feature file %s is written again", self.path)
            self.error = None
        log.info("node labels written to %s: %d labels", self.path, len(self.labels))
        self._written = dict(self.labels)

    def _machine_of(self, snap: Snapshot) -> Machine:
        """Read again only when the GPUs change: the product name and PCI classes do not change under us."""
        bus_ids = tuple(g.bus_id for g in snap.gpus)
        if self._machine is None or bus_ids != self._machine_for:
            self._machine = read_machine(self._sysfs_root, bus_ids)
            self._machine_for = bus_ids
        return self._machine
