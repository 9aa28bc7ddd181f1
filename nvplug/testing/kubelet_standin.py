"""A stand-in for the kubelet's device manager, for end-to-end tests and ``nvplug demo``.

It does what the real kubelet does with a device plugin (see the kubelet contract):
serves ``v1beta1.Registration/Register`` on ``<dir>/kubelet.sock``, validates the
request, dials back to the plugin's socket inside Register, reads the options,
opens ListAndWatch, records every update, marks everything unhealthy when the
stream ends, and on (re)start deletes every unix socket in the directory. Started
with ``hang=True`` it is a wedged kubelet: it takes Register and never answers.

State is published as immutable snapshots (frozen dataclasses, tuples, read-only
mappings) that are replaced, never mutated, so other threads may read them at any
time without locks. Everything that acts runs on the FakeKubelet's event loop.

Run ``python -m nvplug.testing.kubelet --dir DIR`` for a foreground stand-in that
prints each registration and update; SIGHUP simulates a kubelet restart.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from nvplug.protos import API_VERSION, KUBELET_SOCKET
from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.testing.podresources_standin import Container, FakePodResources, Pod

CHECKPOINT_FILE = "kubelet_internal_checkpoint"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# The kubelet's blocking dial-back timeout inside Register.
DIAL_TIMEOUT_S = 10.0
# The kubelet's PreStartContainer deadline; Allocate and GetPreferredAllocation have none.
PRE_START_TIMEOUT_S = 30.0
# sun_path is 108 bytes including the NUL; gRPC's bind error for longer paths is cryptic.
_MAX_UNIX_PATH = 107
# The error recorded for a Register that a hung kubelet took and never answered.
HUNG = "never answered: the kubelet is hung"

_SERVICE_REGISTRATION = "v1beta1.Registration"
_DP = "/v1beta1.DevicePlugin/"

_T = TypeVar("_T")


class KubeletError(RuntimeError):
    """The stand-in refused to act, or the plugin answered what the kubelet would reject."""


# ---------------------------------------------------------------------------
# Snapshots
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PluginOptions:
    pre_start_required: bool
    get_preferred_allocation_available: bool

    @staticmethod
    def from_pb(msg: pb.DevicePluginOptions) -> PluginOptions:
        return PluginOptions(
            pre_start_required=msg.pre_start_required,
            get_preferred_allocation_available=msg.get_preferred_allocation_available,
        )


@dataclass(frozen=True)
class DeviceView:
    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        # Any string other than exactly "Healthy" counts as unhealthy, as in the kubelet.
        return self.health == HEALTHY

    @staticmethod
    def from_pb(dev: pb.Device) -> DeviceView:
        nodes = tuple(n.ID for n in dev.topology.nodes) if dev.HasField("topology") else ()
        return DeviceView(id=dev.ID, health=dev.health, numa_nodes=nodes)


@dataclass(frozen=True)
class Update:
    """One ListAndWatch message, as received."""

    at: float  # time.monotonic()
    devices: tuple[DeviceView, ...]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices)

    @property
    def healthy_ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices if d.healthy)


@dataclass(frozen=True)
class RegistrationRecord:
    at: float  # time.monotonic(), once decided (after the dial-back)
    received_at: float  # time.monotonic(), as the call arrived
    resource: str
    endpoint: str
    version: str
    accepted: bool
    error: str | None = None
    # The options sent in the request; current kubelets ignore them and ask the plugin.
    request_options: PluginOptions | None = None


def _frozen_map(d: Mapping[str, DeviceView]) -> Mapping[str, DeviceView]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class PluginView:
    """What the kubelet knows about one registered plugin (one registration)."""

    resource: str
    endpoint: str
    socket_path: Path
    serial: int  # increases with each accepted registration, across resources
    registered_at: float
    options: PluginOptions
    updates: tuple[Update, ...] = ()
    # The current device set, keyed by ID: replaced by each update, all Unhealthy once the stream ends.
    devices: Mapping[str, DeviceView] = field(default_factory=lambda: _frozen_map({}), hash=False)
    stream_ended_at: float | None = None
    # How the stream ended: "EOF", "<CODE>: details", or why the kubelet cancelled it.
    stream_end: str | None = None

    @property
    def stream_open(self) -> bool:
        return self.stream_ended_at is None

    @property
    def capacity(self) -> int:
        return len(self.devices)

    @property
    def allocatable(self) -> int:
        return sum(1 for d in self.devices.values() if d.healthy)

    @property
    def healthy_ids(self) -> tuple[str, ...]:
        return tuple(i for i, d in self.devices.items() if d.healthy)

    def describe(self) -> str:
        state = "open" if self.stream_open else f"ended ({self.stream_end})"
        head = (
            f"{self.resource}: endpoint={self.endpoint} capacity={self.capacity} "
            f"allocatable={self.allocatable} updates={len(self.updates)} stream={state} "
            f"options={self.options}"
        )
        devs = [f"    {d.id} {d.health} numa={list(d.numa_nodes)}" for d in self.devices.values()]
        return "\n".join([head, *devs])


# ---------------------------------------------------------------------------
# Validation, as the kubelet does it
# ---------------------------------------------------------------------------

_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _qualified_name_error(value: str) -> str | None:
    """k8s IsQualifiedName: optional DNS-1123 subdomain prefix, '/', name of <= 63 chars."""
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            return "prefix part must be non-empty"
        if len(prefix) > 253:
            return f"prefix part must be no more than 253 characters (got {len(prefix)})"
        if not _DNS1123_SUBDOMAIN.fullmatch(prefix):
            return f"prefix part {prefix!r} must be a lowercase RFC 1123 subdomain"
    else:
        return "a qualified name must contain at most one '/'"
    if not name:
        return "name part must be non-empty"
    if len(name) > 63:
        return f"name part must be no more than 63 characters (got {len(name)})"
    if not _QUALIFIED_NAME.fullmatch(name):
        return (
            f"name part {name!r} must consist of alphanumerics, '-', '_' or '.', and start and end with an alphanumeric"
        )
    return None


def extended_resource_name_error(name: str) -> str | None:
    """Why the kubelet would reject `name` as a device plugin resource, or None.

    Mirrors v1helper.IsExtendedResourceName: not native (has '/', no 'kubernetes.io/'),
    not 'requests.'-prefixed, and 'requests.' + name is a qualified name -- so the
    domain prefix is effectively limited to 244 characters.
    """
    if "/" not in name:
        return f"resource name {name!r} must contain '/' (an extended resource is domain/name)"
    if "kubernetes.io/" in name:
        return f"resource name {name!r} is in the reserved kubernetes.io namespace"
    if name.startswith("requests."):
        return f"resource name {name!r} must not start with 'requests.'"
    err = _qualified_name_error("requests." + name)
    if err is not None:
        return f"resource name {name!r} is not a qualified name: {err}"
    return None


def registration_error(req: pb.RegisterRequest) -> str | None:
    if req.version != API_VERSION:
        return (
            f"requested API version {req.version!r} is not supported by kubelet; "
            f"supported versions are [{API_VERSION!r}] (resource {req.resource_name!r})"
        )
    return extended_resource_name_error(req.resource_name)


def _go_join(directory: Path, endpoint: str) -> Path:
    # The kubelet uses filepath.Join, which cleans the result: "/a" + "/b" is "/a/b", not "/b".
    return Path(os.path.normpath(f"{directory}/{endpoint}"))


def _rpc_error_text(err: grpc.aio.AioRpcError) -> str:
    return f"{err.code().name}: {err.details()}"


# ---------------------------------------------------------------------------
# The asyncio stand-in
# ---------------------------------------------------------------------------


class _Connection:
    """The kubelet's client for one accepted registration (mutable, loop-private)."""

    def __init__(self, serial: int, resource: str, socket_path: Path, channel: grpc.aio.Channel) -> None:
        self.serial = serial
        self.resource = resource
        self.socket_path = socket_path
        self.channel = channel
        self.task: asyncio.Task[None] | None = None


