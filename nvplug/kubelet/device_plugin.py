"""The DevicePlugin gRPC service for one resource name, its ListAndWatch encoding, and the server of its socket."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from nvplug.base.linked_socket_server import LinkedSocketServer
from nvplug.core.device_nodes import host_path
from nvplug.core.latest_snapshot import LatestSnapshot
from nvplug.core.snapshot import Snapshot
from nvplug.kubelet.allocation import AllocationError, AllocationPolicy, allocate, preferred
from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.shaping.resource_plan import Device, Resource

log = logging.getLogger(__name__)

# Projects a snapshot onto the devices of this resource, reusing what the last projection holds.
Projection = Callable[[Snapshot, Resource | None], Resource]
# What Register announces and GetDevicePluginOptions answers: the same, always.
PLUGIN_OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
SERVICE = "v1beta1.DevicePlugin"
# The kubelet's gRPC client refuses a larger message (its default receive limit), and the resource
# then vanishes from the node (kubernetes PR #127049).
MAX_MESSAGE = 4 << 20
# ListAndWatchResponse field 1 (devices), length-delimited.
_DEVICES_TAG = b"\x0a"


def encode_device(device_id: str, health: str, numa_node: int | None) -> bytes:
    """One device as a `devices` entry of a serialized ListAndWatchResponse: a repeated message field
    is its entries back to back, so a whole list is the join of its devices' encodings."""
    return _entry(device_id, _after_id(health, numa_node))


def _after_id(health: str, numa_node: int | None) -> bytes:
    """A Device message without its ID (proto3 leaves an empty string out): what follows the ID in an
    entry, since fields go in number order (ID, health, topology). A GPU's replicas share it."""
    rest = pb.Device(health=health)
    if numa_node is not None:
        rest.topology.nodes.add(ID=numa_node)
    return rest.SerializeToString()


def _entry(device_id: str, tail: bytes) -> bytes:
    raw = device_id.encode()
    field = b"\x0a" + _varint(len(raw)) + raw if raw else b""
    return _DEVICES_TAG + _varint(len(field) + len(tail)) + field + tail


_SHORT = [bytes((n,)) for n in range(128)]


def _varint(value: int) -> bytes:
    if value < 128:
        return _SHORT[value]  # every length in a device entry: no loop on the hot path
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def device_size(device_id: str, health: str, numa_node: int | None) -> int:
    """len(encode_device(...)), counted rather than encoded: proto3 leaves out empty strings and zeros."""
    body = _field(len(device_id.encode())) if device_id else 0
    body += _field(len(health.encode())) if health else 0
    if numa_node is not None:
        node = 1 + _varint_size(numa_node) if numa_node else 0
        body += _field(_field(node))
    return _field(body)


def _field(length: int) -> int:
    """A length-delimited field: its tag, its length, its bytes."""
    return 1 + _varint_size(length) + length


