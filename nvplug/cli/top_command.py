"""`nvplug top`: the GPUs, what they are doing, and the pods and processes using them, once a second.

It reads the running daemon's /telemetry, so it shows what the daemon serves and nothing else. On a
terminal it redraws in place until interrupted; otherwise it prints plain text, once (or `--count` times).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from nvplug.status import status_client as statusclient

CLEAR = "\x1b[H\x1b[2J"
GIB = 1024.0


def run(args: argparse.Namespace) -> int:
    listen = statusclient.listen_address(args.status_listen, args.config)
    out: TextIO = sys.stdout
    live = out.isatty()
    count = args.count if args.count is not None else (0 if live else 1)
    shown = 0
    try:
        while True:
            try:
                doc = statusclient.status(listen, timeout=3.0, path="/telemetry")
            except (statusclient.StatusUnavailable, ValueError) as err:
                print(f"the daemon does not answer: {err}", file=sys.stderr)
                return 1
            text = "\n".join(frame(doc.get("gpus") or [], time.time())) + "\n"
            out.write(CLEAR + text if live else text)
            out.flush()
            shown += 1
            if count and shown >= count:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def frame(gpus: Sequence[Mapping[str, Any]], now: float) -> list[str]:
    """One screen: a line per GPU, and under it a line per process, its pod's first."""
    lines = [
        f"nvplug top  {time.strftime('%H:%M:%S', time.localtime(now))}  {len(gpus)} GPUs",
        f"{'GPU':>3}  {'UTIL':>4}  {'TENSOR':>6}  {'MEMORY':>15}  {'TEMP':>4}  {'POWER':>6}  {'HELD BY':<10}  HEALTH",
    ]
    for gpu in gpus:
        f = gpu.get("figures") or {}
        total = f.get("fb_total_mib")
        health = "Healthy" if gpu.get("healthy") else f"Unhealthy: {gpu.get('reason') or '?'}"
        stale = f"  (stale: {gpu['stale']})" if gpu.get("stale") else ""
        lines.append(
            f"{gpu.get('index', '?'):>3}  {_value(f.get('util_gpu'), '%'):>4}  {_percent(f.get('tensor_active')):>6}  "
            f"{_memory(f.get('fb_used_mib'), total):>15}  {_value(f.get('temperature_c'), 'C'):>4}  "
            f"{_value(f.get('power_w'), 'W'):>6}  {_held(f.get('clock_event_reasons')):<10}  {health}{stale}"
        )
        processes = sorted(gpu.get("processes") or [], key=lambda p: (p.get("pod") == "", p.get("pod"), p["pid"]))
        for p in processes:
            where = f"{p['namespace']}/{p['pod']} ({p['container'] or '?'})" if p.get("pod") else "(no pod)"
            used = p.get("used_mib")
            share = f"{used / total * 100:.0f}% of memory" if used is not None and total else "memory unknown"
            sm = p.get("sm_util")
            busy = f"{sm:.0f}% SM" if sm is not None else "SM n/a"
            device = "" if p.get("device") == gpu.get("uuid") else f"  on {p.get('device')}"
            lines.append(
                f"       {where:<40} pid {p['pid']:<8} {p.get('kind', ''):<8} "
                f"{_memory(used, None):>9}  {share:<16} {busy}{device}"
            )
    return lines


# What holds the clocks down now, from nvmlClocksEventReasons: the power cap or brake, the heat (software or
# hardware slowdown), another hardware slowdown, sync boost. Idle and the applications clocks are the GPU's
# own choice, not held.
HELD_BY = ((0x4 | 0x80, "power"), (0x20 | 0x40, "heat"), (0x8, "hardware"), (0x10, "sync"))


def _held(reasons: int | None) -> str:
    if reasons is None:
        return "-"
    return ",".join(name for bits, name in HELD_BY if reasons & bits) or "none"


def _percent(ratio: float | None) -> str:
    """GPM's ratios (Hopper and later; none before a second read)."""
    return _value(None if ratio is None else ratio * 100, "%")


def _value(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:.0f}{unit}"


def _memory(used: float | None, total: float | None) -> str:
    if used is None:
        return "-"
    if total is None:
        return f"{used / GIB:.1f} GiB"
    return f"{used / GIB:.1f}/{total / GIB:.1f} GiB"
