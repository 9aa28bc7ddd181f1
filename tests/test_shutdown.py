"""A clean shutdown logs no error: SIGTERM in the middle of a flood of XIDs, kubelet restarts,
udev messages and other plugins' sockets coming and going, repeated, against the real daemon
on the simulated node.

What these rounds caught: watchdog's inotify emitter stopped while it was handing on an event
from the watched directory logged `InotifyEmitter.queue_events() called when the thread is
inactive` at ERROR; a rebind still under way at SIGTERM served again after the stop, and its
gRPC server, collected once the loop was closed, printed a Traceback (and left its socket).
Each is a race: one round in a few hit one, so one round is not enough.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable

from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with
from nvplug.testing.udev_sender import pci_event

ROUNDS = 10
TIMEOUT = 15.0
# The logs.py stderr format: "<date> <time> LEVEL   logger: message".
BAD_LINE = re.compile(r"^\S+ \S+ (ERROR|CRITICAL)\b|Traceback", re.MULTILINE)


def _registered_anew(before: int) -> Callable[[FakeKubelet], bool]:
    """Registered by the daemon just started, not a stream left from the one before."""

    def check(k: FakeKubelet) -> bool:
        return k.accepted_registrations(GPU_RESOURCE) > before and registered_with(8)(k)

    return check


class _Flood:
    """Threads that keep the daemon's sources busy until stopped."""

    def __init__(self, node: SimulatedNode, gpus: list[dict[str, str]]) -> None:
        self._node = node
        self._buses = [g["bus"] for g in gpus]
        self._done = threading.Event()
        # Set before SIGTERM: the XIDs go through the daemon's own process, gone from then on.
        self.signalled = threading.Event()
        self._errors: list[BaseException] = []
        workers: list[Callable[[], None]] = [self._xids, self._restarts, self._neighbours]
        # Broadcasting uevents needs CAP_NET_ADMIN; without it the other two floods still run.
        if os.geteuid() == 0:
            workers.append(self._udev)
        self._threads = [threading.Thread(target=self._guard, args=(w,), daemon=True) for w in workers]

    def __enter__(self) -> _Flood:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        for t in self._threads:
            t.join(15)
        assert not self._errors, self._errors

    def _guard(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as err:  # reported by __exit__, in the test's thread
            if not self.signalled.is_set():
                self._errors.append(err)

    def _xids(self) -> None:
        i = 0
        while not self._done.is_set():
            # Harmless 13s, so that a fatal one does not change what the next round starts with.
            self._node.control.send(f"xid {i % 8} 13", timeout=0.5)
            i += 1
            time.sleep(0.001)

    def _restarts(self) -> None:
        # Each restart deletes every socket in the watched directory (ours too) and makes a new kubelet.sock.
        while not self._done.wait(0.03):
            self._node.kubelet.restart()

    def _neighbours(self) -> None:
        # Other device plugins' sockets coming and going: events in the directory the daemon watches,
        # at any moment of its shutdown, that it has no say over.
        path = self._node.plugin_dir / "neighbour.sock"
        while not self._done.is_set():
            with socket.socket(socket.AF_UNIX) as sock:
                sock.bind(str(path))
            path.unlink(missing_ok=True)
            time.sleep(0.0001)

    def _udev(self) -> None:
        with self._node.udev() as sender:
            i = 0
            while not self._done.is_set():
                sender.send(pci_event("change", self._buses[i % len(self._buses)], driver="nvidia"))
                i += 1
                time.sleep(0.001)


def test_sigterm_under_load_logs_no_error(node: SimulatedNode) -> None:
    node.kubelet.start()
    gpus = node.scenario_gpus()
    began = time.monotonic()
    for round_ in range(ROUNDS):
        offset = len(node.log_text())
        before = node.kubelet.accepted_registrations(GPU_RESOURCE)
        node.start_daemon(log_level="info")
        node.kubelet.wait_for(_registered_anew(before), TIMEOUT)
        with _Flood(node, gpus) as flood:
            # SIGTERM at varying phases of the flood.
            time.sleep(0.2 + 0.05 * (round_ % 5))
            flood.signalled.set()
            code = node.stop_daemon(signal.SIGTERM)
        log = node.log_text()[offset:]
        assert code == 0, f"round {round_}: exit status {code}\n{log}"
        assert "nvplug stopped" in log, f"round {round_}: no clean stop\n{log}"
        bad = [line for line in log.splitlines() if BAD_LINE.search(line)]
        # From the first one on: a Traceback's own lines follow it.
        assert not bad, f"round {round_}: error-level lines on SIGTERM:\n{log[log.index(bad[0]) :][:4000]}"
        # Nothing serves after the stop: the socket went with the server.
        assert not node.plugin_socket.exists(), f"round {round_}: {node.plugin_socket.name} left behind\n{log}"
    print(f"[shutdown] {ROUNDS} SIGTERMs under load in {time.monotonic() - began:.1f}s, no error logged")
