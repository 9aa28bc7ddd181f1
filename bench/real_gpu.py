#!/usr/bin/env python3
"""The real-GPU check: discovery, event types and the daemon against the real driver.

Run through bench/real_gpu.sh on a machine with an NVIDIA GPU. It prints what
it found, which figures a GPU's telemetry read gets (and which the driver does
not give), how its reads go alone and side by side, what a scrape of the
GPUs' telemetry takes (wall and CPU: a driver's time that is CPU counts against
the daemon's idle share where it waits for nothing), how the figures a read
takes as fields compare with their own calls (values and time: the read asks
them in one nvmlDeviceGetFieldValues), how long a rescan that counts the GPUs
again takes (a udev bind, as root: the daemon's NVML goes to init count zero
while its event process listens on, then a new one takes over) and how long a
stop takes; it changes nothing on the GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml  # type: ignore[import-untyped]
from latency import proc_times

from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.sources.nvml_discovery import Nvml, recovery_action, session
from nvplug.sources.nvml_events import WANTED
from nvplug.sources.nvml_field_values import FieldRequest
from nvplug.sources.nvml_telemetry import Window, read_gpu, release
from nvplug.status import status_client
from nvplug.testing.process_tree import child_pids
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, registered_with
from nvplug.testing.udev_sender import pci_event

EVENT_NAMES = {
    0x1: "SingleBitEccError",
    0x2: "DoubleBitEccError",
    0x4: "PState",
    0x8: "XidCriticalError",
    0x10: "Clock",
    0x80: "PowerSourceChange",
    0x100: "MigConfigChange",
    0x200: "SingleBitEccErrorStorm",
    0x400: "DramRetirementEvent",
    0x800: "DramRetirementFailure",
    0x1000: "NonFatalPoisonError",
    0x2000: "FatalPoisonError",
    0x4000: "GpuUnavailableError",
    0x8000: "GpuRecoveryAction",
}


# Figures a read takes as fields (sources/nvml_telemetry.FIELD_FIGURES) that have a call of their own.
CALLS_AND_FIELDS: tuple[tuple[str, Callable[[Any], object], tuple[int, ...]], ...] = (
    ("energy", lambda h: pynvml.nvmlDeviceGetTotalEnergyConsumption(h), (pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,)),
    (
        "ECC totals",
        lambda h: [pynvml.nvmlDeviceGetTotalEccErrors(h, kind, counter) for counter in (0, 1) for kind in (0, 1)],
        (
            pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,
            pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
            pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL,
            pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL,
        ),
    ),
    ("PCIe replays", lambda h: pynvml.nvmlDeviceGetPcieReplayCounter(h), (pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER,)),
    (
        "retired pages",
        lambda h: [
            *(len(pynvml.nvmlDeviceGetRetiredPages(h, cause)) for cause in (0, 1)),
            pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h),
        ],
        (pynvml.NVML_FI_DEV_RETIRED_SBE, pynvml.NVML_FI_DEV_RETIRED_DBE, pynvml.NVML_FI_DEV_RETIRED_PENDING),
    ),
    (
        "remapped rows",
        lambda h: list(pynvml.nvmlDeviceGetRemappedRows(h)),
        (
            pynvml.NVML_FI_DEV_REMAPPED_COR,
            pynvml.NVML_FI_DEV_REMAPPED_UNC,
            pynvml.NVML_FI_DEV_REMAPPED_PENDING,
            pynvml.NVML_FI_DEV_REMAPPED_FAILURE,
        ),
    ),
)


def names(mask: int) -> str:
    return ", ".join(n for bit, n in EVENT_NAMES.items() if mask & bit) or "none"


def discovery() -> list[tuple[str, str]]:
    """The GPUs' UUIDs and PCI bus ids."""
    started = time.monotonic()
    scan = Nvml().scan()
    took = time.monotonic() - started
    found = scan.discovery
    print(f"== discovery: {len(found.gpus)} GPUs in {took * 1000:.1f} ms, driver {found.driver_version}")
    for gpu in found.gpus:
        for field in ("index", "uuid", "bus_id", "minor", "numa_node", "name", "memory_mib", "compute_capability"):
            print(f"   {field:<19} {getattr(gpu, field)}")
    for line in (*found.absent, *found.problems):
        print(f"   note: {line}")
    for probe in scan.probes:
        print(f"   probe {probe.uuid}: {'passed' if probe.passed else probe.failure}")
    print("== NVML event types")
    with session():
        for gpu in found.gpus:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            try:
                mask = int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
            except pynvml.NVMLError as err:
                print(f"   gpu {gpu.index}: supported event types unreadable: {err}")
                continue
            print(f"   gpu {gpu.index}: supported 0x{mask:x}: {names(mask)}")
            print(f"   gpu {gpu.index}: nvplug subscribes 0x{mask & WANTED:x}: {names(mask & WANTED)}")
            try:
                print(f"   gpu {gpu.index}: recovery action (field 230): {recovery_action(handle)}")
            except pynvml.NVMLError as err:
                print(f"   gpu {gpu.index}: recovery action (field 230): {err}")
    return [(g.uuid, g.bus_id) for g in found.gpus]


