"""Pods and devices without a kubelet: ID mapping, the rate limiter, the doctor's cross-check."""

from __future__ import annotations

import json
from pathlib import Path

from nvplug.cli.doctor.crosscheck import CheckpointEntry, cross_check, read_checkpoint, unhealthy_ids
from nvplug.core.events import InventoryFound
from nvplug.core.gpu import Gpu, MigDevice
from nvplug.core.node_state import NodeState
from nvplug.core.snapshot import Snapshot
from nvplug.kubelet.podresources_client import TokenBucket
from nvplug.pods.pod_holders import ContainerDevices, Holder, holders, of_gpu, resolve

MIGS = (MigDevice("MIG-a", 1, 0, "3g.40gb"), MigDevice("MIG-b", 2, 0, "1g.10gb"))
GPUS = (Gpu("GPU-0", 0, "0000:18:00.0"), Gpu("GPU-1", 1, "0000:2a:00.0", mig_enabled=True, mig=MIGS))


def snapshot() -> Snapshot:
    state = NodeState()
    state.apply(InventoryFound(GPUS))
    return state.current


def test_every_id_format_maps_to_its_device() -> None:
    assert resolve("GPU-0", GPUS) == ("GPU-0", None)
    assert resolve("GPU-0::7", GPUS) == ("GPU-0", 7)
    assert resolve("MIG-b", GPUS) == ("MIG-b", None)
    assert resolve("0", GPUS) == ("GPU-0", None)
    assert resolve("1:1", GPUS) == ("MIG-b", None)
    for foreign in ("GPU-9", "GPU-0::x", "1:5", "7", "fpga-0", "", "::"):
        assert resolve(foreign, GPUS) is None, foreign


def test_holders_by_device_and_by_gpu() -> None:
    entries = [
        ContainerDevices("ml", "a", "main", "nvidia.com/gpu", ("GPU-0::1", "GPU-0::2")),
        ContainerDevices("ml", "b", "main", "nvidia.com/mig-1g.10gb", ("MIG-b",)),
        ContainerDevices("x", "c", "main", "example.com/fpga", ("0",)),  # someone else's 0
        ContainerDevices("x", "d", "main", "nvidia.com/gpu.shared", ("1",)),
    ]
    found = holders(entries, snapshot(), served=["nvidia.com/gpu"])
    assert [h.replica for h in found["GPU-0"]] == [1, 2]
    assert [h.pod for h in found["MIG-b"]] == ["b"]
    assert [h.pod for h in found["GPU-1"]] == ["d"]
    assert [h.pod for h in of_gpu(found, GPUS[1])] == ["d", "b"]
    assert found["GPU-0"][0].text == "ml/a (container main, replica 1)"
    assert Holder("ml", "b", "main", "r", "MIG-b").text == "ml/b (container main)"


def test_token_bucket_waits_and_refuses() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=2.0, burst=2, clock=lambda: now[0])
    assert [bucket.delay() for _ in range(3)] == [0.0, 0.0, 0.5]
    now[0] = 10.0
    assert bucket.allow() and bucket.allow() and not bucket.allow()
    now[0] = 10.5
    assert bucket.allow() and not bucket.allow()


STATUS = {
    "resources": [{"name": "nvidia.com/gpu"}],
    "gpus": [
        {"uuid": "GPU-0", "health": "Unhealthy", "advertised": {"nvidia.com/gpu": ["GPU-0"]}, "mig": []},
        {"uuid": "GPU-1", "health": "Healthy", "advertised": {"nvidia.com/gpu": ["GPU-1"]}, "mig": []},
    ],
}


def test_cross_check_finds_each_disagreement_with_its_fix() -> None:
    assert unhealthy_ids(STATUS) == {"nvidia.com/gpu": {"GPU-0"}}
    allocatable = {"nvidia.com/gpu": ["GPU-0", "GPU-1"], "nvidia.com/mig-1g.10gb": ["MIG-b"], "example.com/x": ["0"]}
    pods = [ContainerDevices("ml", "a", "main", "nvidia.com/gpu", ("GPU-1",))]
    checkpoint = [
        CheckpointEntry("uid-a", "main", "nvidia.com/gpu", ("GPU-1",)),
        CheckpointEntry("uid-gone", "main", "nvidia.com/gpu", ("GPU-0",)),
        CheckpointEntry("uid-other", "main", "example.com/x", ("0",)),
    ]
    found = cross_check(STATUS, allocatable, pods, checkpoint)
    assert [f.problem for f in found] == [
        "the kubelet counts 1 nvidia.com/gpu device(s) as allocatable that nvplug says are Unhealthy: GPU-0",
        "the kubelet still lists nvidia.com/mig-1g.10gb (1 devices) that nvplug does not serve",
        "the kubelet's checkpoint gives nvidia.com/gpu GPU-0 to pod uid-gone (container main), which no running pod "
        "holds",
    ]
    assert all(f.fix for f in found)
    assert cross_check(STATUS, {"nvidia.com/gpu": ["GPU-1"]}, pods, checkpoint[:1]) == []


def test_checkpoint_formats(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    entry = {"PodUID": "u1", "ContainerName": "c", "ResourceName": "nvidia.com/gpu", "AllocResp": "AA=="}
    path.write_text(
        json.dumps({"Data": {"PodDeviceEntries": [{**entry, "DeviceIDs": {"0": ["GPU-0"], "1": ["GPU-1"]}}]}})
    )
    assert read_checkpoint(path) == [CheckpointEntry("u1", "c", "nvidia.com/gpu", ("GPU-0", "GPU-1"))]
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": [{**entry, "DeviceIDs": ["GPU-2"]}]}}))
    assert read_checkpoint(path)[0].device_ids == ("GPU-2",)
