"""Doctor step: the config loads, and nvplug serves all it asks for."""

from __future__ import annotations

from pathlib import Path

from nvplug import config
from nvplug.cli.doctor.doctor_step import Check, DoctorContext


def check_config(ctx: DoctorContext) -> Check:
    from nvplug.shaping.resource_plan import unserved_sharing

    path: Path | None = ctx.args.config
    try:
        cfg = config.load(path)
    except config.ConfigError as err:
        return Check(
            "FAIL",
            "the config is invalid",
            [str(err)],
            "fix the key named above (`nvplug config check FILE`), then `systemctl reload nvplug`",
        )
    names = dict.fromkeys([*(r.name for r in cfg.resources.gpus), *(r.name for r in cfg.resources.mig)])
    evidence = [f"{cfg.source}: resources {', '.join(names)}"]
    ignored = unserved_sharing(cfg)
    if ignored:
        return Check(
            "WARN",
            "the config is valid but has settings nvplug ignores",
            evidence + [f"sharing.timeSlicing for {name} is ignored" for name in ignored],
            "remove those sharing entries, or expect no time-slicing of them",
        )
    return Check("PASS", "the config is valid", evidence)
