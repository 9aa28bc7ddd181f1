"""Bad input, on purpose: what the kubelet never sends, what an operator should never write.

1. gRPC requests straight to the real daemon's socket (SimulatedNode, kubelet stand-in):
   empty, unknown, repeated, oversized and undecodable requests each get a clear gRPC error,
   and the daemon keeps running in the same state.
2. Property-based (hypothesis), in-process: the Allocate and GetPreferredAllocation answers
   are valid or an AllocationError, never another exception; the config loader loads or
   raises ConfigError, and what loads round-trips through `to_yaml`.
3. Config files through the daemon's SIGHUP reload: a YAML bomb and a file over MAX_BYTES
   are refused with an error in the log, and the config in force stays.

Every bad input tried is counted; the total is printed when the module is done.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvplug import config
from nvplug.cli import cli_arguments
from nvplug.core.events import HealthReported, InventoryFound
from nvplug.core.gpu import Gpu
from nvplug.core.node_state import NodeState
from nvplug.core.topology import Link, PcieLevel, Topology
from nvplug.kubelet.allocation import (
    LIST_STRATEGIES,
    VISIBLE_DEVICES_ENV,
    AllocationError,
    AllocationPolicy,
    allocate,
    preferred,
)
from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.protos import deviceplugin_pb2_grpc as pb_grpc
from nvplug.shaping.resource_plan import REPLICA_SEPARATOR, Resource, ResourceSpec
from nvplug.testing.kubelet_views import DeviceView
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with

TIMEOUT = 15.0
# "Within a second or so" for a 10,000-element request, with room for a slow CI machine.
BIG_REQUEST_S = 1.5
BIG = 10_000

# Inputs tried, by group, and how many of them were good enough to answer or load (the
# generated ones include some); printed at the end of the module.
TRIED: Counter[str] = Counter()
ACCEPTED: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_count(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    total, good = sum(TRIED.values()), sum(ACCEPTED.values())
    parts = ", ".join(f"{group}: {n}" for group, n in sorted(TRIED.items()))
    accepted = ", ".join(f"{group}: {n}" for group, n in sorted(ACCEPTED.items()))
    line = (
        f"test_bad_input: {total} inputs tried ({parts}); {total - good} of them refused as bad, "
        f"{good} answered or loaded ({accepted})"
    )
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line)
        return
    # Past pytest's capture, so that it shows in a plain run.
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(line)


# =====================================================================================
# 1. gRPC requests against the real daemon
# =====================================================================================


class Live:
    """A running daemon, the stand-in it registered with, and a raw channel to its socket."""

    def __init__(self, node: SimulatedNode) -> None:
        self.node = node
        self.channel = grpc.insecure_channel(f"unix://{node.plugin_socket}")
        self.stub = pb_grpc.DevicePluginStub(self.channel)
        self.uuids = [g["uuid"] for g in node.scenario_gpus()]
        self.baseline = self.devices()
        self.registrations = node.kubelet.accepted_registrations(GPU_RESOURCE)

    def devices(self) -> dict[str, DeviceView]:
        plugin = self.node.kubelet.plugin(GPU_RESOURCE)
        assert plugin is not None
        return dict(plugin.devices)

    def raw(self, method: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
        """A call that sends bytes as they are and hands back the bytes of the answer."""
        return self.channel.unary_unary(
            f"/v1beta1.DevicePlugin/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )

    def assert_unharmed(self) -> None:
        """Same pid, alive, same device list on the same stream, and a normal Allocate works."""
        daemon = self.node.daemon
        assert daemon is not None and daemon.poll() is None, self.node.log_text()[-3000:]
        os.kill(daemon.pid, 0)
        plugin = self.node.kubelet.plugin(GPU_RESOURCE)
        assert plugin is not None and plugin.stream_open
        assert self.devices() == self.baseline
        assert self.node.kubelet.accepted_registrations(GPU_RESOURCE) == self.registrations
        one = self.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[self.uuids[0]])]),
            timeout=5,
        )
        assert one.container_responses[0].envs[VISIBLE_DEVICES_ENV] == self.uuids[0]
        via_kubelet = self.node.kubelet.allocate(GPU_RESOURCE, [self.uuids[1]], timeout=5)
        assert via_kubelet.container_responses[0].envs[VISIBLE_DEVICES_ENV] == self.uuids[1]

    def close(self) -> None:
        self.channel.close()


def _start(node: SimulatedNode) -> Live:
    node.kubelet.start()
    node.start_daemon(log_level="info")
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    return Live(node)


@pytest.fixture(scope="module")
def live(nvml_lib_dir: Path) -> Iterator[Live]:
    """One daemon for the whole group: each case checks that it left it as it found it."""
    root = Path(tempfile.mkdtemp(prefix="nvp-bad-", dir="/tmp"))
    node = SimulatedNode(root, lib_dir=nvml_lib_dir)
    rig: Live | None = None
    try:
        rig = _start(node)
        yield rig
    finally:
        if rig is not None:
            rig.close()
        node.close()
        print(f"--- daemon log ({node.log_path}) ---\n{node.log_text()[-5000:]}")
        shutil.rmtree(root, ignore_errors=True)


def _alloc(*containers: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])


def _pref(available: list[str], must: list[str], size: int) -> pb.PreferredAllocationRequest:
    creq = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
    )
    return pb.PreferredAllocationRequest(container_requests=[creq])


def _refused(call: Callable[[], Any], code: grpc.StatusCode, pattern: str) -> str:
    """The call fails with `code` and details matching `pattern`; returns the details."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    err: Any = info.value  # a sync channel's errors are grpc.Call too
    details = err.details() or ""
    assert err.code() == code, (err.code(), details[:300])
    assert re.search(pattern, details), details[:300]
    return details


