"""The status endpoint: /healthz, /status and /metrics of the real daemon, over HTTP on its socket."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import time
from pathlib import Path

import pytest
from support.scraped_metrics import scrape, value

from nvplug.base.backoff import Backoff
from nvplug.core.snapshot import Snapshot
from nvplug.status import status_client as statusclient
from nvplug.status.status_endpoint import StatusEndpoint
from nvplug.status.status_server import Peer, StatusServer, reason_class
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with

TIMEOUT = 15.0


def get(node: SimulatedNode, path: str) -> tuple[int, str]:
    deadline = time.monotonic() + TIMEOUT
    while not node.status_socket.exists():
        assert time.monotonic() < deadline, node.log_text()
        time.sleep(0.02)
    return statusclient.fetch(f"unix:{node.status_socket}", path, timeout=5)


def test_healthz_waits_for_registration(node: SimulatedNode) -> None:
    node.start_daemon()
    status, body = get(node, "/healthz")
    assert status == 503 and "waiting for kubelet.sock" in body
    node.kubelet.start()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while get(node, "/healthz")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert get(node, "/healthz") == (200, "ok\n")
    assert get(node, "/nope")[0] == 404
    assert oct(node.status_socket.stat().st_mode & 0o777) == "0o600"


def test_status_and_metrics_after_an_xid(node: SimulatedNode) -> None:
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    uuid = node.scenario_gpus()[5]["uuid"]
    node.control.xid(5, 79)
    node.kubelet.wait_for(device_health(uuid, healthy=False), TIMEOUT)
    status, body = get(node, "/status")
    assert status == 200
    doc = json.loads(body)
    assert doc["resources"] == [
        {"name": GPU_RESOURCE, "registered": True, "endpoint": node.plugin_socket.name, "devices": 8, "healthy": 7}
    ]
    gpu5 = next(g for g in doc["gpus"] if g["uuid"] == uuid)
    assert gpu5["health"] == "Unhealthy" and gpu5["reason"].startswith("XID 79 ")
    assert gpu5["advertised"] == {GPU_RESOURCE: [uuid]} and gpu5["numa_node"] == 1
    assert len(gpu5["nvlink_peers"]) == 7 and set(gpu5["nvlink_peers"].values()) == {18}

    m = scrape(node)
    assert value(m, "nvplug_devices", resource=GPU_RESOURCE, health="Healthy") == 7
    assert value(m, "nvplug_devices", resource=GPU_RESOURCE, health="Unhealthy") == 1
    assert value(m, "nvplug_health_transitions_total", to="unhealthy", reason="XID 79") == 1
    assert value(m, "nvplug_events_total", source="nvml", kind="XidOccurred") == 1
    assert value(m, "nvplug_events_total", source="nvml", kind="InventoryFound") == 1
    assert value(m, "nvplug_registrations_total", resource=GPU_RESOURCE) == 1
    assert value(m, "nvplug_registered", resource=GPU_RESOURCE) == 1
    # The XID's message and the first list both had their latency measured, in well under a second.
    assert value(m, "nvplug_event_to_list_and_watch_seconds_count", resource=GPU_RESOURCE) >= 2
    assert value(m, "nvplug_event_to_list_and_watch_seconds_bucket", resource=GPU_RESOURCE, le="1.0") >= 2
    assert value(m, "nvplug_build_info") == 1


def test_nvml_failure_shows_in_metrics_and_healthz(node: SimulatedNode) -> None:
    node.scenario.write_text(node.scenario.read_text().replace("init_error 0", "init_error 9"))
    node.kubelet.start()
    node.start_daemon()
    node.wait_log("NVML unavailable")
    node.wait_log("status endpoint on")  # opened after the first scan's failure is logged
    m = scrape(node)
    assert value(m, "nvplug_nvml_errors_total", function="nvmlInit") >= 1
    doc = json.loads(get(node, "/status")[1])
    assert "Driver Not Loaded" in doc["nvml_error"] and doc["gpus"] == []


def test_reason_classes_are_bounded() -> None:
    assert reason_class("XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM)") == "XID 79"
    assert reason_class("probe failed: GPU is lost") == "probe failed"
    assert reason_class("MIG 1g.10gb gi 3 ci 0 (MIG-abc): XID 79 X (RESTART_BM)") == "XID 79"
    assert reason_class("recovered: re-probe 2 of the Unhealthy GPU, probe passed") == "recovered"


def test_post_is_served_on_the_unix_socket_only_and_knows_the_caller(short_tmp: Path) -> None:
    seen: list[tuple[bytes, Peer]] = []

    async def record(body: bytes, peer: Peer) -> tuple[int, str, bytes]:
        seen.append((body, peer))
        return 200, "text/plain", b"done\n"

    def status() -> tuple[int, str, bytes]:
        return 200, "application/json", b"{}"

    async def scenario() -> list[tuple[int, str]]:
        with socket.socket() as probe:  # a free port on the loopback
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        servers = [
            StatusServer(f"unix:{short_tmp / 's.sock'}", {"/status": status}, {"/heal": record}),
            StatusServer(f":{port}", {}, {"/heal": record}),  # no host: the loopback
        ]
        for server in servers:
            await server.start()
        try:
            ask = functools.partial(asyncio.to_thread, statusclient.fetch)
            return [
                await ask(f"unix:{short_tmp / 's.sock'}", "/heal", 5, b'{"gpu": "0"}'),
                await ask(f"127.0.0.1:{port}", "/heal", 5, b'{"gpu": "0"}'),
                await ask(f":{port}", "/heal", 5, b'{"gpu": "0"}'),
                await ask(f"unix:{short_tmp / 's.sock'}", "/status", 5, b"{}"),
                await ask(f"unix:{short_tmp / 's.sock'}", "/nope", 5, b"{}"),
            ]
        finally:
            for server in servers:
                await server.stop()

    unix, tcp, tcp_no_host, other, unserved = asyncio.run(scenario())
    assert unix == (200, "done\n") and seen == [(b'{"gpu": "0"}', Peer(os.getpid(), os.getuid()))]
    assert tcp == tcp_no_host == (403, "POST is served on the unix socket only\n")
    assert other == (405, "GET /status only\n")  # a path served for GET
    assert unserved[0] == 404  # a path not served at all, whatever the method


def test_the_endpoint_serves_once_opened_and_an_address_in_use_costs_it_alone(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def ok() -> tuple[int, str, bytes]:
        return 200, "text/plain", b"ok\n"

    async def scenario() -> tuple[tuple[int, str], bool]:
        with socket.socket() as taken:  # an address someone else holds
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            busy = StatusEndpoint(StatusServer(f"127.0.0.1:{port}", {"/healthz": ok}))
            await busy.open(Snapshot(revision=0))  # logged, not raised: the GPUs are served without it
            await busy.close()
        path = short_tmp / "e.sock"
        endpoint = StatusEndpoint(StatusServer(f"unix:{path}", {"/healthz": ok}))
        await endpoint.open(Snapshot(revision=0))
        try:
            answer = await asyncio.to_thread(statusclient.fetch, f"unix:{path}", "/healthz", 5)
        finally:
            await endpoint.close()
            await endpoint.close()  # the daemon closes it twice (before the sources, and with the sinks)
        return answer, path.exists()

    with caplog.at_level(logging.ERROR):
        answer, left = asyncio.run(scenario())
    assert answer == (200, "ok\n") and not left
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("status endpoint 127.0.0.1:") and "unavailable" in m for m in said), said


def test_an_address_in_use_is_taken_once_it_is_free_and_said_meanwhile(caplog: pytest.LogCaptureFixture) -> None:
    """A port another exporter still holds (dcgm-exporter's 9400, while an operator moves off it): tried again
    with backoff, the status line saying why meanwhile, and served once the other lets go."""

    async def ok() -> tuple[int, str, bytes]:
        return 200, "text/plain", b"ok\n"

    async def scenario() -> tuple[list[str], object, tuple[int, str], list[str], object]:
        taken = socket.socket()
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = StatusServer(f"127.0.0.1:{port}", {"/metrics": ok}, name="metrics endpoint")
        endpoint = StatusEndpoint(server, backoff=Backoff(0.05, 0.2))
        await endpoint.open(Snapshot(revision=0))
        try:
            await asyncio.sleep(0.3)  # a few tries, all refused
            held = (endpoint.notes(), endpoint.status())
            taken.close()
            deadline = time.monotonic() + TIMEOUT
            while endpoint.error is not None:
                assert time.monotonic() < deadline, endpoint.status()
                await asyncio.sleep(0.02)
            answer = await asyncio.to_thread(statusclient.fetch, f"127.0.0.1:{port}", "/metrics", 5)
            return *held, answer, endpoint.notes(), endpoint.status()
        finally:
            await endpoint.close()

    with caplog.at_level(logging.WARNING):
        notes, held, answer, after, status = asyncio.run(scenario())
    assert len(notes) == 1 and notes[0].startswith("metrics endpoint 127.0.0.1:") and "in use" in notes[0], notes
    assert held == {"listen": notes[0].split()[2], "serving": False, "error": notes[0].split(": ", 1)[1]}
    assert answer == (200, "ok\n")
    assert after == [] and status == {"listen": notes[0].split()[2], "serving": True, "error": None}
    said = [r.getMessage() for r in caplog.records]
    # Said once, with what happens next; the tries that failed the same way are not said again.
    assert len(said) == 1 and said[0].endswith("; trying again with backoff"), said


def test_an_ipv6_address_in_brackets_is_served() -> None:
    """`[::]:9400`, as an address is written with its port: the brackets are not part of the host's name."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError as err:
            pytest.skip(f"no IPv6 loopback here: {err}")
        port = probe.getsockname()[1]

    async def scenario() -> tuple[int, str]:
        server = StatusServer(f"[::1]:{port}", {"/metrics": lambda: (200, "text/plain", b"up 1\n")})
        await server.start()
        try:
            return await asyncio.to_thread(statusclient.fetch, f"[::1]:{port}", "/metrics", 5)
        finally:
            await server.stop()

    assert asyncio.run(scenario()) == (200, "up 1\n")
