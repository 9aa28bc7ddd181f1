"""What operators see: /healthz, /status (JSON) and /metrics (Prometheus), on a local socket.

A small HTTP/1.1 server on the event loop itself (one request per
connection): the GET answers are read from the state, never from NVML, so a
scrape cannot disturb the kubelet's requests. POST routes act (`nvplug heal`);
they are served on the root-only unix socket alone, never on TCP, and know
who asked (SO_PEERCRED).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import inspect
import json
import logging
import os
import platform
import socket
import struct
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from nvplug import __version__, config
from nvplug.core.snapshot import Snapshot
from nvplug.kubelet.plugin_fleet import ResourceView
from nvplug.pods.pod_holders import Holder
from nvplug.status.prometheus_text import Collector, Counter, Family, Histogram, info_text

log = logging.getLogger(__name__)

MAX_REQUEST = 8192
READ_TIMEOUT = 5.0
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def reason_class(reason: str) -> str:
    """A bounded label for a health reason: `XID 79`, `probe failed`, `driver unbound from the PCI device`."""
    if reason.startswith("MIG ") and "): " in reason:
        reason = reason.split("): ", 1)[1]  # drop the MIG device's name: one label per reason, not per device
    head = reason.split(" (", 1)[0].split(":", 1)[0]
    words = head.split()
    if len(words) >= 2 and words[0] == "XID":
        return " ".join(words[:2])
    return head[:48]


def status_document(
    snapshot: Snapshot,
    resources: Sequence[ResourceView],
    plan_error: str | None,
    pods: Mapping[str, list[Holder]] | None = None,
    pods_error: str | None = None,
    excluded: Mapping[str, str] | None = None,
    dra: Mapping[str, list[dict[str, Any]]] | None = None,
    roots: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """`pods`: the holders by device UUID, from PodResources; None when unknown (`pods_error` says why).
    `excluded`: GPUs nvplug.devices leaves out, and why. `dra`: by GPU UUID, its devices in the DRA
    pool and the claims prepared with them. `roots`: where the daemon reads the node (Options.roots)."""
    excluded = excluded or {}
    dra = dra or {}

    def held(uuids: Sequence[str]) -> list[dict[str, object]] | None:
        return None if pods is None else [h.as_dict() for u in uuids for h in pods.get(u, [])]

    advertised: dict[str, dict[str, list[str]]] = {}
    for view in resources:
        for device in view.resource.devices:
            owner = device.gpu.uuid
            advertised.setdefault(owner, {}).setdefault(view.resource.name, []).append(device.id)
    gpus = []
    for gpu in snapshot.gpus:
        health = snapshot.health[gpu.uuid]
        peers = {
            other.uuid: link.nvlinks
            for other in snapshot.gpus
            if other.uuid != gpu.uuid and (link := snapshot.topology.link(gpu.uuid, other.uuid)).nvlinks
        }
        migs = []
        for mig in gpu.mig:
            own = snapshot.health.get(mig.uuid)
            migs.append(
                {
                    "uuid": mig.uuid,
                    "profile": mig.profile,
                    "gpu_instance": mig.gpu_instance,
                    "compute_instance": mig.compute_instance,
                    "health": own.health.value if own else None,
                    "reason": own.reason if own else None,
                    "waiting_for": own.waiting_for(gpu.bus_id, gpu.index) if own else None,
                    "pods": held([mig.uuid]),
                }
            )
        gpus.append(
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "bus_id": gpu.bus_id,
                "name": gpu.name,
                "memory_mib": gpu.memory_mib,
                "numa_node": gpu.numa_node,
                "minor": gpu.minor,
                "health": health.health.value,
                "reason": health.reason,
                "since": health.since,
                "clears": health.clears.value if health.clears else None,
                "evidence": health.evidence,
                # NVML's recovery action last read during the fault (0: none, or never asked for).
                "recovery_action": health.recovery_action,
                # Xids taken in this run, each once whether NVML, the kernel log or both reported it.
                "xids": snapshot.xids.get(gpu.uuid, 0),
                # nvplug's own resets (nvplug.health.autoReset): the last step, and how many this boot.
                "auto_reset": snapshot.auto_reset.get(gpu.uuid),
                "auto_resets": len(snapshot.auto_resets.get(gpu.uuid, ())),
                "waiting_for": health.waiting_for(gpu.bus_id, gpu.index),
                "advertised": advertised.get(gpu.uuid, {}),
                "excluded": excluded.get(gpu.uuid),
                "dra": dra.get(gpu.uuid),
                "nvlink_peers": peers,
                "mig": migs,
                # Who holds the GPU: whole, a replica of it, or one of its MIG devices.
                "pods": held([gpu.uuid, *(m.uuid for m in gpu.mig)]),
            }
        )
    return {
        "version": __version__,
        "revision": snapshot.revision,
        # Where the daemon reads the node (--sysfs-root and the like): doctor reads there too.
        "roots": dict(roots) if roots is not None else None,
        "nvml_error": snapshot.nvml_error,
        "health_watch_error": snapshot.health_watch_error,
        "kernel_log": {
            "error": snapshot.kernel_log_error,
            "seq": snapshot.kernel_log_seq,
            "lost": snapshot.kernel_log_lost,
            # Xids both NVML and the kernel log reported, taken in once.
            "matched": snapshot.xids_matched,
        },
        # SXids of the NVSwitches: a fabric signal, no GPU is Unhealthy for them.
        "nvswitches": [
            {"bus_id": bus, "switch": e.switch, "sxids": e.count, "last_code": e.last_code, "last": e.last_message}
            for bus, e in sorted(snapshot.switch_errors.items())
        ],
        "plan_error": plan_error,
        "pods_error": pods_error,
        "resources": [
            {
                "name": v.resource.name,
                "registered": v.registered,
                "endpoint": v.endpoint,
                "devices": len(v.resource.devices),
                "healthy": v.resource.healthy_count,
            }
            for v in resources
        ],
        "gpus": gpus,
    }


class Metrics:
    """The daemon's counters and the families read from the state at each scrape (no process-wide state)."""

    def __init__(
        self,
        resources: Callable[[], Sequence[ResourceView]],
        holders: Callable[[], Mapping[str, list[Holder]]] = dict,
        dra: Callable[[], Mapping[str, Any] | None] = lambda: None,
        snapshot: Callable[[], Snapshot] | None = None,
    ) -> None:
        # What is advertised, per resource (the fleet's views): the rejoin metric times each one.
        self.resources = resources
        self.events = Counter("nvplug_events", "Events received, by source and kind", ["source", "kind"])
        self.transitions = Counter(
            "nvplug_health_transitions", "Health transitions, by new health and reason", ["to", "reason"]
        )
        self.nvml_errors = Counter("nvplug_nvml_errors", "NVML failures, by the call that failed", ["function"])
        self.auto_reset = Counter(
            "nvplug_auto_reset_steps", "Steps of nvplug's own GPU resets, taken or refused", ["step"]
        )
        self.latency = Histogram(
            "nvplug_event_to_list_and_watch_seconds",
            "From an event's arrival to the ListAndWatch message that carries its effect",
            ["resource"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0),
        )
        self.rejoin = Histogram(
            "nvplug_kubelet_rejoin_to_list_and_watch_seconds",
            "From the kubelet's socket or nvplug's seen gone or new to the first ListAndWatch message after it",
            ["resource"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0),
        )
        build = {"version": __version__, "python": platform.python_version(), "grpcio": grpc.__version__}
        self._build = info_text("nvplug_build", "Build information", build)
        self._collectors: list[Collector] = [
            _ResourceCollector(resources, holders),
            _DraCollector(dra),
        ]
        if snapshot is not None:
            self._collectors.append(_NodeCollector(snapshot))

    def render(self) -> bytes:
        counted = (self.events, self.transitions, self.nvml_errors, self.auto_reset, self.latency, self.rejoin)
        parts = [*(m.text() for m in counted), self._build]
        parts += [family.text() for collector in self._collectors for family in collector.collect()]
        return "".join(parts).encode()


