"""Doctor step: the nvplug daemon answers on its status endpoint and serves every resource."""

from __future__ import annotations

from nvplug.cli.doctor.doctor_step import Check, DoctorContext
from nvplug.status import status_client as statusclient


def check_daemon(ctx: DoctorContext) -> Check:
    listen = statusclient.listen_address(ctx.args.status_listen, ctx.args.config)
    try:
        doc = statusclient.status(listen)
    except (statusclient.StatusUnavailable, ValueError) as err:
        return Check(
            "FAIL",
            "the nvplug daemon does not answer",
            [str(err)],
            "`systemctl status nvplug` and `journalctl -u nvplug -p err`; start it with `systemctl start nvplug` "
            "(or pass --status-listen where it listens)",
        )
    evidence = [f"{listen}: nvplug {doc.get('version', '?')}, state revision {doc.get('revision', '?')}"]
    failures = []
    for key in ("nvml_error", "plan_error"):
        if doc.get(key):
            failures.append(f"{key.replace('_', ' ')}: {doc[key]}")
    # Why the daemon cannot serve now (a directory the kubelet's wipe took, a bind failing), naming it.
    not_served = [f"{name} is not served: {why}" for name, why in _fleet_part(doc).items()]
    dra = doc.get("dra") or {}
    if dra.get("not_served"):
        not_served.append(f"DRA {dra.get('driver')} is not served: {dra['not_served']}")
    failures += not_served
    resources = doc.get("resources") or []
    if not resources:
        failures.append("no resource is advertised")
    for r in resources:
        registered = bool(r.get("registered"))
        line = f"{r.get('name')}: {'registered' if registered else 'NOT registered'}"
        line += f", {r.get('devices', 0)} devices, {r.get('healthy', 0)} healthy"
        evidence.append(line)
        if not registered:
            failures.append(f"{r.get('name')} is not registered with the kubelet")
    unhealthy = []
    for g in doc.get("gpus") or []:
        if g.get("health") != "Healthy":
            unhealthy.append(f"unhealthy: gpu {g.get('index')} {g.get('uuid')} ({g.get('bus_id')}): {g.get('reason')}")
        for m in g.get("mig") or []:
            if m.get("health") != "Healthy" and g.get("health") == "Healthy":
                where = f"MIG {m.get('profile')} {m.get('uuid')} on gpu {g.get('index')}"
                unhealthy.append(f"unhealthy: {where}: {m.get('reason')}")
    warnings = []
    if doc.get("health_watch_error"):
        warnings.append(f"health watch error: {doc['health_watch_error']}")
    # The GPUs are served without it; Prometheus is not.
    metrics = doc.get("metrics endpoint") or {}
    unscraped = (
        [f"metrics endpoint {metrics.get('listen')} is not served: {metrics['error']}"] if metrics.get("error") else []
    )
    if failures:
        fix = (
            "`journalctl -u nvplug -p warning` says why; registration waits for kubelet.sock (step 6) and NVML (step 3)"
        )
        if not_served:
            fix = (
                "a directory nvplug serves its sockets in is gone (a node re-join or a kubelet reinstall wipes "
                "/var/lib/kubelet): the kubelet makes it again when it starts, and nvplug serves and registers "
                "again at once, without a restart; `journalctl -u nvplug -p warning` says what it waits for"
            )
        return Check(
            "FAIL", "the daemon runs but does not serve every resource", failures + evidence + unhealthy + warnings, fix
        )
    total = sum(int(r.get("devices", 0)) for r in resources)
    healthy = sum(int(r.get("healthy", 0)) for r in resources)
    if unhealthy or warnings or unscraped:
        fixes = []
        if unhealthy or warnings:
            fixes.append(
                "`nvplug devices` says what each Unhealthy GPU waits for (`journalctl -u nvplug` has the evidence); "
                "a GPU whose fault needs a reset stays Unhealthy until it is reset: `nvidia-smi -r -i <bus id>` "
                "(no process on it) or a reboot, or `nvplug heal GPU --reset` (checks that no process uses it, "
                "then resets it); after a repair nvplug cannot see, `nvplug heal GPU` records that the GPU "
                "was fixed and probes it"
            )
        if unscraped:
            fixes.append(
                "Prometheus cannot scrape the metrics port: `ss -ltnp` names what holds it (a dcgm-exporter still "
                "running?), and nvplug takes it as soon as it is free; or set nvplug.status.metricsListen to "
                "another port and `systemctl reload nvplug`. A family the unit refuses needs its drop-in for TCP "
                "and a restart (docs/telemetry.md)"
            )
        return Check(
            "WARN",
            f"the daemon is registered: {total} devices advertised, {healthy} healthy",
            evidence + unhealthy + warnings + unscraped,
            "; ".join(fixes),
        )
    return Check("PASS", f"the daemon is registered: {total} devices advertised, all healthy", evidence)


def _fleet_part(doc: dict[str, object]) -> dict[str, str]:
    """The device plugins' part of /status: each resource not served now, and why (a daemon before it: none)."""
    part = doc.get("device plugins")
    found = part.get("not_served") if isinstance(part, dict) else None
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
