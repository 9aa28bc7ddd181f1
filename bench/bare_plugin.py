#!/usr/bin/env python3
"""A bare device plugin: what a kubelet restart costs any Python plugin on grpc.aio, and no more.

It does only what a kubelet restart asks of a plugin: one asyncio loop that reads inotify itself (no
thread), the socket name linked again to a listener that never stops (as nvplug does), a Register
from a new channel, GetDevicePluginOptions, and a ListAndWatch that sends one list encoded at start.
No NVML, no health, no state, no sinks, no logs. `compare.py --bare` runs it beside nvplug, each on
its own kubelet stand-in, sample by sample: the difference is nvplug's own, the rest is gRPC between
two Python processes and the stand-in.

    python bench/bare_plugin.py PLUGIN_DIR [--devices 8]

It prints `ready` once served and registered, and runs until it is killed. `serving()` runs it so for
another bench, on a simulated node's stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from nvplug.inotify.inotify_binding import IN_CREATE, InotifyEvent, WatchDescriptor
from nvplug.inotify.inotify_reader import CallbackId, InotifyReader
from nvplug.protos import API_VERSION, KUBELET_SOCKET
from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.protos import deviceplugin_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from nvplug.testing.simulated_node import SimulatedNode

RESOURCE = "nvidia.com/gpu"
ENDPOINT = "bare.sock"
# A kubelet.sock is bound before it listens: a Register in between is refused, and tried again soon.
RETRY = 0.001


class BarePlugin:
    def __init__(self, plugin_dir: Path, devices: int) -> None:
        self.name = plugin_dir / ENDPOINT
        self.kubelet = plugin_dir / KUBELET_SOCKET
        self.listener = plugin_dir / ".bare" / secrets.token_hex(4)
        devs = [pb.Device(ID=f"GPU-bare-{i:04d}", health="Healthy") for i in range(devices)]
        self.message = pb.ListAndWatchResponse(devices=devs).SerializeToString()
        self.registering: asyncio.Task[None] | None = None
        self.registered = asyncio.Event()

    async def serve(self) -> grpc.aio.Server:
        async def options(request: pb.Empty, context: object) -> pb.DevicePluginOptions:
            return pb.DevicePluginOptions()

        async def list_and_watch(request: pb.Empty, context: object) -> AsyncIterator[bytes]:
            yield self.message
            await asyncio.Event().wait()  # until the kubelet goes

        handlers = {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                options, pb.Empty.FromString, pb.DevicePluginOptions.SerializeToString
            ),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(list_and_watch, pb.Empty.FromString, bytes),
        }
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", handlers),))
        self.listener.parent.mkdir(mode=0o700, exist_ok=True)
        server.add_insecure_port(f"unix:{self.listener}")
        await server.start()
        os.link(self.listener, self.name)
        return server

    def watch(self) -> None:
        """inotify on the plugin directory, read on the loop as nvplug reads it (`InotifyReader`)."""
        reader = InotifyReader()
        reader.add_callback(os.fsencode(self.kubelet.parent), IN_CREATE, self, CallbackId(0))
        reader.start()

    # What the reader calls (`WatchCallback`).

    def on_event(self, event: InotifyEvent) -> None:
        if event.is_create and event.name == KUBELET_SOCKET.encode():
            self.kubelet_came()

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        pass  # the directory stays for the bench's run

    def on_queue_overflow(self) -> None:
        pass  # a handful of events per restart

    def kubelet_came(self) -> None:
        """A new kubelet wiped our name with every other socket: link it again, then register."""
        if not self.name.exists():
            os.link(self.listener, self.name)
        if self.registering is not None:
            self.registering.cancel()
        self.registering = asyncio.get_running_loop().create_task(self._register())

    async def _register(self) -> None:
        request = pb.RegisterRequest(
            version=API_VERSION, endpoint=ENDPOINT, resource_name=RESOURCE, options=pb.DevicePluginOptions()
        )
        while True:
            try:
                async with grpc.aio.insecure_channel(
                    f"unix:{self.kubelet}", options=[("grpc.use_local_subchannel_pool", 1)]
                ) as channel:
                    await pb_grpc.RegistrationStub(channel).Register(request, timeout=10)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(RETRY)
                continue
            self.registered.set()
            return


async def run(plugin_dir: Path, devices: int) -> None:
    plugin = BarePlugin(plugin_dir, devices)
    server = await plugin.serve()
    plugin.watch()
    if plugin.kubelet.exists():
        plugin.kubelet_came()
    await plugin.registered.wait()
    print("ready", flush=True)
    await server.wait_for_termination()


@contextlib.contextmanager
def serving(node: SimulatedNode, timeout: float = 20.0) -> Iterator[int]:
    """This plugin registered with `node`'s kubelet stand-in (started here), in the node's network namespace:
    its PID."""
    from nvplug.testing.simulated_node import registered_with

    node.kubelet.start()
    argv = [sys.executable, __file__, str(node.plugin_dir)]
    plugin = subprocess.Popen(node.isolated(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        node.kubelet.wait_for(registered_with(8), timeout)
        yield plugin.pid
    finally:
        plugin.kill()
        plugin.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plugin_dir", type=Path)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(run(args.plugin_dir, args.devices))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
