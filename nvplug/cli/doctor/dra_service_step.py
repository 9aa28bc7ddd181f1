"""Doctor step: the DRA plugin is registered, its kubeconfig works, its ResourceSlices are the pool."""

from __future__ import annotations

import time
from typing import Any

from nvplug.cli.doctor.cdi_names_step import resolvable, runtime_specs
from nvplug.cli.doctor.doctor_step import Check, DoctorContext, loaded_config
from nvplug.config import Config
from nvplug.status import status_client as statusclient


def check_dra(ctx: DoctorContext) -> Check:
    """The DRA plugin: registered with the kubelet, its kubeconfig accepted, its slices what the pool is."""
    import asyncio

    from nvplug.dra.api_client import ApiClient, KubeConfigError
    from nvplug.dra.dra_credentials import load_kubeconfig
    from nvplug.dra.dra_driver import node_name
    from nvplug.dra.resource_slices import GROUP
    from nvplug.dra.slice_publisher import FAILURES
    from nvplug.dra.slice_requests import discover, list_slices, writes_other_nodes

    cfg = loaded_config(ctx)
    if isinstance(cfg, Check):
        return cfg
    if not cfg.dra.enabled:
        return Check("PASS", "DRA is off (nvplug.dra.enabled: false)")
    driver, node = cfg.dra.driver_name, node_name(cfg)
    fix = "check the kubeconfig's server and credentials, and the RBAC that docs/dra.md lists"
    try:
        kubeconfig = load_kubeconfig(cfg.dra)
    except KubeConfigError as err:
        return Check("FAIL", "the DRA plugin's kubeconfig cannot be used", [str(err)], fix)

    async def ask() -> tuple[str, list[dict[str, Any]], tuple[bool | None, str]]:
        client = ApiClient(kubeconfig, timeout=5.0)
        try:
            version = await discover(client)
            slices = await list_slices(client, version, node, driver)
            return version, slices, await writes_other_nodes(client, version, driver)
        finally:
            await client.close()

    try:
        version, slices, (others, refusal) = asyncio.run(ask())
    except FAILURES as err:
        return Check("FAIL", f"the API server cannot be asked with {kubeconfig.source}", [str(err)], fix)
    published = sum(len(s.get("spec", {}).get("devices") or []) for s in slices)
    evidence = [
        f"{kubeconfig.server}: {GROUP}/{version}, {len(slices)} ResourceSlices of {node} for {driver} "
        f"with {published} devices, as {kubeconfig.source}"
    ]
    # Credentials that may write another node's slices let one node delete every node's GPUs from the scheduler.
    if others:
        reach = (
            f"these credentials may write other nodes' ResourceSlices: a dry run (which stores nothing) of one "
            f"for node {refusal} was accepted"
        )
    elif others is None:
        evidence.append(f"whether these credentials may write other nodes' ResourceSlices is not known: {refusal}")
    else:
        evidence.append(f"another node's ResourceSlice is refused to these credentials ({refusal})")
    try:
        doc = statusclient.status(statusclient.listen_address(ctx.args.status_listen, ctx.args.config))
    except (statusclient.StatusUnavailable, ValueError) as err:
        return Check("WARN", "the API server answers; the daemon does not (step 7)", [*evidence, str(err)])
    dra = doc.get("dra") or {}
    problems = []
    if not dra.get("registered"):
        why = dra.get("registration_error") or "the kubelet has not asked GetInfo"
        where = dra.get("registry_socket")
        problems.append(
            f"the kubelet has not registered the DRA plugin ({why}); {where} must be in the directory "
            "the kubelet watches (a kubelet with DRA: Kubernetes 1.32 and later)"
        )
    if dra.get("error"):
        problems.append(f"the daemon cannot publish: {dra['error']}")
    if published != dra.get("pool_devices"):
        problems.append(f"the API server has {published} devices in the slices, the pool {dra.get('pool_devices')}")
        change = dra.get("foreign_change") or {}
        if change.get("what"):
            # Not credentials: someone deleted or changed them, most often the kubelet's wipe at its start.
            when = time.strftime("%H:%M:%S", time.localtime(float(change.get("at") or 0)))
            fix = (
                f"the slices were {change['what']} by someone else at {when}: the kubelet deletes its node's "
                "slices when it starts and when a driver deregisters. nvplug's watch writes them again at "
                "once; run doctor again, and if the count stays wrong see `journalctl -u nvplug`"
            )
        elif not dra.get("watching"):
            why = dra.get("watch_error") or "see `journalctl -u nvplug`"
            fix = f"nvplug is not watching the slices ({why}; its ClusterRole needs `watch`); " + fix
    unresolved = _unresolved_claims(ctx, cfg, dra.get("claims") or [])
    if unresolved and not problems:
        fix = (
            "the daemon writes each claim's spec before prepare answers: `journalctl -u nvplug | grep CDI` says "
            "why one is missing; a unit must allow the spec directory"
        )
    problems += unresolved
    if problems:
        return Check("FAIL", "the DRA plugin is not in service", problems + ([reach] if others else []) + evidence, fix)
    claims = len(dra.get("claims") or [])
    summary = f"DRA {driver}: registered, {published} devices published, {claims} claims prepared"
    if others:
        fix = (
            "speak as the node itself (nvplug.dra.kubeconfig: kubelet, or auto with no /etc/nvplug/kubeconfig), "
            "which the Node authorizer limits to this node's slices (docs/dra.md)"
        )
        return Check("WARN", f"{summary}; its credentials may write other nodes' slices", [reach, *evidence], fix)
    return Check("PASS", summary, evidence)


def _unresolved_claims(ctx: DoctorContext, cfg: Config, claims: list[dict[str, Any]]) -> list[str]:
    """Each prepared claim's CDI names that no spec in the runtimes' directories defines."""
    defined = resolvable(runtime_specs(ctx, cfg)[1])
    return [
        f"claim {c.get('namespace')}/{c.get('name')}: its CDI name {n} does not resolve"
        for c in claims
        for n in c.get("cdi") or []
        if n not in defined
    ]
