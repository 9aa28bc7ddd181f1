"""A gRPC server on a root-only unix socket, and the stale socket it replaces: the device plugin's
servers and the DRA plugin's sockets are all served this way."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import grpc

from nvplug.base.grpc_target import UNIX_SOCKET_OPTIONS, grpc_target


class SocketBindFailed(RuntimeError):
    """A socket could not be served: its directory is missing, or gRPC refused the bind."""


async def serve_unix(path: Path, handlers: list[grpc.GenericRpcHandler]) -> grpc.aio.Server:
    """A gRPC server on a unix socket at `path` (a stale socket there is replaced), root's only."""
    if not path.parent.is_dir():
        # Said here, in words: gRPC would log its own bind error at ERROR on every retry.
        raise SocketBindFailed(f"cannot serve on {path}: the directory {path.parent} does not exist")
    remove_stale_socket(path)
    server = grpc.aio.server(options=UNIX_SOCKET_OPTIONS)
    server.add_generic_rpc_handlers(handlers)
    # Nobody but root may talk to the plugin.
    old_umask = os.umask(0o077)
    try:
        try:
            server.add_insecure_port(grpc_target(path))
        except RuntimeError as err:
            where = "" if path.parent.is_dir() else f": the directory {path.parent} is gone"
            raise SocketBindFailed(f"cannot serve on {path}{where} ({err})") from err
        await server.start()
    finally:
        os.umask(old_umask)
    return server


def remove_stale_socket(path: Path) -> None:
    """Remove a socket left behind; refuse to touch anything that is not one."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeError(f"{path} exists and is not a unix socket; refusing to replace it")
    path.unlink()
