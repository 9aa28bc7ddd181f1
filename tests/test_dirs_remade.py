"""The kubelet's directories removed and made again (a node re-join, a kubelet reinstall that wipes
/var/lib/kubelet): the watch follows the nearest parent that exists and comes back down, the sockets
are served again and registered at once, and while they cannot be, the status line, /healthz and
doctor say why, naming the directory. Real inotify, real sockets, the real daemon."""

from __future__ import annotations

import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.notify_socket import NotifySocket
from support.waiting import wait_until
from test_doctor import doctor, prepare
from test_dra_e2e import DRIVER, Dra, dra  # noqa: F401 (the fixture)

from nvplug.core.events import Event, KubeletSocketCreated, PluginSocketRemoved, WatchedDirChanged
from nvplug.inotify.inotify_binding import IN_CREATE, IN_Q_OVERFLOW, InotifyEvent, WatchDescriptor, parse
from nvplug.inotify.inotify_reader import CallbackId, InotifyReader
from nvplug.sources.kubelet_dir_watch import DirFollower, KubeletDirWatch
from nvplug.status import status_client as statusclient
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.kubelet_thread import KubeletThread
from nvplug.testing.loop_thread import LoopThread
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with, remove_tree

TIMEOUT = 15.0
# From the directory and kubelet.sock being back to Register accepted at the kubelet stand-in.
MAX_REREGISTER = 1.0


# ---------------------------------------------------------------------------
# The parent-watching logic alone, on real inotify


@pytest.fixture
def on_loop() -> Iterator[LoopThread]:
    """A loop in a thread, as the daemon's: the watch reads inotify on it."""
    with LoopThread(TIMEOUT) as loop:
        yield loop