def side_by_side(uuid: str, reads: int = 20) -> None:
    """A GPU's reads one after the other, then from 2 and 4 threads at once, NVML held open throughout:
    whether the driver lets reads run side by side (the telemetry shares a slow pass among threads)."""

    def chain(took: list[float], cpu: list[float] | None = None) -> None:
        window = Window()
        for _ in range(reads):
            began, began_cpu = time.perf_counter(), time.thread_time()
            got = read_gpu(uuid, window)
            took.append(time.perf_counter() - began)
            if cpu is not None:
                cpu.append(time.thread_time() - began_cpu)
            window = got.window
        release(window)

    with session():
        chain([])  # the first reads: handles, GPM support
        # A second read, a moment after the first: the figures over a window (GPM, NVLink's rate) need two.
        first = read_gpu(uuid, Window())
        time.sleep(0.2)
        second = read_gpu(uuid, first.window)
        release(second.window)
        figures = dataclasses.asdict(second.figures)
        given = {k: v for k, v in figures.items() if v is not None}
        print(f"== figures of {uuid}: {given}")
        print(f"   none from this driver: {sorted(k for k, v in figures.items() if v is None)}")
        alone: list[float] = []
        cpu: list[float] = []
        chain(alone, cpu)
        each = statistics.median(alone) * 1000
        print(
            f"== telemetry reads of {uuid}: {each:.2f} ms each, one after the other, of which CPU "
            f"{statistics.median(cpu) * 1000:.2f} ms (this thread's, the driver's time in the kernel with it)"
        )
        for threads in (2, 4):
            took: list[float] = []
            workers = [threading.Thread(target=chain, args=(took,)) for _ in range(threads)]
            began = time.perf_counter()
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            wall = (time.perf_counter() - began) * 1000
            print(
                f"   {threads} threads at once: {threads * reads} reads in {wall:.0f} ms, each "
                f"{statistics.median(took) * 1000:.2f} ms; {threads * reads * each / wall:.2f}x the reads "
                f"one thread does in that time (side by side: {threads}x, one at a time: 1x)"
            )


def calls_or_fields(uuid: str, times: int = 10) -> None:
    """Each of CALLS_AND_FIELDS read by its calls and by its fields, and all the fields in one call: the
    median wall and CPU time of each, with what each read got side by side."""

    def timed(read: Callable[[], object]) -> tuple[float, float, object]:
        walls, cpus, got = [], [], None
        for _ in range(times):
            began, began_cpu = time.perf_counter(), time.thread_time()
            try:
                got = read()
            except pynvml.NVMLError as err:
                got = f"error: {err}"
            walls.append(time.perf_counter() - began)
            cpus.append(time.thread_time() - began_cpu)
        return statistics.median(walls) * 1000, statistics.median(cpus) * 1000, got

    def fields(handle: Any, request: FieldRequest) -> list[object]:
        return [f"error {got.returned}" if got.value is None else got.value for got in request.read(handle)]

    print(f"== one call each, or fields (nvmlDeviceGetFieldValues), on {uuid}: median ms wall / CPU")
    with session():
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        for what, call, ids in CALLS_AND_FIELDS:
            request = FieldRequest([(i, 0) for i in ids])
            wall, cpu, by_call = timed(lambda: call(handle))  # noqa: B023
            field_wall, field_cpu, by_field = timed(lambda: fields(handle, request))  # noqa: B023
            print(
                f"   {what}: calls {wall:.3f} / {cpu:.3f} ms -> {by_call}; fields {field_wall:.3f} / "
                f"{field_cpu:.3f} ms -> {by_field}"
            )
        every = FieldRequest([(i, 0) for _, _, ids in CALLS_AND_FIELDS for i in ids])
        wall, cpu, got = timed(lambda: fields(handle, every))
        print(f"   all {len(got) if isinstance(got, list) else '?'} fields in one call: {wall:.3f} / {cpu:.3f} ms")


