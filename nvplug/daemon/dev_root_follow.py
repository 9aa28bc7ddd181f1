"""A reload that moves flags.nvidiaDevRoot, or the NVML calls' limits, for the sources that read them.

The CDI spec and Allocate take the dev root from the config they are handed; the scanner and the
device nodes' watch are sources, which a reload does not reach: this sink moves them, and what
/status says (doctor reads the node where the daemon does).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from pathlib import Path

from nvplug.config import Config
from nvplug.core.snapshot import Snapshot
from nvplug.edges.edge_protocols import Commit, Sink
from nvplug.sources.dev_node_watch import DevNodeWatch
from nvplug.sources.nvml_scanner import Scanner

log = logging.getLogger(__name__)


class DevRootFollower(Sink):
    name = "the dev root"
    # No snapshot field: only a reload moves it.
    reads = frozenset[str]()

    def __init__(self, cfg: Config, scanner: Scanner, watch: DevNodeWatch, roots: MutableMapping[str, str]) -> None:
        self.dev_root = Path(cfg.flags.nvidia_dev_root)
        self._scanner = scanner
        self._watch = watch
        # The report's roots, shown on /status.
        self._roots = roots

    def prepare(self, cfg: Config) -> Commit:
        new = Path(cfg.flags.nvidia_dev_root)
        health = cfg.health
        shown = str(new.absolute())

        async def commit(snapshot: Snapshot) -> None:
            # The first commit (this sink is the wiring's first): later ones' NVML calls are bound anew.
            self._scanner.calls.set_limits(health.nvml_call_deadline_seconds, health.driver_hang_seconds)
            if new == self.dev_root:
                return
            log.info("the dev root moves from %s to %s (flags.nvidiaDevRoot)", self.dev_root, new)
            self.dev_root = self._scanner.dev_root = new
            self._roots["dev_root"] = shown
            await self._watch.follow(new)
            # Which GPUs have their device nodes is the new root's now.
            self._scanner.request("flags.nvidiaDevRoot moved")

        return commit