class Recorder:
    """What a watch told, from its thread, with a condition to wait on."""

    def __init__(self) -> None:
        self.seen: list[object] = []
        self._cond = threading.Condition()

    def add(self, item: object) -> None:
        with self._cond:
            self.seen.append(item)
            self._cond.notify_all()

    def wait(self, check: Callable[[list[object]], bool], what: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        with self._cond:
            while not check(self.seen):
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"timed out waiting for {what}: {self.seen}"
                self._cond.wait(remaining)


class Inside:
    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def made(self, path: Path) -> None:
        self._recorder.add(("created", path))

    def removed(self, path: Path) -> None:
        pass

    def overflowed(self, directory: Path) -> None:
        self._recorder.add(("overflowed", directory))


def test_a_directory_removed_two_levels_deep_is_followed_from_its_parent_and_back(
    short_tmp: Path, on_loop: LoopThread
) -> None:
    kubelet = short_tmp / "var-lib-kubelet"
    target = kubelet / "device-plugins"
    ours = kubelet / "plugins" / "gpu.nvidia.com"
    target.mkdir(parents=True)
    ours.mkdir(parents=True)
    recorder = Recorder()
    follower = DirFollower(Inside(recorder), lambda path, exists: recorder.add((path, exists)))
    follower.follow(target)
    follower.follow(ours, make=True)  # nvplug's own: made again once its parent is back
    on_loop.call(follower.start)
    try:
        for n in range(3):
            recorder.seen.clear()
            shutil.rmtree(kubelet)
            recorder.wait(lambda seen: (target, False) in seen and (ours, False) in seen, "both gone")
            wait_until(
                lambda: follower.watching(target) == follower.watching(ours) == short_tmp,
                TIMEOUT,
                "the watches on the nearest existing parent",
            )
            assert not follower.exists(target)

            # Made again two levels at once, as mkdir -p does: quicker than any new watch.
            began = time.monotonic()
            target.mkdir(parents=True)
            recorder.wait(lambda seen: (target, True) in seen, "the directory back")
            back = time.monotonic() - began
            assert follower.watching(target) == target and follower.exists(target)
            # Not ours to make yet: its parent (plugins) is still missing; watched from the nearest one.
            wait_until(lambda: follower.watching(ours) == kubelet, TIMEOUT, "ours watched from the new parent")
            assert not ours.exists()
            (kubelet / "plugins").mkdir()
            recorder.wait(lambda seen: (ours, True) in seen, "ours made again")
            assert ours.is_dir() and follower.watching(ours) == ours

            # The watch is on the new directory itself: what is made in it is told.
            (target / "kubelet.sock").touch()
            recorder.wait(lambda seen: ("created", target / "kubelet.sock") in seen, "kubelet.sock seen")
            print(f"round {n}: made again (mkdir -p, 2 levels) -> watched again: {back * 1000:.1f} ms")

        # Removed alone while its parent stays (an rm -rf under way, perhaps): not made again behind it.
        recorder.seen.clear()
        ours.rmdir()
        recorder.wait(lambda seen: (ours, False) in seen, "ours gone")
        time.sleep(0.2)
        assert not ours.exists() and follower.watching(ours) == kubelet / "plugins"
        ours.mkdir()
        recorder.wait(lambda seen: (ours, True) in seen, "ours back")
    finally:
        on_loop.call(follower.stop)


def test_the_kubelet_dir_watch_tells_the_directory_and_a_new_kubelet_sock_in_it(
    short_tmp: Path, on_loop: LoopThread
) -> None:
    plugin_dir = short_tmp / "kubelet" / "device-plugins"
    plugin_dir.mkdir(parents=True)
    own = plugin_dir / "nvplug-nvidia.com-gpu.sock"
    own.touch()
    recorder = Recorder()

    def events(seen: list[object]) -> list[Event]:
        return [e for e in seen if isinstance(e, (WatchedDirChanged, KubeletSocketCreated, PluginSocketRemoved))]

    watch = KubeletDirWatch(plugin_dir, [own], recorder.add)
    on_loop.call(watch.start)
    # A kubelet still serving on its socket in the directory: the removed directory is not freed (so
    # it does not tell its own deletion) until that socket closes; its parent tells the removal.
    serving = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    serving.bind(str(plugin_dir / "kubelet.sock"))
    serving.listen()
    try:
        recorder.wait(lambda seen: KubeletSocketCreated() in seen, "the first kubelet.sock")
        recorder.seen.clear()
        shutil.rmtree(short_tmp / "kubelet")
        gone = WatchedDirChanged(str(plugin_dir), False)
        recorder.wait(lambda seen: gone in seen, "the directory gone, its kubelet still serving")
        # Our socket's own removal is told too, unless the parent's word came first and took the
        # directory's watch with it: the directory gone says as much (its sockets went with it).
        assert set(events(recorder.seen)) <= {gone, PluginSocketRemoved(str(own))}
        plugin_dir.mkdir(parents=True)
        back = WatchedDirChanged(str(plugin_dir), True)
        recorder.wait(lambda seen: back in seen, "the directory back")
        (plugin_dir / "kubelet.sock").touch()
        recorder.wait(lambda seen: KubeletSocketCreated() in seen, "kubelet.sock in the new directory")
        assert events(recorder.seen).index(back) < events(recorder.seen).index(KubeletSocketCreated())

        # Renamed away (a reinstall that keeps the old tree aside), then made again.
        recorder.seen.clear()
        plugin_dir.rename(plugin_dir.with_name("device-plugins.old"))
        recorder.wait(lambda seen: gone in seen, "the directory renamed away")
        plugin_dir.mkdir()
        recorder.wait(lambda seen: back in seen, "the directory back after the rename")
    finally:
        serving.close()
        on_loop.run(watch.stop())


class Callback:
    """A WatchCallback that records what it is told, by name."""

    def __init__(self, recorder: Recorder, name: str) -> None:
        self._recorder, self._name = recorder, name

    def on_event(self, event: InotifyEvent) -> None:
        if event.is_create:
            self._recorder.add((self._name, event.name.decode()))

    def on_watch_deleted(self, wd: WatchDescriptor) -> None:
        self._recorder.add((self._name, "watch ended"))

    def on_queue_overflow(self) -> None:
        self._recorder.add((self._name, "overflow"))


def test_the_inotify_reader_shares_a_directory_s_watch_and_tells_its_end(short_tmp: Path, on_loop: LoopThread) -> None:
    """Read on the loop: one watch per directory shared by its callbacks, taken
    off with the last of them, and its end (the directory freed) told to those left."""
    directory = short_tmp / "watched"
    directory.mkdir()
    recorder = Recorder()
    reader = on_loop.call(InotifyReader)
    mask = IN_CREATE
    a, b = Callback(recorder, "a"), Callback(recorder, "b")
    try:
        wd_a = on_loop.call(lambda: reader.add_callback(bytes(directory), mask, a, CallbackId(1)))
        wd_b = on_loop.call(lambda: reader.add_callback(bytes(directory), mask, b, CallbackId(2)))
        assert wd_a == wd_b
        on_loop.call(reader.start)
        (directory / "one").touch()
        recorder.wait(lambda seen: {("a", "one"), ("b", "one")} <= set(seen), "both told")
        on_loop.call(lambda: reader.remove_callbacks([(wd_a, CallbackId(1))]))
        (directory / "two").touch()
        recorder.wait(lambda seen: ("b", "two") in seen, "b told")
        directory.joinpath("one").unlink()
        directory.joinpath("two").unlink()
        directory.rmdir()
        recorder.wait(lambda seen: ("b", "watch ended") in seen, "the watch's end")
        assert ("a", "two") not in recorder.seen and ("a", "watch ended") not in recorder.seen
        with pytest.raises(FileNotFoundError, match="cannot watch"):
            on_loop.call(lambda: reader.add_callback(bytes(directory), mask, a, CallbackId(1)))
    finally:
        on_loop.call(reader.stop)
        on_loop.call(reader.stop)  # again: nothing


def test_events_the_kernel_dropped_are_told_from_what_is_there(short_tmp: Path, on_loop: LoopThread) -> None:
    """inotify's queue overflowed: whatever the dropped events said must still reach the daemon. A new
    kubelet.sock is told again (a Register goes only to a socket not registered with yet) and a
    socket of ours that is gone is told gone; one that is there is not."""
    plugin_dir = short_tmp / "device-plugins"
    dra_dir = short_tmp / "plugins" / "gpu.nvidia.com"
    plugin_dir.mkdir()
    own, dra_own = plugin_dir / "nvplug-nvidia.com-gpu.sock", dra_dir / "dra.sock"
    recorder = Recorder()
    watch = KubeletDirWatch(plugin_dir, [own, dra_own, plugin_dir / "nvplug-other.sock"], recorder.add, [dra_dir])
    (plugin_dir / "nvplug-other.sock").touch()
    on_loop.call(watch.start)
    try:
        # Made while the events that would tell it were lost.
        (plugin_dir / "kubelet.sock").touch()
        recorder.wait(lambda seen: KubeletSocketCreated() in seen, "kubelet.sock")
        recorder.seen.clear()
        follower = watch._follower
        assert follower is not None
        # The kernel's overflow record as a read returns it: no watch (wd -1), no name.
        [overflow] = parse(struct.pack("iIII", -1, IN_Q_OVERFLOW, 0, 0))
        assert overflow.is_queue_overflow
        on_loop.call(lambda: follower._inotify.handle_event(overflow))
        told = set(recorder.seen)
        assert told == {KubeletSocketCreated(), PluginSocketRemoved(str(own)), PluginSocketRemoved(str(dra_own))}
    finally:
        on_loop.run(watch.stop())


# ---------------------------------------------------------------------------
# The daemon on the simulated node


def healthz(node: SimulatedNode) -> tuple[int, str]:
    return statusclient.fetch(f"unix:{node.status_socket}", "/healthz", timeout=5)


def accepted_since(since: float) -> Callable[[FakeKubelet], bool]:
    def check(k: FakeKubelet) -> bool:
        return any(r.accepted and r.resource == GPU_RESOURCE and r.received_at >= since for r in k.registrations)

    return check


def reregistered(kubelet: KubeletThread) -> tuple[float, float]:
    """Seconds from the new kubelet.sock to Register accepted, and to the first ListAndWatch message."""
    created = kubelet.socket_created_at
    assert created is not None
    kubelet.wait_for(accepted_since(created), TIMEOUT)
    kubelet.wait_for(registered_with(8), TIMEOUT)
    record = next(r for r in kubelet.registrations if r.accepted and r.received_at >= created)
    plugin = kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.updates
    return record.at - created, plugin.updates[0].at - created


def test_the_device_plugin_dir_removed_and_made_again(node: SimulatedNode, notify: NotifySocket) -> None:
    prepare(node)
    node.kubelet.start()
    node.start_daemon(env={"NOTIFY_SOCKET": str(notify.path)})
    node.kubelet.wait_for(registered_with(8), TIMEOUT)

    # Wiped under the running kubelet, which then restarts (a reinstall): kubelet.sock goes with it.
    remove_tree(node.plugin_dir)
    where = str(node.plugin_dir)
    missing = f"{GPU_RESOURCE} not served: the device-plugin directory {where} is missing"
    # First the failed bind says so (the socket's removal comes first), then the directory's own removal.
    wait_until(
        lambda: healthz(node)[0] == 503 and missing in healthz(node)[1], TIMEOUT, "/healthz 503 naming the directory"
    )
    print(f"/healthz while gone: {' '.join(map(str, healthz(node))).strip()}")
    line = notify.status_with(missing)
    print(f"status line while gone: {line}")
    status = statusclient.status(f"unix:{node.status_socket}")
    assert status["device plugins"]["plugin_dir_missing"] is True
    assert where in status["device plugins"]["not_served"][GPU_RESOURCE]
    # The bind is retried with backoff meanwhile (never given up), and says why, naming the directory.
    node.wait_log(f"the directory {where} does not exist; retrying")
    d = doctor(node, f"unix:{node.status_socket}")
    assert d.verdict(5) == "FAIL" and "does not exist" in d.text(5) and "no restart" in d.text(5), d
    assert d.verdict(7) == "FAIL", d
    assert f"{GPU_RESOURCE} is not served: the device-plugin directory {where} is missing" in d.text(7), d

    # The kubelet makes its directory again when it starts, deletes every socket in it, makes its own.
    node.plugin_dir.mkdir()
    node.kubelet.restart()
    to_register, to_list = reregistered(node.kubelet)
    print(f"kubelet.sock back -> Register accepted {to_register * 1000:.1f} ms, first list {to_list * 1000:.1f} ms")
    assert to_register < MAX_REREGISTER and to_list < MAX_REREGISTER, node.kubelet.describe()
    assert node.plugin_socket.exists()
    wait_until(lambda: healthz(node) == (200, "ok\n"), TIMEOUT, "/healthz 200 again")
    notify.status_with(f"{GPU_RESOURCE} registered: 8 devices, 8 healthy")
    assert "Failed to add port" not in node.log_text() and "Traceback" not in node.log_text()


def test_var_lib_kubelet_wiped_and_made_again_with_mkdir_p(node: SimulatedNode, short_tmp: Path) -> None:
    # A plugin directory two levels below a root that goes whole, as /var/lib/kubelet does.
    kubelet_root = short_tmp / "var-lib-kubelet"
    plugin_dir = kubelet_root / "device-plugins"
    plugin_dir.mkdir(parents=True)
    kubelet = KubeletThread(plugin_dir, pod_resources_socket=node.kubelet.pod_resources.socket_path)
    kubelet.start()
    try:
        node.start_daemon("--device-plugin-dir", str(plugin_dir))
        kubelet.wait_for(registered_with(8), TIMEOUT)
        times = []
        for n in range(3):
            remove_tree(kubelet_root)
            wait_until(lambda: str(plugin_dir) in healthz(node)[1], TIMEOUT, "/healthz naming the directory")
            assert healthz(node)[0] == 503
            time.sleep(0.2 * n)  # at varying points of the bind's backoff
            plugin_dir.mkdir(parents=True)  # mkdir -p, then the kubelet restarts: its new socket
            kubelet.restart()
            to_register, to_list = reregistered(kubelet)
            times.append(to_register)
            print(f"round {n}: kubelet.sock back -> Register accepted {to_register * 1000:.1f} ms, "
                  f"first list {to_list * 1000:.1f} ms")  # fmt: skip
            assert to_register < MAX_REREGISTER and to_list < MAX_REREGISTER, kubelet.describe()
        wait_until(lambda: healthz(node) == (200, "ok\n"), TIMEOUT, "/healthz 200 again")
    finally:
        kubelet.stop()


def test_the_dra_directories_removed_and_made_again(dra: Dra) -> None:  # noqa: F811 (the fixture)
    dra.start()
    dra.wait(lambda: len(dra.pool()) == 4, "the pool")
    node = dra.node
    registry, plugins = node.root / "registry", node.root / "plugins"
    accepted = dra.kubelet.accepted(DRIVER)

    # The DRA kubelet stand-in scans plugins_registry: it goes with it, as the kubelet would.
    dra.kubelet.stop()
    remove_tree(registry)
    remove_tree(plugins)
    wait_until(lambda: healthz(node)[0] == 503 and "DRA gpu.nvidia.com not served" in healthz(node)[1], TIMEOUT, "503")
    body = healthz(node)[1]
    print(f"/healthz while gone: {body.strip()}")
    assert str(registry) in body or str(plugins) in body

    def dra_status() -> dict[str, Any]:
        part: dict[str, Any] = statusclient.status(f"unix:{node.status_socket}")["dra"]
        return part

    wait_until(lambda: dra_status()["registered"] is False, TIMEOUT, "/status: DRA not registered")
    assert dra_status()["not_served"]
    # The device plugin beside it is not touched.
    node.kubelet.wait_for(registered_with(4, GPU_RESOURCE), TIMEOUT)

    # The kubelet makes plugins again; nvplug makes its own directory in it and serves dra.sock there.
    began = time.monotonic()
    plugins.mkdir()
    dra.kubelet.start()  # makes plugins_registry, then finds our registration socket in it
    sockets = (plugins / DRIVER / "dra.sock", registry / f"{DRIVER}-reg.sock")
    served = wait_until(lambda: all(s.exists() for s in sockets), TIMEOUT, "both DRA sockets served again", poll=0.005)
    dra.wait(lambda: dra.kubelet.accepted(DRIVER) > accepted, "the DRA plugin registered again")
    elapsed = time.monotonic() - began
    print(f"DRA directories back -> both sockets served {served * 1000:.1f} ms, "
          f"registered at the kubelet stand-in {elapsed * 1000:.1f} ms")  # fmt: skip
    assert elapsed < MAX_REREGISTER
    claim = dra.claim("after-wipe", "gpu-6")
    assert dra.kubelet.prepare(DRIVER, [claim])[claim[2]].error == ""
    wait_until(lambda: healthz(node)[0] == 200, TIMEOUT, "/healthz 200 again")