def daemon(uuids: list[str], bus: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="nvr-", dir="/tmp"))
    try:
        with SimulatedNode(root) as node:
            node.kubelet.start()
            started = time.monotonic()
            node.start_daemon("--dev-root", "/", nvml="host", log_level="info")
            node.kubelet.wait_for(registered_with(len(uuids)), 60)
            plugin = node.kubelet.plugin(GPU_RESOURCE)
            assert plugin is not None
            first = plugin.updates[0].at - started
            print(f"== daemon: start to first ListAndWatch {first * 1000:.0f} ms (target 500 ms)")
            for device in plugin.devices.values():
                print(f"   {device.id} {device.health} NUMA {list(device.numa_nodes)}")
            response = node.kubelet.allocate(GPU_RESOURCE, uuids[:1]).container_responses[0]
            print(f"== Allocate {uuids[0]}")
            for key, value in sorted(response.envs.items()):
                print(f"   env    {key}={value}")
            for spec in response.devices:
                print(f"   device {spec.container_path} <- {spec.host_path} ({spec.permissions})")
            scrapes(node)
            if os.geteuid() == 0:
                recount(node, bus)
            started = time.monotonic()
            code = node.stop_daemon(signal.SIGTERM)
            print(f"== daemon stopped with status {code} in {time.monotonic() - started:.2f} s; its log:")
            print(node.log_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def recount(node: SimulatedNode, bus: str) -> None:
    """A udev bind: a rescan that counts the GPUs again, and the event process it replaces."""
    assert node.daemon is not None
    before = child_pids(node.daemon.pid)
    offset = len(node.log_text())
    began = time.monotonic()
    node.send_uevent(pci_event("bind", bus.lower()))
    node.wait_log(" GPUs (driver", timeout=60, after=offset)
    took = time.monotonic() - began
    after = child_pids(node.daemon.pid)
    print(f"== udev bind of {bus}: rescanned in {took * 1000:.0f} ms; event process {before} -> {after}")


def scrapes(node: SimulatedNode, count: int = 5) -> None:
    """/metrics a second apart, so that each reads every GPU afresh, and what the reads took."""
    assert node.daemon is not None
    took, cpu, lines = [], [], 0
    for _ in range(count):
        time.sleep(1.05)
        began, began_cpu = time.perf_counter(), proc_times(node.daemon.pid)[0]
        code, body = status_client.fetch(f"unix:{node.status_socket}", "/metrics", timeout=5)
        took.append((time.perf_counter() - began) * 1000)
        cpu.append((proc_times(node.daemon.pid)[0] - began_cpu) * 1000)
        lines = body.count("\n") if code == 200 else -code
    part = status_client.status(f"unix:{node.status_socket}", timeout=5)["GPU telemetry"]
    print(
        f"== /metrics: {lines} lines; scrapes {', '.join(f'{t:.1f}' for t in took)} ms; a GPU's read "
        f"{part['read_ms']} ms, the pass {part['last_pass_ms']} ms on {part['lanes']} thread(s); "
        f"stale: {part['stale'] or 'none'}; the daemon's CPU a scrape {', '.join(f'{c:.1f}' for c in cpu)} ms"
    )


def main() -> int:
    print(f"== host: {os.uname().sysname} {os.uname().release}, uid {os.geteuid()}")
    try:
        found = discovery()
    except NvmlUnavailable as err:
        print(f"== NVML unavailable: {err}")
        return 1
    if not found:
        print("== no GPUs: nothing more to check")
        return 1
    uuids = [uuid for uuid, _ in found]
    side_by_side(uuids[0])
    calls_or_fields(uuids[0])
    daemon(uuids, found[0][1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
