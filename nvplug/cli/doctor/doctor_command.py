"""`nvplug doctor`: walk the failure chain from the kernel driver to the kubelet, in order.

Each step (doctor_steps.STEPS, a module each) prints PASS, WARN or FAIL, the evidence, and the fix. The exit status is
1 when any step fails. Doctor loads NVML itself, in its own process, with the
operator's environment (so the library it finds is the one `nvplug run` would find
under the same environment).

`nvplug doctor --brief` is the exception: one line from the daemon's status endpoint
alone, with Node Problem Detector's exit statuses (see npd_brief).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from nvplug.cli.doctor.daemon_roots import resolve_roots
from nvplug.cli.doctor.doctor_step import Check, DoctorContext
from nvplug.cli.doctor.doctor_steps import STEPS
from nvplug.cli.doctor.npd_brief import run_brief


def _guarded(step: Callable[[DoctorContext], Check], ctx: DoctorContext) -> Check:
    try:
        return step(ctx)
    except Exception as err:  # a doctor that crashes halfway helps nobody
        return Check("FAIL", "the check itself failed", [f"{type(err).__name__}: {err}"], "report this as a bug")


def run(args: argparse.Namespace, out: Any = None) -> int:
    if getattr(args, "brief", False):
        return run_brief(args, out)
    stream = out or sys.stdout
    args, taken = resolve_roots(args)
    if taken:
        print(f"reading the node where the running daemon does: {', '.join(taken)}\n", file=stream)
    ctx = DoctorContext(args)
    counts = {"PASS": 0, "WARN": 0, "FAIL": 0}
    for number, step in enumerate(STEPS, 1):
        check = _guarded(step.check, ctx)
        counts[check.verdict] += 1
        print(f"{check.verdict}  {number}. {step.title}: {check.summary}", file=stream)
        for line in check.evidence:
            print(f"        {line}", file=stream)
        if check.fix and check.verdict != "PASS":
            print(f"      fix: {check.fix}", file=stream)
        stream.flush()
    print(f"\n{counts['FAIL']} failed, {counts['WARN']} warnings, {counts['PASS']} passed", file=stream)
    return 1 if counts["FAIL"] else 0
