"""Device nodes watched, not only scanned: a node made after the start, or removed, is seen at once."""

from __future__ import annotations

import queue
import time
from pathlib import Path

from nvplug.core.events import DeviceNodesChanged, Event, InventoryFound
from nvplug.core.gpu import Gpu
from nvplug.core.health import Clears
from nvplug.core.node_state import NodeState
from nvplug.sources.dev_node_watch import DevNodeWatch, list_nodes
from nvplug.testing.loop_thread import LoopThread
from nvplug.testing.simulated_node import SimulatedNode, device_health, registered_with

TIMEOUT = 15.0
UUID = "GPU-00000000"
MISSING = "its device node /dev/nvidia0 is missing"


def gpu() -> Gpu:
    return Gpu(UUID, 0, "0000:18:00.0", minor=0)


def test_listing_names_nodes_as_a_container_sees_them(tmp_path: Path) -> None:
    (tmp_path / "dev/nvidia-caps").mkdir(parents=True)
    for name in ("dev/nvidia0", "dev/nvidiactl", "dev/null", "dev/nvidia-caps/nvidia-cap1"):
        (tmp_path / name).touch()
    expected = {"/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-caps", "/dev/nvidia-caps/nvidia-cap1"}
    assert list_nodes(tmp_path) == expected
    assert list_nodes(tmp_path / "absent") == frozenset()


def test_a_node_that_appears_heals_and_one_removed_unreadies() -> None:
    state = NodeState()
    state.apply(InventoryFound((gpu(),), unready={UUID: MISSING}))
    assert state.current.health[UUID].clears is Clears.CHECK
    state.apply(DeviceNodesChanged(frozenset({"/dev/nvidia0"})))
    assert state.current.health[UUID].reason == "recovered: what Allocate needs is present now"
    state.apply(DeviceNodesChanged(frozenset()))
    assert state.current.health[UUID].reason == f"cannot be allocated: {MISSING}"


def test_a_scan_that_looked_before_the_node_appeared_does_not_undo_the_watch() -> None:
    """The scan's look at /dev can reach the bus after the watch's newer listing: the listing wins."""
    state = NodeState()
    state.apply(DeviceNodesChanged(frozenset({"/dev/nvidia0"})))
    state.apply(InventoryFound((gpu(),), unready={UUID: MISSING}))
    assert state.current.health[UUID].healthy


def test_the_watch_publishes_each_new_listing(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    seen: queue.Queue[Event] = queue.Queue()

    # A loop in a thread, as the daemon's: the watch reads inotify on it while this thread waits.
    with LoopThread(TIMEOUT) as loop:
        watch = DevNodeWatch(tmp_path, seen.put)
        loop.call(watch.start)
        try:
            assert seen.get(timeout=5) == DeviceNodesChanged(frozenset())
            (tmp_path / "dev/nvidia3").touch()
            assert seen.get(timeout=5) == DeviceNodesChanged(frozenset({"/dev/nvidia3"}))
            (tmp_path / "dev/unrelated").touch()  # not an NVIDIA node: nothing to tell
            # nvidia-caps made later (MIG enabled) is followed too.
            (tmp_path / "dev/nvidia-caps").mkdir()
            assert seen.get(timeout=5) == DeviceNodesChanged(frozenset({"/dev/nvidia3", "/dev/nvidia-caps"}))
            (tmp_path / "dev/nvidia-caps/nvidia-cap2").touch()
            expected = {"/dev/nvidia3", "/dev/nvidia-caps", "/dev/nvidia-caps/nvidia-cap2"}
            assert seen.get(timeout=5) == DeviceNodesChanged(frozenset(expected))
            (tmp_path / "dev/nvidia3").unlink()
            assert seen.get(timeout=5) == DeviceNodesChanged(frozenset(expected - {"/dev/nvidia3"}))
            assert seen.empty()
        finally:
            loop.run(watch.stop())


def test_a_late_device_node_turns_its_gpu_healthy_without_a_scan(tmp_path: Path) -> None:
    with SimulatedNode(tmp_path) as node:
        gpus = node.scenario_gpus()
        late = gpus[3]
        node_path = node.dev_root / "dev" / f"nvidia{late['minor']}"
        node_path.unlink()
        node.kubelet.start()
        node.start_daemon()
        node.kubelet.wait_for(registered_with(len(gpus)), TIMEOUT)
        node.kubelet.wait_for(device_health(late["uuid"], False), TIMEOUT)
        scans = node.log_text().count("scan ")
        node_path.touch()
        made = time.monotonic()
        node.kubelet.wait_for(device_health(late["uuid"], True), TIMEOUT)
        took = time.monotonic() - made
        log = node.wait_log("recovered: what Allocate needs is present now")
        assert node.log_text().count("scan ") == scans, "healed by the watch, not by a rescan"
        print(f"late node to Healthy at the kubelet: {took * 1000:.1f} ms")
        # The reverse: a node removed makes its GPU unready at once.
        node_path.unlink()
        node.kubelet.wait_for(device_health(late["uuid"], False), TIMEOUT)
        assert f"its device node /dev/nvidia{late['minor']} is missing" in node.wait_log("is missing", after=len(log))