class FakeKubelet:
    """The kubelet's device manager, asyncio-native. Use it from one event loop only;
    read-only properties are safe from any thread."""

    def __init__(
        self,
        plugin_dir: Path,
        *,
        dial_timeout: float = DIAL_TIMEOUT_S,
        clean_on_start: bool = True,
        on_event: Callable[[str], None] | None = None,
        pod_resources_socket: Path | None = None,
    ) -> None:
        """`clean_on_start`: delete every unix socket in plugin_dir when starting, as the
        real kubelet does on every start (not just restarts). `on_event` gets one line
        per registration, update, stream end and restart. PodResources is served on
        `pod_resources_socket` (default: pod-resources/kubelet.sock beside plugin_dir)."""
        self._dir = Path(plugin_dir).absolute()
        self.pod_resources = FakePodResources(
            pod_resources_socket or self._dir.parent / "pod-resources" / "kubelet.sock", self._allocatable
        )
        self._dial_timeout = dial_timeout
        self._clean_on_start = clean_on_start
        self._on_event = on_event
        self._server: grpc.aio.Server | None = None
        self._hung = False
        self._socket_created_at: float | None = None
        # Hung kubelets replaced by a restart: like a wedged process not yet reaped, they
        # keep the connections they took (and the Registers on them) until stop().
        self._wedged: list[grpc.aio.Server] = []
        self._conns: dict[str, _Connection] = {}
        self._serial = 0
        # Bumped on every stop, so a Register that straddles a stop does not install itself.
        self._epoch = 0
        self._restarts = 0
        # Published snapshots: replaced wholesale, never mutated.
        self._plugins: Mapping[str, PluginView] = MappingProxyType({})
        self._history: tuple[PluginView, ...] = ()
        self._registrations: tuple[RegistrationRecord, ...] = ()
        # Swapped for a fresh Event on each change; waiters wait on the one they saw.
        self._changed = asyncio.Event()

    # -- read access (any thread) -------------------------------------------------

    @property
    def plugin_dir(self) -> Path:
        return self._dir

    @property
    def socket_path(self) -> Path:
        return self._dir / KUBELET_SOCKET

    @property
    def serving(self) -> bool:
        return self._server is not None

    @property
    def hung(self) -> bool:
        """The kubelet serving now takes Register and never answers it."""
        return self._server is not None and self._hung

    @property
    def socket_created_at(self) -> float | None:
        """time.monotonic() just before the current (or last) kubelet.sock was bound."""
        return self._socket_created_at

    @property
    def restarts(self) -> int:
        return self._restarts

    @property
    def registrations(self) -> tuple[RegistrationRecord, ...]:
        return self._registrations

    @property
    def plugins(self) -> Mapping[str, PluginView]:
        """The current plugin per resource (newest registration wins)."""
        return self._plugins

    @property
    def history(self) -> tuple[PluginView, ...]:
        """Final views of registrations that were superseded or dropped by a restart."""
        return self._history

    def plugin(self, resource: str) -> PluginView | None:
        return self._plugins.get(resource)

    def capacity(self, resource: str) -> int:
        view = self._plugins.get(resource)
        return 0 if view is None else view.capacity

    def allocatable(self, resource: str) -> int:
        view = self._plugins.get(resource)
        return 0 if view is None else view.allocatable

    def accepted_registrations(self, resource: str | None = None) -> int:
        return sum(1 for r in self._registrations if r.accepted and resource in (None, r.resource))

    def describe(self) -> str:
        hung = " HUNG" if self.hung else ""
        lines = [f"FakeKubelet dir={self._dir} serving={self.serving}{hung} restarts={self._restarts}"]
        plugins = self._plugins
        if not plugins:
            lines.append("  no plugins registered")
        lines += ["  " + v.describe() for v in plugins.values()]
        regs = self._registrations
        lines.append(f"  registrations ({len(regs)}, last 5):")
        for r in regs[-5:]:
            verdict = "accepted" if r.accepted else f"rejected: {r.error}"
            lines.append(f"    t={r.at:.3f} {r.resource!r} endpoint={r.endpoint!r} {verdict}")
        return "\n".join(lines)

    # -- lifecycle --------------------------------------------------------------

    async def start(self, *, hang: bool = False) -> None:
        """`hang`: a wedged kubelet, which accepts connections on kubelet.sock and takes
        Register calls but never answers them (until it is stopped)."""
        if self._server is not None:
            raise KubeletError(f"kubelet stand-in on {self.socket_path} is already serving")
        sock = self.socket_path
        if len(str(sock)) > _MAX_UNIX_PATH:
            raise KubeletError(f"socket path too long for a unix socket ({len(str(sock))} > 107): {sock}")
        self._dir.mkdir(parents=True, exist_ok=True)
        if self._clean_on_start:
            self._delete_sockets()
        else:
            sock.unlink(missing_ok=True)
        handler = grpc.unary_unary_rpc_method_handler(
            # Fixed per server: a wedged one stays wedged whatever its successor does.
            self._hang_register if hang else self._register,
            request_deserializer=pb.RegisterRequest.FromString,
            response_serializer=pb.Empty.SerializeToString,
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(_SERVICE_REGISTRATION, {"Register": handler}),)
        )
        # Taken before the bind creates the file: delays measured from it are not understated.
        created_at = time.monotonic()
        try:
            server.add_insecure_port(f"unix:{sock}")
        except RuntimeError as e:
            raise KubeletError(f"cannot bind kubelet socket {sock}: {e}") from e
        await server.start()
        self._server, self._hung, self._socket_created_at = server, hang, created_at
        await self.pod_resources.start()
        self._changed_now()

    async def stop(self) -> None:
        """Stop serving and drop all plugin connections; views stay readable, marked ended.
        Hung kubelets left behind by restarts go too, aborting the Registers they held."""
        wedged, self._wedged = self._wedged, []
        await asyncio.gather(*(server.stop(None) for server in wedged))
        await self._shutdown("kubelet stopped", forget=False)
        self.socket_path.unlink(missing_ok=True)
        await self.pod_resources.stop()
        self._changed_now()

    async def restart(self, *, hang: bool = False) -> None:
        """What a kubelet restart does: forget every plugin, delete every unix socket in
        the directory (not directories, not the checkpoint), serve a new kubelet.sock.
        A hung kubelet is not stopped but left wedged: the Registers it holds get no
        answer and no error, so only the new kubelet.sock can tell the plugin to move on.
        `hang`: the new kubelet is hung too (see start)."""
        if self._hung and self._server is not None:
            self._wedged.append(self._server)
            self._server = None
            self._emit(f"restart: the hung kubelet on {self.socket_path} is left wedged, connections open")
        await self._shutdown("kubelet restarted", forget=True)
        self._delete_sockets()
        self._restarts += 1
        self._emit(f"restart #{self._restarts}: sockets in {self._dir} deleted")
        clean, self._clean_on_start = self._clean_on_start, False
        try:
            await self.start(hang=hang)
        finally:
            self._clean_on_start = clean

    async def _shutdown(self, reason: str, *, forget: bool) -> None:
        await self.pod_resources.stop()
        self._epoch += 1
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)  # aborts in-flight Register calls at once
        conns, self._conns = self._conns, {}
        now = time.monotonic()
        views = {r: _ended(v, now, reason) if v.stream_open else v for r, v in self._plugins.items()}
        if forget:
            self._history = (*self._history, *views.values())
            views = {}
        self._plugins = MappingProxyType(views)
        await asyncio.gather(*(self._disconnect(c) for c in conns.values()))

    def _delete_sockets(self) -> None:
        # Like the kubelet's CleanupPluginDirectory: stat follows links; only sockets go.
        for entry in self._dir.iterdir():
            if entry.name == CHECKPOINT_FILE:
                continue
            try:
                if stat.S_ISSOCK(entry.stat().st_mode):
                    entry.unlink()
            except FileNotFoundError:
                continue

    # -- Registration service ------------------------------------------------------

    async def _register(
        self, req: pb.RegisterRequest, context: grpc.aio.ServicerContext[pb.RegisterRequest, pb.Empty]
    ) -> pb.Empty:
        received_at = time.monotonic()
        opts = PluginOptions.from_pb(req.options) if req.HasField("options") else None
        invalid = registration_error(req)
        if invalid is not None:
            self._record(req, opts, invalid, received_at)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, invalid)
        epoch = self._epoch
        try:
            conn, options = await self._dial(req)
        except KubeletError as e:
            self._record(req, opts, str(e), received_at)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if epoch != self._epoch:
            # A stop/restart happened while we were dialing: a real kubelet would have died with it.
            await conn.channel.close(None)
            msg = f"kubelet stopped while registering {req.resource_name!r}"
            self._record(req, opts, msg, received_at)
            await context.abort(grpc.StatusCode.UNAVAILABLE, msg)
        self._install(req, conn, options)
        self._record(req, opts, None, received_at)
        return pb.Empty()

    async def _hang_register(
        self, req: pb.RegisterRequest, context: grpc.aio.ServicerContext[pb.RegisterRequest, pb.Empty]
    ) -> pb.Empty:
        """A wedged kubelet's Register: recorded, never answered. Only stopping this
        server ends the call (the plugin's deadline or cancellation ends it on its side)."""
        opts = PluginOptions.from_pb(req.options) if req.HasField("options") else None
        self._record(req, opts, HUNG, time.monotonic())
        never: asyncio.Future[pb.Empty] = asyncio.get_running_loop().create_future()
        return await never

    async def _dial(self, req: pb.RegisterRequest) -> tuple[_Connection, PluginOptions]:
        path = _go_join(self._dir, req.endpoint)
        target = f"unix:{path}"
        channel = grpc.aio.insecure_channel(target)
        ok = False
        try:
            try:
                await asyncio.wait_for(channel.channel_ready(), self._dial_timeout)
            except TimeoutError:
                raise KubeletError(
                    f"dial-back to {target} for {req.resource_name!r} timed out after "
                    f"{self._dial_timeout:g}s (is the plugin serving on that socket?)"
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
                    f"GetDevicePluginOptions on {target} for {req.resource_name!r} failed: {_rpc_error_text(e)}"
                ) from e
            self._serial += 1
            conn = _Connection(self._serial, req.resource_name, path, channel)
            ok = True
            return conn, options
        finally:
            if not ok:
                await channel.close(None)

    def _install(self, req: pb.RegisterRequest, conn: _Connection, options: PluginOptions) -> None:
        resource = req.resource_name
        now = time.monotonic()
        old_conn = self._conns.get(resource)
        old_view = self._plugins.get(resource)
        # The device set outlives a re-registration until the new plugin's first update.
        view = PluginView(
            resource=resource,
            endpoint=req.endpoint,
            socket_path=conn.socket_path,
            serial=conn.serial,
            registered_at=now,
            options=options,
            devices=old_view.devices if old_view is not None else _frozen_map({}),
        )
        if old_view is not None:
            ended = old_view
            if old_view.stream_open:
                ended = replace(old_view, stream_ended_at=now, stream_end="superseded by a newer registration")
            self._history = (*self._history, ended)
        self._conns[resource] = conn
        self._plugins = MappingProxyType({**self._plugins, resource: view})
        if old_conn is not None:
            asyncio.get_running_loop().create_task(self._disconnect(old_conn))
        list_and_watch = conn.channel.unary_stream(
            _DP + "ListAndWatch",
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=pb.ListAndWatchResponse.FromString,
        )
        call = list_and_watch(pb.Empty())
        conn.task = asyncio.get_running_loop().create_task(
            self._watch(conn, call), name=f"ListAndWatch {resource} {conn.socket_path}"
        )

    async def _watch(self, conn: _Connection, call: grpc.aio.UnaryStreamCall[Message, pb.ListAndWatchResponse]) -> None:
        try:
            async for resp in call:
                self._on_update(conn, resp)
        except grpc.aio.AioRpcError as e:
            how = _rpc_error_text(e)
        else:
            how = "EOF"
        # Only a stream that ended on its own gets here; cancellation is recorded by the canceller.
        self._on_stream_end(conn, how)
        await conn.channel.close(None)

    def _on_update(self, conn: _Connection, resp: pb.ListAndWatchResponse) -> None:
        view = self._plugins.get(conn.resource)
        if view is None or view.serial != conn.serial:
            return
        upd = Update(at=time.monotonic(), devices=tuple(DeviceView.from_pb(d) for d in resp.devices))
        # Each message replaces the whole set; a missing ID is a removed device.
        devices = _frozen_map({d.id: d for d in upd.devices})
        self._publish(replace(view, updates=(*view.updates, upd), devices=devices))
        summary = " ".join(f"{d.id}={d.health}@{','.join(map(str, d.numa_nodes)) or '-'}" for d in upd.devices)
        self._emit(f"update {conn.resource}: {len(upd.devices)} devices, {len(upd.healthy_ids)} healthy [{summary}]")

    def _on_stream_end(self, conn: _Connection, how: str) -> None:
        if self._conns.get(conn.resource) is conn:
            del self._conns[conn.resource]
        view = self._plugins.get(conn.resource)
        if view is None or view.serial != conn.serial:
            return
        self._publish(_ended(view, time.monotonic(), how))
        self._emit(f"stream-end {conn.resource} ({conn.socket_path}): {how}; all devices Unhealthy")

    async def _disconnect(self, conn: _Connection) -> None:
        if conn.task is not None and not conn.task.done():
            conn.task.cancel()
            await asyncio.wait([conn.task])
        await conn.channel.close(None)

    # -- calls into the plugin (as the kubelet makes them) ------------------------

    def _connected(self, resource: str, rpc: str) -> tuple[_Connection, PluginView]:
        conn = self._conns.get(resource)
        view = self._plugins.get(resource)
        if conn is None or view is None or view.serial != conn.serial:
            why = "no plugin registered" if view is None else f"stream ended ({view.stream_end})"
            raise KubeletError(f"cannot call {rpc} for {resource!r}: {why} (endpoint stopped)")
        return conn, view

    async def allocate(
        self, resource: str, device_ids: Sequence[str], *, timeout: float | None = None
    ) -> pb.AllocateResponse:
        """One Allocate with one ContainerAllocateRequest, as at container admission.
        The kubelet sets no deadline; `timeout` exists only to keep tests bounded."""
        conn, _ = self._connected(resource, "Allocate")
        rpc = conn.channel.unary_unary(
            _DP + "Allocate",
            request_serializer=pb.AllocateRequest.SerializeToString,
            response_deserializer=pb.AllocateResponse.FromString,
        )
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=device_ids)])
        resp = await rpc(req, timeout=timeout)
        if not resp.container_responses:
            # The kubelet reads container_responses[0] and fails the pod without it.
            raise KubeletError(f"Allocate for {resource!r} on {conn.socket_path} returned no container responses")
        return resp

    async def admit(
        self, namespace: str, pod: str, container: str, resource: str, device_ids: Sequence[str]
    ) -> pb.AllocateResponse:
        """A container admitted as the kubelet does it: Allocate, then the pod is on record for PodResources."""
        response = await self.allocate(resource, device_ids)
        known = self.pod_resources.pods.get((namespace, pod))
        containers = {c.name: c for c in (known.containers if known else ())}
        held = dict(containers[container].devices) if container in containers else {}
        held[resource] = (*held.get(resource, ()), *device_ids)
        containers[container] = Container(container, held)
        self.pod_resources.admit(Pod(namespace, pod, tuple(containers.values())))
        return response

    def _allocatable(self) -> Mapping[str, tuple[str, ...]]:
        """The healthy devices of every resource the kubelet knows, a stopped endpoint's included."""
        return {name: tuple(d.id for d in v.devices.values() if d.healthy) for name, v in self._plugins.items()}

    async def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        *,
        check_options: bool = True,
        timeout: float | None = None,
    ) -> list[str]:
        """The plugin's answer (container_responses[0].deviceIDs), unfiltered. The kubelet
        only calls this when the plugin advertised it; `check_options=False` skips that."""
        conn, view = self._connected(resource, "GetPreferredAllocation")
        if check_options and not view.options.get_preferred_allocation_available:
            raise KubeletError(
                f"plugin for {resource!r} did not advertise get_preferred_allocation_available; "
                "the kubelet would not call GetPreferredAllocation"
            )
        rpc = conn.channel.unary_unary(
            _DP + "GetPreferredAllocation",
            request_serializer=pb.PreferredAllocationRequest.SerializeToString,
            response_deserializer=pb.PreferredAllocationResponse.FromString,
        )
        creq = pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
        )
        resp = await rpc(pb.PreferredAllocationRequest(container_requests=[creq]), timeout=timeout)
        return list(resp.container_responses[0].deviceIDs) if resp.container_responses else []

    async def pre_start(
        self,
        resource: str,
        device_ids: Sequence[str],
        *,
        check_options: bool = True,
        timeout: float = PRE_START_TIMEOUT_S,
    ) -> None:
        conn, view = self._connected(resource, "PreStartContainer")
        if check_options and not view.options.pre_start_required:
            raise KubeletError(
                f"plugin for {resource!r} did not set pre_start_required; the kubelet would not call PreStartContainer"
            )
        rpc = conn.channel.unary_unary(
            _DP + "PreStartContainer",
            request_serializer=pb.PreStartContainerRequest.SerializeToString,
            response_deserializer=pb.PreStartContainerResponse.FromString,
        )
        await rpc(pb.PreStartContainerRequest(devices_ids=device_ids), timeout=timeout)

    # -- waiting ------------------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[FakeKubelet], bool], timeout: float) -> None:
        """Return once predicate(self) holds; it is re-checked on every recorded change."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate(self):
            changed = self._changed
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(
                    f"condition {getattr(predicate, '__name__', predicate)!s} not met within "
                    f"{timeout:g}s; state:\n{self.describe()}"
                )
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                continue  # re-check once more, then report

    # -- bookkeeping ----------------------------------------------------------------------

    def _record(
        self, req: pb.RegisterRequest, opts: PluginOptions | None, error: str | None, received_at: float
    ) -> None:
        rec = RegistrationRecord(
            at=time.monotonic(),
            received_at=received_at,
            resource=req.resource_name,
            endpoint=req.endpoint,
            version=req.version,
            accepted=error is None,
            error=error,
            request_options=opts,
        )
        self._registrations = (*self._registrations, rec)
        verdict = "accepted" if error is None else f"rejected: {error}"
        self._emit(f"register {req.resource_name!r} endpoint={req.endpoint!r} version={req.version!r} {verdict}")
        self._changed_now()

    def _publish(self, view: PluginView) -> None:
        self._plugins = MappingProxyType({**self._plugins, view.resource: view})
        self._changed_now()

    def _changed_now(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _emit(self, line: str) -> None:
        if self._on_event is not None:
            self._on_event(line)


def _ended(view: PluginView, at: float, how: str) -> PluginView:
    # The kubelet marks every device of the resource unhealthy the moment the stream ends.
    devices = _frozen_map({i: replace(d, health=UNHEALTHY) for i, d in view.devices.items()})
    return replace(view, devices=devices, stream_ended_at=at, stream_end=how)


# ---------------------------------------------------------------------------
# Sync wrapper: a FakeKubelet on its own loop in a daemon thread
# ---------------------------------------------------------------------------


class KubeletThread:
    """Runs a FakeKubelet on a private event loop in a daemon thread, for sync code
    (pytest tests, the demo) that drives a plugin running in another process."""

    def __init__(
        self,
        plugin_dir: Path,
        *,
        dial_timeout: float = DIAL_TIMEOUT_S,
        clean_on_start: bool = True,
        on_event: Callable[[str], None] | None = None,
        pod_resources_socket: Path | None = None,
    ) -> None:
        self._kubelet = FakeKubelet(
            plugin_dir,
            dial_timeout=dial_timeout,
            clean_on_start=clean_on_start,
            on_event=on_event,
            pod_resources_socket=pod_resources_socket,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _submit(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        loop = self._loop
        if loop is None:
            coro.close()
            raise KubeletError(f"kubelet stand-in for {self._kubelet.plugin_dir} is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def start(self, timeout: float = 10.0, *, hang: bool = False) -> None:
        if self._thread is not None:
            raise KubeletError(f"kubelet stand-in for {self._kubelet.plugin_dir} already started")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=_run_loop, args=(loop,), name=f"fake-kubelet {self._kubelet.plugin_dir}", daemon=True
        )
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._submit(self._kubelet.start(hang=hang), timeout)
        except BaseException:
            self._halt_loop()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is None:
            return
        try:
            self._submit(self._kubelet.stop(), timeout)
        finally:
            self._halt_loop()

    def _halt_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(10.0)

    def restart(self, timeout: float = 10.0, *, hang: bool = False) -> None:
        self._submit(self._kubelet.restart(hang=hang), timeout)

    def allocate(
        self, resource: str, device_ids: Sequence[str], *, timeout: float | None = None
    ) -> pb.AllocateResponse:
        return self._submit(self._kubelet.allocate(resource, device_ids, timeout=timeout))

    def admit(
        self, namespace: str, pod: str, container: str, resource: str, device_ids: Sequence[str]
    ) -> pb.AllocateResponse:
        return self._submit(self._kubelet.admit(namespace, pod, container, resource, device_ids))

    def delete_pod(self, namespace: str, pod: str) -> None:
        async def delete() -> None:
            self._kubelet.pod_resources.delete(namespace, pod)

        self._submit(delete())

    @property
    def pod_resources(self) -> FakePodResources:
        return self._kubelet.pod_resources

    def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        *,
        check_options: bool = True,
        timeout: float | None = None,
    ) -> list[str]:
        return self._submit(
            self._kubelet.preferred_allocation(
                resource, available, must_include, size, check_options=check_options, timeout=timeout
            )
        )

    def pre_start(
        self,
        resource: str,
        device_ids: Sequence[str],
        *,
        check_options: bool = True,
        timeout: float = PRE_START_TIMEOUT_S,
    ) -> None:
        self._submit(self._kubelet.pre_start(resource, device_ids, check_options=check_options, timeout=timeout))

    def wait_for(self, predicate: Callable[[FakeKubelet], bool], timeout: float) -> None:
        """Block until predicate(kubelet) holds; it runs on the kubelet's loop."""
        self._submit(self._kubelet.wait_for(predicate, timeout), timeout + 5.0)

    # Reads return immutable snapshots, safe from this thread without hopping to the loop.
    @property
    def plugin_dir(self) -> Path:
        return self._kubelet.plugin_dir

    @property
    def socket_path(self) -> Path:
        return self._kubelet.socket_path

    @property
    def serving(self) -> bool:
        return self._kubelet.serving

    @property
    def hung(self) -> bool:
        return self._kubelet.hung

    @property
    def socket_created_at(self) -> float | None:
        return self._kubelet.socket_created_at

    @property
    def restarts(self) -> int:
        return self._kubelet.restarts

    @property
    def registrations(self) -> tuple[RegistrationRecord, ...]:
        return self._kubelet.registrations

    @property
    def plugins(self) -> Mapping[str, PluginView]:
        return self._kubelet.plugins

    @property
    def history(self) -> tuple[PluginView, ...]:
        return self._kubelet.history

    def plugin(self, resource: str) -> PluginView | None:
        return self._kubelet.plugin(resource)

    def capacity(self, resource: str) -> int:
        return self._kubelet.capacity(resource)

    def allocatable(self, resource: str) -> int:
        return self._kubelet.allocatable(resource)

    def accepted_registrations(self, resource: str | None = None) -> int:
        return self._kubelet.accepted_registrations(resource)

    def describe(self) -> str:
        return self._kubelet.describe()

    def __enter__(self) -> KubeletThread:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        # Let cancelled tasks (stream readers) finish before the loop goes away.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=5.0))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()


# ---------------------------------------------------------------------------
# Foreground CLI
# ---------------------------------------------------------------------------


async def _serve(plugin_dir: Path, dial_timeout: float) -> None:
    start = time.monotonic()

    def emit(line: str) -> None:
        print(f"[{time.monotonic() - start:9.3f}] {line}", flush=True)

    kubelet = FakeKubelet(plugin_dir, dial_timeout=dial_timeout, on_event=emit)
    await kubelet.start()
    emit(f"serving {kubelet.socket_path} (SIGHUP: restart, SIGINT/SIGTERM: stop)")
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    hups: list[asyncio.Task[None]] = []  # strong refs so restarts are not garbage-collected
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: hups.append(loop.create_task(kubelet.restart())))
    try:
        await done.wait()
    finally:
        await kubelet.stop()
        emit("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nvplug.testing.kubelet_standin", description="Run a kubelet device-manager stand-in."
    )
    parser.add_argument("--dir", type=Path, required=True, help="device-plugins directory to serve in")
    parser.add_argument("--dial-timeout", type=float, default=DIAL_TIMEOUT_S, help="dial-back timeout (s)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args.dir, args.dial_timeout))
    except KubeletError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