class _ResourceCollector:
    """Read at scrape time, so the gauges can never disagree with the state."""

    def __init__(
        self, resources: Callable[[], Sequence[ResourceView]], holders: Callable[[], Mapping[str, list[Holder]]]
    ) -> None:
        self._resources = resources
        self._holders = holders

    def collect(self) -> Iterator[Family]:
        devices = Family(
            "nvplug_devices", "Advertised devices, by resource and health", "gauge", labels=["resource", "health"]
        )
        registered = Family(
            "nvplug_registered", "1 when the resource is registered with the kubelet", "gauge", labels=["resource"]
        )
        ok = Family("nvplug_registrations", "Successful registrations with the kubelet", "counter", labels=["resource"])
        failed = Family("nvplug_registration_failures", "Failed registration attempts", "counter", labels=["resource"])
        for view in self._resources():
            name = view.resource.name
            healthy = view.resource.healthy_count
            devices.add_metric([name, "Healthy"], healthy)
            devices.add_metric([name, "Unhealthy"], len(view.resource.devices) - healthy)
            registered.add_metric([name], 1.0 if view.registered else 0.0)
            ok.add_metric([name], view.registrations)
            failed.add_metric([name], view.registration_failures)
        allocated = Family(
            "nvplug_device_allocated",
            "1 while a container holds the device (the kubelet's PodResources, read at scrape time)",
            "gauge",
            labels=["resource", "uuid", "namespace", "pod", "container"],
        )
        # A container may hold several replicas of one GPU: one series for it.
        held = self._holders().items()
        series = {(h.resource, uuid, h.namespace, h.pod, h.container) for uuid, hs in held for h in hs}
        for labels in sorted(series):
            allocated.add_metric(list(labels), 1.0)
        yield from (devices, registered, ok, failed, allocated)


