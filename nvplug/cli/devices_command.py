"""`nvplug devices`: every GPU, its health and what it is advertised as.

From the running daemon's status endpoint when it answers, else from a direct
NVML read (labelled so), with the health of that read's probes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from nvplug import config
from nvplug.core.health import Health, HealthState
from nvplug.core.snapshot import Snapshot
from nvplug.pods.pod_holders import Holder
from nvplug.shaping.resource_plan import plan
from nvplug.sinks.gfd_labels import node_labels
from nvplug.sinks.gfd_labels import render as render_labels
from nvplug.sinks.nfd_feature_file import read_machine
from nvplug.sources.nvml_snapshot import scan_snapshot
from nvplug.status import status_client as statusclient

DIRECT_LABEL = "(direct NVML read; the daemon is not running)"


def run(args: argparse.Namespace) -> int:
    listen = statusclient.listen_address(args.status_listen, args.config)
    try:
        doc = statusclient.status(listen)
    except (statusclient.StatusUnavailable, ValueError) as err:
        daemon_error = str(err)
    else:
        if args.labels:
            return _print_labels((doc.get("labels") or {}).get("labels") or {}, "daemon", args.json)
        return _print(doc.get("gpus") or [], "daemon", args.json, header=_daemon_header(doc))
    if args.labels:
        try:
            labels = direct_labels(_config_or_default(args.config), args.sysfs_root, args.proc_root)
        except Exception as err:  # as below: NVML cannot be read at all
            print(f"the daemon does not answer: {daemon_error}", file=sys.stderr)
            print(f"and NVML cannot be read directly: {err}", file=sys.stderr)
            return 1
        print(DIRECT_LABEL, file=sys.stderr)
        return _print_labels(labels, "nvml", args.json)
    try:
        gpus = direct_read(_config_or_default(args.config), args.sysfs_root, args.proc_root)
    except Exception as err:  # NvmlUnavailable, or pynvml failing to load the library at all
        if args.json:
            print(json.dumps({"source": None, "gpus": [], "daemon_error": daemon_error, "nvml_error": str(err)}))
        else:
            print(f"the daemon does not answer: {daemon_error}", file=sys.stderr)
            print(f"and NVML cannot be read directly: {err}", file=sys.stderr)
        return 1
    return _print(gpus, "nvml", args.json, header=[DIRECT_LABEL, f"  daemon: {daemon_error}"], extra=daemon_error)


def _config_or_default(path: Path | None) -> config.Config:
    try:
        return config.load(path)
    except (config.ConfigError, OSError):
        return config.Config()


def _daemon_header(doc: Mapping[str, Any]) -> list[str]:
    lines = [f"nvplug {doc.get('version', '?')}, state revision {doc.get('revision', '?')} (from the daemon)"]
    for r in doc.get("resources") or []:
        state = "registered" if r.get("registered") else "NOT registered"
        lines.append(f"  {r.get('name')}: {state}, {r.get('devices', 0)} devices, {r.get('healthy', 0)} healthy")
    dra = doc.get("dra")
    if dra:
        state = "registered" if dra.get("registered") else "NOT registered"
        slices = ", ".join(dra.get("slices") or []) or "none"
        lines.append(
            f"  DRA {dra.get('driver')}: {state}, {dra.get('pool_devices', 0)} devices in the pool "
            f"(ResourceSlices: {slices}), {len(dra.get('claims') or [])} claims prepared"
        )
        if dra.get("error"):
            lines.append(f"  DRA error: {dra['error']}")
    lines += mps_lines(doc.get("mps") or {}, time.time())
    for key in ("nvml_error", "health_watch_error", "plan_error"):
        if doc.get(key):
            lines.append(f"  {key.replace('_', ' ')}: {doc[key]}")
    kernel_log = doc.get("kernel_log") or {}
    if kernel_log.get("error"):
        lines.append(f"  kernel log unread: {kernel_log['error']}")
    if kernel_log.get("lost"):
        lines.append(f"  kernel log records lost: {kernel_log['lost']}")
    for switch in doc.get("nvswitches") or []:
        lines.append(
            f"  NVSwitch {switch.get('switch')} ({switch.get('bus_id')}): {switch.get('sxids')} SXids, "
            f"last {switch.get('last_code')} (no GPU is Unhealthy for these)"
        )
    return lines


def mps_lines(mps: Mapping[str, Any], now: float) -> list[str]:
    """Each MPS group: its daemon, limits and clients as it last answered, or why it is down."""
    lines = [f"  MPS: {note}" for note in mps.get("notes") or []]
    for g in mps.get("groups") or []:
        count = len(g.get("devices") or [])
        head = f"  MPS group {g.get('name')} ({g.get('resource')}, {count} device{'' if count == 1 else 's'})"
        if not g.get("up"):
            lines.append(f"{head}: DOWN, {g.get('restarts', 0)} restarts: {g.get('last_error') or 'starting'}")
            continue
        pinned = sorted({m for m in g.get("pinned_memory_mib") or [] if m is not None})
        memory = f", pinned memory {'/'.join(f'{m}M' for m in pinned)} per device" if pinned else ""
        servers = g.get("servers") or []
        # Started by an earlier nvplug and adopted by this one: since when this one supervises it.
        adopted = g.get("adopted_at")
        adopted_text = f" (adopted {since_text(adopted, now)})" if adopted else ""
        kept = g.get("kept_settings")
        kept_text = (
            f"; runs with an earlier config's {kept.get('thread_percentage')}% until its clients leave" if kept else ""
        )
        lines.append(
            f"{head}: daemon pid {g.get('pid')}{adopted_text}, up {duration(g.get('uptime_seconds') or 0)}, "
            f"{g.get('active_thread_percentage')}% of the SMs per client{memory}; {len(servers)} servers, "
            f"{g.get('clients', 0)} clients (at {since_text(g.get('probed_at'), now).split(' ')[0]}), "
            f"{g.get('restarts', 0)} restarts{kept_text}"
        )
    for o in mps.get("leftovers") or []:
        clients = ", ".join(str(c) for c in o.get("clients") or [])
        lines.append(
            f"  MPS group {o.get('name')}: daemon pid {o.get('pid')} left by an earlier nvplug, asked for by no "
            f"config or claim; runs on while its clients ({clients or 'none seen yet'}) are connected"
        )
    return lines


def direct_labels(cfg: config.Config, sysfs_root: Path, proc_root: Path) -> dict[str, str]:
    """The labels for this node from one NVML scan, as the daemon would write them (health: the scan's)."""
    snap = scan_snapshot(sysfs_root, proc_root)
    return node_labels(snap, cfg, read_machine(sysfs_root, [g.bus_id for g in snap.gpus]), cfg.unhealthy_count_label)


def _print_labels(labels: Mapping[str, str], source: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"source": source, "labels": dict(sorted(labels.items()))}, indent=2))
    else:
        sys.stdout.buffer.write(render_labels(labels))
    return 0


