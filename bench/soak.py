#!/usr/bin/env python3
"""Invariant-checked soak of the real daemon: random faults, checks after every step.

Random interleavings of XIDs (through NVML, the kernel log, or both, as a real
driver reports them), lost and restored GPUs, device nodes removed and made
again, hot add and remove (udev, as root), kubelet restarts and config reloads,
against `nvplug run` on the fake NVML library with the kubelet stand-in and the
simulated node's kernel log. After each step:

- every GPU the daemon knows is advertised exactly once (whole GPUs),
- no device the daemon holds Unhealthy is offered as Healthy,
- the kubelet stand-in's view converges to the daemon's state within 100 ms,
- a scrape of /metrics answers (its time is printed: the daemon waits 0.7 s at
  most for the GPUs' reads, whatever they are going through), with a process
  of this soak's on a random GPU,
- no GPU is Healthy while its last reset-class fault (XID 48 or 79) has no
  evidence of a repair after it (udev unbind and bind, NVML's recovery action
  back to none, `nvplug heal`). An XID counts once the daemon shows it taken
  in (its per-GPU `xids` count in /status, and for one both sources reported,
  the count of matched ones). One sent through NVML alone while a rescan
  re-subscribes to NVML events is lost, as with a real driver, and is counted
  apart; one the kernel log also has must never be lost,
and at the end memory and file descriptors must be flat.

    python bench/soak.py [--seconds 600] [--seed N]

Prints the faults injected and the checks passed; exits 1 on a broken invariant.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from nvplug.status import status_client as statusclient
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.fakenvml_control import ControlError
from nvplug.testing.fakenvml_devices import GpuProcess
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with
from nvplug.testing.udev_sender import pci_event

CONVERGE = 0.1  # seconds the stand-in may lag the daemon
TIMEOUT = 15.0
# XIDs whose catalog action needs a reset, whatever the config says (13 is fatal only by config).
RESET_XIDS = (48, 79)
# How long an XID may take from the fake library to the daemon's state.
XID_ARRIVES = 1.0


def soon(done: Callable[[], bool], within: float = XID_ARRIVES) -> bool:
    deadline = time.monotonic() + within
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def daemon_status(node: SimulatedNode) -> dict[str, Any]:
    return statusclient.status(f"unix:{node.status_socket}", timeout=5)


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(int(ln.split()[1]) for ln in status if ln.startswith("VmRSS")) / 1024


def fds_and_rss(pid: int) -> tuple[int, float]:
    return len(list(Path(f"/proc/{pid}/fd").iterdir())), rss_mib(pid)


def open_files(pid: int) -> list[str]:
    """What each of the daemon's file descriptors is (a socket's inode, a pipe, a path)."""
    found = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            found.append(f"{fd.name}={fd.readlink()}")
        except OSError:
            continue  # closed meanwhile
    return found


def memory_map(pid: int, top: int = 8) -> list[str]:
    """The daemon's threads and its largest mappings by RSS: where growth lies (heap, a thread's arena, a file)."""
    lines = [f"threads: {len(list(Path(f'/proc/{pid}/task').iterdir()))}"]
    maps: list[tuple[int, str]] = []
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            name = f"{fields[0]} {fields[5] if len(fields) > 5 else '[anon]'}"
        elif fields[0] == "Rss:":
            maps.append((int(fields[1]), name))
    lines += [f"{kib / 1024:8.1f} MiB  {where}" for kib, where in sorted(maps, reverse=True)[:top]]
    return lines


class Soak:
    def __init__(self, node: SimulatedNode, rng: random.Random) -> None:
        self.node = node
        self.rng = rng
        self.faults: dict[str, int] = {}
        self.checks = 0
        self.added: list[str] = []  # UUIDs of hot-added GPUs still present
        self.slots: dict[str, int] = {}  # their slot: minor 100+slot, bus 0002:<slot>:00.0
        self.serial = 0
        self.fatal_13 = False
        self.udev = node.udev() if node.netns is not None else None
        # GPUs whose last reset-class fault has had no repair since: they must stay Unhealthy. By UUID,
        # their PCI address as it was then: a repair needs it, and the GPU may be out of the daemon's list
        # for a moment when the repair starts (a rescan's window, as `until` and the XID's count allow for).
        self.broken: dict[str, str] = {}
        # Reset-class XIDs the daemon never showed, by how they were sent: through NVML alone,
        # one sent while a rescan re-subscribed is lost; with the kernel log, none may be.
        self.lost_xids: dict[str, int] = {"nvml": 0, "kernel log": 0, "both": 0}
        self.sent_xids: dict[str, int] = {"nvml": 0, "kernel log": 0, "both": 0}
        self.nvml_copies_lost = 0
        self.scrape_ms: list[float] = []
        # The steps after which the daemon's RSS grew most: (MiB grown, step number, action).
        self.growth: list[tuple[float, int, str]] = []
        self.steps = 0

    def step(self) -> None:
        actions = [self.xid, self.xid, self.repair, self.lose_and_restore, self.kubelet_restart, self.reload]
        actions += [self.node_churn, self.scrape]
        if self.udev is not None:
            actions += [self.hot_add, self.hot_remove]
        action = self.rng.choice(actions)
        assert self.node.daemon is not None
        before = rss_mib(self.node.daemon.pid)
        if action() is not False:  # a hot add with four added already, say, is skipped
            self.faults[action.__name__] = self.faults.get(action.__name__, 0) + 1
        self.check()
        self.steps += 1
        grown = rss_mib(self.node.daemon.pid) - before
        if grown > 1.0:
            self.growth = sorted([*self.growth, (grown, self.steps, action.__name__)], reverse=True)[:5]

    def gpus(self) -> list[str]:
        return [g["uuid"] for g in daemon_status(self.node)["gpus"]]

    def xid(self) -> None:
        """An XID, counted once the daemon has taken it in: not merely once the GPU shows Unhealthy,
        which it may be already, with the XID still on its way (and then behind the next repair)."""
        status = daemon_status(self.node)
        gpu = self.rng.choice(status["gpus"])
        code = self.rng.choice([13, 31, 43, 48, 79, 94])
        # A real driver prints every Xid; NVML drops some, and a ring buffer overrun loses a line.
        how = self.rng.choice(["both", "both", "kernel log", "nvml"])
        xids, matched = gpu["xids"], status["kernel_log"]["matched"]
        if how != "kernel log":
            self.node.control.xid(gpu["uuid"], code)
        if how != "nvml":
            address = gpu["bus_id"].lower()[:-2]  # the driver prints no function
            self.node.kernel_log(f"NVRM: Xid (PCI:{address}): {code}, pid='<unknown>', name=<unknown>, soak")
        self.sent_xids[how] += code in RESET_XIDS

        def taken(reports: int) -> Callable[[], bool]:
            """That many reports taken in: counted for the GPU, or matched with the other source's
            (a kernel report may match an NVML-only one of the same fault, before any repair)."""

            def check() -> bool:
                doc = daemon_status(self.node)
                count = next((g["xids"] for g in doc["gpus"] if g["uuid"] == gpu["uuid"]), None)
                return count is not None and (count - xids) + (doc["kernel_log"]["matched"] - matched) >= reports

            return check

        if not soon(taken(1)):
            self.lost_xids[how] += code in RESET_XIDS
            return
        if how == "both" and not soon(taken(2)):
            self.nvml_copies_lost += 1  # the kernel's copy counted; NVML's fell in a rescan's window
        if code in RESET_XIDS:
            self.broken[gpu["uuid"]] = gpu["bus_id"]

    def node_churn(self) -> bool:
        """A GPU's /dev/nvidiaN removed and made again, as a udev rule or nvidia-persistenced does."""
        gpus = [g for g in daemon_status(self.node)["gpus"] if g["minor"] is not None and g["minor"] < 100]
        if not gpus:
            return False
        gpu = self.rng.choice(gpus)
        path = self.node.dev_root / "dev" / f"nvidia{gpu['minor']}"
        missing = f"its device node /dev/nvidia{gpu['minor']} is missing"
        path.unlink()
        if gpu["health"] == "Healthy":
            self.until(gpu["uuid"], lambda g: missing in g["reason"])
        path.touch()
        self.until(gpu["uuid"], lambda g: missing not in g["reason"])
        return True

    def repair(self) -> bool:
        """Evidence of a repair for a broken GPU, of a random kind; done once the daemon has it."""
        if not self.broken:
            return False
        gpu = self.rng.choice(sorted(self.broken))
        kinds = ["recovery_action", "heal"] + (["udev"] if self.udev is not None else [])
        kind = self.rng.choice(kinds)
        bus = self.broken[gpu]
        if kind == "udev" and self.udev is not None:
            self.udev.send(pci_event("unbind", bus, driver=None))
            self.udev.send(pci_event("bind", bus))
        elif kind == "recovery_action":
            # The driver asks for a reset, and once the daemon has read that, says none is needed.
            # Each is sent again until it shows: an event can fall in a rescan's window too.
            self.until(gpu, lambda g: bool(g["recovery_action"]), lambda: self.node.control.recovery_action(gpu, 1))
            self.until(gpu, lambda g: g["health"] == "Healthy", lambda: self.node.control.recovery_action(gpu, 0))
        else:
            body = f'{{"gpu": "{gpu}", "operator": "soak"}}'.encode()
            statusclient.fetch(f"unix:{self.node.status_socket}", "/heal", TIMEOUT, body)
        # Only a repair the daemon has acted on may count: a fault injected next must come after it.
        self.until(gpu, lambda g: g["health"] == "Healthy")
        del self.broken[gpu]
        return True

    def until(self, gpu: str, done: Callable[[dict[str, Any]], bool], send: Callable[[], object] = str) -> None:
        """`send`, then again every second, until the daemon's view of `gpu` is `done`."""
        deadline = time.monotonic() + TIMEOUT
        sent = 0.0
        while not any(g["uuid"] == gpu and done(g) for g in daemon_status(self.node)["gpus"]):
            assert time.monotonic() < deadline, (
                f"{gpu}: {send} never took effect:\n{daemon_status(self.node)}\n"
                f"the daemon's last lines of it:\n{self.log_of(gpu)}"
            )
            if time.monotonic() - sent > 1.0:
                send()
                sent = time.monotonic()
            time.sleep(0.01)

    def log_of(self, gpu: str, lines: int = 40) -> str:
        """The daemon's last log lines that name `gpu`, or its PCI address: what became of it."""
        names = [gpu, *((self.broken[gpu],) if gpu in self.broken else ())]
        return "\n".join([line for line in self.node.log_text().splitlines() if any(n in line for n in names)][-lines:])

    def lose_and_restore(self) -> None:
        gpu = self.rng.choice(self.gpus())
        self.node.control.lose(gpu)
        time.sleep(self.rng.uniform(0, 0.05))
        self.node.control.restore(gpu)

    def scrape(self) -> None:
        """/metrics, with this soak's own process moved to a random GPU (unattributed: no pod's); a GPU
        lost or gone just now is stale or absent in it, never the scrape's end."""
        gpu = self.rng.choice(self.gpus())
        for other in self.gpus():
            with contextlib.suppress(ControlError):  # a GPU lost or removed meanwhile
                self.node.control.procs(other, [GpuProcess(os.getpid(), 256)] if other == gpu else [])
        began = time.monotonic()
        code, _ = statusclient.fetch(f"unix:{self.node.status_socket}", "/metrics", TIMEOUT)
        self.scrape_ms.append((time.monotonic() - began) * 1000)
        assert code == 200, f"/metrics answered {code}"

    def kubelet_restart(self) -> None:
        self.node.kubelet.restart()

        def streaming(k: FakeKubelet) -> bool:
            plugin = k.plugin(GPU_RESOURCE)
            return plugin is not None and plugin.stream_open and bool(plugin.updates)

        # Registered again and listing; whether the list is right is check()'s job.
        self.node.kubelet.wait_for(streaming, TIMEOUT)

    def reload(self) -> None:
        self.fatal_13 = not self.fatal_13
        fatal = "[13]" if self.fatal_13 else "[]"
        self.node.config.write_text(
            "version: v1\nnvplug:\n  health:\n    reprobeInitialSeconds: 0.05\n    reprobeMaxSeconds: 0.2\n"
            f"    fatalXids: {fatal}\n"
        )
        assert self.node.daemon is not None
        self.node.daemon.send_signal(signal.SIGHUP)

    def hot_add(self) -> bool:
        if len(self.added) >= 4 or self.udev is None:
            return False
        self.serial += 1
        slot = min(set(range(8)) - set(self.slots.values()))
        bus = f"0002:{slot:02x}:00.0"
        uuid = f"GPU-50a00000-0000-4000-8000-{self.serial:012d}"
        try:
            self.node.add_gpu(f"uuid={uuid} minor={100 + slot} bus={bus} numa=1")
        except ControlError:
            # The slot's last GPU came back: a restore of it raced its removal. Try another step.
            return False
        self.slots[uuid] = slot
        self.udev.send(pci_event("add", bus, driver=None))
        self.added.append(uuid)
        before = len(self.gpus())
        deadline = time.monotonic() + TIMEOUT
        while uuid not in self.gpus():
            assert time.monotonic() < deadline, f"hot-added {uuid} never appeared (had {before})"
            time.sleep(0.01)
        return True

    def hot_remove(self) -> bool:
        if not self.added or self.udev is None:
            return False
        uuid = self.added.pop(self.rng.randrange(len(self.added)))
        self.broken.pop(uuid, None)  # gone from the bus: nothing left to offer
        slot = self.slots.pop(uuid)
        bus = f"0002:{slot:02x}:00.0"
        self.node.control.remove(uuid)
        self.udev.send(pci_event("remove", bus, driver=None))
        deadline = time.monotonic() + TIMEOUT
        while uuid in self.gpus():
            assert time.monotonic() < deadline, f"removed {uuid} is still listed"
            time.sleep(0.01)
        return True

    def check(self) -> None:
        """The four invariants, against the daemon's own view."""
        status = daemon_status(self.node)
        for gpu in status["gpus"]:
            healthy = gpu["health"] == "Healthy"
            assert not (healthy and gpu["uuid"] in self.broken), (
                f"{gpu['uuid']} is Healthy with no repair after its XID"
            )
        want = {g["uuid"]: g["health"] == "Healthy" for g in status["gpus"]}

        def agrees(k: FakeKubelet) -> bool:
            plugin = k.plugin(GPU_RESOURCE)
            if plugin is None or not plugin.stream_open or not plugin.updates:
                return False
            last = plugin.updates[-1].devices
            ids = [d.id for d in last]
            return len(ids) == len(set(ids)) and {d.id: d.healthy for d in last} == want

        try:
            self.node.kubelet.wait_for(agrees, CONVERGE)
        except TimeoutError:
            # The daemon may have moved on meanwhile: compare with its newest state once more.
            status = daemon_status(self.node)
            want = {g["uuid"]: g["health"] == "Healthy" for g in status["gpus"]}
            self.node.kubelet.wait_for(agrees, CONVERGE)
        self.checks += 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    print(f"soak: seed {seed} (--seed {seed} runs the same steps again)", flush=True)
    root = Path(tempfile.mkdtemp(prefix="nvs-", dir="/tmp"))
    try:
        with SimulatedNode(root) as node:
            node.config.write_text(
                "version: v1\nnvplug:\n  health:\n    reprobeInitialSeconds: 0.05\n    reprobeMaxSeconds: 0.2\n"
            )
            node.kubelet.start()
            # info: a failure's message quotes what the daemon said of the GPU (a GPU added, removed, healed).
            daemon = node.start_daemon(log_level="info")
            node.kubelet.wait_for(registered_with(8), TIMEOUT)
            soak = Soak(node, random.Random(seed))
            for _ in range(20):  # warm up caches and lazy imports before the baseline
                soak.step()
            fds0, rss0 = fds_and_rss(daemon.pid)
            deadline = time.monotonic() + args.seconds
            steps = 0
            while time.monotonic() < deadline:
                soak.step()
                steps += 1
            # Settle, then the end state: every fault undone, resources flat.
            for gpu in soak.gpus():
                node.control.restore(gpu)
            while soak.broken:
                soak.repair()
            soak.check()
            # A connection still closing (a kubelet's stream, a status query) is no leak: one that stays is.
            settled = time.monotonic() + 5.0
            while (fds1 := fds_and_rss(daemon.pid)[0]) > fds0 + 2 and time.monotonic() < settled:
                time.sleep(0.1)
            fds1, rss1 = fds_and_rss(daemon.pid)
            print(f"soak: seed {seed}, {args.seconds:g} s, {steps} steps")
            print("faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(soak.faults.items())))
            print(f"invariant checks passed: {soak.checks}")
            if soak.scrape_ms:
                took = sorted(soak.scrape_ms)
                print(
                    f"scrapes: {len(took)}, p50 {statistics.median(took):.1f} ms, "
                    f"p99 {took[round(0.99 * (len(took) - 1))]:.1f} ms, max {took[-1]:.1f} ms, "
                    f"over 1 s: {sum(t > 1000 for t in took)}"
                )
            for how, sent in sorted(soak.sent_xids.items()):
                print(f"reset-class XIDs through {how}: {sent} sent, {soak.lost_xids[how]} lost")
            print(f"XIDs sent through both whose NVML copy was lost (the kernel's counted): {soak.nvml_copies_lost}")
            if soak.lost_xids["kernel log"] or soak.lost_xids["both"]:
                print("a reset-class XID the kernel log had was lost", file=sys.stderr)
                return 1
            print(f"file descriptors: {fds0} -> {fds1}; RSS: {rss0:.1f} -> {rss1:.1f} MiB")
            if soak.growth:
                print("largest RSS steps: " + ", ".join(f"+{g:.1f} MiB at step {n} ({a})" for g, n, a in soak.growth))
            if fds1 > fds0 + 2 or rss1 > rss0 + 20:
                print("\n".join(memory_map(daemon.pid)))
                print("open files: " + ", ".join(sorted(open_files(daemon.pid))))
                print("resources are not flat", file=sys.stderr)
                return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
