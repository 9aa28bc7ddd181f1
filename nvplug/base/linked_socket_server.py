"""A gRPC server on a unix socket name that comes back after the kubelet wipes it.

The server listens on a socket of its own in a private directory beside the name (LISTENERS), and the
name is a hard link to it: when the kubelet removes the name, linking it again serves it again, with
no new server. Only when the listener itself is gone (the whole directory was removed) does a new
server start. The device plugin's sockets and the DRA plugin's two are all served this way.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from nvplug.base.unix_grpc_server import SocketBindFailed, remove_stale_socket, serve_unix

log = logging.getLogger(__name__)

# Beside the served names, in a directory the kubelet leaves alone when it restarts (it removes the
# directory's sockets, not its subdirectories): each server's own socket, which its name is a hard link to.
LISTENERS = ".nvplug"
# A listener's name starts with a dot: the kubelet's plugin watcher walks plugins_registry's
# subdirectories too, and registers every socket it finds there but those whose name starts with one.
_HIDDEN = "."


class LinkedSocketServer:
    """One grpc.aio server serving one socket name through a hard link to its listener.

    `owner` names it in the log (a resource, a DRA driver), which is the owner's logger; `on_start` runs
    before each start, `on_stop` before each stop (a service that ends its streams cleanly first)."""

    def __init__(
        self,
        socket_path: Path,
        handlers: Sequence[grpc.GenericRpcHandler],
        owner: str,
        logger: logging.Logger = log,
        on_start: Callable[[], None] = lambda: None,
        on_stop: Callable[[], None] = lambda: None,
    ) -> None:
        self.socket_path = socket_path
        self.owner = owner
        self._log = logger
        self._handlers = list(handlers)
        self._on_start = on_start
        self._on_stop = on_stop
        self._server: grpc.aio.Server | None = None
        self._listener: Path | None = None

    @property
    def serving(self) -> bool:
        """A server is up (its name may still be gone, until it is linked again)."""
        return self._server is not None

    async def start(self) -> None:
        """Serve the name: a new listener, and the name linked to it. Its directory is never made here."""
        self._on_start()
        if not self.socket_path.parent.is_dir():
            raise SocketBindFailed(
                f"cannot serve on {self.socket_path}: the directory {self.socket_path.parent} does not exist"
            )
        listeners = self.socket_path.parent / LISTENERS
        listeners.mkdir(mode=0o700, exist_ok=True)
        # A name of its own per start (a server that stops unlinks its path, which must not be a later
        # one's), and a short one: a unix socket's path has 107 bytes at most.
        listener = listeners / (_HIDDEN + secrets.token_hex(4))
        while listener.exists():
            listener = listeners / (_HIDDEN + secrets.token_hex(4))
        self._server = await serve_unix(listener, self._handlers)
        self._listener = listener
        try:
            self._link()
        except OSError:
            await self.stop(grace=0)
            raise
        self._log.info("%s: serving on %s", self.owner, self.socket_path)

    async def stop(self, grace: float = 0.5) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        listener, self._listener = self._listener, None
        # Looked at first: gRPC unlinks the listener as it stops.
        ours = listener is not None and _same_file(self.socket_path, listener)
        self._on_stop()
        await server.stop(grace)
        if ours:
            self.socket_path.unlink(missing_ok=True)
        if listener is not None:
            remove_stale_socket(listener)
        self._log.info("%s: stopped serving on %s", self.owner, self.socket_path)

    async def rebind(self) -> None:
        """Serve the name again: linked again to the listener, or a new server if that is gone too."""
        if self._server is not None and self._listener is not None and self._listener.exists():
            try:
                self._link()
            except FileNotFoundError:
                pass  # the listener went meanwhile
            else:
                self._log.info("%s: serving on %s again", self.owner, self.socket_path)
                return
        # Stop first: gRPC unlinks its socket path when the old listener closes.
        await self.stop(grace=0)
        await self.start()

    def _link(self) -> None:
        assert self._listener is not None
        remove_stale_socket(self.socket_path)
        try:
            os.link(self._listener, self.socket_path)
        except FileExistsError:
            # Made in between by someone else: replaced, as a stale one would be.
            remove_stale_socket(self.socket_path)
            os.link(self._listener, self.socket_path)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def remove_leftover_listeners(directory: Path) -> None:
    """At start: the listeners a killed nvplug left beside `directory`'s names (only one nvplug serves them)."""
    try:
        found = list((directory / LISTENERS).iterdir())
    except OSError:
        return
    for path in found:
        try:
            remove_stale_socket(path)
        except (OSError, RuntimeError) as err:
            log.warning("cannot remove the leftover listener %s: %s", path, err)