def direct_read(cfg: config.Config, sysfs_root: Path, proc_root: Path) -> list[dict[str, Any]]:
    """One NVML scan, shaped like /status's `gpus`; what the config would advertise, by the same plan."""
    from nvplug.sources.nvml_discovery import Nvml

    now = time.time()
    scan = Nvml(sysfs_root, proc_root).scan()
    found = scan.discovery
    failures = {p.uuid: p.failure for p in scan.probes}
    health: dict[str, HealthState] = {}
    for g in found.gpus:
        failure = failures.get(g.uuid)
        state = (
            HealthState(Health.HEALTHY, "discovered", now)
            if failure is None
            else HealthState(Health.UNHEALTHY, f"probe failed: {failure}", now)
        )
        health[g.uuid] = state
        for m in g.mig:
            health[m.uuid] = state
    snapshot = Snapshot(
        revision=0,
        gpus=found.gpus,
        health=MappingProxyType(health),
        topology=found.topology,
        cap_minors=found.cap_minors,
    )
    advertised: dict[str, dict[str, list[str]]] = {}
    try:
        planned = plan(cfg, snapshot)
    except config.ConfigError:
        planned = None
    for spec in planned.served if planned is not None else []:
        for device in spec.project(snapshot).devices:
            advertised.setdefault(device.gpu.uuid, {}).setdefault(spec.name, []).append(device.id)
    out = []
    for g in found.gpus:
        peers = {}
        for other in found.gpus:
            if other.uuid != g.uuid:
                links = found.topology.link(g.uuid, other.uuid).nvlinks
                if links:
                    peers[other.uuid] = links
        state = health[g.uuid]
        out.append(
            {
                "index": g.index,
                "uuid": g.uuid,
                "bus_id": g.bus_id,
                "name": g.name,
                "memory_mib": g.memory_mib,
                "numa_node": g.numa_node,
                "minor": g.minor,
                "health": state.health.value,
                "reason": state.reason,
                "since": state.since,
                "advertised": advertised.get(g.uuid, {}),
                "excluded": planned.excluded.get(g.uuid) if planned is not None else None,
                "nvlink_peers": peers,
                "mig": [
                    {
                        "uuid": m.uuid,
                        "profile": m.profile,
                        "gpu_instance": m.gpu_instance,
                        "compute_instance": m.compute_instance,
                        "health": state.health.value,
                        "reason": state.reason,
                    }
                    for m in g.mig
                ],
            }
        )
    return out


def _print(
    gpus: Sequence[Mapping[str, Any]],
    source: str,
    as_json: bool,
    header: Sequence[str] = (),
    extra: str | None = None,
) -> int:
    if as_json:
        doc: dict[str, Any] = {"source": source, "gpus": list(gpus)}
        if extra is not None:
            doc["daemon_error"] = extra
        print(json.dumps(doc, indent=2))
    else:
        for line in header:
            print(line)
        print(render(gpus, time.time()))
    return 0


def since_text(since: Any, now: float) -> str:
    """`14:03:11 (for 3m12s)`; a date too once it is not today."""
    if not isinstance(since, (int, float)):
        return "-"
    then = time.localtime(since)
    same_day = time.localtime(now)[:3] == then[:3]
    when = time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M", then)
    return f"{when} (for {duration(now - since)})"


