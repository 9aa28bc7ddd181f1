"""The command line's overrides of config keys: one rule for all of them.

A flag of `nvplug run` that stands in for a key is written onto the config as that key, at the start
and at every reload (a reload reads the file again, and the flag still wins). Every part then reads the
key from the config it is handed, so a reload that changes a key no flag overrides reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from nvplug.config.model import Config


@dataclass(frozen=True)
class Overrides:
    """Each field is a flag, named after the key it overrides; None: not given, the config's key holds."""

    # --dev-root: flags.nvidiaDevRoot
    nvidia_dev_root: Path | None = None
    # --nvidia-ctk-path: flags.plugin.nvidiaCTKPath
    nvidia_ctk_path: Path | None = None
    # --status-listen: nvplug.status.listen
    status_listen: str | None = None
    # --cdi-spec-dir: nvplug.cdi.specDir
    cdi_spec_dir: Path | None = None
    # --cdi-runtime-dirs: nvplug.cdi.runtimeDirs
    cdi_runtime_dirs: tuple[Path, ...] | None = None
    # --nfd-feature-file: nvplug.labels.featureFile
    feature_file: Path | None = None
    # --pod-resources-socket: nvplug.podResources.socket
    pod_resources_socket: Path | None = None
    # --mps-root: nvplug.mps.root
    mps_root: Path | None = None
    # --pod-log-root: nvplug.telemetry.podLogRoot
    pod_log_root: Path | None = None


def overridden(cfg: Config, given: Overrides) -> Config:
    """The config with each given flag in place of its key."""
    flags = cfg.flags
    if given.nvidia_dev_root is not None:
        flags = replace(flags, nvidia_dev_root=str(given.nvidia_dev_root))
    if given.nvidia_ctk_path is not None:
        flags = replace(flags, plugin=replace(flags.plugin, nvidia_ctk_path=str(given.nvidia_ctk_path)))
    cfg = replace(cfg, flags=flags)
    if given.status_listen:  # an empty one was never taken
        cfg = replace(cfg, status_listen=given.status_listen)
    if given.cdi_spec_dir is not None:
        cfg = replace(cfg, cdi_spec_dir=_path_key(given.cdi_spec_dir))
    if given.cdi_runtime_dirs is not None:
        cfg = replace(cfg, cdi_runtime_dirs=tuple(str(d) for d in given.cdi_runtime_dirs))
    if given.feature_file is not None:
        cfg = replace(cfg, feature_file=_path_key(given.feature_file))
    if given.pod_resources_socket is not None:
        cfg = replace(cfg, pod_resources_socket=_path_key(given.pod_resources_socket))
    if given.mps_root is not None:
        cfg = replace(cfg, mps=replace(cfg.mps, root=str(given.mps_root)))
    if given.pod_log_root is not None:
        cfg = replace(cfg, telemetry=replace(cfg.telemetry, log_root=str(given.pod_log_root)))
    return cfg


def _path_key(path: Path) -> str:
    """A path flag as a key that may be `off`: a flag always names a path, even one called `off`."""
    return str(path.absolute()) if str(path) == "off" else str(path)
