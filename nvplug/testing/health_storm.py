"""A storm of health changes on a simulated node, through the fake library's control socket.

Each churn command changes what the health state file holds: NVML's recovery action asks for a
GPU reset (a fault), or goes back to none (the evidence, which starts a probe that may heal it
before the next). Faults that stay are XID 79s on other GPUs, each timed from when the kubelet
stand-in saw it. The changes are counted as the daemon's revisions. The storm's tests and
`bench/storm.py` both drive it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from nvplug.sinks.health_state_file import LAG_BOUND, WRITE_INTERVAL
from nvplug.status import status_client
from nvplug.testing.fakenvml_control import Control
from nvplug.testing.kubelet_thread import KubeletThread
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode

GPU_RESET = 1  # NVML's recovery action: a GPU reset


def write_scenario(path: Path, count: int) -> list[str]:
    """A scenario of `count` GPUs (the fake library's most is 64); their UUIDs."""
    uuids = [f"GPU-{n:08x}-0000-4000-8000-{n:012x}" for n in range(count)]
    lines = ["driver 550.54.15", "nvml 12.550.54.15", "cuda 12040"]
    lines += [f"gpu uuid={u} minor={n} bus=0000:{n + 1:02x}:00.0 numa={n // 32}" for n, u in enumerate(uuids)]
    path.write_text("\n".join(lines) + "\n")
    return uuids


@dataclass
class Churn:
    """Recovery-action cycles on some GPUs, one command every `pace` seconds, on a thread of its own."""

    control: Control
    gpus: Sequence[int]
    pace: float
    cycles: int = 0
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)
        self._thread.start()

    def halt(self) -> None:
        """The command in flight is its last, and one the daemon may never answer (about to be killed)."""
        self._stop.set()

    def stop(self) -> int:
        """Stops it; the cycles it completed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.error is not None:
            raise self.error
        return self.cycles

    def _run(self) -> None:
        due = time.monotonic()
        try:
            while not self._stop.is_set():
                for action in (GPU_RESET, 0):
                    for gpu in self.gpus:
                        due += self.pace
                        time.sleep(max(0.0, due - time.monotonic()))
                        self.control.recovery_action(gpu, action)
                self.cycles += len(self.gpus)
        except (OSError, TimeoutError) as err:  # the daemon killed under it is no error of the storm's
            if not self._stop.is_set():
                self.error = err


def xid_faults(control: Control, gpus: Sequence[int], pace: float) -> dict[int, float]:
    """XID 79 on each GPU in turn, one every `pace` seconds: when each was sent (monotonic)."""
    sent: dict[int, float] = {}
    due = time.monotonic()
    for gpu in gpus:
        due += pace
        time.sleep(max(0.0, due - time.monotonic()))
        sent[gpu] = time.monotonic()
        control.xid(gpu, 79)
    return sent


def seen_unhealthy(kubelet: KubeletThread, uuid: str, resource: str = GPU_RESOURCE) -> float | None:
    """When the stand-in first got a list with this device Unhealthy; None if it never did."""
    plugin = kubelet.plugin(resource)
    if plugin is None:
        return None
    return next((u.at for u in plugin.updates if any(d.id == uuid and not d.healthy for d in u.devices)), None)


@dataclass(frozen=True)
class StormStatus:
    """From /status: the state's revision, and the health state file's writes so far and the longest
    one (None: this nvplug does not say)."""

    revision: int
    writes: int | None
    slowest: float | None


def storm_status(node: SimulatedNode) -> StormStatus:
    _, body = status_client.fetch(f"unix:{node.status_socket}", "/status", 30.0)
    doc = json.loads(body)
    file = doc.get("health state file", {})
    return StormStatus(int(doc["revision"]), file.get("writes"), file.get("slowest_write_seconds"))


def lag_bound(slowest: float | None) -> float:
    """How old a fault may be and still be lost to a crash: the pace, then the write in flight and the
    one that takes it; LAG_BOUND while no write took over 25 ms."""
    return max(LAG_BOUND, WRITE_INTERVAL + 2 * (slowest or 0.0))


class _Renamed(FileSystemEventHandler):
    def __init__(self, target: str) -> None:
        self.target = target
        self.count = 0

    def on_moved(self, event: FileSystemEvent) -> None:
        if str(event.dest_path) == self.target:
            self.count += 1


class RenameCounter:
    """Counts the atomic writes of one file, as inotify sees them: each is a rename onto its name."""

    def __init__(self, path: Path) -> None:
        self._renamed = _Renamed(str(path))
        self._observer = Observer()
        self._observer.schedule(self._renamed, str(path.parent))

    @property
    def count(self) -> int:
        return self._renamed.count

    def __enter__(self) -> RenameCounter:
        self._observer.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._observer.stop()
        self._observer.join(5)
