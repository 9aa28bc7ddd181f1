"""Doctor step: every CDI name nvplug would hand out resolves in the runtimes' spec directories."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nvplug.cli.doctor.doctor_step import Check, DoctorContext, StepVerdict, loaded_config
from nvplug.config import Config

if TYPE_CHECKING:
    from nvplug.sinks.cdi.cdi_files import SpecFile


def runtime_specs(ctx: DoctorContext, cfg: Config) -> tuple[Path, list[SpecFile]]:
    """nvplug's spec directory, and every spec the runtimes read (theirs and it)."""
    from nvplug.sinks.cdi.cdi_files import read_specs

    spec_dir: Path = ctx.args.cdi_spec_dir or Path(cfg.cdi_spec_dir)
    return spec_dir, read_specs([*map(Path, cfg.cdi_runtime_dirs), spec_dir])


def resolvable(files: list[SpecFile]) -> set[str]:
    """The qualified names these spec files define (an unreadable one defines none)."""
    return {name for f in files if f.error is None for name in f.qualified()}


def check_cdi(ctx: DoctorContext) -> Check:
    """Every name nvplug would hand out resolves in the runtimes' spec directories, defined once."""
    from nvplug.cli.node_cdi_specs import node_specs
    from nvplug.sinks.cdi.cdi_files import conflicts

    cfg = loaded_config(ctx)
    if isinstance(cfg, Check):
        return cfg
    uses_cdi = [s for s in cfg.flags.plugin.device_list_strategy if s.startswith("cdi")]
    if cfg.cdi_spec_dir == "off" and ctx.args.cdi_spec_dir is None:
        return Check("PASS", "nvplug writes no CDI spec (nvplug.cdi.specDir: off) and hands out no CDI names")
    if not ctx.nvml_ok:
        return Check("WARN", "not checked: NVML does not work (step 3), so the node's devices are unknown")
    spec_dir, files = runtime_specs(ctx, cfg)
    found = node_specs(cfg, ctx.args.dev_root, ctx.args.sysfs_root, ctx.args.proc_root)
    wanted = found.specs
    defined = resolvable(files)
    names = [n for spec in wanted for n in spec.names() if not n.endswith("=all")]
    missing = [n for n in names if n not in defined]
    ours = [spec_dir / spec.file_name for spec in wanted]
    clashes = conflicts(files, ours, [spec.kind for spec in wanted])
    evidence = [
        f"{f.path}: {f.kind or '?'}, {len(f.names)} devices" + (f" (unreadable: {f.error})" if f.error else "")
        for f in files
        if f.kind in {s.kind for s in wanted} or f.error
    ]
    how = f"deviceListStrategy {uses_cdi} hands them out" if uses_cdi else "no cdi strategy hands them out yet"
    if missing or clashes:
        shown = [f"does not resolve: {n}" for n in missing[:5]] + (
            [f"and {len(missing) - 5} more"] if missing[5:] else []
        )
        fixes = []
        if missing:
            fixes.append(
                f"the daemon writes {ours[0]} at start and on every change: `journalctl -u nvplug | grep CDI` "
                f"says why it could not (a unit must allow the directory: ReadWritePaths=-{spec_dir})"
            )
        if clashes:
            fixes.append(
                "remove the other spec of that kind (or its generator's unit), so that one spec defines each name"
            )
        verdict: StepVerdict = "FAIL" if uses_cdi or clashes else "WARN"
        problems = shown + clashes + evidence + list(found.problems)
        return Check(verdict, f"CDI names do not resolve cleanly ({how})", problems, "; ".join(fixes))
    summary = f"all {len(names)} CDI names resolve, each defined once ({how})"
    if found.problems:
        return Check(
            "WARN",
            summary + ", but the spec lacks driver files",
            [*evidence, *found.problems],
            "set flags.nvidiaDriverRoot to where the driver is installed (its etc/ld.so.cache must list the "
            "driver's libraries: run `ldconfig` there); without them containers get no libcuda.so.1",
        )
    return Check("PASS", summary, evidence)
