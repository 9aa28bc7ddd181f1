"""DRA without the daemon: which GPUs DRA offers and how they are described, the ResourceSlices made of
them, preparing claims and their checkpoint, the API client on the wire, and the slice publisher against
the API-server stand-in."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import stat
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from support.apiserver_standin import FakeApiServer

from nvplug import config
from nvplug.core.events import HealthReported, InventoryFound, XidOccurred
from nvplug.core.gpu import Gpu, MigAttributes, MigDevice
from nvplug.core.node_state import NodeState
from nvplug.dra import claims, slice_publisher
from nvplug.dra import dra_devices as devices
from nvplug.dra import resource_slices as slices
from nvplug.dra.api_client import ApiClient, ApiError, KubeConfig, KubeConfigError
from nvplug.dra.claims import ClaimError, ClaimRef, ClaimStore, PreparedClaim, PreparedDevice
from nvplug.dra.device_taints import XID_KEY, Taint
from nvplug.dra.dra_devices import DraDevice, Value
from nvplug.dra.slice_publisher import SlicePublisher
from nvplug.shaping.resource_plan import Naming, plan

T = TypeVar("T")

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
DRIVER = "gpu.nvidia.com"
NODE = "node-a"
GROUP = "resource.k8s.io"


def uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-0000-0000-000000000000"


def gpu(i: int, name: str = H100, **kw: Any) -> Gpu:
    return Gpu(uuid(i), i, f"0000:{0x18 + i:02x}:00.0", minor=i, name=name, **kw)


def node(*gpus: Gpu, driver_version: str | None = None, cuda_version: int | None = None) -> NodeState:
    state = NodeState()
    state.apply(InventoryFound(gpus, driver_version=driver_version, cuda_version=cuda_version))
    return state


def naming(dra: str, extra: str = "") -> Naming:
    """Naming from a config with nvplug.dra enabled; `dra` is the rest of the nvplug.dra mapping."""
    return Naming.from_config(config.parse(f"{extra}nvplug:\n  dra:\n    enabled: true\n{dra}", "c.yaml"))


def names(found: Sequence[DraDevice]) -> list[str]:
    return [d.name for d in found]


# --- which GPUs DRA owns ---------------------------------------------------------------------------


def six_gpus() -> NodeState:
    """GPUs 0-3 are H100s, 4-5 A100s."""
    return node(*(gpu(i, H100 if i < 4 else A100) for i in range(6)))


@pytest.mark.parametrize(
    ("dra", "extra", "owned"),
    [
        # By index, by UUID and by product pattern; GPU 5 is an A100 but nvplug.devices excludes it.
        (f"    devices: [0, {uuid(1)}, A100]\n", "  devices:\n    exclude: [5]\n", [0, 1, 4]),
        # An explicit DRA selector does not beat nvplug.devices either.
        ("    devices: [2, 5]\n", "  devices:\n    exclude: [5]\n", [2]),
        # No list, or an empty one: every GPU nvplug hands out at all.
        ("", "", [0, 1, 2, 3, 4, 5]),
        ("    devices: []\n", "  devices:\n    include: [0, 1]\n", [0, 1]),
    ],
)
def test_dra_owns_the_selected_gpus_and_the_device_plugin_the_rest(dra: str, extra: str, owned: list[int]) -> None:
    state = six_gpus()
    cfg = config.parse(f"nvplug:\n{extra}  dra:\n    enabled: true\n{dra}", "c.yaml")
    n = Naming.from_config(cfg)
    assert [g.index for g in state.current.gpus if n.dra_owns(g)] == owned
    assert names(devices.offered(state.current, n)) == [f"gpu-{i}" for i in owned]
    # No GPU through both: the device plugin names none that DRA owns (nor an excluded one), and its plan
    # leaves them out.
    for g in state.current.gpus:
        plugin = None if g.index in owned or cfg.devices.excludes(g) else "nvidia.com/gpu"
        assert n.name(g, None) == plugin
    served = {d.gpu.index for s in plan(cfg, state.current).served for d in s.project(state.current).devices}
    assert served == {g.index for g in state.current.gpus if not cfg.devices.excludes(g)} - set(owned)


def test_dra_off_owns_nothing() -> None:
    state = six_gpus()
    n = Naming.from_config(config.parse("nvplug:\n  dra:\n    enabled: false\n    devices: [0]\n", "c.yaml"))
    assert n.dra is None
    assert devices.offered(state.current, n) == []
    assert all(n.name(g, None) == "nvidia.com/gpu" for g in state.current.gpus)


def test_dra_owns_a_mig_gpu_and_its_mig_devices() -> None:
    # Under mixed the device plugin would offer each MIG device: DRA owning the GPU takes them all.
    mig = MigDevice("MIG-a", 1, 0, "1g.10gb")
    state = node(gpu(0, mig_enabled=True, mig=(mig,)), gpu(1))
    n = naming("    devices: [0]\n", "flags:\n  migStrategy: mixed\n")
    g0, g1 = state.current.gpus
    assert n.name(g0, None) is None and n.name(g0, mig) is None
    assert list(n.units(state.current)) == [(g1, None, "nvidia.com/gpu")]


# --- how a device is described -------------------------------------------------------------------


def test_a_whole_gpu_is_described_as_nvidias_driver_does() -> None:
    g = Gpu(uuid(2), 2, "0000:1a:00.0", minor=5, name=H100, memory_mib=81559, compute_capability=(9, 0),
            brand="Nvidia", architecture="Hopper")  # fmt: skip
    state = node(g, driver_version="535.104.05", cuda_version=12040)
    assert state.current.driver_version == "535.104.05" and state.current.cuda_version == 12040
    (d,) = devices.offered(state.current, naming(""))
    # Named by the minor (the /dev/nvidiaN node), not the index.
    assert d.name == "gpu-5"
    assert d.uuid == uuid(2) and d.gpu == g and d.mig is None
    assert d.healthy
    assert dict(d.attributes) == {
        "type": ("string", "gpu"),
        "uuid": ("string", uuid(2)),
        "index": ("int", 2),
        "minor": ("int", 5),
        "productName": ("string", H100),
        "brand": ("string", "Nvidia"),
        "architecture": ("string", "Hopper"),
        "pcieBusID": ("string", "0000:1a:00.0"),
        "resource.kubernetes.io/pciBusID": ("string", "0000:1a:00.0"),
        "cudaComputeCapability": ("version", "9.0.0"),
        # Versions are semver: leading zeros dropped, 12040 read as CUDA 12.4.
        "driverVersion": ("version", "535.104.5"),
        "cudaDriverVersion": ("version", "12.4.0"),
    }
    assert dict(d.capacity) == {"memory": "81559Mi"}


def test_what_the_driver_cannot_report_is_left_out() -> None:
    # No minor: named by index; unknown facts are absent rather than empty or "None".
    state = node(Gpu(uuid(3), 3, "0000:1b:00.0"))
    (d,) = devices.offered(state.current, naming(""))
    assert d.name == "gpu-3"
    assert set(d.attributes) == {"type", "uuid", "index", "pcieBusID", "resource.kubernetes.io/pciBusID"}
    assert dict(d.capacity) == {}


def test_long_product_names_are_cut_to_the_apis_limit() -> None:
    (d,) = devices.offered(node(gpu(0, "X" * 100)).current, naming(""))
    assert d.attributes["productName"] == ("string", "X" * 64)


MIG_ATTRS = MigAttributes(gi_slices=1, ci_slices=1, multiprocessors=16, copy_engines=1, decoders=1, encoders=0,
                          jpeg_engines=1, ofa_engines=0)  # fmt: skip


def mig_gpu() -> Gpu:
    migs = (
        MigDevice("MIG-a", 1, 0, "1g.10gb", memory_mib=9856, attributes=MIG_ATTRS),
        MigDevice("MIG-b", 2, 0, "3g.40gb", memory_mib=40192),
        MigDevice("MIG-c", 5, 1, "1c.2g.20gb"),
    )
    return Gpu(uuid(0), 0, "0000:18:00.0", minor=7, name=H100, memory_mib=81559, compute_capability=(9, 0),
               mig_enabled=True, mig=migs, mig_capable=True)  # fmt: skip


@pytest.mark.parametrize("strategy", ["mixed", "single"])
def test_mig_devices_are_offered_under_a_mig_strategy(strategy: str) -> None:
    state = node(mig_gpu(), driver_version="550.54.15", cuda_version=12040)
    found = devices.offered(state.current, naming("", f"flags:\n  migStrategy: {strategy}\n"))
    # gpu-<minor>-mig-<profile without dots>-<gi>-<ci>: DNS labels.
    assert names(found) == ["gpu-7-mig-1g10gb-1-0", "gpu-7-mig-3g40gb-2-0", "gpu-7-mig-1c2g20gb-5-1"]
    assert [d.uuid for d in found] == ["MIG-a", "MIG-b", "MIG-c"]
    first = found[0]
    assert first.mig is not None and first.mig.uuid == "MIG-a"
    assert dict(first.attributes) == {
        "type": ("string", "mig"),
        "uuid": ("string", "MIG-a"),
        "profile": ("string", "1g.10gb"),
        "parentUUID": ("string", uuid(0)),
        "parentIndex": ("int", 0),
        "parentMinor": ("int", 7),
        "index": ("int", 0),
        "productName": ("string", H100),
        "pcieBusID": ("string", "0000:18:00.0"),
        "resource.kubernetes.io/pciBusID": ("string", "0000:18:00.0"),
        "cudaComputeCapability": ("version", "9.0.0"),
        "driverVersion": ("version", "550.54.15"),
        "cudaDriverVersion": ("version", "12.4.0"),
    }
    # The MIG device's own memory and engines, from NVML's device attributes.
    assert dict(first.capacity) == {
        "memory": "9856Mi",
        "multiprocessors": "16",
        "copyEngines": "1",
        "decoders": "1",
        "encoders": "0",
        "jpegEngines": "1",
        "ofaEngines": "0",
    }
    # Without attributes, only the memory; without memory, nothing.
    assert dict(found[1].capacity) == {"memory": "40192Mi"}
    assert dict(found[2].capacity) == {}
    assert [d.attributes["index"] for d in found] == [("int", 0), ("int", 1), ("int", 2)]


def test_under_mig_strategy_none_a_mig_gpu_is_offered_whole() -> None:
    state = node(mig_gpu())
    (d,) = devices.offered(state.current, naming(""))
    assert d.name == "gpu-7" and d.mig is None
    assert d.attributes["type"] == ("string", "gpu") and d.attributes["uuid"] == ("string", uuid(0))


def test_unhealthy_devices_are_offered_with_the_reason() -> None:
    state = node(gpu(0), gpu(1))
    state.apply(XidOccurred(uuid(1), 79))
    found = devices.offered(state.current, naming(""))
    assert [(d.name, d.healthy) for d in found] == [("gpu-0", True), ("gpu-1", False)]
    assert "XID 79" in found[1].reason


def test_a_fault_of_the_gpu_is_a_fault_of_each_mig_device() -> None:
    state = node(mig_gpu())
    n = naming("", "flags:\n  migStrategy: mixed\n")
    # An XID naming a GPU and compute instance is that MIG device's alone.
    state.apply(XidOccurred(uuid(0), 79, gpu_instance=2, compute_instance=0))
    assert [d.healthy for d in devices.offered(state.current, n)] == [True, False, True]
    state.apply(HealthReported(uuid(0), "ECC uncorrectable"))
    found = devices.offered(state.current, n)
    assert [d.healthy for d in found] == [False, False, False]
    assert found[0].reason == "ECC uncorrectable"


# --- versions ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("550.54.15", "550.54.15"),
        ("9.0", "9.0.0"),
        ("12", "12.0.0"),
        ("535.104.05", "535.104.5"),
        ("09.00.00", "9.0.0"),
        (None, None),
        ("", None),
        ("1.2.3.4", None),
        ("1.2.", None),
        ("1..2", None),
        ("550.54.15-rc1", None),
        (" 9.0", None),
        ("abc", None),
        ("-1.0", None),
        ("\u00b2.0", None),  # a digit to str.isdigit, not to int()
    ],
)
def test_semver(text: str | None, version: str | None) -> None:
    assert devices.semver(text) == version


@pytest.mark.parametrize(
    ("dra", "owned", "served"),
    [
        # The H100s are nvidia.com/gpu, the A100s renamed: DRA takes what pods ask for as nvidia.com/gpu.
        ("    extendedResources: [nvidia.com/gpu]\n", [0, 1, 2, 3], {"nvidia.com/gpu": 0, "nvidia.com/a100": 2}),
        # NVIDIA's short form, and a selector beside it: both are DRA's.
        (
            "    extendedResources: [gpu]\n    devices: [4]\n",
            [0, 1, 2, 3, 4],
            {"nvidia.com/gpu": 0, "nvidia.com/a100": 1},
        ),
        ("    extendedResources: [nvidia.com/a100]\n", [4, 5], {"nvidia.com/gpu": 4, "nvidia.com/a100": 0}),
    ],
)
def test_an_extended_resource_dra_serves_is_offered_by_the_device_plugin_with_no_devices(
    dra: str, owned: list[int], served: dict[str, int]
) -> None:
    # The scheduler backs an extended resource with DRA only where the node's allocatable for it is 0.
    state = six_gpus()
    extra = "resources:\n  gpus:\n  - pattern: '*A100*'\n    name: a100\n"
    cfg = config.parse(f"{extra}nvplug:\n  dra:\n    enabled: true\n{dra}", "c.yaml")
    n = Naming.from_config(cfg)
    assert [g.index for g in state.current.gpus if n.dra_owns(g)] == owned
    counts = {spec.name: len(spec.project(state.current).devices) for spec in plan(cfg, state.current).served}
    assert counts == served


def test_extended_resources_are_checked() -> None:
    with pytest.raises(config.ConfigError, match=r"line 3: nvplug\.dra\.extendedResources: needs nvplug\.dra\.enabled"):
        config.parse("nvplug:\n  dra:\n    extendedResources: [nvidia.com/gpu]\n", "c.yaml")
    with pytest.raises(config.ConfigError, match=r"nvidia\.com/gpu is listed twice"):
        config.parse("nvplug:\n  dra:\n    enabled: true\n    extendedResources: [gpu, nvidia.com/gpu]\n", "c.yaml")
    # A name no whole GPU's model has (a typo, a MIG profile): refused, with the names there are.
    with pytest.raises(config.ConfigError, match=r"line 7: nvplug\.dra\.extendedResources: nvidia\.com/gpus is no "
                       r"whole GPU's name \(resources\.gpus names nvidia\.com/a100, nvidia\.com/gpu\)"):  # fmt: skip
        config.parse("resources:\n  gpus:\n  - pattern: '*A100*'\n    name: a100\nnvplug:\n  dra:\n"
                     "    enabled: true\n    extendedResources: [nvidia.com/gpus]\n", "c.yaml")  # fmt: skip


# --- ResourceSlices ------------------------------------------------------------------------------


def dra_device(i: int, healthy: bool = True, **attributes: Value) -> DraDevice:
    """A device built directly: the publisher and slices need no snapshot."""
    g = gpu(i)
    attrs: dict[str, Value] = {"type": ("string", "gpu"), "uuid": ("string", g.uuid), "index": ("int", i)}
    return DraDevice(
        name=f"gpu-{i:03d}",
        gpu=g,
        mig=None,
        healthy=healthy,
        reason="" if healthy else "XID 79 (test)",
        attributes=attrs | attributes,
        capacity={"memory": "81559Mi"},
        taints=() if healthy else (Taint(XID_KEY, "79", "NoSchedule"),),
    )


def test_device_object_in_each_versions_shape() -> None:
    d = dra_device(3, flag=("bool", True), cc=("version", "9.0.0"))
    body: dict[str, dict[str, Any]] = {
        "attributes": {
            "cc": {"version": "9.0.0"},
            "flag": {"bool": True},
            "index": {"int": 3},
            "type": {"string": "gpu"},
            "uuid": {"string": uuid(3)},
        },
        "capacity": {"memory": {"value": "81559Mi"}},
    }
    # v1beta1 nests attributes and capacity under basic; v1beta2 and v1 put them on the device.
    assert slices.device_object(d, "v1beta1") == {"name": "gpu-003", "basic": body}
    assert slices.device_object(d, "v1beta2") == {"name": "gpu-003", **body}
    assert slices.device_object(d, "v1") == {"name": "gpu-003", **body}
    # Sorted keys: the same pool always makes the same JSON, so an unchanged pool compares equal.
    assert list(slices.device_object(d, "v1")["attributes"]) == sorted(body["attributes"])


def test_a_large_pool_is_split_into_slices_of_one_generation() -> None:
    pool = [dra_device(i) for i in reversed(range(300))] + [dra_device(i, healthy=False) for i in range(300, 310)]
    wanted = slices.pool_devices(pool, "v1")
    # Unhealthy devices leave the pool; the rest are in name order.
    assert [d["name"] for d in wanted] == [f"gpu-{i:03d}" for i in range(300)]
    made = slices.slices(wanted, DRIVER, NODE, 7, "v1")
    assert [len(s["spec"]["devices"]) for s in made] == [128, 128, 44]
    assert [d for s in made for d in s["spec"]["devices"]] == wanted
    for s in made:
        assert s["apiVersion"] == f"{GROUP}/v1" and s["kind"] == "ResourceSlice"
        assert s["metadata"] == {"generateName": f"{NODE}-{DRIVER}-"}
        assert s["spec"]["driver"] == DRIVER and s["spec"]["nodeName"] == NODE
        assert s["spec"]["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 3}


def test_an_empty_pool_is_one_empty_slice() -> None:
    # The pool (and its generation) must still exist so that the scheduler sees it emptied.
    assert slices.pool_devices([dra_device(0, healthy=False)], "v1") == []
    (only,) = slices.slices([], DRIVER, NODE, 1, "v1beta1")
    assert only["apiVersion"] == f"{GROUP}/v1beta1"
    assert only["spec"]["devices"] == []
    assert only["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}


def test_exactly_128_devices_fit_one_slice() -> None:
    wanted = slices.pool_devices([dra_device(i) for i in range(128)], "v1")
    assert len(slices.slices(wanted, DRIVER, NODE, 1, "v1")) == 1
    assert len(slices.slices([*wanted, wanted[0]], DRIVER, NODE, 1, "v1")) == 2


# --- preparing claims ----------------------------------------------------------------------------


REF = ClaimRef("ns", "train", "uid-1")


def pool_of(*found: DraDevice) -> dict[str, DraDevice]:
    return {d.name: d for d in found}


def cdi_ids(d: DraDevice) -> tuple[str, ...]:
    return (f"k8s.gpu.nvidia.com/gpu={d.uuid}",)


def claim(results: list[dict[str, Any]] | None, uid: str = "uid-1") -> dict[str, Any]:
    status = {"allocation": {"devices": {"results": results}}} if results is not None else {}
    return {"metadata": {"namespace": "ns", "name": "train", "uid": uid}, "status": status}


def result(device: str, request: str = "gpus", pool: str = NODE, driver: str = DRIVER, **kw: Any) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **kw}


def test_prepare_hands_out_this_drivers_devices() -> None:
    offered = pool_of(dra_device(0), dra_device(1), dra_device(2))
    doc = claim(
        [
            result("gpu-000", "train/big"),  # a subrequest is folded into its request
            result("nic-0", "net", pool="switch-1", driver="nic.example.com"),  # another driver's: not ours
            result("gpu-001", "infer"),
            result("gpu-001", "shared"),  # one device for two requests: prepared once
        ]
    )
    got = claims.prepare(REF, doc, DRIVER, NODE, offered, cdi_ids)
    assert got == PreparedClaim(
        REF,
        (
            PreparedDevice(("train",), NODE, "gpu-000", uuid(0), (f"k8s.gpu.nvidia.com/gpu={uuid(0)}",)),
            PreparedDevice(("infer", "shared"), NODE, "gpu-001", uuid(1), (f"k8s.gpu.nvidia.com/gpu={uuid(1)}",)),
        ),
    )


def test_prepare_folds_subrequests_of_one_request_on_one_device() -> None:
    doc = claim([result("gpu-000", "req/a"), result("gpu-000", "req/b"), result("gpu-000", "req")])
    (d,) = claims.prepare(REF, doc, DRIVER, NODE, pool_of(dra_device(0)), cdi_ids).devices
    assert d.requests == ("req",)


def test_a_claim_allocated_to_other_drivers_only_prepares_nothing() -> None:
    doc = claim([result("nic-0", driver="nic.example.com", pool="elsewhere")])
    assert claims.prepare(REF, doc, DRIVER, NODE, {}, cdi_ids) == PreparedClaim(REF, ())


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        # The claim was deleted and made again under the same name: not the one the kubelet means.
        (claim([result("gpu-000")], uid="uid-2"), "has UID uid-2 under that name"),
        (claim(None), "not allocated"),
        ({"metadata": {"uid": "uid-1"}, "status": {"allocation": None}}, "not allocated"),
        ({"metadata": {"uid": "uid-1"}}, "not allocated"),
        (claim([result("gpu-000", pool="node-b")]), "is in pool node-b, not in this node's pool node-a"),
        (claim([result("gpu-000"), result("gpu-009")]), "device gpu-009 is not offered by gpu.nvidia.com"),
        (claim([result("gpu-000"), result("gpu-002")]), f"device gpu-002 ({uuid(2)}) is Unhealthy: XID 79"),
        (claim([result("gpu-002", adminAccess=False)]), "is Unhealthy"),
    ],
)
def test_prepare_refuses(doc: dict[str, Any], message: str) -> None:
    offered = pool_of(dra_device(0), dra_device(1), dra_device(2, healthy=False))
    with pytest.raises(ClaimError, match=re.escape(message)) as err:
        claims.prepare(REF, doc, DRIVER, NODE, offered, cdi_ids)
    # The kubelet shows the message in the pod's events: it names the claim.
    assert str(err.value).startswith("ResourceClaim ns/train (uid-1): ")


def test_admin_access_may_use_an_unhealthy_device() -> None:
    offered = pool_of(dra_device(2, healthy=False))
    got = claims.prepare(REF, claim([result("gpu-002", adminAccess=True)]), DRIVER, NODE, offered, cdi_ids)
    assert [d.device for d in got.devices] == ["gpu-002"]


def prepared(uid: str, *devs: tuple[str, int]) -> PreparedClaim:
    return PreparedClaim(
        ClaimRef("ns", f"claim-{uid}", uid),
        tuple(PreparedDevice(("gpus",), NODE, name, uuid(i), (f"cdi/{i}",)) for name, i in devs),
    )


def test_claim_store_persists_and_restores(tmp_path: Path) -> None:
    path = tmp_path / "state" / claims.CHECKPOINT
    store = ClaimStore(path)
    store.load()  # no file yet: nothing, no error
    a, b, c = prepared("a", ("gpu-000", 0)), prepared("b", ("gpu-001", 1), ("gpu-002", 2)), prepared("c")
    for one in (a, b, c):
        store.put(one)
    assert store.remove("c") and not store.remove("c")
    assert store.get("a") == a and store.get("c") is None and len(store) == 2
    assert store.holding(uuid(2)) == [b] and store.holding(uuid(9)) == []
    # Only root can read what was handed out to whom.
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["version"] == claims.CHECKPOINT_VERSION

    again = ClaimStore(path)
    again.load()
    assert again.get("a") == a and again.get("b") == b and again.get("c") is None
    assert sorted(x.claim.uid for x in again) == ["a", "b"]


def test_claim_store_without_a_path_keeps_claims_in_memory(tmp_path: Path) -> None:
    store = ClaimStore(None)
    store.load()
    store.put(prepared("a"))
    assert store.get("a") == prepared("a") and store.remove("a")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        b"[]",
        b"null",
        b'{"version": 2, "claims": []}',
        b'{"version": 1}',
        b'{"version": 1, "claims": [{"claim": {"namespace": "ns"}}]}',
        b'{"version": 1, "claims": [{"claim": {"namespace": "ns", "name": "n", "uid": "u"}, "devices": 3}]}',
    ],
)
def test_a_corrupt_checkpoint_is_kept_aside(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / claims.CHECKPOINT
    path.write_bytes(content)
    store = ClaimStore(path)
    store.load()  # logged, never raised: the plugin must still start
    assert len(store) == 0
    assert not path.exists()
    assert (tmp_path / f"{claims.CHECKPOINT}.bad").read_bytes() == content
    # The next claim starts a new checkpoint; the bad one stays for the operator.
    store.put(prepared("a"))
    assert path.exists() and (tmp_path / f"{claims.CHECKPOINT}.bad").exists()


# --- the API client ------------------------------------------------------------------------------


async def get(cfg: KubeConfig, path: str) -> dict[str, Any]:
    """One GET by a new client."""
    client = ApiClient(cfg, timeout=5.0)
    try:
        return await client.request("GET", path)
    finally:
        await client.close()


def test_discovery_and_a_write_over_the_wire(tmp_path: Path) -> None:
    with FakeApiServer(versions=("v1", "v1beta1")) as api:
        cfg = KubeConfig.load(api.write_kubeconfig(tmp_path / "kc"))
        assert cfg.server == api.url and cfg.token == api.token and cfg.source == str(tmp_path / "kc")

        async def main() -> None:
            client = ApiClient(cfg, timeout=5.0)
            group = await client.request("GET", f"/apis/{GROUP}")
            assert group["kind"] == "APIGroup"
            assert [v["version"] for v in group["versions"]] == ["v1", "v1beta1"]
            # A body goes as JSON: the server answers 415 to any other Content-Type.
            body = slices.slices([], DRIVER, NODE, 1, "v1")[0]
            made = await client.request("POST", f"/apis/{GROUP}/v1/resourceslices", body)
            assert made["metadata"]["name"].startswith(f"{NODE}-{DRIVER}-")
            got = await client.request("GET", f"/apis/{GROUP}/v1/resourceslices/{made['metadata']['name']}")
            assert got["spec"] == body["spec"]
            await client.close()

        asyncio.run(main())
        assert [(m, s) for m, _, s in api.requests] == [("GET", 200), ("POST", 201), ("GET", 200)]


def test_a_wrong_token_is_401(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        cfg = KubeConfig.load(api.write_kubeconfig(tmp_path / "kc", token="wrong"))
        with pytest.raises(ApiError) as err:
            asyncio.run(get(cfg, f"/apis/{GROUP}"))
        assert err.value.status == 401 and err.value.reason == "Unauthorized"
        assert "GET /apis/resource.k8s.io: 401 Unauthorized" in str(err.value)


def test_an_unknown_object_is_404(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        cfg = KubeConfig.load(api.write_kubeconfig(tmp_path / "kc"))
        with pytest.raises(ApiError) as err:
            asyncio.run(get(cfg, f"/apis/{GROUP}/v1/resourceslices/absent"))
        assert err.value.status == 404 and err.value.reason == "NotFound"
        assert '"absent" not found' in str(err.value)
        # A version the server does not serve is not there at all.
        with pytest.raises(ApiError) as err:
            asyncio.run(get(cfg, f"/apis/{GROUP}/v1beta1/resourceslices"))
        assert err.value.status == 404


def test_an_invalid_object_is_422_with_the_servers_message(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        cfg = KubeConfig.load(api.write_kubeconfig(tmp_path / "kc"))
        # A v1beta1-shaped device (under basic) in a v1 slice.
        body = slices.slices([slices.device_object(dra_device(0), "v1beta1")], DRIVER, NODE, 1, "v1")[0]

        async def main() -> None:
            client = ApiClient(cfg, timeout=5.0)
            try:
                await client.request("POST", f"/apis/{GROUP}/v1/resourceslices", body)
            finally:
                await client.close()

        with pytest.raises(ApiError) as err:
            asyncio.run(main())
        assert err.value.status == 422 and err.value.reason == "Invalid"
        assert "spec.devices[0].basic" in str(err.value)


def kubeconfig(
    server: str = "http://127.0.0.1:6443", user: dict[str, Any] | None = None, top: dict[str, Any] | None = None
) -> str:
    """A kubeconfig with one cluster, user and context; `top` replaces top-level keys."""
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user if user is not None else {"token": "t"}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
    }
    doc.update(top or {})
    return yaml.safe_dump(doc)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (kubeconfig(user={"exec": {"command": "aws"}}), "exec and auth-provider credentials are not supported"),
        (kubeconfig(user={"auth-provider": {"name": "gcp"}}), "exec and auth-provider credentials"),
        (kubeconfig(top={"current-context": None}), "current-context is not set"),
        (kubeconfig(top={"current-context": "other"}), "contexts: no entry named 'other'"),
        (kubeconfig(server="127.0.0.1:6443"), "server must be an http(s) URL"),
        (kubeconfig(server="ftp://127.0.0.1"), "server must be an http(s) URL"),
        (kubeconfig(top={"clusters": [{"name": "c", "cluster": {}}]}), "server must be an http(s) URL, not None"),
        (kubeconfig(user={"client-certificate-data": "not base64!"}), "client-certificate-data is not base64"),
        ("- just\n- a list\n", "not a kubeconfig"),
        ("clusters: [\n", "cannot read the kubeconfig"),
    ],
)
def test_an_unusable_kubeconfig_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "kc"
    path.write_text(text)
    with pytest.raises(KubeConfigError, match=re.escape(message)) as err:
        KubeConfig.load(path)
    assert str(err.value).startswith(f"{path}: ")


def test_a_missing_kubeconfig_is_named(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match=re.escape(f"{tmp_path / 'absent'}: cannot read")):
        KubeConfig.load(tmp_path / "absent")


def test_the_token_file_is_read_at_each_request(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        # A relative tokenFile is relative to the kubeconfig, as kubectl reads it.
        path = tmp_path / "kc"
        path.write_text(kubeconfig(api.url, {"tokenFile": "token"}))
        token = tmp_path / "token"
        token.write_text("rotated-1\n")
        cfg = KubeConfig.load(path)
        assert cfg.token_file == str(token)

        async def main() -> None:
            client = ApiClient(cfg, timeout=5.0)
            with pytest.raises(ApiError) as err:
                await client.request("GET", f"/apis/{GROUP}")
            assert err.value.status == 401
            api.token = "rotated-1"
            assert (await client.request("GET", f"/apis/{GROUP}"))["kind"] == "APIGroup"
            # Rotated in place (a projected token): the next request sends the new one.
            token.write_text("rotated-2")
            with pytest.raises(ApiError) as err:
                await client.request("GET", f"/apis/{GROUP}")
            assert err.value.status == 401
            api.token = "rotated-2"
            assert (await client.request("GET", f"/apis/{GROUP}"))["kind"] == "APIGroup"
            # Gone: the request fails naming the kubeconfig and the file, and nothing is sent.
            token.unlink()
            sent = len(api.requests)
            with pytest.raises(KubeConfigError, match=re.escape(f"{path}: tokenFile {token}")):
                await client.request("GET", f"/apis/{GROUP}")
            assert len(api.requests) == sent
            await client.close()

        asyncio.run(main())


def test_a_stopped_server_refuses_and_a_restarted_one_is_reached_again(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        cfg = KubeConfig.load(api.write_kubeconfig(tmp_path / "kc"))

        async def main() -> None:
            client = ApiClient(cfg, timeout=5.0)
            assert (await client.request("GET", f"/apis/{GROUP}"))["kind"] == "APIGroup"
            await asyncio.to_thread(api.stop)
            # A new connection is refused; the kept-alive one fails too (an OSError, either way).
            with pytest.raises(ConnectionRefusedError):
                await get(cfg, f"/apis/{GROUP}")
            with pytest.raises(OSError):
                await client.request("GET", f"/apis/{GROUP}")
            await asyncio.to_thread(api.start)
            # The same client reaches the server again: no new client, no restart of the caller.
            assert (await client.request("GET", f"/apis/{GROUP}"))["kind"] == "APIGroup"
            # A restart while the client is idle: the first request after it is answered.
            await asyncio.to_thread(api.restart)
            assert (await client.request("GET", f"/apis/{GROUP}"))["kind"] == "APIGroup"
            await client.close()

        asyncio.run(main())


def test_the_first_request_after_the_server_closed_an_idle_connection_succeeds(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        cfg = KubeConfig.load(api.write_kubeconfig(tmp_path / "kc"))

        async def main() -> None:
            client = ApiClient(cfg, timeout=5.0)
            try:
                await client.request("GET", f"/apis/{GROUP}")
                # The server restarts (or drops the idle connection) while the client is idle; the loop
                # runs meanwhile and sees the connection's end.
                await asyncio.to_thread(api.restart)
                await asyncio.sleep(0.1)
                assert (await client.request("GET", f"/apis/{GROUP}"))["kind"] == "APIGroup"
            finally:
                await client.close()

        asyncio.run(main())


# --- the slice publisher -------------------------------------------------------------------------


async def until(check: Callable[[], T | None], what: str, timeout: float = 5.0) -> T:
    """Poll the stand-in's state (no HTTP) until `check` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def publishing(kubeconfig_path: Path, timeout: float = 5.0) -> AsyncIterator[SlicePublisher]:
    """A publisher running as a task on this loop, cancelled at the end."""
    client = ApiClient(KubeConfig.load(kubeconfig_path), timeout=timeout)
    publisher = SlicePublisher(client, DRIVER, NODE)
    task = asyncio.create_task(publisher.run())
    try:
        yield publisher
        # The task never ends on its own: ended means it died of an error it should have retried.
        assert not task.done(), task.exception() if task.done() else None
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


