"""`nvplug doctor --brief`: one line for Node Problem Detector.

NPD runs it every invoke_interval: it asks the daemon's status endpoint and nothing
else (no NVML, no kubelet probe), so it is cheap and cannot disturb the GPUs. The
exit status is NPD's custom-plugin protocol; the one line is the condition's message.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nvplug.status import status_client as statusclient

BRIEF_OK, BRIEF_PROBLEM, BRIEF_UNKNOWN = 0, 1, 2
BRIEF_MAX = 300  # characters; packaging/npd/nvplug-gpu-health.json's max_output_length
BRIEF_TIMEOUT = 4.0  # seconds per socket operation: well under the plugin's 10 s timeout
_ITEM_MAX = 200  # one GPU's entry, so that a second one usually still fits
_CUT_MIN = 60  # an item cut shorter than this no longer says which device and why


def _one_line(text: Any, limit: int) -> str:
    """`text` on one line (NPD keeps only the first), at most `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3].rstrip() + "..."


def _short_uuid(uuid: Any) -> str:
    """GPU-b52e1a2c... : enough to tell GPUs apart next to the index and the bus id."""
    text = str(uuid)
    kind, sep, rest = text.partition("-")
    return f"{kind}-{rest[:8]}..." if sep and len(rest) > 8 else text


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def brief_problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(code, text) for each problem in a /status document, the node-wide ones first.

    Raises ValueError for a document whose shape is not the daemon's (unreadable: unknown).
    """
    resources = doc.get("resources") or []
    gpus = doc.get("gpus") or []
    if not isinstance(resources, list) or not all(isinstance(r, dict) for r in resources):
        raise ValueError("/status has no readable resources list")
    if not isinstance(gpus, list) or not all(isinstance(g, dict) for g in gpus):
        raise ValueError("/status has no readable gpus list")
    problems: list[tuple[str, str]] = []
    if doc.get("nvml_error"):
        problems.append(("NVPLUG_NVML_ERROR", f"NVML: {doc['nvml_error']}"))
    if doc.get("plan_error"):
        problems.append(("NVPLUG_PLAN_ERROR", f"resource plan: {doc['plan_error']}"))
    if not resources:
        problems.append(("NVPLUG_NO_RESOURCE", "no resource is advertised"))
    for r in resources:
        if not r.get("registered"):
            problems.append(("NVPLUG_NOT_REGISTERED", f"{r.get('name')} is not registered with the kubelet"))
    if doc.get("health_watch_error"):
        # No health events: an XID would go unseen, so the Healthy GPUs cannot be trusted.
        problems.append(("NVPLUG_HEALTH_EVENTS_UNAVAILABLE", str(doc["health_watch_error"])))
    for g in gpus:
        if g.get("health") != "Healthy":
            text = f"gpu {g.get('index')} {_short_uuid(g.get('uuid'))} ({g.get('bus_id')}): {g.get('reason')}"
            waiting = g.get("waiting_for")  # newer daemons: what an Unhealthy GPU waits for
            if isinstance(waiting, str) and waiting:
                text += f"; waiting for {waiting}"
            problems.append(("NVPLUG_GPU_UNHEALTHY", text))
            continue  # its MIG devices are out with it
        for m in g.get("mig") or []:
            if isinstance(m, dict) and m.get("health") != "Healthy":
                where = f"MIG {m.get('profile')} {_short_uuid(m.get('uuid'))} on gpu {g.get('index')}"
                problems.append(("NVPLUG_MIG_UNHEALTHY", f"{where}: {m.get('reason')}"))
    return problems


def brief_ok(doc: dict[str, Any]) -> str:
    gpus = doc.get("gpus") or []
    migs = sum(len(g.get("mig") or []) for g in gpus)
    names = ", ".join(str(r.get("name")) for r in doc.get("resources") or [])
    what = _plural(len(gpus), "GPU") + (f" and {_plural(migs, 'MIG device')}" if migs else "")
    return _one_line(f"ok: {what} healthy, {names} registered", BRIEF_MAX)


def brief_line(problems: list[tuple[str, str]], limit: int = BRIEF_MAX) -> str:
    """`CODE: item | item | OTHER_CODE: item | +N more`, within `limit` characters.

    A code is written where it changes, so that each item reads as what it is. An
    item that does not fit whole is cut rather than dropped while enough of it fits
    to name the device: a node-wide problem first must not hide which GPU is bad.
    """
    parts: list[str] = []
    previous = None
    for code, text in problems:
        item = _one_line(text, _ITEM_MAX)
        parts.append(item if code == previous else f"{code}: {item}")
        previous = code
    line = ""
    for shown, part in enumerate(parts):
        rest = len(parts) - shown - 1
        more = f" | +{rest} more" if rest else ""
        sep = " | " if line else ""
        room = limit - len(line) - len(sep) - len(more)
        if len(part) <= room:
            line += sep + part
        elif room >= _CUT_MIN or not line:
            return line + sep + _one_line(part, room) + more
        else:
            # The previous step left room for exactly this count.
            return f"{line} | +{rest + 1} more"
    return line


def run_brief(args: argparse.Namespace, out: Any = None) -> int:
    """One line and NPD's exit status: 0 healthy, 1 a problem, 2 unknown."""
    stream = out or sys.stdout
    try:
        listen = statusclient.listen_address(args.status_listen, args.config)
        try:
            doc = statusclient.status(listen, timeout=BRIEF_TIMEOUT)
        except (statusclient.StatusUnavailable, ValueError) as err:
            code, line = BRIEF_UNKNOWN, f"NVPLUG_STATUS_UNKNOWN: the nvplug daemon does not answer: {err}"
        else:
            try:
                problems = brief_problems(doc)
            except ValueError as err:
                code, line = BRIEF_UNKNOWN, f"NVPLUG_STATUS_UNKNOWN: {listen}: {err}"
            else:
                code = BRIEF_PROBLEM if problems else BRIEF_OK
                line = brief_line(problems) if problems else brief_ok(doc)
    except Exception as err:  # Python's own exit status for a crash is 1, which NPD reads as a problem
        code, line = BRIEF_UNKNOWN, f"NVPLUG_STATUS_UNKNOWN: doctor --brief failed: {type(err).__name__}: {err}"
    print(_one_line(line, BRIEF_MAX), file=stream)
    stream.flush()
    return code
