"""A stand-in for the kubelet's device manager, for end-to-end tests and ``nvplug demo``.

It does what the real kubelet does with a device plugin (see the kubelet contract):
serves ``v1beta1.Registration/Register`` on ``<dir>/kubelet.sock``, validates the
request, dials back to the plugin's socket inside Register, reads the options,
opens ListAndWatch, records every update, marks everything unhealthy when the
stream ends, and on (re)start deletes every unix socket in the directory. Started
with ``hang=True`` it is a wedged kubelet: it takes Register and never answers.

Its state is published as immutable snapshots (``kubelet_views``), so other
threads may read them at any time without locks. Everything that acts runs on
the FakeKubelet's event loop; ``kubelet_thread.KubeletThread`` runs one for sync code.
"""

from __future__ import annotations

import asyncio
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import grpc
import grpc.aio
from google.protobuf.message import Message

from nvplug.protos import KUBELET_SOCKET
from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.testing.kubelet_admission import KubeletAdmission
from nvplug.testing.kubelet_plugin_client import (
    DIAL_TIMEOUT_S,
    KubeletError,
    PluginConnection,
    dial_plugin,
    rpc_error_text,
)
from nvplug.testing.kubelet_validation import registration_error
from nvplug.testing.kubelet_views import (
    HUNG,
    DeviceView,
    PluginOptions,
    PluginView,
    RegistrationRecord,
    Update,
    ended_view,
    frozen_devices,
)
from nvplug.testing.podresources_standin import FakePodResources

CHECKPOINT_FILE = "kubelet_internal_checkpoint"
# sun_path is 108 bytes including the NUL; gRPC's bind error for longer paths is cryptic.
_MAX_UNIX_PATH = 107

_SERVICE_REGISTRATION = "v1beta1.Registration"


class FakeKubelet(KubeletAdmission):
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
        self._conns: dict[str, PluginConnection] = {}
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

    def views(self, resource: str) -> list[PluginView]:
        """Every registration's view of `resource`, oldest first: the superseded ones, then the current."""
        current = self._plugins.get(resource)
        return [v for v in (*self._history, *([current] if current is not None else [])) if v.resource == resource]

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
        views = {r: ended_view(v, now, reason) if v.stream_open else v for r, v in self._plugins.items()}
        if forget:
            self._history = (*self._history, *views.values())
            views = {}
        self._plugins = MappingProxyType(views)
        await asyncio.gather(*(c.close() for c in conns.values()))

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

    async def _dial(self, req: pb.RegisterRequest) -> tuple[PluginConnection, PluginOptions]:
        """The dial-back inside Register; only one that succeeded takes a serial."""
        path, channel, options = await dial_plugin(self._dir, req, self._dial_timeout)
        self._serial += 1
        return PluginConnection(self._serial, req.resource_name, path, channel), options

    def _install(self, req: pb.RegisterRequest, conn: PluginConnection, options: PluginOptions) -> None:
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
            devices=old_view.devices if old_view is not None else frozen_devices({}),
        )
        if old_view is not None:
            ended = old_view
            if old_view.stream_open:
                ended = replace(old_view, stream_ended_at=now, stream_end="superseded by a newer registration")
            self._history = (*self._history, ended)
        self._conns[resource] = conn
        self._plugins = MappingProxyType({**self._plugins, resource: view})
        if old_conn is not None:
            asyncio.get_running_loop().create_task(old_conn.close())
        call = conn.list_and_watch()
        conn.task = asyncio.get_running_loop().create_task(
            self._watch(conn, call), name=f"ListAndWatch {resource} {conn.socket_path}"
        )

    async def _watch(
        self, conn: PluginConnection, call: grpc.aio.UnaryStreamCall[Message, pb.ListAndWatchResponse]
    ) -> None:
        try:
            async for resp in call:
                self._on_update(conn, resp)
        except grpc.aio.AioRpcError as e:
            how = rpc_error_text(e)
        else:
            how = "EOF"
        # Only a stream that ended on its own gets here; cancellation is recorded by the canceller.
        self._on_stream_end(conn, how)
        await conn.channel.close(None)

    def _on_update(self, conn: PluginConnection, resp: pb.ListAndWatchResponse) -> None:
        view = self._plugins.get(conn.resource)
        if view is None or view.serial != conn.serial:
            return
        upd = Update(at=time.monotonic(), devices=tuple(DeviceView.from_pb(d) for d in resp.devices))
        # Each message replaces the whole set; a missing ID is a removed device.
        devices = frozen_devices({d.id: d for d in upd.devices})
        self._publish(replace(view, updates=(*view.updates, upd), devices=devices))
        summary = " ".join(f"{d.id}={d.health}@{','.join(map(str, d.numa_nodes)) or '-'}" for d in upd.devices)
        self._emit(f"update {conn.resource}: {len(upd.devices)} devices, {len(upd.healthy_ids)} healthy [{summary}]")

    def _on_stream_end(self, conn: PluginConnection, how: str) -> None:
        if self._conns.get(conn.resource) is conn:
            del self._conns[conn.resource]
        view = self._plugins.get(conn.resource)
        if view is None or view.serial != conn.serial:
            return
        self._publish(ended_view(view, time.monotonic(), how))
        self._emit(f"stream-end {conn.resource} ({conn.socket_path}): {how}; all devices Unhealthy")

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