def published(api: FakeApiServer) -> list[dict[str, Any]]:
    return api.slices(NODE, DRIVER)


def pool_state(found: list[dict[str, Any]]) -> tuple[set[int], list[str]]:
    """The generations of the node's slices, and their devices' names in slice order."""
    return {s["spec"]["pool"]["generation"] for s in found}, [d["name"] for s in found for d in s["spec"]["devices"]]


def settled(api: FakeApiServer, pub: SlicePublisher, generation: int, count: int) -> list[dict[str, Any]] | None:
    """The node's slices once all `count` of them hold `generation` and the publisher is done with them:
    the server stores a slice before its answer reaches the publisher, which takes the slices as
    written only after its last request."""
    found = published(api)
    ok = len(found) == count and all(s["spec"]["pool"]["generation"] == generation for s in found)
    return found if ok and sorted(pub.slice_names) == [s["metadata"]["name"] for s in found] else None


def written(
    api: FakeApiServer, pub: SlicePublisher, check: Callable[[list[dict[str, Any]]], bool]
) -> Callable[[], list[dict[str, Any]] | None]:
    """The node's one slice once the publisher is done with a write that passes `check`, of whatever
    generation (a write that lost a conflict used one up)."""

    def found() -> list[dict[str, Any]] | None:
        now = published(api)
        done = len(now) == 1 and pub.published and pub.slice_names == [now[0]["metadata"]["name"]]
        return now if done and check(now) else None

    return found


