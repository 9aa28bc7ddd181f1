"""Doctor step: kubelet.sock is a socket that accepts connections and answers gRPC."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

from nvplug.base.grpc_target import grpc_target
from nvplug.cli.doctor.doctor_step import Check, DoctorContext


def check_kubelet(ctx: DoctorContext) -> Check:
    sock_path: Path = ctx.args.device_plugin_dir / "kubelet.sock"
    fix_start = "start the kubelet (`systemctl status kubelet`, `journalctl -u kubelet`); nvplug registers when it is"
    try:
        mode = sock_path.stat().st_mode
    except FileNotFoundError:
        return Check("FAIL", "kubelet.sock does not exist", [f"{sock_path}: no such file"], fix_start)
    except OSError as err:
        return Check("FAIL", "kubelet.sock cannot be read", [f"{sock_path}: {err}"], fix_start)
    if not stat.S_ISSOCK(mode):
        return Check("FAIL", "kubelet.sock is not a socket", [f"{sock_path}: {stat.filemode(mode)}"], fix_start)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(sock_path))
        except OSError as err:
            return Check(
                "FAIL",
                "kubelet.sock refuses connections",
                [f"connect {sock_path}: {err}", "a stale socket: the kubelet that made it is gone or hung"],
                "restart the kubelet (`systemctl restart kubelet`); it recreates the socket",
            )
    import grpc

    with grpc.insecure_channel(grpc_target(sock_path)) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=2.0)
        except grpc.FutureTimeoutError:
            return Check(
                "FAIL",
                "kubelet.sock accepts connections but does not answer gRPC within 2 s",
                [str(sock_path)],
                "the kubelet is hung or something else owns the socket: `journalctl -u kubelet`, restart it",
            )
    return Check("PASS", "the kubelet answers on kubelet.sock", [f"{sock_path}: gRPC channel ready"])