class _NodeCollector:
    """What the state counts beside the devices: the kernel log reader's losses, NVSwitch SXids."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Family]:
        snap = self._snapshot()
        lost = Family(
            "nvplug_kernel_log_records_lost",
            "Kernel log records the reader missed (ring buffer overrun, seq jump)",
            "counter",
        )
        lost.add_metric([], snap.kernel_log_lost)
        readable = Family("nvplug_kernel_log_readable", "1 while the kernel log is read for GPU faults", "gauge")
        readable.add_metric([], 0.0 if snap.kernel_log_error else 1.0)
        sxids = Family(
            "nvplug_nvswitch_sxids",
            "NVSwitch SXids in the kernel log this boot",
            "counter",
            labels=["switch", "bus_id"],
        )
        for bus, errors in sorted(snap.switch_errors.items()):
            sxids.add_metric([errors.switch, bus], errors.count)
        up = Family(
            "nvplug_mps_daemon_up",
            "1 while the MPS group's control daemon answers",
            "gauge",
            labels=["group", "resource"],
        )
        restarts = Family(
            "nvplug_mps_daemon_restarts",
            "Restarts of the MPS group's control daemon",
            "counter",
            labels=["group", "resource"],
        )
        for name, group in sorted(snap.mps.items()):
            up.add_metric([name, group.resource], 1.0 if group.health.healthy else 0.0)
            restarts.add_metric([name, group.resource], group.restarts)
        exclusive = Family(
            "nvplug_mps_exclusive_process",
            "1 for a GPU nvplug put in EXCLUSIVE_PROCESS for MPS",
            "gauge",
            labels=["uuid"],
        )
        for uuid in sorted(snap.compute_modes):
            exclusive.add_metric([uuid], 1.0)
        yield from (lost, readable, sxids, up, restarts, exclusive)


class _DraCollector:
    """The DRA driver's pool and claims, from its status (nothing while DRA is off)."""

    def __init__(self, dra: Callable[[], Mapping[str, Any] | None]) -> None:
        self._dra = dra

    def collect(self) -> Iterator[Family]:
        doc = self._dra()
        if doc is None:
            return
        driver = [str(doc["driver"])]
        claims = Family("nvplug_dra_claims_prepared", "ResourceClaims prepared", "gauge", labels=["driver"])
        claims.add_metric(driver, len(doc["claims"]))
        pool = Family("nvplug_dra_pool_devices", "Devices published in the pool", "gauge", labels=["driver"])
        pool.add_metric(driver, float(doc["pool_devices"]))
        registered = Family(
            "nvplug_dra_registered", "1 when the kubelet registered the DRA plugin", "gauge", labels=["driver"]
        )
        registered.add_metric(driver, 1.0 if doc["registered"] else 0.0)
        published = Family(
            "nvplug_dra_slices_published",
            "1 when the API server holds the ResourceSlices as the pool is",
            "gauge",
            labels=["driver"],
        )
        published.add_metric(driver, 1.0 if doc["published"] and not doc["error"] else 0.0)
        tainted = Family(
            "nvplug_dra_device_tainted",
            "1 for each taint nvplug keeps on a device in its slice",
            "gauge",
            labels=["driver", "device", "taint"],
        )
        for device, taints in sorted((doc.get("tainted") or {}).items()):
            for taint in taints:
                tainted.add_metric([*driver, device, taint], 1.0)
        requests = Family(
            "nvplug_dra_slice_requests",
            "Requests that wrote the node's ResourceSlices, by verb and outcome (ok, an HTTP status, no answer)",
            "counter",
            labels=["driver", "verb", "outcome"],
        )
        for key, n in sorted((doc.get("requests") or {}).items()):
            verb, _, outcome = key.partition(" ")
            requests.add_metric([*driver, verb, outcome], float(n))
        written = Family(
            "nvplug_dra_slice_bytes_written", "Bytes of the ResourceSlices nvplug sent", "counter", labels=["driver"]
        )
        written.add_metric(driver, float(doc.get("bytes_written", 0)))
        coalesced = Family(
            "nvplug_dra_slice_changes_coalesced",
            "Changes of the pool written together with a later one (the write budget)",
            "counter",
            labels=["driver"],
        )
        coalesced.add_metric(driver, float(doc.get("changes_coalesced", 0)))
        yield from (claims, pool, registered, published, tainted, requests, written, coalesced)
        if doc.get("taints_kept") is not None:
            kept = Family(
                "nvplug_dra_taints_kept",
                "1 when the API server keeps device taints, 0 when it drops them",
                "gauge",
                labels=["driver"],
            )
            kept.add_metric(driver, 1.0 if doc["taints_kept"] else 0.0)
            yield kept