def test_a_republish_while_the_publisher_probes_lists_again_and_fails_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The kubelet registers us again while the taints probe waits on the API server: the list taken
    before it is dropped, and the publisher lists again, with no failure and no backoff."""
    with FakeApiServer(taints=False) as api:
        kc = api.write_kubeconfig(tmp_path / "kc")
        probe = slice_publisher.probe_taints
        probes: list[bool] = []

        async def main() -> None:
            async with publishing(kc) as pub:

                async def republished_meanwhile(*args: Any) -> tuple[bool, bool]:
                    if not probes:
                        pub.republish(settle=False)
                    probes.append(True)
                    return await probe(*args)

                monkeypatch.setattr(slice_publisher, "probe_taints", republished_meanwhile)
                pub.want([dra_device(i) for i in range(3)])
                await until(lambda: settled(api, pub, 1, 1), "the first slice")
                assert len(probes) == 2  # the republish asked for the probe again
                assert pub.error is None

        with caplog.at_level("ERROR", logger="nvplug.dra"):
            asyncio.run(main())
        assert not [r.getMessage() for r in caplog.records if "not published" in r.getMessage()]


def test_a_failure_that_is_no_api_error_is_logged_with_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A TypeError in reconcile (a bug, or an answer nvplug cannot read) is retried like an API failure, but
    not passed off as one: its traceback is in the log. An API server's refusal has none."""
    with FakeApiServer(taints=False) as api:
        kc = api.write_kubeconfig(tmp_path / "kc")
        probe = slice_publisher.probe_taints
        calls: list[int] = []

        async def main() -> None:
            async with publishing(kc) as pub:

                async def broken_once(*args: Any) -> tuple[bool, bool]:
                    calls.append(1)
                    if len(calls) == 1:
                        raise TypeError("'NoneType' object is not iterable")
                    return await probe(*args)

                monkeypatch.setattr(slice_publisher, "probe_taints", broken_once)
                pub.want([dra_device(i) for i in range(3)])
                await until(lambda: settled(api, pub, 1, 1), "the slice, after the retry")
                assert pub.error is None

        with caplog.at_level("ERROR", logger="nvplug.dra"):
            asyncio.run(main())
        (failed,) = [r for r in caplog.records if "not published" in r.getMessage()]
        assert failed.exc_info is not None and failed.exc_info[0] is TypeError

        api.fail_next(1, 503, "ServiceUnavailable")
        caplog.clear()

        async def refused() -> None:
            async with publishing(kc) as pub:
                pub.want([dra_device(i) for i in range(2)])
                await until(lambda: settled(api, pub, 2, 1), "the slice, after the 503")

        with caplog.at_level("ERROR", logger="nvplug.dra"):
            asyncio.run(refused())
        (failed,) = [r for r in caplog.records if "not published" in r.getMessage()]
        assert "503" in failed.getMessage() and not failed.exc_info