def duration(seconds: float) -> str:
    s = max(int(seconds), 0)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes}m"
    if minutes:
        return f"{minutes}m{s}s"
    return f"{s}s"


def _pods_cell(pods: Any) -> str:
    """How many pods hold the GPU, `-` for none, `unknown` when PodResources could not say."""
    if pods is None:
        return "unknown"
    names = list(dict.fromkeys(f"{p.get('namespace')}/{p.get('pod')}" for p in pods))
    if not names:
        return "-"
    return names[0] if len(names) == 1 else f"{len(names)} pods"


def _holder_text(holder: Mapping[str, Any]) -> str:
    return Holder.from_dict(holder).text


def _advertised_text(
    advertised: Mapping[str, Sequence[str]], excluded: str | None, dra: Sequence[Mapping[str, Any]] | None
) -> str:
    """Each resource's IDs of the GPU; a device's replicas folded into `x4 (<uuid>::0..::3)`; or its DRA devices."""
    if excluded:
        return f"excluded ({excluded}); health still watched"
    if dra:
        return "through DRA: " + "; ".join(_dra_text(d) for d in dra)
    parts = []
    for resource, ids in advertised.items():
        runs: dict[str, list[str]] = {}
        for device_id in ids:
            unit, sep, replica = device_id.partition("::")
            runs.setdefault(unit if sep else device_id, []).append(replica if sep else "")
        texts = []
        for unit, replicas in runs.items():
            if replicas[0]:
                texts.append(f"x{len(replicas)} ({unit}::{replicas[0]}..::{replicas[-1]})")
            else:
                texts.append(unit)
        parts.append(f"{resource} {', '.join(texts)}")
    return "; ".join(parts) if parts else "not advertised"


def _dra_text(device: Mapping[str, Any]) -> str:
    """`gpu.nvidia.com gpu-5, claimed by ml/train` (or `in the pool`, `left out of the pool (Unhealthy)`,
    `in the pool, tainted gpu.nvidia.com/xid=79:NoSchedule`)."""
    claims = device.get("claims") or []
    taints = device.get("taints") or []
    where = f"claimed by {', '.join(claims)}" if claims else "in the pool"
    if taints:
        where += f", tainted {', '.join(taints)}"
    elif not device.get("healthy"):
        where = "left out of the pool (Unhealthy)" + (f", prepared for {', '.join(claims)}" if claims else "")
    return f"{device.get('driver')} {device.get('device')}, {where}"


def _nvlink_text(peers: Mapping[str, int], index_of: Mapping[str, Any]) -> str:
    if not peers:
        return "none"
    named = sorted(((index_of.get(u, u), n) for u, n in peers.items()), key=lambda p: str(p[0]).zfill(8))
    counts = {n for _, n in named}
    if len(counts) == 1:
        return f"{', '.join(str(i) for i, _ in named)} ({counts.pop()} links each)"
    return ", ".join(f"{i} ({n} links)" for i, n in named)


def render(gpus: Sequence[Mapping[str, Any]], now: float) -> str:
    """A row per GPU, then its advertisement, NVLink peers and MIG devices on indented lines."""
    if not gpus:
        return "no GPUs"
    headers = ("IDX", "UUID", "BUS ID", "NAME", "MEMORY", "NUMA", "HEALTH", "PODS", "SINCE", "REASON")
    rows = []
    for g in gpus:
        numa = g.get("numa_node")
        memory = g.get("memory_mib")
        rows.append(
            (
                str(g.get("index", "?")),
                str(g.get("uuid", "?")),
                str(g.get("bus_id", "?")),
                str(g.get("name") or "?"),
                f"{memory} MiB" if memory is not None else "?",
                str(numa) if isinstance(numa, int) and numa >= 0 else "-",
                str(g.get("health", "?")) + (", excluded" if g.get("excluded") else ""),
                _pods_cell(g.get("pods")),
                since_text(g.get("since"), now),
                str(g.get("reason") or ""),
            )
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()

    index_of = {str(g.get("uuid")): g.get("index") for g in gpus}
    out = [line(headers)]
    for g, row in zip(gpus, rows, strict=True):
        out.append(line(row))
        if g.get("waiting_for"):
            out.append(f"     waiting for {g['waiting_for']}")
        if g.get("pods"):
            out.append(f"     pods: {', '.join(_holder_text(h) for h in g['pods'])}")
        out.append(f"     advertised: {_advertised_text(g.get('advertised') or {}, g.get('excluded'), g.get('dra'))}")
        out.append(f"     nvlink peers: {_nvlink_text(g.get('nvlink_peers') or {}, index_of)}")
        for m in g.get("mig") or []:
            out.append(
                f"     mig {m.get('profile')} gi {m.get('gpu_instance')} ci {m.get('compute_instance')} "
                f"{m.get('uuid')}: {m.get('health')} ({m.get('reason')})"
                + (f"; waiting for {m['waiting_for']}" if m.get("waiting_for") else "")
            )
    return "\n".join(out)