Answer = tuple[int, str, bytes]
Route = Callable[[], Answer | Awaitable[Answer]]


@dataclass(frozen=True)
class Peer:
    """Who is at the other end of the unix socket, as the kernel says."""

    pid: int
    uid: int

    def __str__(self) -> str:
        return f"uid {self.uid} (pid {self.pid})"


# A POST handler gets the request body and the peer.
PostRoute = Callable[[bytes, Peer], Awaitable[Answer]]


class StatusServer:
    """`unix:/path` (mode 0600) or `host:port`; `off` serves nothing. `name`: what the log calls it."""

    def __init__(
        self,
        listen: str,
        routes: Mapping[str, Route],
        posts: Mapping[str, PostRoute] | None = None,
        name: str = "status endpoint",
    ) -> None:
        self.listen = listen
        self.name = name
        self._routes = routes
        self._posts = posts or {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        if self.listen == "off":
            return
        if self.listen.startswith("unix:"):
            path = _prepare_socket_path(Path(self.listen[5:]))
            old = os.umask(0o177)  # root alone may ask
            try:
                self._server = await asyncio.start_unix_server(self._serve, path=str(path))
            finally:
                os.umask(old)
        else:
            server = await asyncio.start_server(self._serve, *config.tcp_address(self.listen))
            if not server.sockets:
                # asyncio skips each address whose socket cannot be made, and serves none without a word.
                server.close()
                raise OSError(
                    errno.EAFNOSUPPORT, f"no socket can be made for {self.listen}: {os.strerror(errno.EAFNOSUPPORT)}"
                )
            self._server = server
        log.info("%s on %s (%s)", self.name, self.listen, ", ".join([*self._routes, *self._posts]))

    @property
    def serving(self) -> bool:
        return self._server is not None

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()
            if self.listen.startswith("unix:"):
                _prepare_socket_path(Path(self.listen[5:]))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # One deadline for the request (a timeout, not wait_for: no task of its own for each read).
            async with asyncio.timeout(READ_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, _, headers = head.decode("latin-1").partition("\r\n")
                method, target, _ = request_line.split(" ", 2)
                length = _content_length(headers)
                # Read whatever was sent before answering: a client still writing would get EPIPE.
                data = await reader.readexactly(length) if 0 <= length <= MAX_REQUEST else None
            if data is None:
                status, ctype, body = 413, "text/plain", b"request body too large\n"
            else:
                status, ctype, body = await self._answer(method, target.split("?", 1)[0], data, writer)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            status, ctype, body = 400, "text/plain", b"bad request\n"
        writer.write(
            f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        )
        writer.write(body)  # not joined to the head: a busy node's /metrics is half a megabyte to copy
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    async def _answer(self, method: str, path: str, data: bytes, writer: asyncio.StreamWriter) -> Answer:
        if path not in self._routes and path not in self._posts:
            return 404, "text/plain", f"try {', '.join(self._routes)}\n".encode()
        if method == "POST" and path in self._posts:
            peer = _peer(writer)
            if peer is None:
                # Acting on a GPU is for root on the node, never for whoever reaches a TCP port.
                return 403, "text/plain", b"POST is served on the unix socket only\n"
            return await self._posts[path](data, peer)
        if method != "GET" or path not in self._routes:
            return 405, "text/plain", f"GET {path} only\n".encode() if path in self._routes else b"POST only\n"
        answer = self._routes[path]()
        return await answer if inspect.isawaitable(answer) else answer


def _content_length(headers: str) -> int:
    for line in headers.split("\r\n"):
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            return int(value.strip())
    return 0


def _peer(writer: asyncio.StreamWriter) -> Peer | None:
    """The peer of a unix socket connection; None on TCP."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return Peer(pid, uid)


_REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Content Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def _prepare_socket_path(path: Path) -> Path:
    """Our directory, and no stale socket of ours in the way; anything else is left alone."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if path.is_socket():
            path.unlink()
    return path


def json_answer(document: dict[str, Any]) -> Answer:
    return 200, "application/json", json.dumps(document, indent=1).encode() + b"\n"
