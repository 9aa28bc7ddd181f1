"""The kubelet's DRA side, as a stand-in on real unix sockets.

Like the kubelet's plugin watcher it looks for sockets in plugins_registry (file names
starting with '.' are skipped), asks GetInfo, checks the type and the services, dials the
endpoint, and answers NotifyRegistrationStatus. It picks the DRA service as the kubelet
of its version would: 1.32 and 1.33 want v1beta1.DRAPlugin; 1.34 and later take the first
of the plugin's services they know (v1.DRAPlugin, v1beta1.DRAPlugin). Like the kubelet it
deletes its node's ResourceSlices when it starts (through the API-server stand-in). The real
1.32 kubelet does so in a goroutine, which landed up to 60 ms after it registered a plugin:
`late_wipe` makes this one wipe that long after its first registration instead. A kubelet of 1.35 or
later (ResourceHealthStatus on) watches each registered plugin's resource health
(DRAResourceHealth/NodeWatchResources), opening the stream again 5 s after it ends, and keeps what it
received in `health`: 1.35 and 1.36 call v1alpha1 whether GetInfo lists it or not; 1.37 and later
take the first of v1, v1beta1, v1alpha1 that GetInfo lists, and watch nothing if it lists none.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import grpc

from nvplug.protos import dra_health_v1alpha1_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2

DRA_PLUGIN = "DRAPlugin"
_MODULES = {"v1.DRAPlugin": dra_v1_pb2, "v1beta1.DRAPlugin": dra_v1beta1_pb2}
CALL_TIMEOUT = 10.0
# The kubelet opens a health stream that failed or ended again after this long.
HEALTH_RETRY = 5.0
# The health services a kubelet from 1.37 on knows, in the order it prefers them.
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")


@dataclass(frozen=True)
class HealthUpdate:
    """One NodeWatchResources response, as received: when, and each device's health and message."""

    at: float  # time.monotonic()
    devices: Mapping[str, tuple[str, str]]  # device name -> (HEALTHY/UNHEALTHY/UNKNOWN, message)
    timeout: Mapping[str, int]


class SliceStore(Protocol):
    def delete_slices(self, node: str) -> int: ...


@dataclass(frozen=True)
class Registration:
    driver: str
    endpoint: str
    service: str | None
    error: str | None
    socket: str

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Prepared:
    devices: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...]  # pool, device, requests, CDI IDs
    error: str


