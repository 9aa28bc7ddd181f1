"""What `nvplug run` hands the daemon: the paths of this node, and the config it loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nvplug.config import Config, with_paths


@dataclass(frozen=True)
class Options:
    plugin_dir: Path
    dev_root: Path
    sysfs_root: Path
    config: Config
    # Where SIGHUP re-reads the config from; None is the default path.
    config_path: Path | None = None
    proc_root: Path = Path("/proc")
    # Overrides the config's nvplug.status.listen.
    status_listen: str | None = None
    # --state-dir: where the health state file lives, unless systemd says ($STATE_DIRECTORY).
    state_dir: Path | None = None
    # --cdi-spec-dir: overrides the config's nvplug.cdi.specDir.
    cdi_spec_dir: Path | None = None
    # --nfd-feature-file: overrides the config's nvplug.labels.featureFile.
    feature_file: Path | None = None
    # --pod-resources-socket: overrides the config's nvplug.podResources.socket.
    pod_resources_socket: Path | None = None
    # --kernel-log: the kernel's record interface; tests point it at a FIFO of records in its format.
    kernel_log: Path = Path("/dev/kmsg")
    # --mps-root, --cdi-runtime-dirs, --nvidia-ctk-path: override the config's nvplug.mps.root,
    # nvplug.cdi.runtimeDirs and flags.plugin.nvidiaCTKPath (a simulated node keeps to its own root).
    mps_root: Path | None = None
    cdi_runtime_dirs: tuple[Path, ...] | None = None
    nvidia_ctk_path: Path | None = None

    def roots(self) -> dict[str, str]:
        """Where the daemon reads the node, by the names of their options: /status shows them, so that
        `nvplug doctor` reads the node where the daemon does unless told otherwise."""
        paths = {
            "device_plugin_dir": self.plugin_dir,
            "dev_root": self.dev_root,
            "sysfs_root": self.sysfs_root,
            "proc_root": self.proc_root,
        }
        # Absolute: a doctor run from another directory must not read them elsewhere.
        return {name: str(path.absolute()) for name, path in paths.items()}

    def configured(self, cfg: Config) -> Config:
        """A loaded config with the command line's overrides of its keys, at the start and at each reload."""
        return with_paths(
            cfg, mps_root=self.mps_root, cdi_runtime_dirs=self.cdi_runtime_dirs, nvidia_ctk_path=self.nvidia_ctk_path
        )
