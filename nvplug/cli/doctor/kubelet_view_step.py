"""Doctor step: the kubelet's PodResources view of nvplug's devices agrees with nvplug's (crosscheck)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nvplug.cli.doctor.doctor_step import Check, DoctorContext, loaded_config
from nvplug.status import status_client as statusclient


def check_kubelet_view(ctx: DoctorContext) -> Check:
    """PodResources against nvplug's /status: what the kubelet believes of nvplug's devices."""
    import asyncio

    from nvplug.cli.doctor.crosscheck import CHECKPOINT, CheckpointEntry, cross_check, read_checkpoint
    from nvplug.kubelet.podresources_client import PodResourcesClient, PodResourcesUnavailable

    cfg = loaded_config(ctx)
    if isinstance(cfg, Check):
        return cfg
    if cfg.pod_resources_socket == "off" and ctx.args.pod_resources_socket is None:
        return Check("PASS", "not asked: PodResources is off (nvplug.podResources.socket: off)")
    path: Path = ctx.args.pod_resources_socket or Path(cfg.pod_resources_socket)
    try:
        doc = statusclient.status(statusclient.listen_address(ctx.args.status_listen, ctx.args.config))
    except (statusclient.StatusUnavailable, ValueError) as err:
        return Check("WARN", "not checked: the daemon does not answer (step 7)", [str(err)])

    async def ask() -> tuple[dict[str, list[str]], tuple[Any, ...]]:
        client = PodResourcesClient(path, rate=2.0, burst=2)
        try:
            return await client.allocatable(), await client.list_pods()
        finally:
            await client.close()

    try:
        allocatable, pods = asyncio.run(ask())
    except PodResourcesUnavailable as err:
        return Check(
            "WARN",
            "the kubelet's PodResources cannot be asked: which pod holds which GPU is unknown",
            [str(err)],
            "is the kubelet running (step 6)? PodResources is served since Kubernetes 1.13, "
            "GetAllocatableResources since 1.23 (GA 1.28)",
        )
    checkpoint: list[CheckpointEntry] = []
    # The kubelet sends one entry per device (and per resource): count containers, not entries.
    containers = len({(p.namespace, p.pod, p.container) for p in pods})
    evidence = [
        f"{path}: {sum(len(v) for v in allocatable.values())} allocatable devices, {containers} containers "
        "holding devices"
    ]
    try:
        checkpoint = read_checkpoint(ctx.args.device_plugin_dir / CHECKPOINT)
    except (OSError, ValueError) as err:
        evidence.append(f"the kubelet's checkpoint is not read: {err}")
    findings = cross_check(doc, allocatable, pods, checkpoint)
    if findings:
        return Check(
            "FAIL",
            "the kubelet's view of nvplug's devices disagrees with nvplug's",
            [f.problem for f in findings] + evidence,
            "; ".join(dict.fromkeys(f.fix for f in findings)),
        )
    return Check("PASS", "the kubelet's view agrees with nvplug's", evidence)