class DraKubelet:
    def __init__(
        self,
        registry_dir: Path,
        node: str,
        version: str = "1.34",
        apiserver: SliceStore | None = None,
        mounts: Mapping[str, Path] | None = None,
        late_wipe: float | None = None,
    ) -> None:
        """`mounts`: where a path the plugin names (its endpoint) is on this side, for a plugin in a
        container whose directories are bound from here (prefix -> host directory)."""
        self.registry_dir = registry_dir
        self.mounts = dict(mounts or {})
        self.node = node
        self.version = version
        self.apiserver = apiserver
        self.registrations: list[Registration] = []
        self.wiped = 0
        self.late_wipe = late_wipe
        # When each wipe came (time.monotonic()), and how many slices it deleted.
        self.wipes: list[tuple[float, int]] = []
        self._wipe_pending = False
        self.watch_health = tuple(int(p) for p in version.split(".")) >= (1, 35)
        self._picks_health = tuple(int(p) for p in version.split(".")) >= (1, 37)
        # The health service watched for each driver.
        self.health_services: dict[str, str] = {}
        self.health: list[HealthUpdate] = []
        self._health_threads: dict[str, threading.Thread] = {}
        # The registered plugin of each driver: its endpoint and service.
        self._plugins: dict[str, Registration] = {}
        self._seen: dict[str, tuple[int, int, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """As a starting kubelet: wipe the node's slices (at once, or `late_wipe` s after the first
        registration), then find the plugins already there."""
        self._wipe_pending = self.late_wipe is not None
        if not self._wipe_pending:
            self._wipe()
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._seen.clear()
        self._thread = threading.Thread(target=self._watch, name="dra kubelet", daemon=True)
        self._thread.start()

    def _wipe(self) -> None:
        if self.apiserver is not None:
            deleted = self.apiserver.delete_slices(self.node)
            self.wiped += deleted
            self.wipes.append((time.monotonic(), deleted))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            self._plugins.clear()

    def restart(self) -> None:
        self.stop()
        self.start()

    def plugin(self, driver: str) -> Registration | None:
        with self._lock:
            return self._plugins.get(driver)

    def accepted(self, driver: str) -> int:
        with self._lock:
            return sum(1 for r in self.registrations if r.driver == driver and r.ok)

    def prepare(self, driver: str, claims: list[tuple[str, str, str]]) -> dict[str, Prepared]:
        """NodePrepareResources for (namespace, name, uid) claims; the answer by claim UID."""
        pb, endpoint = self._service(driver)
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        response = self._call(endpoint, pb, "NodePrepareResources", request, pb.NodePrepareResourcesResponse)
        return {
            uid: Prepared(
                tuple((d.pool_name, d.device_name, tuple(d.request_names), tuple(d.cdi_device_ids)) for d in r.devices),
                r.error,
            )
            for uid, r in response.claims.items()
        }

    def unprepare(self, driver: str, claims: list[tuple[str, str, str]]) -> dict[str, str]:
        pb, endpoint = self._service(driver)
        request = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        response = self._call(endpoint, pb, "NodeUnprepareResources", request, pb.NodeUnprepareResourcesResponse)
        return {uid: r.error for uid, r in response.claims.items()}

    def _service(self, driver: str) -> tuple[ModuleType, str]:
        registration = self.plugin(driver)
        if registration is None or registration.service is None:
            raise RuntimeError(f"no DRA plugin registered for {driver}")
        return _MODULES[registration.service], self._here(registration.endpoint)

    def _here(self, path: str) -> str:
        for prefix, host in self.mounts.items():
            if path.startswith(prefix.rstrip("/") + "/"):
                return str(host / path[len(prefix.rstrip("/")) + 1 :])
        return path

    @staticmethod
    def _call(endpoint: str, pb: ModuleType, method: str, request: Any, reply: Any) -> Any:
        with grpc.insecure_channel(f"unix:{endpoint}") as channel:
            call = channel.unary_unary(
                f"/{pb.DESCRIPTOR.package}.DRAPlugin/{method}",
                request_serializer=type(request).SerializeToString,
                response_deserializer=reply.FromString,
            )
            return call(request, timeout=CALL_TIMEOUT)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.scan()
            self._stop.wait(0.02)

    def scan(self) -> None:
        """Register each new socket (one made again at a path counts as new, as inotify would tell: its
        inode number may be reused, its change time not); a vanished one deregisters."""
        found: dict[str, tuple[int, int, int]] = {}
        for entry in os.scandir(self.registry_dir):
            if entry.name.startswith("."):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                found[entry.path] = (st.st_dev, st.st_ino, st.st_ctime_ns)
        for path, key in found.items():
            if self._seen.get(path) != key:
                self._seen[path] = key
                self._register(path)
        for path in set(self._seen) - set(found):
            del self._seen[path]
            with self._lock:
                for driver, reg in list(self._plugins.items()):
                    if reg.socket == path:
                        del self._plugins[driver]

    def _register(self, path: str) -> None:
        pb = pluginregistration_pb2
        try:
            with grpc.insecure_channel(f"unix:{path}") as channel:
                info = channel.unary_unary(
                    "/pluginregistration.Registration/GetInfo",
                    request_serializer=pb.InfoRequest.SerializeToString,
                    response_deserializer=pb.PluginInfo.FromString,
                )(pb.InfoRequest(), timeout=CALL_TIMEOUT)
                service, error = self._validate(info)
                if error is None:
                    error = self._dial(self._here(info.endpoint))
                channel.unary_unary(
                    "/pluginregistration.Registration/NotifyRegistrationStatus",
                    request_serializer=pb.RegistrationStatus.SerializeToString,
                    response_deserializer=pb.RegistrationStatusResponse.FromString,
                )(pb.RegistrationStatus(plugin_registered=error is None, error=error or ""), timeout=CALL_TIMEOUT)
        except grpc.RpcError as err:
            self._seen.pop(path, None)  # try again on the next scan, as the plugin watcher retries
            record = Registration("", "", None, f"{path}: {err.code().name}: {err.details()}", path)
            with self._lock:
                self.registrations.append(record)
            return
        record = Registration(info.name, info.endpoint, service, error, path)
        with self._lock:
            self.registrations.append(record)
            if record.ok:
                self._plugins[info.name] = record
        health = self._health_service(list(info.supported_versions))
        if record.ok and self.watch_health and health is not None:
            self.health_services[info.name] = health
            self._watch_health(info.name)
        if record.ok and self._wipe_pending and self.late_wipe is not None:
            self._wipe_pending = False
            timer = threading.Timer(self.late_wipe, self._wipe)
            timer.daemon = True
            timer.start()

    def _health_service(self, listed: list[str]) -> str | None:
        if not self._picks_health:
            return HEALTH_SERVICES[-1]
        return next((s for s in HEALTH_SERVICES if s in listed), None)

    def _watch_health(self, driver: str) -> None:
        running = self._health_threads.get(driver)
        if running is not None and running.is_alive():
            return
        thread = threading.Thread(target=self._health_loop, args=(driver,), name=f"dra health {driver}", daemon=True)
        self._health_threads[driver] = thread
        thread.start()

    def _health_loop(self, driver: str) -> None:
        pb = dra_health_v1alpha1_pb2
        while not self._stop.is_set():
            registration = self.plugin(driver)
            if registration is None:
                return
            try:
                with grpc.insecure_channel(f"unix:{self._here(registration.endpoint)}") as channel:
                    stream = channel.unary_stream(
                        f"/{self.health_services[driver]}/NodeWatchResources",
                        request_serializer=pb.NodeWatchResourcesRequest.SerializeToString,
                        response_deserializer=pb.NodeWatchResourcesResponse.FromString,
                    )(pb.NodeWatchResourcesRequest())
                    for response in stream:
                        update = HealthUpdate(
                            time.monotonic(),
                            {
                                d.device.device_name: (pb.HealthStatus.Name(d.health), d.message)
                                for d in response.devices
                            },
                            {d.device.device_name: d.health_check_timeout_seconds for d in response.devices},
                        )
                        with self._lock:
                            self.health.append(update)
                        if self._stop.is_set():
                            stream.cancel()
                            return
            except grpc.RpcError:
                pass
            self._stop.wait(HEALTH_RETRY)

    def latest_health(self) -> HealthUpdate | None:
        with self._lock:
            return self.health[-1] if self.health else None

    def _validate(self, info: Any) -> tuple[str | None, str | None]:
        if info.type != DRA_PLUGIN:
            return None, f"type {info.type!r} is not {DRA_PLUGIN}"
        offered = list(info.supported_versions)
        if not offered:
            return None, "no supported versions"
        if self.version in ("1.32", "1.33"):
            if "v1beta1.DRAPlugin" in offered:
                return "v1beta1.DRAPlugin", None
            return None, f"{offered}: this kubelet would fall back to v1alpha4, which the plugin does not serve"
        service = next((s for s in offered if s in _MODULES), None)
        if service is None:
            return None, f"none of the plugin's services {offered} is supported by the kubelet ({list(_MODULES)})"
        return service, None

    @staticmethod
    def _dial(endpoint: str) -> str | None:
        try:
            with grpc.insecure_channel(f"unix:{endpoint}") as channel:
                grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT)
        except grpc.FutureTimeoutError:
            return f"cannot connect to {endpoint}"
        return None