def test_publisher_writes_the_pool_and_updates_it_in_place(tmp_path: Path) -> None:
    # A server that drops taints (DRADeviceTaints off): an Unhealthy device leaves the pool.
    with FakeApiServer(taints=False) as api:
        kc = api.write_kubeconfig(tmp_path / "kc")

        async def main() -> None:
            async with publishing(kc) as pub:
                pub.want([dra_device(i) for i in range(3)])
                (first,) = await until(lambda: settled(api, pub, 1, 1), "the first slice")
                name = first["metadata"]["name"]
                assert first["apiVersion"] == f"{GROUP}/v1"
                assert name.startswith(f"{NODE}-{DRIVER}-")
                assert first["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
                assert first["spec"]["devices"] == slices.pool_devices([dra_device(i) for i in range(3)], "v1")
                status = pub.status()
                assert status["api_version"] == f"{GROUP}/v1" and status["pool_generation"] == 1
                assert status["slices"] == [name] and status["pool_devices"] == 3
                assert status["error"] is None and status["published_at"] is not None

                # A device turns Unhealthy: the same slice, the next generation, without it.
                pub.want([dra_device(0), dra_device(1, healthy=False), dra_device(2)])
                (second,) = await until(lambda: settled(api, pub, 2, 1), "generation 2")
                assert second["metadata"]["name"] == name
                assert pool_state([second]) == ({2}, ["gpu-000", "gpu-002"])
                assert second["metadata"]["uid"] == first["metadata"]["uid"]

                # An attribute changes (a new driver): written again.
                pub.want([dra_device(0, driverVersion=("version", "560.0.0")), dra_device(2)])
                (third,) = await until(lambda: settled(api, pub, 3, 1), "generation 3")
                assert third["metadata"]["name"] == name
                assert third["spec"]["devices"][0]["attributes"]["driverVersion"] == {"version": "560.0.0"}

                # The same pool again is not written.
                writes, sent = pub.writes, len(api.requests)
                pub.want([dra_device(0, driverVersion=("version", "560.0.0")), dra_device(2)])
                await asyncio.sleep(0.2)
                assert pub.writes == writes and len(api.requests) == sent
                assert pub.status()["pool_generation"] == 3

        asyncio.run(main())


@pytest.mark.parametrize(("taints", "cut"), [(False, [72, 128]), (True, [8, 64, 64, 64])])
def test_publisher_splits_and_merges_slices(tmp_path: Path, taints: bool, cut: list[int]) -> None:
    # A slice with a taint holds 64 devices: where taints are kept, the pool is cut at 64 from the start.
    with FakeApiServer(taints=taints) as api:
        kc = api.write_kubeconfig(tmp_path / "kc")

        async def main() -> None:
            async with publishing(kc) as pub:
                pub.want([dra_device(i) for i in range(200)])
                two = await until(lambda: settled(api, pub, 1, len(cut)), "the slices")
                # Slices are named by the server (generateName): their order by name is random.
                assert sorted(len(s["spec"]["devices"]) for s in two) == cut
                assert sorted(pool_state(two)[1]) == [f"gpu-{i:03d}" for i in range(200)]
                assert all(s["spec"]["pool"]["resourceSliceCount"] == len(cut) for s in two)
                assert sorted(pub.slice_names) == [s["metadata"]["name"] for s in two]

                # Back to 10 devices: one slice is rewritten, the other deleted.
                pub.want([dra_device(i) for i in range(10)])
                (one,) = await until(lambda: settled(api, pub, 2, 1), "one slice")
                assert one["metadata"]["name"] in {s["metadata"]["name"] for s in two}
                assert pool_state([one]) == ({2}, [f"gpu-{i:03d}" for i in range(10)])
                assert one["spec"]["pool"]["resourceSliceCount"] == 1
                assert [m for m, _, _ in api.requests].count("DELETE") == len(cut) - 1

        asyncio.run(main())


def test_publisher_taints_keeps_what_the_server_stored_and_merges_on_a_conflict(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        kc = api.write_kubeconfig(tmp_path / "kc")
        admin = {"key": "example.com/maintenance", "effect": "NoSchedule", "timeAdded": "2020-01-01T00:00:00Z"}
        new_driver = ("version", "560.0.0")

        def taints_of(found: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
            return next(d.get("taints") or [] for s in found for d in s["spec"]["devices"] if d["name"] == name)

        async def main() -> None:
            async with publishing(kc) as pub:
                pub.want([dra_device(0), dra_device(1, healthy=False), dra_device(2)])
                (first,) = await until(lambda: settled(api, pub, 1, 1), "the tainted slice")
                (ours,) = taints_of([first], "gpu-001")
                assert (ours["key"], ours["value"], ours["effect"]) == (XID_KEY, "79", "NoSchedule")
                assert pub.taints is True and pub.status()["pool_devices"] == 3

                # An admin's taint lands just before nvplug's next write, which then carries an old
                # resourceVersion and gets 409: nvplug reads the slice again and merges. The admin also
                # moved our taint's timeAdded: nvplug keeps what the server stored.
                def edit(obj: dict[str, Any]) -> None:
                    device = next(d for d in obj["spec"]["devices"] if d["name"] == "gpu-001")
                    device["taints"] = [{**device["taints"][0], "timeAdded": "2021-01-01T00:00:00Z"}, dict(admin)]

                api.edit_slice(first["metadata"]["name"], edit)
                pub.want([dra_device(0, driverVersion=new_driver), dra_device(1, healthy=False), dra_device(2)])
                second = await until(
                    written(api, pub, lambda f: "driverVersion" in f[0]["spec"]["devices"][0]["attributes"]),
                    "the merged write",
                )
                assert taints_of(second, "gpu-001") == [{**ours, "timeAdded": "2021-01-01T00:00:00Z"}, admin]
                # The PUT went out before the watch's news of the edit was read (both ready in one turn of the
                # loop, the publisher's first): 409, then read again and merged.
                assert [r[2] for r in api.requests if r[0] == "PUT"] == [409, 200]

                # The device heals: our taint goes, the admin's stays.
                pub.want([dra_device(0, driverVersion=new_driver), dra_device(1), dra_device(2)])
                third = await until(written(api, pub, lambda f: len(taints_of(f, "gpu-001")) == 1), "the heal")
                assert taints_of(third, "gpu-001") == [admin]

        asyncio.run(main())


def test_publisher_on_a_server_without_the_effect_none_and_one_that_refuses_the_dry_run(tmp_path: Path) -> None:
    unmonitored = replace(dra_device(2), taints=(Taint("gpu.nvidia.com/unmonitored", "", "None"),))
    with FakeApiServer() as api:
        api.effect_none = False  # 1.33 and 1.34: NoSchedule and NoExecute only
        kc = api.write_kubeconfig(tmp_path / "kc")

        async def main() -> None:
            async with publishing(kc) as pub:
                pub.want([dra_device(0), dra_device(1, healthy=False), unmonitored])
                (found,) = await until(lambda: settled(api, pub, 1, 1), "the slice")
                taints = {d["name"]: [t["key"] for t in d.get("taints") or []] for d in found["spec"]["devices"]}
                # The Xid's taint is written; the one of effect None is left out rather than refused.
                assert taints == {"gpu-000": [], "gpu-001": [XID_KEY], "gpu-002": []}
                assert pub.taints is True and pub.status()["tainted"] == {"gpu-001": [f"{XID_KEY}=79:NoSchedule"]}

        asyncio.run(main())
    with FakeApiServer() as api:
        api.fail_next(1, 422, "Invalid", writes_only=True)  # the dry run: a server that takes no taint
        kc = api.write_kubeconfig(tmp_path / "kc2")

        async def refused() -> None:
            async with publishing(kc) as pub:
                pub.want([dra_device(0), dra_device(1, healthy=False)])
                (found,) = await until(lambda: settled(api, pub, 1, 1), "the slice")
                assert [d["name"] for d in found["spec"]["devices"]] == ["gpu-000"] and pub.taints is False

        asyncio.run(refused())


def test_publisher_publishes_an_empty_pool(tmp_path: Path) -> None:
    with FakeApiServer(taints=False) as api:
        kc = api.write_kubeconfig(tmp_path / "kc")

        async def main() -> None:
            async with publishing(kc) as pub:
                pub.want([dra_device(0, healthy=False)])
                (only,) = await until(lambda: settled(api, pub, 1, 1), "an empty slice")
                assert only["spec"]["devices"] == [] and only["spec"]["pool"]["resourceSliceCount"] == 1
                assert pub.status()["pool_devices"] == 0

        asyncio.run(main())


def test_republish_writes_slices_the_kubelet_deleted(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        kc = api.write_kubeconfig(tmp_path / "kc")

        async def main() -> None:
            async with publishing(kc) as pub:
                pub.want([dra_device(i) for i in range(4)])
                (before,) = await until(lambda: settled(api, pub, 1, 1), "the first slice")
                # The kubelet deletes its node's slices when it starts, then registers the plugin again.
                assert api.delete_slices(NODE) == 1
                pub.republish()
                (after,) = await until(lambda: settled(api, pub, 2, 1), "the slices written again")
                assert after["spec"]["devices"] == before["spec"]["devices"]
                assert pub.slice_names == [after["metadata"]["name"]]

        asyncio.run(main())


def test_republish_during_a_write_is_not_lost(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        kc = api.write_kubeconfig(tmp_path / "kc")

        async def main() -> None:
            async with publishing(kc) as pub:
                assert pub.client is not None
                real = pub.client.request
                raced = False

                async def request(method: str, path: str, body: Any = None) -> dict[str, Any]:
                    nonlocal raced
                    answer = await real(method, path, body)
                    if method == "POST" and not raced:
                        # The slice is stored; before its answer is taken in, the kubelet restarts
                        # (deleting the node's slices) and the plugin registers again.
                        raced = True
                        api.delete_slices(NODE)
                        pub.republish()
                    return answer

                pub.client.request = request  # type: ignore[method-assign]
                pub.want([dra_device(0)])
                await until(lambda: raced, "the write")
                await until(lambda: published(api), "the slices written again", timeout=1.5)

        asyncio.run(main())


def test_publisher_records_errors_and_clears_them_once_published(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        kc = api.write_kubeconfig(tmp_path / "kc")

        async def main() -> None:
            api.fail_next(2, 500)
            async with publishing(kc) as pub:
                pub.want([dra_device(0)])
                error = await until(lambda: pub.error, "the error")
                assert f"ResourceSlices of {NODE} not published" in error and "500" in error
                assert pub.status()["error"] == error
                # Retried with backoff until the server answers; the error is then gone.
                await until(lambda: settled(api, pub, 1, 1), "the slice after the failures")
                await until(lambda: pub.error is None, "the error cleared")
                assert [s for _, _, s in api.requests][:2] == [500, 500]

        asyncio.run(main())


def test_a_server_that_never_answers_is_an_error_not_the_end_of_the_publisher(tmp_path: Path) -> None:
    # A socket that listens and never answers: each request times out. The timeout must be caught as an
    # API failure (retried with backoff), not escape run() (on Python 3.10 asyncio's TimeoutError is not
    # the builtin one that publisher.FAILURES names).
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        path = tmp_path / "kc"
        path.write_text(kubeconfig(f"http://127.0.0.1:{mute.getsockname()[1]}"))

        async def main() -> None:
            async with publishing(path, timeout=0.2) as pub:
                pub.want([dra_device(0)])
                error = await until(lambda: pub.error, "the error")
                assert error.startswith(f"ResourceSlices of {NODE} not published")
                # Past the first retry: still running (publishing() checks the task at the end).
                await asyncio.sleep(0.8)

        asyncio.run(main())


@pytest.mark.parametrize(
    ("served", "chosen"),
    [
        (("v1beta1",), "v1beta1"),
        # The newest version nvplug knows, whatever the server prefers.
        (("v1beta1", "v1beta2"), "v1beta2"),
        (("v1beta2", "v1"), "v1"),
    ],
)
def test_publisher_writes_the_newest_version_served(tmp_path: Path, served: tuple[str, ...], chosen: str) -> None:
    with FakeApiServer(versions=served) as api:
        kc = api.write_kubeconfig(tmp_path / "kc")

        async def main() -> None:
            async with publishing(kc) as pub:
                pub.want([dra_device(0), dra_device(1)])
                (only,) = await until(lambda: settled(api, pub, 1, 1), "the slice")
                assert pub.version == chosen
                assert only["apiVersion"] == f"{GROUP}/{chosen}"
                assert only["spec"]["devices"] == slices.pool_devices([dra_device(0), dra_device(1)], chosen)
                # Only v1beta1 nests under basic.
                assert ("basic" in only["spec"]["devices"][0]) == (chosen == "v1beta1")

        asyncio.run(main())


@pytest.mark.parametrize("version", ["v1", "v1beta2", "v1beta1"])
def test_offered_devices_pass_the_api_servers_validation(tmp_path: Path, version: str) -> None:
    # Real descriptions (GPU and MIG devices, every attribute and capacity) against the stand-in's
    # validation of names, attribute types, versions and quantities: a 422 would leave no slice.
    mig = mig_gpu()
    state = node(mig, gpu(1, A100, memory_mib=81920, compute_capability=(8, 0), brand="Nvidia",
                          architecture="Ampere"), driver_version="550.54.15", cuda_version=12040)  # fmt: skip
    found = devices.offered(state.current, naming("", "flags:\n  migStrategy: mixed\n"))
    assert len(found) == 4
    with FakeApiServer(versions=(version,)) as api:
        kc = api.write_kubeconfig(tmp_path / "kc")

        async def main() -> None:
            async with publishing(kc) as pub:
                pub.want(found)
                (only,) = await until(lambda: settled(api, pub, 1, 1), "the slice")
                assert sorted(pool_state([only])[1]) == sorted(names(found))
                assert pub.error is None

        asyncio.run(main())
        assert all(status < 400 for _, _, status in api.requests)
