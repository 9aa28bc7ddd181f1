"""Doctor step: the NFD feature file holds the labels true of this node now."""

from __future__ import annotations

from pathlib import Path

from nvplug.cli.doctor.doctor_step import Check, DoctorContext, loaded_config


def check_labels(ctx: DoctorContext) -> Check:
    """The NFD feature file is there and says what this node is now."""
    from nvplug.sinks.gfd_labels import UNHEALTHY_COUNT, node_labels
    from nvplug.sinks.nfd_feature_file import read_machine
    from nvplug.sources.nvml_snapshot import scan_snapshot

    cfg = loaded_config(ctx)
    if isinstance(cfg, Check):
        return cfg
    if cfg.feature_file == "off" and ctx.args.nfd_feature_file is None:
        return Check("PASS", "nvplug writes no node labels (nvplug.labels.featureFile: off)")
    path: Path = ctx.args.nfd_feature_file or Path(cfg.feature_file)
    if not path.parent.is_dir():
        return Check(
            "WARN",
            "Node Feature Discovery's features.d does not exist: no node labels",
            [f"{path.parent}: no such directory"],
            "install NFD (its master with extraLabelNs: [nvidia.com]), then `systemctl restart nvplug` (the unit "
            "may write the directory only if it existed when it started); or set nvplug.labels.featureFile: off",
        )
    if not ctx.nvml_ok:
        return Check("WARN", "not checked: NVML does not work (step 3), so the node's labels are unknown")
    snap = scan_snapshot(ctx.args.sysfs_root, ctx.args.proc_root)
    want = node_labels(snap, cfg, read_machine(ctx.args.sysfs_root, [g.bus_id for g in snap.gpus]))
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        return Check(
            "FAIL",
            "the node label file is missing or unreadable",
            [f"{path}: {err.strerror}"],
            "the daemon writes it at start and on every change: `journalctl -u nvplug | grep 'NFD feature'` says why "
            f"it could not (a unit must allow the directory: ReadWritePaths=-{path.parent})",
        )
    have = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    have.pop(UNHEALTHY_COUNT, None)  # the daemon's health, which one scan cannot know
    wrong = [
        f"{k}: the file says {have[k]!r}, the node {v!r}" for k, v in sorted(want.items()) if k in have and have[k] != v
    ]
    wrong += [f"{k}: missing from the file (the node: {v!r})" for k, v in sorted(want.items()) if k not in have]
    wrong += [f"{k}: in the file ({have[k]!r}), not true of the node" for k in sorted(set(have) - set(want))]
    evidence = [f"{path}: {len(have)} labels"]
    if wrong:
        return Check(
            "FAIL",
            "the node labels do not match this node",
            wrong[:8] + evidence,
            "the daemon rewrites the file on every change: is it running (step 7)? `nvplug devices --labels` prints "
            "what it would write",
        )
    gfd = path.parent / "gfd"
    if gfd.exists() and gfd != path:
        return Check(
            "WARN",
            f"the {len(want)} node labels match this node, but GPU Feature Discovery writes the same keys too",
            [*evidence, f"{gfd}: GFD's file"],
            "run one of them: remove GFD (its DaemonSet), or set nvplug.labels.featureFile: off",
        )
    return Check("PASS", f"the {len(want)} node labels match this node", evidence)
