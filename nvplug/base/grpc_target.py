"""The gRPC target of a unix socket, made once: every client and server of nvplug's sockets uses it.

gRPC reads `unix://` as the start of an authority: `unix://kubelet/device-plugins/kubelet.sock` (a
relative path) names the host `kubelet`, and the call fails with a misleading error. `unix:` and an
absolute path is right for any path, relative ones made absolute from the working directory now.
"""

from __future__ import annotations

from pathlib import Path


def grpc_target(path: str | Path) -> str:
    return f"unix:{Path(path).absolute()}"