# Each: the container requests, and the refusal's pattern. The UUIDs are filled in per run.
ALLOCATE_REFUSALS: list[tuple[str, Callable[[list[str]], list[list[str]]], str]] = [
    ("empty ID list", lambda u: [[]], r"nvidia\.com/gpu: the request names no device"),
    ("unknown ID", lambda u: [["GPU-does-not-exist"]], r"unknown device ID 'GPU-does-not-exist'"),
    ("empty-string ID", lambda u: [[""]], r"unknown device ID ''"),
    ("unknown after known", lambda u: [[u[0], "GPU-nope"]], r"unknown device ID 'GPU-nope'"),
    ("duplicate ID", lambda u: [[u[2], u[3], u[2]]], r"device ID 'GPU-[0-9a-f-]+' is requested twice"),
    ("replica ID on the whole-GPU resource", lambda u: [[f"{u[0]}::0"]], r"unknown device ID 'GPU-[0-9a-f-]+::0'"),
    ("lower-cased UUID", lambda u: [[u[0].lower()]], r"unknown device ID 'gpu-"),
    ("UUID with a NUL", lambda u: [[u[0] + "\0"]], r"unknown device ID 'GPU-[0-9a-f-]+\\x00'"),
    ("second container bad", lambda u: [[u[0]], ["GPU-nope"]], r"unknown device ID 'GPU-nope'"),
    ("second container repeats itself", lambda u: [[u[0]], [u[1], u[1]]], r"requested twice"),
]


@pytest.mark.parametrize(("what", "make", "pattern"), ALLOCATE_REFUSALS, ids=[c[0] for c in ALLOCATE_REFUSALS])
def test_allocate_refusals(live: Live, what: str, make: Callable[[list[str]], list[list[str]]], pattern: str) -> None:
    TRIED["grpc"] += 1
    request = _alloc(*make(live.uuids))
    _refused(lambda: live.stub.Allocate(request, timeout=5), grpc.StatusCode.INVALID_ARGUMENT, pattern)
    live.assert_unharmed()


def test_allocate_without_container_requests_answers_none(live: Live) -> None:
    """No containers asked for, none answered: one response per request, as NVIDIA's plugin does.
    (The kubelet never sends this; an error would do too, but a partial answer would not.)"""
    TRIED["grpc"] += 2
    ACCEPTED["grpc"] += 2
    assert len(live.stub.Allocate(pb.AllocateRequest(), timeout=5).container_responses) == 0
    assert len(live.stub.GetPreferredAllocation(pb.PreferredAllocationRequest(), timeout=5).container_responses) == 0
    live.assert_unharmed()


