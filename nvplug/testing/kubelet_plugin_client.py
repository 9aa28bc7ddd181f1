"""The kubelet stand-in's gRPC client for a device plugin: the dial-back and the calls it makes.

Everything here runs on the FakeKubelet's event loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path

import grpc
import grpc.aio
from google.protobuf.message import Message

from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.testing.kubelet_views import PluginOptions

# The kubelet's blocking dial-back timeout inside Register.
DIAL_TIMEOUT_S = 10.0
# The kubelet's PreStartContainer deadline; Allocate and GetPreferredAllocation have none.
PRE_START_TIMEOUT_S = 30.0

_DP = "/v1beta1.DevicePlugin/"


class KubeletError(RuntimeError):
    """The stand-in refused to act, or the plugin answered what the kubelet would reject."""


def _go_join(directory: Path, endpoint: str) -> Path:
    # The kubelet uses filepath.Join, which cleans the result: "/a" + "/b" is "/a/b", not "/b".
    return Path(os.path.normpath(f"{directory}/{endpoint}"))


def rpc_error_text(err: grpc.aio.AioRpcError) -> str:
    """How a failed call is recorded: ``<CODE>: details``."""
    return f"{err.code().name}: {err.details()}"


async def dial_plugin(
    directory: Path, req: pb.RegisterRequest, dial_timeout: float
) -> tuple[Path, grpc.aio.Channel, PluginOptions]:
    """Dial back to the endpoint of ``req`` inside Register and read the plugin's options.

    Returns the plugin's socket path, the open channel and the options; on failure
    the channel is closed and :class:`KubeletError` says why.
    """
    path = _go_join(directory, req.endpoint)
    target = f"unix:{path}"
    channel = grpc.aio.insecure_channel(target)
    ok = False
    try:
        try:
            await asyncio.wait_for(channel.channel_ready(), dial_timeout)
        except TimeoutError:
            raise KubeletError(
                f"dial-back to {target} for {req.resource_name!r} timed out after "
                f"{dial_timeout:g}s (is the plugin serving on that socket?)"
            ) from None
        get_opts = channel.unary_unary(
            _DP + "GetDevicePluginOptions",
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=pb.DevicePluginOptions.FromString,
        )
        try:
            # No deadline: the kubelet uses context.Background() here.
            options = PluginOptions.from_pb(await get_opts(pb.Empty()))
        except grpc.aio.AioRpcError as e:
            raise KubeletError(
                f"GetDevicePluginOptions on {target} for {req.resource_name!r} failed: {rpc_error_text(e)}"
            ) from e
        ok = True
        return path, channel, options
    finally:
        if not ok:
            await channel.close(None)


class PluginConnection:
    """The kubelet's client for one accepted registration (mutable, loop-private)."""

    def __init__(self, serial: int, resource: str, socket_path: Path, channel: grpc.aio.Channel) -> None:
        self.serial = serial
        self.resource = resource
        self.socket_path = socket_path
        self.channel = channel
        self.task: asyncio.Task[None] | None = None

    def list_and_watch(self) -> grpc.aio.UnaryStreamCall[Message, pb.ListAndWatchResponse]:
        list_and_watch = self.channel.unary_stream(
            _DP + "ListAndWatch",
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=pb.ListAndWatchResponse.FromString,
        )
        return list_and_watch(pb.Empty())

    async def allocate(self, device_ids: Sequence[str], timeout: float | None) -> pb.AllocateResponse:
        """One Allocate with one ContainerAllocateRequest, as at container admission."""
        rpc = self.channel.unary_unary(
            _DP + "Allocate",
            request_serializer=pb.AllocateRequest.SerializeToString,
            response_deserializer=pb.AllocateResponse.FromString,
        )
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)])
        resp = await rpc(req, timeout=timeout)
        if not resp.container_responses:
            # The kubelet reads container_responses[0] and fails the pod without it.
            raise KubeletError(f"Allocate for {self.resource!r} on {self.socket_path} returned no container responses")
        return resp

    async def preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int, timeout: float | None
    ) -> list[str]:
        """The plugin's answer (container_responses[0].deviceIDs), unfiltered."""
        rpc = self.channel.unary_unary(
            _DP + "GetPreferredAllocation",
            request_serializer=pb.PreferredAllocationRequest.SerializeToString,
            response_deserializer=pb.PreferredAllocationResponse.FromString,
        )
        creq = pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
        )
        resp = await rpc(pb.PreferredAllocationRequest(container_requests=[creq]), timeout=timeout)
        return list(resp.container_responses[0].deviceIDs) if resp.container_responses else []

    async def pre_start(self, device_ids: Sequence[str], timeout: float) -> None:
        rpc = self.channel.unary_unary(
            _DP + "PreStartContainer",
            request_serializer=pb.PreStartContainerRequest.SerializeToString,
            response_deserializer=pb.PreStartContainerResponse.FromString,
        )
        await rpc(pb.PreStartContainerRequest(devices_ids=device_ids), timeout=timeout)

    async def close(self) -> None:
        """Cancel the ListAndWatch reader, if still running, then close the channel."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait([self.task])
        await self.channel.close(None)
