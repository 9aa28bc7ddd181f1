"""What `nvplug run` hands the daemon: the paths of this node, and the config it loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nvplug.config import Config, Overrides, overridden


@dataclass(frozen=True)
class Options:
    plugin_dir: Path
    sysfs_root: Path
    config: Config
    # Where SIGHUP re-reads the config from; None is the default path.
    config_path: Path | None = None
    proc_root: Path = Path("/proc")
    # --state-dir: where the health state file lives, unless systemd says ($STATE_DIRECTORY).
    state_dir: Path | None = None
    # --kernel-log: the kernel's record interface; tests point it at a FIFO of records in its format.
    kernel_log: Path = Path("/dev/kmsg")
    # The flags that stand in for config keys (--dev-root, --cdi-spec-dir, ...): no part reads them here,
    # each reads its key from the config, which `configured` writes them onto.
    overrides: Overrides = field(default_factory=Overrides)

    def roots(self, cfg: Config) -> dict[str, str]:
        """Where the daemon reads the node, by the names of their options: /status shows them, so that
        `nvplug doctor` reads the node where the daemon does unless told otherwise."""
        paths = {
            "device_plugin_dir": self.plugin_dir,
            "dev_root": Path(cfg.flags.nvidia_dev_root),
            "sysfs_root": self.sysfs_root,
            "proc_root": self.proc_root,
        }
        # Absolute: a doctor run from another directory must not read them elsewhere.
        return {name: str(path.absolute()) for name, path in paths.items()}

    def configured(self, cfg: Config) -> Config:
        """A loaded config with the command line's overrides of its keys, at the start and at each reload."""
        return overridden(cfg, self.overrides)
