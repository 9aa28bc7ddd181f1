"""The socket server both kubelet plugins serve through: a name that is a hard link to a listener kept
under .nvplug/, linked again after a wipe, and a new server only when the listener went too."""

from __future__ import annotations

import asyncio
import shutil
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from nvplug.base.linked_socket_server import LISTENERS, LinkedSocketServer, remove_leftover_listeners
from nvplug.base.unix_grpc_server import SocketBindFailed

SERVICE = "test.Echo"


def _handler() -> grpc.GenericRpcHandler:
    async def echo(request: bytes, context: Any) -> bytes:
        return request

    return grpc.method_handlers_generic_handler(
        SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(echo, lambda b: b, lambda b: b)}
    )


async def _echo(path: Path) -> bytes:
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        call = channel.unary_unary(
            f"/{SERVICE}/Echo", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        reply: bytes = await call(b"ping", timeout=5)
        return reply


def _listener(directory: Path) -> Path:
    (found,) = (directory / LISTENERS).iterdir()
    return found


def test_a_wiped_name_is_linked_again_to_the_same_listener(short_tmp: Path) -> None:
    name = short_tmp / "plugin.sock"
    events: list[str] = []

    async def run() -> None:
        server = LinkedSocketServer(
            name, [_handler()], "test", on_start=lambda: events.append("start"), on_stop=lambda: events.append("stop")
        )
        await server.start()
        listener = _listener(short_tmp)
        # Hidden from the kubelet's plugin watcher, which skips names that start with a dot.
        assert listener.name.startswith(".") and name.samefile(listener)
        assert await _echo(name) == b"ping"
        name.unlink()  # the kubelet restarts
        await server.rebind()
        assert name.samefile(listener) and await _echo(name) == b"ping"
        assert events == ["start"]  # no new server
        await server.stop()
        assert not name.exists() and list((short_tmp / LISTENERS).iterdir()) == []
        assert events == ["start", "stop"] and not server.serving

    asyncio.run(run())


def test_a_listener_gone_with_its_directory_gets_a_new_server(short_tmp: Path) -> None:
    name = short_tmp / "plugin.sock"

    async def run() -> None:
        server = LinkedSocketServer(name, [_handler()], "test")
        await server.start()
        old = _listener(short_tmp)
        shutil.rmtree(short_tmp / LISTENERS)
        name.unlink()
        await server.rebind()
        new = _listener(short_tmp)
        assert new != old and name.samefile(new) and await _echo(name) == b"ping"
        await server.stop()

    asyncio.run(run())


def test_a_missing_directory_is_said_with_the_socket(short_tmp: Path) -> None:
    name = short_tmp / "gone" / "plugin.sock"

    async def run() -> None:
        server = LinkedSocketServer(name, [_handler()], "test")
        with pytest.raises(SocketBindFailed, match=f"cannot serve on {name}"):
            await server.start()
        assert not server.serving

    asyncio.run(run())


def test_leftover_listeners_are_removed_and_other_files_kept(short_tmp: Path) -> None:
    listeners = short_tmp / LISTENERS
    listeners.mkdir()
    with socket.socket(socket.AF_UNIX) as left:
        left.bind(str(listeners / ".0123abcd"))
    (listeners / "notes").write_text("not a socket")
    remove_leftover_listeners(short_tmp)
    assert [p.name for p in listeners.iterdir()] == ["notes"]