def _varint_size(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def list_size(devices: Iterable[Device]) -> int:
    """The bytes of the ListAndWatch message that advertises these devices."""
    return sum(device_size(d.id, d.health.health.value, d.numa_node) for d in devices)


class ListEncoder:
    """A resource's ListAndWatch message, serialized block by block (a GPU's replicas): a block whose
    devices did not change since the last message is not encoded again."""

    def __init__(self) -> None:
        self._blocks: dict[int, tuple[tuple[Device, ...], bytes]] = {}

    def encode(self, resource: Resource) -> bytes:
        fresh: dict[int, tuple[tuple[Device, ...], bytes]] = {}
        parts = []
        for block in resource.blocks:
            cached = self._blocks.get(id(block))
            if cached is not None and cached[0] is block:
                data = cached[1]
            elif resource.uniform_blocks and block:
                data = _encode_replicas(block)
            else:
                data = b"".join(encode_device(d.id, d.health.health.value, d.numa_node) for d in block)
            fresh[id(block)] = (block, data)
            parts.append(data)
        self._blocks = fresh
        return b"".join(parts)


def _encode_replicas(block: tuple[Device, ...]) -> bytes:
    """A GPU's replicas share health and NUMA node: what follows each ID is made once, and so is what
    comes before an ID of each length. An entry is `head + id + tail`, so a run of IDs of one length
    is `head + (tail + head).join(ids) + tail`: one join in C, not an encoding per replica."""
    tail = _after_id(block[0].health.health.value, block[0].numa_node)
    ids = [d.id for d in block]
    if not "".join(ids).isascii():  # characters are not bytes then: entry by entry
        return b"".join(_entry(i, tail) for i in ids)
    lengths = list(map(len, ids))
    parts = []
    start = 0
    while start < len(ids):
        size, end = lengths[start], start + 1
        while end < len(ids) and lengths[end] == size:
            end += 1
        if size == 0:
            parts.append(_entry("", tail) * (end - start))
        else:
            field = b"\x0a" + _varint(size)
            head = _DEVICES_TAG + _varint(len(field) + size + len(tail)) + field
            # latin-1 maps bytes to characters one to one: the join runs on str, the IDs are ASCII.
            glue = (tail + head).decode("latin-1")
            parts.append(head + glue.join(ids[start:end]).encode("latin-1") + tail)
        start = end
    return b"".join(parts)


def _serialize(message: bytes | Message) -> bytes:
    """ListAndWatch answers with bytes it serialized itself; everything else is a message."""
    return message if isinstance(message, bytes) else message.SerializeToString()


class DevicePluginService:
    """Answers the kubelet from the snapshots its fleet was handed; never calls NVML on the request path."""

    def __init__(
        self,
        resource_name: str,
        shown: LatestSnapshot,
        project: Projection,
        dev_root: Path,
        policy: AllocationPolicy | None = None,
        on_send: Callable[[str, int, bool], None] = lambda resource, revision, first: None,
        on_delivered: Callable[[str, Resource], None] = lambda name, resource: None,
        on_allocated: Callable[[], None] = lambda: None,
    ) -> None:
        self.resource_name = resource_name
        self._shown = shown
        self._project = project
        # Where Allocate's device specs point on the host; a reload of flags.nvidiaDevRoot sets it.
        self.dev_root = dev_root
        self.policy = policy or AllocationPolicy()
        # Told (resource, revision) as each ListAndWatch message goes out, for the latency metric.
        self._on_send = on_send
        # Told each list once gRPC has taken it: what the kubelet may now allocate from.
        self._on_delivered = on_delivered
        # Told after each Allocate: the kubelet records the pod just after, for PodResources.
        self._on_allocated = on_allocated
        self._closing = asyncio.Event()
        self._retired = False
        # The projection of the last revision asked for, and the encoded blocks of the last list.
        self._projection: tuple[int, Resource] | None = None
        self._encoder = ListEncoder()
        # Open ListAndWatch streams; `idle` is set while there are none.
        self._streams = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Streams that have handed their first list to gRPC, counted; the Event is swapped for a fresh
        # one on each, so a waiter waits on the one it saw.
        self.streams_listed = 0
        self._listed = asyncio.Event()

    def open(self) -> None:
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End every ListAndWatch stream cleanly, without a last message."""
        self._closing.set()
        self._shown.wake()

    async def retire(self, timeout: float = 1.0) -> None:
        """The resource stops being served: each stream sends an empty list, then ends.

        Waits (bounded) until every stream has handed its last message to gRPC, so that
        stopping the server next cannot cut it off.
        """
        self._retired = True
        self._closing.set()
        self._shown.wake()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)

    async def listed_after(self, count: int) -> None:
        """Returns once more than `count` streams have handed their first list to gRPC."""
        while self.streams_listed <= count:
            await self._listed.wait()

    def resource(self) -> Resource:
        return self._current()[1]

    def reproject(self, project: Projection) -> None:
        """A new way to project the same devices (a reloaded config); the next request projects afresh."""
        self._project = project
        self._projection = None

    def _current(self) -> tuple[int, Resource]:
        """This resource for the current revision: projected once per revision, then looked up by ID."""
        snapshot = self._shown.current
        cached = self._projection
        if cached is None or cached[0] != snapshot.revision:
            self._projection = cached = (snapshot.revision, self._project(snapshot, cached[1] if cached else None))
        return cached

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.DevicePluginOptions]
    ) -> pb.DevicePluginOptions:
        return PLUGIN_OPTIONS

    async def ListAndWatch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.ListAndWatchResponse]
    ) -> AsyncIterator[bytes]:
        revision = -1
        last: bytes | None = None
        log.info("%s: kubelet opened ListAndWatch", self.resource_name)
        self._streams += 1
        self._idle.clear()
        try:
            while True:
                snapshot = await self._next_snapshot(revision)
                if snapshot is None:
                    if self._retired and (last is None or last):
                        log.info(
                            "%s: ListAndWatch sends an empty list: the resource is no longer served", self.resource_name
                        )
                        yield b""
                        self._on_delivered(self.resource_name, Resource(self.resource_name))
                    return
                # A changed GPU's replicas are thousands of new objects: the collections they set off
                # run once the message is handed over, not between the event and the kubelet.
                collecting = gc.isenabled()
                gc.disable()
                try:
                    revision, resource = self._current()
                    message = self._encoder.encode(resource)
                finally:
                    if collecting:
                        asyncio.get_running_loop().call_soon(gc.enable)
                # Several revisions may leave this resource unchanged.
                if message == last:
                    continue
                # Measured at the hand-off: after `yield`, we run again only when gRPC wants the next one.
                first = last is None
                self._on_send(self.resource_name, revision, first)
                if first:
                    self.streams_listed += 1
                    listed, self._listed = self._listed, asyncio.Event()
                    listed.set()
                last = message
                yield message
                log.info(
                    "%s: ListAndWatch sent %d devices, %d healthy (revision %d)",
                    self.resource_name,
                    len(resource.devices),
                    resource.healthy_count,
                    revision,
                )
                self._on_delivered(self.resource_name, resource)
        finally:
            self._streams -= 1
            if not self._streams:
                self._idle.set()
            log.info("%s: ListAndWatch stream closed", self.resource_name)

    async def _next_snapshot(self, revision: int) -> Snapshot | None:
        """The next revision, or None once the server is closing.

        One wait on the fleet's snapshots (closing wakes it too), not a race of two tasks: the stream
        then runs in the loop turn right after the change, ahead of the sinks that follow the list."""
        while not self._closing.is_set():
            current = self._shown.current
            if current.revision > revision:
                return current
            await self._shown.next_revision()
        return None

    async def Allocate(
        self,
        request: pb.AllocateRequest,
        context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse],
    ) -> pb.AllocateResponse:
        resource = self.resource()
        response = pb.AllocateResponse()
        for container in request.container_requests:
            try:
                result = allocate(resource, list(container.devices_ids), self.policy, self._host_path, os.path.exists)
            except AllocationError as err:
                log.warning("Allocate refused: %s", err)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            out = response.container_responses.add()
            out.envs.update(result.envs)
            out.annotations.update(result.annotations)
            for node in result.device_nodes:
                out.devices.add(
                    container_path=node.container_path, host_path=node.host_path, permissions=node.permissions
                )
            for mount in result.mounts:
                out.mounts.add(
                    container_path=mount.container_path, host_path=mount.host_path, read_only=mount.read_only
                )
            for name in result.cdi_devices:
                out.cdi_devices.add(name=name)
            log.info("%s: allocated %s", self.resource_name, ", ".join(g.label for g in result.gpus))
        self._on_allocated()
        return response

    async def GetPreferredAllocation(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[pb.PreferredAllocationRequest, pb.PreferredAllocationResponse],
    ) -> pb.PreferredAllocationResponse:
        resource = self.resource()
        response = pb.PreferredAllocationResponse()
        for container in request.container_requests:
            try:
                ids = preferred(
                    resource,
                    list(container.available_deviceIDs),
                    list(container.must_include_deviceIDs),
                    container.allocation_size,
                    self.policy.packed,
                )
            except AllocationError as err:
                log.warning("GetPreferredAllocation refused: %s", err)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            response.container_responses.add(deviceIDs=ids)
        return response

    async def PreStartContainer(
        self,
        request: pb.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[pb.PreStartContainerRequest, pb.PreStartContainerResponse],
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    def _host_path(self, path: str) -> str:
        return host_path(self.dev_root, path)


def plugin_server(service: DevicePluginService, socket_path: Path) -> LinkedSocketServer:
    """The service served on its socket name, which comes back by a link after the kubelet wipes it.
    Its streams end cleanly, without a last message, before each stop: an empty list would drop capacity."""
    handler = grpc.method_handlers_generic_handler(SERVICE, _handlers(service))
    return LinkedSocketServer(socket_path, [handler], service.resource_name, log, service.open, service.close)


def _handlers(service: DevicePluginService) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """The generated registration, but ListAndWatch's answers pass through as the bytes they are."""
    return {
        "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
            service.GetDevicePluginOptions, pb.Empty.FromString, pb.DevicePluginOptions.SerializeToString
        ),
        "ListAndWatch": grpc.unary_stream_rpc_method_handler(service.ListAndWatch, pb.Empty.FromString, _serialize),
        "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
            service.GetPreferredAllocation,
            pb.PreferredAllocationRequest.FromString,
            pb.PreferredAllocationResponse.SerializeToString,
        ),
        "Allocate": grpc.unary_unary_rpc_method_handler(
            service.Allocate, pb.AllocateRequest.FromString, pb.AllocateResponse.SerializeToString
        ),
        "PreStartContainer": grpc.unary_unary_rpc_method_handler(
            service.PreStartContainer,
            pb.PreStartContainerRequest.FromString,
            pb.PreStartContainerResponse.SerializeToString,
        ),
    }
