"""Doctor step: every MPS group's control daemon answers with its limits, and its GPUs are in EXCLUSIVE_PROCESS."""

from __future__ import annotations

from nvplug.cli.doctor.doctor_step import Check, DoctorContext, loaded_config
from nvplug.status import status_client as statusclient


def check_mps(ctx: DoctorContext) -> Check:
    import asyncio

    from nvplug.mps.compute_modes import EXCLUSIVE_PROCESS, mode_name
    from nvplug.mps.control_client import ControlClient, MpsControlError
    from nvplug.nvml.nvml_errors import NvmlUnavailable
    from nvplug.shaping.mps_groups import pipe_dir
    from nvplug.sources.nvml_discovery import Nvml

    cfg = loaded_config(ctx)
    if isinstance(cfg, Check):
        return cfg
    if cfg.sharing.strategy != "mps":
        return Check("PASS", "MPS is off (no sharing.mps resources)")
    try:
        doc = statusclient.status(statusclient.listen_address(ctx.args.status_listen, ctx.args.config))
    except (statusclient.StatusUnavailable, ValueError) as err:
        return Check(
            "WARN", "sharing.mps is set, but the daemon that runs the MPS daemons does not answer (step 7)", [str(err)]
        )
    mps = doc.get("mps") or {}
    groups = mps.get("groups") or []
    root = str(mps.get("root") or cfg.mps_root)  # the daemon's, which its command line may set
    fix = "see `journalctl -u nvplug` and each group's control.log under nvplug.mps.root"
    if not groups:
        return Check("FAIL", "sharing.mps is set, but the daemon runs no MPS group", [], fix)
    evidence: list[str] = []
    problems: list[str] = []
    nvml = Nvml(ctx.args.sysfs_root, ctx.args.proc_root) if ctx.nvml_ok else None
    for group in groups:
        name = str(group.get("name"))
        client = ControlClient(cfg.mps_control, pipe_dir(root, name), "", name)
        try:
            answer = asyncio.run(client.send(["get_default_active_thread_percentage"]))
        except MpsControlError as err:
            problems.append(f"{err} (nvplug says: {group.get('last_error') or 'up'})")
        else:
            said = answer[0] if answer else "nothing"
            adopted = " (adopted after a restart of nvplug)" if group.get("adopted_at") else ""
            evidence.append(
                f"MPS group {name}: daemon pid {group.get('pid')}{adopted}, up {group.get('uptime_seconds')} s, "
                f"answers, {said}% of the SMs per client"
            )
            if said != "nothing" and round(float(said)) != group.get("active_thread_percentage"):
                problems.append(f"MPS group {name} runs with {said}%, not {group.get('active_thread_percentage')}%")
        if nvml is None:
            continue  # step 3 says why NVML cannot be asked
        for uuid in group.get("exclusive_process") or []:  # none under MIG: no compute mode there
            try:
                mode = nvml.compute_mode(uuid)
            except NvmlUnavailable as err:
                problems.append(str(err))
                continue
            if mode != EXCLUSIVE_PROCESS:
                problems.append(
                    f"{uuid} of MPS group {name} is in compute mode {mode_name(mode)}, not "
                    "EXCLUSIVE_PROCESS: another process may take the GPU beside MPS"
                )
    if problems:
        return Check("FAIL", f"{len(problems)} MPS problems", problems + evidence, fix)
    return Check("PASS", f"{len(groups)} MPS groups answer, their GPUs in EXCLUSIVE_PROCESS", evidence)
