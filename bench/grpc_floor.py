#!/usr/bin/env python3
"""What a unary gRPC call costs between two Python processes here, with no plugin logic at all.

A kubelet restart is four such legs in a row (our Register; the kubelet's dial-back and its
GetDevicePluginOptions; the Register's answer; ListAndWatch), two of them on new connections, and the
kubelet stand-in is Python. This is the floor under `latency.py`'s restart figure: a Register from
a new channel (as the daemon sends it) and from one already connected, each timed to the server's
handler and back. The server is a grpc.aio server in a child process, idle otherwise.

    .venv/bin/python bench/grpc_floor.py [--samples 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.protos import deviceplugin_pb2_grpc as pb_grpc

REQUEST = pb.RegisterRequest(version="v1beta1", endpoint="nvplug-nvidia.com-gpu.sock", resource_name="nvidia.com/gpu")


async def serve(path: str) -> None:
    """The child: answers Register, writing when each call reached the handler to stdout."""

    async def register(request: pb.RegisterRequest, context: grpc.aio.ServicerContext[object, object]) -> pb.Empty:
        os.write(1, f"{time.monotonic():.6f}\n".encode())
        return pb.Empty()

    handler = grpc.unary_unary_rpc_method_handler(
        register, request_deserializer=pb.RegisterRequest.FromString, response_serializer=pb.Empty.SerializeToString
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("v1beta1.Registration", {"Register": handler}),)
    )
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    os.write(1, b"ready\n")
    await server.wait_for_termination()


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def measure(
    path: str, server: subprocess.Popen[bytes], samples: int
) -> dict[str, tuple[list[float], list[float]]]:
    assert server.stdout is not None
    target = f"unix:{path}"
    figures: dict[str, tuple[list[float], list[float]]] = {"new channel": ([], []), "connected channel": ([], [])}
    connected = grpc.aio.insecure_channel(target)
    await pb_grpc.RegistrationStub(connected).Register(REQUEST, timeout=5)
    server.stdout.readline()
    for i in range(2 * samples):
        fresh = i % 2 == 0
        name = "new channel" if fresh else "connected channel"
        channel = (
            grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) if fresh else connected
        )
        t0 = time.monotonic()
        await pb_grpc.RegistrationStub(channel).Register(REQUEST, timeout=5)
        back = time.monotonic()
        reached = float(server.stdout.readline())
        figures[name][0].append((reached - t0) * 1000)
        figures[name][1].append((back - t0) * 1000)
        if fresh:
            await channel.close()
        await asyncio.sleep(0.003)
    await connected.close()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    with tempfile.TemporaryDirectory(prefix="nvb-", dir="/tmp") as scratch:
        path = str(Path(scratch) / "kubelet.sock")
        server = subprocess.Popen([sys.executable, __file__, "--serve", path], stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None
            if server.stdout.readline() != b"ready\n":
                raise SystemExit("the server did not start")
            figures = asyncio.run(measure(path, server, args.samples))
        finally:
            server.kill()
            server.wait()
    for name, (reached, round_trip) in figures.items():
        to, back = (f"p50 {percentile(s, 50):5.2f} p99 {percentile(s, 99):5.2f} ms" for s in (reached, round_trip))
        print(f"Register, {name:<18} to the handler {to}   and back {back}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