@pytest.mark.parametrize(
    ("what", "make", "pattern"),
    [
        ("10,000 times one ID", lambda u: [u[0]] * BIG, r"device ID 'GPU-[0-9a-f-]+' is requested twice"),
        (
            "10,000 unknown IDs",
            lambda u: [f"GPU-unknown-{i}" for i in range(BIG)],
            r"unknown device ID 'GPU-unknown-0'",
        ),
        ("8 known then 9,992 unknown", lambda u: u + [f"x{i}" for i in range(BIG - 8)], r"unknown device ID 'x0'"),
        ("10,000 replica IDs", lambda u: [f"{u[i % 8]}::{i}" for i in range(BIG)], r"unknown device ID 'GPU-.*::0'"),
    ],
    ids=["one-id", "unknown", "known-then-unknown", "replicas"],
)
def test_allocate_with_10000_ids_is_refused_fast(
    live: Live, what: str, make: Callable[[list[str]], list[str]], pattern: str
) -> None:
    TRIED["grpc"] += 1
    request = _alloc(make(live.uuids))
    started = time.monotonic()
    _refused(lambda: live.stub.Allocate(request, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, pattern)
    assert time.monotonic() - started < BIG_REQUEST_S
    live.assert_unharmed()


PREFERRED_REFUSALS: list[tuple[str, Callable[[list[str]], tuple[list[str], list[str], int]], str]] = [
    ("size above available", lambda u: (u[:3], [], 4), r"allocation size 4 exceeds the 3 available"),
    ("size above available, duplicates", lambda u: ([u[0]] * 5, [], 2), r"allocation size 2 exceeds the 1 available"),
    ("size zero", lambda u: (u, [], 0), r"allocation size 0 is not positive"),
    ("size -1", lambda u: (u, [], -1), r"allocation size -1 is not positive"),
    ("size -2**31", lambda u: (u, [], -(2**31)), r"allocation size -2147483648 is not positive"),
    ("size 2**31-1", lambda u: (u, [], 2**31 - 1), r"allocation size 2147483647 exceeds the 8 available"),
    ("nothing available", lambda u: ([], [], 1), r"allocation size 1 exceeds the 0 available"),
    ("must-include outside available", lambda u: (u[:4], [u[5]], 2), r"must-include IDs \['GPU-[^']+'\] are not among"),
    ("must-include unknown", lambda u: (u, ["GPU-nope"], 2), r"must-include IDs \['GPU-nope'\] are not among"),
    ("must-include above size", lambda u: (u, u[:3], 2), r"3 must-include IDs exceed allocation size 2"),
    # Unknown IDs are no candidates: none of the 10,000 counts.
    (
        "10,000 unknown available, size 2**31-1",
        lambda u: ([f"a{i}" for i in range(BIG)], [], 2**31 - 1),
        r"exceeds the 0 available",
    ),
    ("10,000 must-include, size 1", lambda u: (u, u * 1250, 1), r"8 must-include IDs exceed allocation size 1"),
]


@pytest.mark.parametrize(("what", "make", "pattern"), PREFERRED_REFUSALS, ids=[c[0] for c in PREFERRED_REFUSALS])
def test_preferred_allocation_refusals(
    live: Live, what: str, make: Callable[[list[str]], tuple[list[str], list[str], int]], pattern: str
) -> None:
    TRIED["grpc"] += 1
    request = _pref(*make(live.uuids))
    started = time.monotonic()
    _refused(lambda: live.stub.GetPreferredAllocation(request, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, pattern)
    assert time.monotonic() - started < BIG_REQUEST_S
    live.assert_unharmed()


def test_preferred_allocation_with_10000_known_ids_answers_fast(live: Live) -> None:
    """10,000 entries that name the 8 GPUs over and over: an answer, in well under a second."""
    u = live.uuids
    for available, must, size in [
        (u[::-1] * 1250, [], 4),
        (u * 1250, [u[6]] * BIG, 2),
        ([f"{x}::0" for x in u] * 1250 + u, [], 8),
    ]:
        TRIED["grpc"] += 1
        ACCEPTED["grpc"] += 1
        started = time.monotonic()
        answer = live.stub.GetPreferredAllocation(_pref(available, must, size), timeout=10)
        assert time.monotonic() - started < BIG_REQUEST_S
        ids = list(answer.container_responses[0].deviceIDs)
        assert len(ids) == size == len(set(ids)) and set(ids) <= set(available)
        assert ids[: len(set(must))] == list(dict.fromkeys(must))
    live.assert_unharmed()


def test_undecodable_bytes_are_unknown_errors(live: Live) -> None:
    """grpc.aio answers a request it cannot decode with UNKNOWN, naming protobuf's DecodeError."""
    bad: list[tuple[str, bytes]] = [
        ("Allocate", b"\xff\xff\xff\xff"),
        ("Allocate", b"\x0a\x05\x0a\x03"),  # a length that runs past the end
        ("Allocate", b"\x0a\x04\x0a\x02\xc3\x28"),  # devices_ids with bad UTF-8
        ("GetPreferredAllocation", b"\x0a\x04\x0a\x02\xc3\x28"),
        ("GetPreferredAllocation", b"\x0a\x03\x18\xff\xff"),  # a truncated varint
        ("GetPreferredAllocation", b"\x07"),  # wire type 7 does not exist
        ("PreStartContainer", b"\xff"),
        ("ListAndWatch", b"\xff"),  # a stream, called here as unary: still decoded first
    ]
    for method, payload in bad:
        TRIED["grpc"] += 1
        _refused(functools.partial(live.raw(method), payload, timeout=5), grpc.StatusCode.UNKNOWN, r"DecodeError")
    live.assert_unharmed()


def test_random_bytes_to_allocate_and_preferred_allocation(live: Live) -> None:
    """Random payloads: decoded (an answer, or INVALID_ARGUMENT) or not (UNKNOWN); nothing else."""
    rng = random.Random(20240601)
    outcomes: Counter[str] = Counter()
    for i in range(200):
        method = ("Allocate", "GetPreferredAllocation")[i % 2]
        payload = rng.randbytes(rng.choice((0, 1, 2, 3, 8, 32, 256)))
        TRIED["grpc"] += 1
        try:
            live.raw(method)(payload, timeout=5)
            outcomes["OK"] += 1
            ACCEPTED["grpc"] += 1
        except grpc.RpcError as rpc_error:
            err: Any = rpc_error  # a grpc.Call too
            code, details = err.code(), err.details() or ""
            assert code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT), (code, details)
            if code == grpc.StatusCode.UNKNOWN:
                assert "DecodeError" in details, details
            outcomes[code.name] += 1
    assert outcomes["UNKNOWN"] > 100, outcomes
    live.assert_unharmed()


def test_unknown_method_and_oversized_message(live: Live) -> None:
    TRIED["grpc"] += 1
    _refused(lambda: live.raw("Bogus")(b"", timeout=5), grpc.StatusCode.UNIMPLEMENTED, r"Method not found")
    TRIED["grpc"] += 1
    huge = _alloc(["x" * 5_000_000])
    _refused(
        lambda: live.stub.Allocate(huge, timeout=10),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        r"Received message larger than max",
    )
    live.assert_unharmed()


def test_allocate_with_a_20k_character_id_names_it(live: Live) -> None:
    TRIED["grpc"] += 1
    long_id = "GPU-" + "x" * 20_000
    try:
        _refused(
            lambda: live.stub.Allocate(_alloc([long_id]), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT,
            r"unknown device ID 'GPU-xxxx",
        )
    finally:
        live.assert_unharmed()


def test_preferred_allocation_with_10000_must_include_outside_available_names_them(live: Live) -> None:
    TRIED["grpc"] += 1
    request = _pref(live.uuids[:2], [f"m{i}" for i in range(BIG)], 1)
    started = time.monotonic()
    try:
        _refused(
            lambda: live.stub.GetPreferredAllocation(request, timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
            r"must-include IDs \['m0'",
        )
        assert time.monotonic() - started < BIG_REQUEST_S
    finally:
        live.assert_unharmed()


def test_preferred_allocation_with_10000_unknown_ids_is_refused_fast(node: SimulatedNode) -> None:
    """Unknown IDs are no candidates: the request is refused at once, not searched."""
    rig = _start(node)
    try:
        TRIED["grpc"] += 1
        available = [f"GPU-unknown-{i}" for i in range(BIG)]
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            rig.stub.GetPreferredAllocation(_pref(available, [], 1), timeout=BIG_REQUEST_S + 1)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "exceeds the 0 available we know" in (info.value.details() or "")  # type: ignore[attr-defined]
        assert time.monotonic() - started < BIG_REQUEST_S
        rig.assert_unharmed()
    finally:
        rig.close()


# =====================================================================================
# 2. Property-based: the request handlers and the config loader
# =====================================================================================

HYPO = settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)


@st.composite
def resources(draw: st.DrawFn) -> Resource:
    """1-8 GPUs (some without a minor), some Unhealthy, some time-sliced, random links."""
    n = draw(st.integers(1, 8))
    gpus = tuple(
        Gpu(uuid=f"GPU-{i}", index=i, bus_id=f"0000:{i + 1:02x}:00.0", minor=draw(st.sampled_from([i, None, i + 8])))
        for i in range(n)
    )
    links = {}
    for a in range(n):
        for b in range(a + 1, n):
            if draw(st.booleans()):
                links[(gpus[a].uuid, gpus[b].uuid)] = Link(draw(st.integers(0, 18)), draw(st.sampled_from(PcieLevel)))
    state = NodeState()
    state.apply(InventoryFound(gpus, topology=Topology.of(links)))
    for i in draw(st.sets(st.integers(0, n - 1))):
        state.apply(HealthReported(f"GPU-{i}", "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS"))
    replicas = draw(st.sampled_from([1, 1, 2, 3, 4]))
    shared = draw(st.sets(st.integers(0, n - 1)))
    spec = ResourceSpec(
        draw(st.sampled_from([GPU_RESOURCE, "nvidia.com/gpu.shared"])),
        replicas,
        fail_requests_greater_than_one=draw(st.booleans()),
        share=tuple(str(i) for i in sorted(shared)),
    )
    return spec.project(state.current)


def device_ids(resource: Resource) -> st.SearchStrategy[str]:
    """Known IDs (often), and the near misses: replica IDs of whole GPUs, whole IDs of shared ones, junk."""
    known = [d.id for d in resource.devices]
    near = [f"GPU-{i}{REPLICA_SEPARATOR}{r}" for i in range(9) for r in (0, 1, 7)] + [f"GPU-{i}" for i in range(10)]
    junk = st.text(max_size=12)
    return st.one_of(st.sampled_from(known), st.sampled_from(near), junk) if known else st.one_of(junk)


policies = st.builds(
    AllocationPolicy,
    list_strategies=st.lists(st.sampled_from(LIST_STRATEGIES), min_size=1, max_size=4, unique=True).map(tuple),
    id_strategy=st.sampled_from(["uuid", "index"]),
    pass_device_specs=st.booleans(),
)


@HYPO
@given(data=st.data(), resource=resources(), policy=policies)
def test_allocate_answers_validly_or_refuses(data: st.DataObject, resource: Resource, policy: AllocationPolicy) -> None:
    TRIED["hypothesis allocate"] += 1
    healthy = [d.id for d in resource.devices if d.health.healthy]
    # Half plausible (what a kubelet would send), half anything.
    plausible = st.lists(st.sampled_from(healthy), min_size=1, max_size=4, unique=True) if healthy else st.just([])
    ids = data.draw(st.one_of(plausible, st.lists(device_ids(resource), max_size=10)), label="device_ids")
    devices = [resource.get(i) for i in ids]
    acceptable = (
        bool(ids)
        and all(d is not None and d.health.healthy for d in devices)
        and len(set(ids)) == len(ids)
        and not (resource.fail_requests_greater_than_one and len(ids) > 1)
    )
    try:
        out = allocate(resource, ids, policy, lambda p: "/host" + p, lambda p: p.endswith("ctl"))
    except AllocationError as err:
        assert not acceptable, f"refused a good request {ids}: {err}"
        assert str(err).startswith(f"{resource.name}: ")
        return
    ACCEPTED["hypothesis allocate"] += 1
    assert acceptable, f"accepted a bad request {ids}"
    assert [d.id for d in out.devices] == ids
    assert all(d.health.healthy for d in out.devices)
    gpu_uuids = [g.uuid for g in out.gpus]
    assert gpu_uuids == list(dict.fromkeys(d.gpu.uuid for d in out.devices))
    visible = (
        [g.uuid for g in out.gpus] if policy.id_strategy == "uuid" else [str(g.index) for g in out.gpus]
    )  # each GPU once, replicas folded
    if "envvar" in policy.list_strategies and "volume-mounts" not in policy.list_strategies:
        assert out.envs[VISIBLE_DEVICES_ENV].split(",") == visible
    if "volume-mounts" in policy.list_strategies:
        assert [m.container_path.rsplit("/", 1)[1] for m in out.mounts] == visible
    if "cdi-cri" in policy.list_strategies:
        assert out.cdi_devices == tuple(f"k8s.device-plugin.nvidia.com/gpu={v}" for v in visible)
    nodes = [n.container_path for n in out.device_nodes]
    if policy.pass_device_specs:
        assert nodes == [g.device_node for g in out.gpus if g.device_node] + ["/dev/nvidiactl"]
    else:
        assert nodes == []


@HYPO
@given(data=st.data(), resource=resources())
def test_preferred_answers_validly_or_refuses(data: st.DataObject, resource: Resource) -> None:
    TRIED["hypothesis preferred"] += 1
    ids = device_ids(resource)
    known = [d.id for d in resource.devices]
    # Half plausible (what a kubelet would send), half anything.
    plausible = data.draw(st.booleans(), label="plausible")
    if plausible:
        available = data.draw(st.lists(st.sampled_from(known), min_size=1, unique=True), label="available")
        must = data.draw(st.lists(st.sampled_from(available), unique=True, max_size=3), label="must_include")
        size = data.draw(st.integers(max(1, len(must)), len(available)), label="size")
    else:
        available = data.draw(st.lists(ids, max_size=24), label="available")
        must = data.draw(
            st.one_of(st.lists(st.sampled_from(available), max_size=4) if available else st.just([]), st.lists(ids)),
            label="must_include",
        )
        size = data.draw(st.one_of(st.integers(-3, 12), st.sampled_from([2**31 - 1, -(2**31)])), label="size")
    # Only IDs the resource knows are candidates; unknown ones are dropped, never answered.
    offered, chosen = {i for i in available if resource.get(i) is not None}, list(dict.fromkeys(must))
    acceptable = 0 < size <= len(offered) and set(must) <= offered and len(chosen) <= size
    try:
        out = preferred(resource, available, must, size)
    except AllocationError as err:
        assert not acceptable, f"refused a good request: {err}"
        assert str(err).startswith(f"{resource.name}: ")
        return
    ACCEPTED["hypothesis preferred"] += 1
    assert acceptable, f"answered a bad request: {out}"
    assert len(out) == size == len(set(out))
    assert set(out) <= offered
    assert out[: len(chosen)] == chosen


# --- the config loader --------------------------------------------------------------------

BOOL_WORDS = ["true", "false", "yes", "No", "on", "OFF", "y", "n", "True"]
# Scalars that YAML 1.1 reads as something else than they look, and edge values.
TRICKY = [
    "~", "null", "''", '""', "0", "-1", "1", "2", "8", "1024", "1025", "0x10", "0o17", "017", "0b11", "1_000",
    "1:30", "0:1", "1e3", "1.5", ".5", "-.inf", ".inf", ".nan", "2001-12-14", "v1", "v2", "all", "gpu",
    "nvidia.com/gpu", "kubernetes.io/gpu", "a/b/c", "envvar", "cdi-cri", "volume-mounts", "uuid", "index",
    "none", "single", "mixed", "auto", "60s", "1m30s", "-5s", "off", "unix:/run/x.sock", "unix:rel",
    "127.0.0.1:9400", "h:0", "h:65536", ":80", "GPU-0e85ec6b-6af1-688b-30dd-e764b2fe55b6",
    "MIG-0e85ec6b-6af1-688b-30dd-e764b2fe55b6", "GPU-nope", "13", "79", "65536", "0.2", "600", "1e9",
    '"\\0"', '"a\\u0000b"', "'*'", "'x'",
]  # fmt: skip
TAGS = ["!!str", "!!int", "!!float", "!!null", "!!seq", "!!map", "!foo", "!!binary"]

# Leaves are tuples of values that are right for the key (drawn most of the time); a dict is a
# mapping of known keys; a one-element list is a list of that item.
BOOL = ("true", "false", "yes", "no", "on", "off", "True", "FALSE")
PATH = ("/", "/run/nvidia/driver", "/usr/bin/nvidia-ctk", "/var/lib/kubelet/device-plugins/kubelet.sock", '"/a b"')
TEXT = ("cdi.k8s.io/", "x", "'*'", "'*A100*'", '"é"', "/tmp/out")
NAME = ("gpu", "nvidia.com/gpu", "nvidia.com/gpu.shared", "example.com/a", "shared-gpu", "mig-1g.10gb", "gpu.x")
DEVICE = ("0", "1", "'1'", "'0:1'", "0:1", "GPU-0e85ec6b-6af1-688b-30dd-e764b2fe55b6", "'007'")
XID = ("13", "79", "109", "48", "31", "0x4F")
SECONDS = ("0.2", "1", "30", "600", "1e3", "1_0")
REPLICATED = {
    "renameByDefault": BOOL,
    "failRequestsGreaterThanOne": BOOL,
    "resources": [{"name": NAME, "rename": NAME, "devices": [DEVICE], "replicas": ("1", "2", "4", "10", "1024")}],
}
SCHEMA: dict[str, Any] = {
    "version": ("v1", "~"),
    "flags": {
        "migStrategy": ("none", "single", "mixed"), "failOnInitError": BOOL, "mpsRoot": PATH,
        "nvidiaDriverRoot": PATH, "nvidiaDevRoot": PATH, "gdrcopyEnabled": BOOL, "gdsEnabled": BOOL,
        "mofedEnabled": BOOL, "useNodeFeatureAPI": BOOL, "deviceDiscoveryStrategy": ("auto", "nvml", "tegra"),
        "plugin": {
            "passDeviceSpecs": BOOL, "deviceListStrategy": [("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")],
            "deviceIDStrategy": ("uuid", "index"), "cdiAnnotationPrefix": TEXT, "nvidiaCTKPath": PATH,
            "containerDriverRoot": PATH, "kubeletSocket": PATH, "cdiFeatureFlags": [TEXT],
        },
        "gfd": {"oneshot": BOOL, "noTimestamp": BOOL, "sleepInterval": ("60s", "1m30s", "100", "0", "1h2m3.5s"),
                "outputFile": TEXT, "machineTypeFile": TEXT},
    },
    "resources": {"gpus": [{"pattern": TEXT, "name": NAME}], "mig": [{"pattern": TEXT, "name": NAME}]},
    "sharing": {"timeSlicing": REPLICATED, "mps": REPLICATED},
    "imex": {"channelIDs": [("0",)], "required": BOOL},
    "nvplug": {
        "health": {"ignoreXids": [XID], "fatalXids": [XID], "reprobeInitialSeconds": SECONDS,
                   "reprobeMaxSeconds": SECONDS},
        "status": {"listen": ("off", "unix:/run/nvplug/s.sock", "127.0.0.1:9400", "localhost:1", "'[::1]:80'")},
    },
}  # fmt: skip
ANY_LEAF: tuple[str, ...] = ()

# No digits other than ASCII ones: see test_non_ascii_digits_in_listen_port_are_a_config_error.
_SAFE_CHARS = st.one_of(
    st.characters(exclude_categories=("Nd", "No", "Nl", "Cs", "Cc")), st.sampled_from("0123456789:/._-")
)


class _Yaml:
    """Renders a document in flow style from hypothesis draws: known keys and fitting values mostly,
    anything at all sometimes, explicit tags, anchors and aliases."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.anchors: list[str] = []  # complete ones: an alias may name these
        self.made = 0
        self.depth = 0

    def one_in(self, n: int) -> bool:
        # The rare branch at the far end: hypothesis shrinks towards 0, the plain case.
        return self.draw(st.integers(0, n - 1)) == n - 1

    def scalar(self, good: tuple[str, ...]) -> str:
        kind = self.draw(st.integers(0, 9))
        if kind <= 5 and good:
            text = self.draw(st.sampled_from(good))
        elif kind <= 6:
            text = self.draw(st.sampled_from(TRICKY))
        elif kind == 7:
            text = self.draw(st.sampled_from(BOOL_WORDS))
        elif kind == 8:
            text = json.dumps(self.draw(st.text(_SAFE_CHARS, max_size=20)), ensure_ascii=False)
        elif self.one_in(2):
            text = str(self.draw(st.integers(-(2**70), 2**70)))
        else:
            text = repr(self.draw(st.floats(allow_nan=False)))
        if self.one_in(15):
            text = f"{self.draw(st.sampled_from(TAGS))} {text}"
        elif self.one_in(15) and text.lower() in yaml.constructor.SafeConstructor.bool_values:
            # An explicit !!bool only on a word that is one: see test_explicit_bool_tag_*.
            text = f"!!bool {text}"
        return text

    def node(self, schema: Any) -> str:
        if self.anchors and self.one_in(15):
            return "*" + self.draw(st.sampled_from(self.anchors))
        anchor = None
        if self.one_in(8):
            anchor, self.made = f"a{self.made}", self.made + 1
        self.depth += 1
        try:
            if self.depth > 6 or self.one_in(16):
                shape = self.draw(st.sampled_from(["scalar", "scalar", "list", "map"])) if self.depth < 8 else "scalar"
                schema = {"scalar": ANY_LEAF, "list": [ANY_LEAF], "map": {}}[shape]
            text = self._value(schema)
        finally:
            self.depth -= 1
        if anchor is None:
            return text
        self.anchors.append(anchor)
        return f"&{anchor} {text}"

    def _value(self, schema: Any) -> str:
        if isinstance(schema, dict):
            keys = self.draw(st.lists(st.sampled_from(sorted(schema)), unique=True)) if schema else []
            if self.one_in(25):
                keys.append(self.draw(st.sampled_from(["bogus", "<<", "Version", "flags", "? [x]"])))
            return "{" + ", ".join(f"{k}: {self.node(schema.get(k, ANY_LEAF))}" for k in keys) + "}"
        if isinstance(schema, list):
            if self.one_in(5):
                return self.scalar((*schema[0], "all", "2"))  # NVIDIA's lists also take one string
            count = self.draw(st.integers(0, 4))
            return "[" + ", ".join(self.node(schema[0]) for _ in range(count)) + "]"
        return self.scalar(schema)


@st.composite
def yaml_documents(draw: st.DrawFn) -> str:
    doc = _Yaml(draw)
    # Block style at the top, as config files are written; flow style below.
    keys = draw(st.lists(st.sampled_from(sorted(SCHEMA)), unique=True))
    if doc.one_in(25):
        keys.append(draw(st.sampled_from(["bogus", "Flags", "<<"])))
    lines = [f"{k}: {doc.node(SCHEMA.get(k, ANY_LEAF))}" for k in keys]
    return "\n".join(lines) + "\n" if lines else draw(st.sampled_from(["", "---\n", "# nothing\n", "~\n"]))


def _load_or_refuse(text: str, source: str = "fuzz.yaml") -> config.Config | None:
    """Loads, or raises ConfigError naming the file; anything else fails the test."""
    try:
        cfg = config.parse(text, source)
    except config.ConfigError as err:
        assert str(err).startswith(source), str(err)
        assert type(err) is config.ConfigError
        return None
    assert isinstance(cfg, config.Config) and cfg.source == source
    return cfg


def _round_trips(cfg: config.Config) -> None:
    again = config.parse(config.to_yaml(cfg), "again.yaml")
    assert again == dataclasses.replace(cfg, source="again.yaml"), config.to_yaml(cfg)


@settings(HYPO, max_examples=1000)
@given(text=yaml_documents())
def test_generated_yaml_loads_or_is_a_config_error_and_round_trips(text: str) -> None:
    TRIED["hypothesis config yaml"] += 1
    cfg = _load_or_refuse(text)
    if cfg is not None:
        ACCEPTED["hypothesis config yaml"] += 1
        _round_trips(cfg)


@HYPO
@given(text=st.text(max_size=300))
def test_random_text_loads_or_is_a_config_error(text: str) -> None:
    TRIED["hypothesis config text"] += 1
    cfg = _load_or_refuse(text)
    if cfg is not None:
        ACCEPTED["hypothesis config text"] += 1
        _round_trips(cfg)


@HYPO
@given(raw=st.binary(max_size=300))
def test_random_bytes_load_or_are_a_config_error(raw: bytes, tmp_path_factory: pytest.TempPathFactory) -> None:
    TRIED["hypothesis config bytes"] += 1
    path = tmp_path_factory.getbasetemp() / "fuzz.yaml"
    path.write_bytes(raw)
    try:
        cfg = config.load(path)
    except config.ConfigError as err:
        assert str(err).startswith(str(path)), str(err)
        return
    ACCEPTED["hypothesis config bytes"] += 1
    _round_trips(cfg)


def test_generated_documents_do_load_sometimes() -> None:
    """Guards the generator: the round-trip property means little if nothing ever loads."""
    if not TRIED["hypothesis config yaml"]:
        pytest.skip("runs after test_generated_yaml_loads_or_is_a_config_error_and_round_trips")
    assert ACCEPTED["hypothesis config yaml"] >= 50, ACCEPTED


@pytest.mark.parametrize(
    "text",
    [
        "flags:\n  failOnInitError: !!bool maybe\n",
        "flags:\n  plugin:\n    passDeviceSpecs: !!bool 1\n",
        "imex:\n  required: !!bool ''\n",
    ],
)
def test_explicit_bool_tag_on_a_non_bool_is_a_config_error(text: str) -> None:
    TRIED["config explicit"] += 1
    with pytest.raises(config.ConfigError, match=r"line \d+: .*must be true or false"):
        config.parse(text, "c.yaml")


@pytest.mark.parametrize(
    "listen",
    ["h:\u00b2", "h:\u00b9\u00b2\u00b3", "h:" + "1" * 5000],
    ids=["superscript-two", "superscripts", "5000-digits"],
)
def test_non_ascii_digits_in_listen_port_are_a_config_error(listen: str) -> None:
    TRIED["config explicit"] += 1
    text = f"nvplug:\n  status:\n    listen: {json.dumps(listen)}\n"
    with pytest.raises(config.ConfigError, match=r"line 3: nvplug\.status\.listen"):
        config.parse(text, "c.yaml")


@pytest.mark.parametrize("listen", ["foo", "localhost:99999", "unix:rel", ":0", "h:", "h:\u00b2"])
def test_the_command_line_refuses_a_status_address_the_config_refuses(listen: str) -> None:
    """`--status-listen` as `nvplug.status.listen`: refused before anything is asked, not later as a
    daemon that does not answer."""
    TRIED["config explicit"] += 1
    with pytest.raises(config.ConfigError, match=r"nvplug\.status\.listen: .* is not off, unix:/absolute/path"):
        config.parse(f"nvplug:\n  status:\n    listen: {json.dumps(listen)}\n", "c.yaml")
    done = subprocess.run(
        [sys.executable, "-m", "nvplug", "devices", "--status-listen", listen], capture_output=True, text=True
    )
    assert done.returncode == 2 and "argument --status-listen: " in done.stderr, done.stderr
    assert "is not off, unix:/absolute/path or host:port" in done.stderr, done.stderr


def test_a_status_address_without_a_host_is_the_loopback_in_the_config_and_on_the_command_line() -> None:
    assert config.parse("nvplug:\n  status:\n    listen: ':9477'\n", "c.yaml").status_listen == ":9477"
    assert cli_arguments.listen_address(":9477") == ":9477"
    assert cli_arguments.listen_address("[::1]:9400") == "[::1]:9400"


def test_a_5000_digit_quoted_device_index_is_a_config_error() -> None:
    TRIED["config explicit"] += 1
    text = "sharing:\n  timeSlicing:\n    resources:\n    - name: gpu\n      replicas: 2\n"
    with pytest.raises(config.ConfigError, match=r"devices\[0\]"):
        config.parse(text + f"      devices: ['{'1' * 5000}']\n", "c.yaml")


def test_unicode_digit_port_is_refused() -> None:
    TRIED["config explicit"] += 1
    with pytest.raises(config.ConfigError, match=r"nvplug\.status\.listen"):
        config.parse('nvplug:\n  status:\n    listen: "h:\u0668\u0660"\n', "c.yaml")


# =====================================================================================
# 3. Config files through the SIGHUP reload
# =====================================================================================

FATAL_13 = "version: v1\nnvplug:\n  health:\n    fatalXids: [13]\n"


def billion_laughs() -> str:
    """The classic: ten levels of nine aliases each, 10**9 leaves, under 1 KiB."""
    lines = ['lol0: &lol0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * 9) + "]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


def laughs_under_known_keys() -> str:
    """The same nesting where the reader does go: anchored inside a known list, aliased from others."""
    seq = ['      - &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    seq += [f"      - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 10)]
    return (
        "version: v1\nflags:\n  plugin:\n    cdiFeatureFlags:\n"
        + "\n".join(seq)
        + "\nresources:\n  gpus: *l9\nnvplug:\n  health:\n    fatalXids: *l9\n"
    )


def wide_aliases() -> str:
    """Flat, but 110,000 aliases of one list: over MAX_NODES, under MAX_BYTES."""
    return (
        "version: v1\nnvplug:\n  health:\n    ignoreXids: &x [109]\n    fatalXids: ["
        + ", ".join(["*x"] * 110_000)
        + "]\n"
    )


def over_max_bytes() -> str:
    """A valid config and one long comment: one byte over MAX_BYTES."""
    head = "version: v1\nnvplug:\n  health:\n    fatalXids: [79]\n"
    return head + "#" * (config.MAX_BYTES + 1 - len(head))


def over_max_bytes_multibyte() -> str:
    """Fewer characters than MAX_BYTES, more bytes: the byte count is what counts."""
    head = "version: v1\nnvplug:\n  health:\n    fatalXids: [79]\n"
    return head + "# " + "é" * (config.MAX_BYTES // 2) + "\n"


BAD_FILES: list[tuple[str, Callable[[], str], str]] = [
    ("billion-laughs", billion_laughs, r"line 1: lol0: unknown key"),
    ("laughs-under-known-keys", laughs_under_known_keys, r"(cdiFeatureFlags|fatalXids)\[0\]: must be .*, not a list"),
    ("wide-aliases", wide_aliases, r"more than 100000 YAML nodes \(aliases expanded\); refusing to read on"),
    ("over-max-bytes", over_max_bytes, rf"larger than {config.MAX_BYTES} bytes; refusing to parse"),
    ("over-max-bytes-multibyte", over_max_bytes_multibyte, rf"larger than {config.MAX_BYTES} bytes"),
    ("nested-deeper-than-max", lambda: "version: v1\nflags: " + "[" * 200 + "]" * 200 + "\n", r"nested deeper"),
]


@pytest.mark.parametrize(("what", "make", "pattern"), BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_hostile_config_files_are_refused_fast_in_process(
    tmp_path: Path, what: str, make: Callable[[], str], pattern: str
) -> None:
    TRIED["config files"] += 1
    path = tmp_path / "config.yaml"
    path.write_text(make())
    started = time.monotonic()
    with pytest.raises(config.ConfigError, match=pattern) as info:
        config.load(path)
    # The refusal is the proof; this catches a reading gone quadratic (the widest takes under 2 s when idle).
    assert time.monotonic() - started < 20
    assert str(info.value).startswith(str(path))


def test_hostile_config_files_on_reload_leave_the_old_config_in_force(node: SimulatedNode) -> None:
    node.config.write_text(FATAL_13)
    rig = _start(node)
    daemon = node.daemon
    assert daemon is not None
    try:
        for what, make, pattern in BAD_FILES:
            TRIED["config files"] += 1
            offset = len(node.log_text())
            node.config.write_text(make())
            started = time.monotonic()
            daemon.send_signal(signal.SIGHUP)
            log = node.wait_log("reload refused", after=offset)
            assert time.monotonic() - started < 5.0, what
            line = next(ln for ln in log[offset:].splitlines() if "reload refused" in ln)
            assert "ERROR" in line and str(node.config) in line and re.search(pattern, line), (what, line[:500])
            assert daemon.poll() is None
            assert rig.devices() == rig.baseline
        # fatalXids: [13] still applies: the bad files' [79] and [109] never did.
        node.control.xid(4, 13)
        node.kubelet.wait_for(device_health(rig.uuids[4], healthy=False), TIMEOUT)
        node.wait_log("(fatal by config)")
        assert "reloaded the config" not in node.log_text()
        assert node.kubelet.accepted_registrations(GPU_RESOURCE) == rig.registrations
    finally:
        rig.close()


def test_reload_with_an_explicit_bad_bool_tag_is_refused(node: SimulatedNode) -> None:
    TRIED["config files"] += 1
    node.config.write_text(FATAL_13)
    rig = _start(node)
    try:
        assert node.daemon is not None
        node.config.write_text("version: v1\nflags:\n  failOnInitError: !!bool maybe\n")
        node.daemon.send_signal(signal.SIGHUP)
        node.wait_log("reload refused", timeout=3.0)
    finally:
        assert node.daemon is not None and node.daemon.poll() is None
        rig.close()
