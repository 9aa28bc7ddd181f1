"""Tests of the kubelet stand-in against a small in-test device plugin on real unix sockets."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.kubelet_plugin_client import KubeletError
from nvplug.testing.kubelet_thread import KubeletThread
from nvplug.testing.kubelet_validation import extended_resource_name_error
from nvplug.testing.loop_thread import LoopThread

RES = "example.com/gpu"


def dev(id_: str, health: str = "Healthy", numa: tuple[int, ...] = ()) -> pb.Device:
    d = pb.Device(ID=id_, health=health)
    if numa:
        d.topology.nodes.extend(pb.NUMANode(ID=n) for n in numa)
    return d


class FakePlugin:
    """A minimal DevicePlugin server: scripted answers, records what the kubelet asked."""

    def __init__(
        self,
        directory: Path,
        endpoint: str = "plug.sock",
        devices: list[pb.Device] | None = None,
        options: pb.DevicePluginOptions | None = None,
    ) -> None:
        self.path = directory / endpoint
        self.endpoint = endpoint
        self.devices = devices if devices is not None else [dev("gpu0", numa=(0,)), dev("gpu1", numa=(1,))]
        self.options = options or pb.DevicePluginOptions(
            pre_start_required=True, get_preferred_allocation_available=True
        )
        self.calls: list[str] = []
        self.allocate_requests: list[pb.AllocateRequest] = []
        self.preferred_requests: list[pb.PreferredAllocationRequest] = []
        self.prestart_requests: list[pb.PreStartContainerRequest] = []
        self.allocate_error: tuple[grpc.StatusCode, str] | None = None
        self.allocate_empty = False
        self.preferred_answer: list[str] = []
        self.queues: list[asyncio.Queue[pb.ListAndWatchResponse | None]] = []
        self.streams_cancelled = 0
        self.stream_cancelled = asyncio.Event()
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        h: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                self._options,
                request_deserializer=pb.Empty.FromString,
                response_serializer=pb.DevicePluginOptions.SerializeToString,
            ),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                self._list_and_watch,
                request_deserializer=pb.Empty.FromString,
                response_serializer=pb.ListAndWatchResponse.SerializeToString,
            ),
            "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
                self._preferred,
                request_deserializer=pb.PreferredAllocationRequest.FromString,
                response_serializer=pb.PreferredAllocationResponse.SerializeToString,
            ),
            "Allocate": grpc.unary_unary_rpc_method_handler(
                self._allocate,
                request_deserializer=pb.AllocateRequest.FromString,
                response_serializer=pb.AllocateResponse.SerializeToString,
            ),
            "PreStartContainer": grpc.unary_unary_rpc_method_handler(
                self._prestart,
                request_deserializer=pb.PreStartContainerRequest.FromString,
                response_serializer=pb.PreStartContainerResponse.SerializeToString,
            ),
        }
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", h),))
        self.server.add_insecure_port(f"unix:{self.path}")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)

    async def register(
        self,
        resource: str = RES,
        version: str = "v1beta1",
        endpoint: str | None = None,
        request_options: pb.DevicePluginOptions | None = None,
    ) -> None:
        await register(self.path.parent, resource, endpoint or self.endpoint, version, request_options)

    def push(self, devices: list[pb.Device] | None) -> None:
        """Send an update on every open stream; None ends the streams cleanly (EOF)."""
        msg = None if devices is None else pb.ListAndWatchResponse(devices=devices)
        for q in self.queues:
            q.put_nowait(msg)

    async def _options(self, req: pb.Empty, ctx: object) -> pb.DevicePluginOptions:
        self.calls.append("GetDevicePluginOptions")
        return self.options

    async def _list_and_watch(self, req: pb.Empty, ctx: object) -> AsyncIterator[pb.ListAndWatchResponse]:
        self.calls.append("ListAndWatch")
        q: asyncio.Queue[pb.ListAndWatchResponse | None] = asyncio.Queue()
        self.queues.append(q)
        try:
            yield pb.ListAndWatchResponse(devices=self.devices)
            while (msg := await q.get()) is not None:
                yield msg
        except asyncio.CancelledError:
            self.streams_cancelled += 1
            self.stream_cancelled.set()
            raise
        finally:
            self.queues.remove(q)

    async def _preferred(self, req: pb.PreferredAllocationRequest, ctx: object) -> pb.PreferredAllocationResponse:
        self.preferred_requests.append(req)
        return pb.PreferredAllocationResponse(
            container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=self.preferred_answer)]
        )

    async def _allocate(self, req: pb.AllocateRequest, ctx: grpc.aio.ServicerContext[Any, Any]) -> pb.AllocateResponse:
        self.allocate_requests.append(req)
        if self.allocate_error is not None:
            await ctx.abort(*self.allocate_error)
        if self.allocate_empty:
            return pb.AllocateResponse()
        ids = ",".join(req.container_requests[0].devices_ids)
        return pb.AllocateResponse(
            container_responses=[pb.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": ids})]
        )

    async def _prestart(self, req: pb.PreStartContainerRequest, ctx: object) -> pb.PreStartContainerResponse:
        self.prestart_requests.append(req)
        return pb.PreStartContainerResponse()


async def register(
    directory: Path,
    resource: str,
    endpoint: str,
    version: str = "v1beta1",
    options: pb.DevicePluginOptions | None = None,
) -> None:
    async with grpc.aio.insecure_channel(f"unix:{directory / 'kubelet.sock'}") as ch:
        rpc = ch.unary_unary(
            "/v1beta1.Registration/Register",
            request_serializer=pb.RegisterRequest.SerializeToString,
            response_deserializer=pb.Empty.FromString,
        )
        req = pb.RegisterRequest(version=version, endpoint=endpoint, resource_name=resource)
        if options is not None:
            req.options.CopyFrom(options)
        await rpc(req, timeout=15)


Scenario = Callable[[FakeKubelet, FakePlugin], Awaitable[None]]


def run_with(directory: Path, scenario: Scenario, **kubelet_kw: Any) -> None:
    """Start a stand-in and a plugin in `directory`, run the scenario, tear both down."""

    async def main() -> None:
        kubelet = FakeKubelet(directory, **kubelet_kw)
        await kubelet.start()
        plugin = FakePlugin(directory)
        await plugin.start()
        try:
            await asyncio.wait_for(scenario(kubelet, plugin), 20)
        finally:
            await kubelet.stop()
            await plugin.stop()

    asyncio.run(main())


def is_socket(p: Path) -> bool:
    return p.exists() and p.is_socket()


# ---------------------------------------------------------------------------


def test_register_dials_back_and_records_updates(tmp_path: Path) -> None:
    async def scenario(k: FakeKubelet, p: FakePlugin) -> None:
        t0 = time.monotonic()
        # Request options differ from what the plugin serves: the kubelet asks the plugin.
        await p.register(request_options=pb.DevicePluginOptions())
        # Options were fetched inside Register, before it returned.
        assert p.calls[0] == "GetDevicePluginOptions"
        view = k.plugin(RES)
        assert view is not None
        assert view.endpoint == "plug.sock"
        assert view.socket_path == p.path
        assert view.options.pre_start_required and view.options.get_preferred_allocation_available
        [rec] = k.registrations
        assert rec.accepted and rec.error is None and rec.version == "v1beta1"
        assert rec.request_options is not None and not rec.request_options.pre_start_required

        await k.wait_for(lambda k: k.capacity(RES) == 2, 5)
        assert k.allocatable(RES) == 2
        view = k.plugin(RES)
        assert view is not None
        assert view.devices["gpu0"].numa_nodes == (0,)
        assert view.updates[0].ids == ("gpu0", "gpu1")
        assert view.updates[0].at >= t0

        # A new message replaces the whole set; an unknown health string is unhealthy.
        p.push([dev("gpu0", "Unhealthy"), dev("gpu2", "healthy"), dev("gpu3")])
        await k.wait_for(lambda k: len(k.plugins[RES].updates) == 2, 5)
        view = k.plugins[RES]
        assert set(view.devices) == {"gpu0", "gpu2", "gpu3"}
        assert (k.capacity(RES), k.allocatable(RES)) == (3, 1)
        assert view.healthy_ids == ("gpu3",)
        assert view.updates[1].at >= view.updates[0].at
        assert view.stream_open

    run_with(tmp_path, scenario)


def test_resource_name_rules() -> None:
    ok = ["example.com/gpu", "nvidia.com/gpu", "a/b", "x.y/Gpu_1.v-2", "e.com/" + "a" * 63]
    bad = [
        "gpu",  # no domain
        "kubernetes.io/gpu",
        "sub.kubernetes.io/gpu",
        "requests.example.com/gpu",
        "/gpu",
        "example.com/",
        "Example.com/gpu",  # prefix must be lowercase
        "example.com/a/b",
        "example.com/-gpu",
        "example.com/gpu_",
        "example.com/" + "a" * 64,
        "a" * 245 + "/gpu",  # 'requests.' + prefix exceeds 253
    ]
    for name in ok:
        assert extended_resource_name_error(name) is None, name
    for name in bad:
        assert extended_resource_name_error(name) is not None, name
    assert extended_resource_name_error("a" * 244 + "/gpu") is None


def test_register_rejects_bad_version_and_name(tmp_path: Path) -> None:
    async def scenario(k: FakeKubelet, p: FakePlugin) -> None:
        for version, resource in (("v1alpha1", RES), ("v1beta1", "kubernetes.io/gpu"), ("v1beta1", "gpu")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await p.register(resource=resource, version=version)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [r.accepted for r in k.registrations] == [False] * 3
        assert "v1alpha1" in (k.registrations[0].error or "")
        assert "kubernetes.io" in (k.registrations[1].error or "")
        assert p.calls == []  # no dial-back for a rejected request
        assert k.plugins == {}

    run_with(tmp_path, scenario)


def test_register_fails_when_dial_back_fails(tmp_path: Path) -> None:
    async def scenario(k: FakeKubelet, p: FakePlugin) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await p.register(endpoint="missing.sock")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "missing.sock" in (err.value.details() or "")
        [rec] = k.registrations
        assert not rec.accepted and "missing.sock" in (rec.error or "")
        assert k.capacity(RES) == 0

    run_with(tmp_path, scenario, dial_timeout=0.3)


def test_stream_end_marks_everything_unhealthy(tmp_path: Path) -> None:
    async def scenario(k: FakeKubelet, p: FakePlugin) -> None:
        await p.register()
        await k.wait_for(lambda k: k.allocatable(RES) == 2, 5)
        p.push(None)  # clean EOF
        await k.wait_for(lambda k: not k.plugins[RES].stream_open, 5)
        view = k.plugins[RES]
        assert view.stream_end == "EOF"
        assert view.stream_ended_at is not None
        assert (k.capacity(RES), k.allocatable(RES)) == (2, 0)
        assert all(d.health == "Unhealthy" for d in view.devices.values())
        with pytest.raises(KubeletError, match="stream ended"):
            await k.allocate(RES, ["gpu0"])

        # Re-register, then the plugin dies: the error is recorded.
        await p.register()
        await k.wait_for(lambda k: k.allocatable(RES) == 2, 5)
        await p.stop()
        await k.wait_for(lambda k: not k.plugins[RES].stream_open, 5)
        assert k.plugins[RES].stream_end != "EOF"
        assert k.allocatable(RES) == 0

    run_with(tmp_path, scenario)


def test_newest_registration_wins(tmp_path: Path) -> None:
    async def scenario(k: FakeKubelet, p: FakePlugin) -> None:
        await p.register()
        await k.wait_for(lambda k: k.allocatable(RES) == 2, 5)
        p2 = FakePlugin(tmp_path, "plug2.sock", devices=[dev("gpu9")])
        await p2.start()
        try:
            await p2.register()
            view = k.plugins[RES]
            assert view.endpoint == "plug2.sock"
            # The old device set stands until the new plugin's first update.
            await k.wait_for(lambda k: k.capacity(RES) == 1, 5)
            assert k.allocatable(RES) == 1
            # The old stream was cancelled, and that did not touch the new registration.
            await asyncio.wait_for(p.stream_cancelled.wait(), 5)
            assert p.streams_cancelled == 1
            assert k.plugins[RES].stream_open
            [old] = k.history
            assert old.endpoint == "plug.sock" and not old.stream_open
            assert "superseded" in (old.stream_end or "")
            assert k.accepted_registrations(RES) == 2
            resp = await k.allocate(RES, ["gpu9"])
            assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "gpu9"
            assert p.allocate_requests == [] and len(p2.allocate_requests) == 1
        finally:
            await p2.stop()

    run_with(tmp_path, scenario)


def test_allocate_preferred_and_prestart(tmp_path: Path) -> None:
    async def scenario(k: FakeKubelet, p: FakePlugin) -> None:
        await p.register()
        resp = await k.allocate(RES, ["gpu0", "gpu1"])
        assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "gpu0,gpu1"
        [req] = p.allocate_requests
        assert len(req.container_requests) == 1  # one container per call, like the kubelet

        p.allocate_error = (grpc.StatusCode.FAILED_PRECONDITION, "gpu0 is unhealthy")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await k.allocate(RES, ["gpu0"])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        p.allocate_error = None
        p.allocate_empty = True
        with pytest.raises(KubeletError, match="no container responses"):
            await k.allocate(RES, ["gpu0"])

        p.preferred_answer = ["gpu1"]
        got = await k.preferred_allocation(RES, ["gpu0", "gpu1"], ["gpu1"], 1)
        assert got == ["gpu1"]
        [preq] = p.preferred_requests
        c = preq.container_requests[0]
        assert (list(c.available_deviceIDs), list(c.must_include_deviceIDs), c.allocation_size) == (
            ["gpu0", "gpu1"],
            ["gpu1"],
            1,
        )

        await k.pre_start(RES, ["gpu0"])
        assert list(p.prestart_requests[0].devices_ids) == ["gpu0"]

        with pytest.raises(KubeletError, match="no plugin registered"):
            await k.allocate("example.com/other", ["x"])

    run_with(tmp_path, scenario)


def test_optional_rpcs_follow_the_options(tmp_path: Path) -> None:
    async def scenario(k: FakeKubelet, p: FakePlugin) -> None:
        p.options = pb.DevicePluginOptions()
        await p.register()
        with pytest.raises(KubeletError, match="get_preferred_allocation_available"):
            await k.preferred_allocation(RES, ["gpu0"], [], 1)
        with pytest.raises(KubeletError, match="pre_start_required"):
            await k.pre_start(RES, ["gpu0"])
        assert await k.preferred_allocation(RES, ["gpu0"], [], 1, check_options=False) == []
        assert p.preferred_requests and not p.prestart_requests

    run_with(tmp_path, scenario)


def _make_unix_socket(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    return s


def test_restart_deletes_sockets_only_and_forgets_plugins(tmp_path: Path) -> None:
    (tmp_path / "kubelet_internal_checkpoint").write_text("{}")
    (tmp_path / "notes.txt").write_text("keep")
    (tmp_path / "subdir").mkdir()
    inner = _make_unix_socket(tmp_path / "subdir" / "inner.sock")
    stray = _make_unix_socket(tmp_path / "stray.sock")

    async def scenario(k: FakeKubelet, p: FakePlugin) -> None:
        await p.register()
        await k.wait_for(lambda k: k.allocatable(RES) == 2, 5)
        await k.restart()
        assert k.restarts == 1
        assert not p.path.exists()
        assert not (tmp_path / "stray.sock").exists()
        assert is_socket(k.socket_path)
        assert (tmp_path / "kubelet_internal_checkpoint").read_text() == "{}"
        assert (tmp_path / "notes.txt").exists()
        assert is_socket(tmp_path / "subdir" / "inner.sock")
        # Capacity is 0 until the plugin registers again.
        assert k.plugins == {} and k.capacity(RES) == 0
        assert k.history[-1].stream_end == "kubelet restarted"
        # The plugin rebinds and registers again.
        await p.stop()
        p.queues.clear()
        await p.start()
        await p.register()
        await k.wait_for(lambda k: k.allocatable(RES) == 2, 5)
        assert k.accepted_registrations(RES) == 2

    try:
        run_with(tmp_path, scenario)
    finally:
        inner.close()
        stray.close()


def test_start_cleans_sockets_and_stop_removes_kubelet_sock(tmp_path: Path) -> None:
    stale = _make_unix_socket(tmp_path / "stale.sock")

    async def main() -> None:
        k = FakeKubelet(tmp_path)
        await k.start()
        assert not (tmp_path / "stale.sock").exists()
        assert is_socket(k.socket_path)
        serving = [k.serving]
        await k.stop()
        serving.append(k.serving)
        assert serving == [True, False]
        assert not k.socket_path.exists()
        keep = FakeKubelet(tmp_path, clean_on_start=False)
        s2 = _make_unix_socket(tmp_path / "other.sock")
        await keep.start()
        assert is_socket(tmp_path / "other.sock")
        await keep.stop()
        s2.close()

    try:
        asyncio.run(main())
    finally:
        stale.close()


def test_wait_for_timeout_describes_state(tmp_path: Path) -> None:
    async def scenario(k: FakeKubelet, p: FakePlugin) -> None:
        await p.register()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            await k.wait_for(lambda k: k.capacity(RES) == 5, 0.2)
        assert time.monotonic() - t0 < 2
        msg = str(err.value)
        assert RES in msg and "plug.sock" in msg and "registrations" in msg

    run_with(tmp_path, scenario)


# ---------------------------------------------------------------------------
# The sync wrapper, with the plugin on another thread's loop (like another process)


def test_kubelet_thread(tmp_path: Path) -> None:
    events: list[str] = []
    other = LoopThread()
    try:
        with KubeletThread(tmp_path, on_event=events.append) as k:
            assert is_socket(k.socket_path)
            p = FakePlugin(tmp_path)
            other.run(p.start())
            other.run(p.register())
            k.wait_for(lambda k: k.allocatable(RES) == 2, 5)
            assert k.capacity(RES) == 2 and k.registrations[0].accepted
            resp = k.allocate(RES, ["gpu1"])
            assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "gpu1"
            p.preferred_answer = ["gpu0"]
            assert k.preferred_allocation(RES, ["gpu0", "gpu1"], [], 1) == ["gpu0"]
            k.pre_start(RES, ["gpu1"])
            with pytest.raises(TimeoutError):
                k.wait_for(lambda k: k.capacity(RES) == 9, 0.1)
            k.restart()
            assert k.restarts == 1 and k.capacity(RES) == 0 and not p.path.exists()
            other.run(p.stop())
        assert not k.socket_path.exists() and not k.serving
        assert any(e.startswith("register") for e in events)
        assert any(e.startswith("update") for e in events)
        with pytest.raises(KubeletError, match="not running"):
            k.allocate(RES, ["gpu0"])
        # Reads still work after stop.
        assert len(k.registrations) == 1
    finally:
        other.close()


def test_cli_prints_registrations_and_updates(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nvplug.testing.kubelet_standin", "--dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        deadline = time.monotonic() + 15
        while not is_socket(tmp_path / "kubelet.sock"):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "stand-in did not create kubelet.sock"
            time.sleep(0.02)

        async def plugin_session() -> None:
            p = FakePlugin(tmp_path)
            await p.start()
            try:
                await p.register()
                await asyncio.sleep(0.3)  # let the first update reach the stand-in
            finally:
                await p.stop()

        asyncio.run(plugin_session())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert f"register {RES!r} endpoint='plug.sock'" in out
    assert "update example.com/gpu: 2 devices, 2 healthy" in out
    assert "stopped" in out
    assert not (tmp_path / "kubelet.sock").exists()
