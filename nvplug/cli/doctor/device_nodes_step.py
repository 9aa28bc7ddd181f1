"""Doctor step: /dev/nvidiactl and a /dev/nvidia<minor> per GPU exist and are rw."""

from __future__ import annotations

import os
import stat

from nvplug.cli.doctor.doctor_step import Check, DoctorContext, StepVerdict


def check_device_nodes(ctx: DoctorContext) -> Check:
    dev = ctx.dev_root() / "dev"
    found = sorted(dev.glob("nvidia*"))
    names = [p.name for p in found]
    wanted = ["nvidiactl", *(f"nvidia{m}" for m in ctx.minors)]
    missing = [n for n in wanted if n not in names]
    if not ctx.minors and not any(n[len("nvidia") :].isdigit() for n in names):
        missing.append("nvidia<N> (no GPU node at all)")
    denied = []
    not_char = []
    for p in found:
        if p.is_dir():
            continue
        try:
            mode = p.stat().st_mode
        except OSError as err:
            denied.append(f"{p}: {err}")
            continue
        if not stat.S_ISCHR(mode):
            not_char.append(p.name)
        if not os.access(p, os.R_OK | os.W_OK):
            denied.append(f"{p}: not readable and writable by uid {os.geteuid()}")
    evidence = [f"{dev}: {' '.join(names) or 'no nvidia* node'}"]
    if not_char:
        evidence.append(f"not character devices (a test tree?): {' '.join(not_char)}")
    problems = [f"missing: {dev / n}" for n in missing] + denied
    if problems:
        return Check(
            "FAIL",
            "the NVIDIA device nodes are missing or not accessible",
            problems + evidence,
            "the nodes appear when the driver is used as root: run `nvidia-smi` once, or `nvidia-modprobe -c <minor>` "
            "per GPU, or enable nvidia-persistenced; they must be rw for root (crw-rw-rw- is the default)",
        )
    verdict: StepVerdict = "PASS"
    fix = None
    if os.geteuid() != 0:
        verdict = "WARN"
        fix = "run `nvplug doctor` as root to check the nodes as the service (root) sees them"
    return Check(verdict, f"{len(names)} device nodes present and rw", evidence, fix)
