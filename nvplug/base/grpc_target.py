"""The gRPC target of a unix socket, made once, and the options every channel and server of nvplug's
sockets is made with.

gRPC reads `unix://` as the start of an authority: `unix://kubelet/device-plugins/kubelet.sock` (a
relative path) names the host `kubelet`, and the call fails with a misleading error. `unix:` and an
absolute path is right for any path, relative ones made absolute from the working directory now.

Idle, gRPC core wakes once a second for each shard of its timer list, and the shards tick together
until a timer shorter than about 3 s lands in one: its window is then made shorter for a while, and its
tick moves apart from the others for good (each tick sets off a dozen wake-ups of its thread pool). Two
kinds of timer did that in nvplug: the deadline of a PodResources call (2 s; the loop's own timer bounds
it now), and HTTP/2's BDP probe, which times pings against the data a connection carries to size its
window, and so has nothing to find on a unix socket. With both, a daemon scraped ten times went from 10
to 20-30 wake-ups a second, idle, for good; without them it stays at 10 (grpcio 1.85).
"""

from __future__ import annotations

from pathlib import Path

UNIX_SOCKET_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.http2.bdp_probe", 0),)


def grpc_target(path: str | Path) -> str:
    return f"unix:{Path(path).absolute()}"
