"""The telemetry reader as a unit: its pace (once a second per GPU however often asked), a read that hangs
left behind while the others are read, a failing read that costs its GPU's figures alone, and processes
placed from a /proc and the kubelet's log records laid out in a directory. The NVML read itself is scripted
here; tests/test_telemetry.py reads the fake NVML through the daemon."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from nvplug.cli.mps_command import _clients_text
from nvplug.core.gpu import Gpu
from nvplug.core.snapshot import Snapshot
from nvplug.core.telemetry import HOST, GpuFigures, ProcessContainer, ProcessUse
from nvplug.edges.edge_protocols import StateUpdate
from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.nvml.nvml_sessions import NvmlSessions
from nvplug.pods.process_places import ProcessPlaces, unattributed
from nvplug.sources import telemetry_reader
from nvplug.sources.nvml_telemetry import GpuRead, Window
from nvplug.sources.telemetry_reader import GpuTelemetry, lanes_for


def gpus(count: int) -> tuple[Gpu, ...]:
    return tuple(Gpu(uuid=f"GPU-{i}", index=i, bus_id=f"0000:{i:02x}:00.0") for i in range(count))


GPUS = gpus(3)
UID = "6f1b2c3d-0a0b-4c0d-8e0f-00000000abcd"
CID = "ab" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Driver:
    """What each GPU's read gives: a temperature, processes, a failure, or a hang until released."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        self.hang: dict[str, threading.Event] = {}
        self.fail: set[str] = set()
        self.processes: dict[str, tuple[ProcessUse, ...]] = {}

    def read(self, uuid: str, since: Window) -> GpuRead:
        self.reads.append(uuid)
        taken = len(self.reads)
        if uuid in self.hang:
            self.hang[uuid].wait(10)
        if uuid in self.fail:
            raise NvmlUnavailable(f"{uuid} is lost")
        figures = GpuFigures(temperature_c=40 + len(self.reads))
        # A GPM sample of its own each read, as NVML's would be: (GPU, read).
        return GpuRead(figures, (), self.processes.get(uuid, ()), Window(since.last_seen + 1, (uuid, taken)))


def reader(
    driver: Driver,
    clock: Clock,
    tmp_path: Path,
    read: Callable[[str, Window], GpuRead] | None = None,
    of: tuple[Gpu, ...] = GPUS,
) -> GpuTelemetry:
    """`read`: in place of the driver's own (which it may call)."""
    telemetry = GpuTelemetry(NvmlSessions(), tmp_path / "proc", tmp_path / "log", read or driver.read, clock)
    asyncio.run(telemetry.open(Snapshot(revision=1, gpus=of)))
    return telemetry


def test_each_gpu_is_read_once_a_second_however_often_asked(tmp_path: Path) -> None:
    driver, clock = Driver(), Clock()
    telemetry = reader(driver, clock, tmp_path)

    async def scrapes() -> None:
        for _ in range(5):
            await telemetry.refresh()
        clock.now += 1.0
        await telemetry.refresh()

    asyncio.run(scrapes())
    assert driver.reads == ["GPU-0", "GPU-1", "GPU-2"] * 2
    assert [r.stale for r in telemetry.latest().readings] == [None] * 3
    assert telemetry.lanes == 1  # quick reads: one thread, one GPU after the other


def test_a_slow_driver_s_reads_are_shared_by_threads_and_a_quick_one_s_are_not(tmp_path: Path) -> None:
    eight = gpus(8)
    driver, clock = Driver(), Clock()
    threads: list[set[int]] = []
    slow = {"seconds": 0.02}  # a real GPU's read is about 10 ms, nearly all of it in the driver

    def read(uuid: str, since: Window) -> GpuRead:
        threads[-1].add(threading.get_ident())
        time.sleep(slow["seconds"])
        return driver.read(uuid, since)

    telemetry = reader(driver, clock, tmp_path, read, eight)

    async def passes() -> list[tuple[int, float]]:
        lanes = []
        for seconds in (0.02, 0.02, 0.0, 0.0):
            slow["seconds"] = seconds
            threads.append(set())
            clock.now += 1.0
            measured = telemetry.read_seconds  # the last pass's reads, which this pass goes by
            got = await telemetry.refresh(budget=5.0)
            assert [r.stale for r in got.readings] == [None] * 8
            lanes.append((telemetry.lanes, measured))
        await telemetry.close()
        return lanes

    # The first pass has no measure yet; eight reads of 20 ms want eight lanes. Quick reads want one, as
    # their measure says: on a busy machine a quick read's measure takes in its waits for a CPU.
    got = asyncio.run(passes())
    assert [lanes for lanes, _ in got[:3]] == [1, 8, 8] and got[1][1] >= 0.02
    assert got[3][0] == lanes_for(8, got[3][1])
    assert [len(t) for t in threads] == [lanes for lanes, _ in got]
    assert sorted(driver.reads) == sorted([g.uuid for g in eight] * 4)  # every GPU once a pass


def test_lanes_follow_the_reads_measure() -> None:
    # The simulated node's read (0.2 ms) keeps one lane; a real GPU's (10 ms) wants one a GPU.
    assert [lanes_for(8, s) for s in (0.0, 0.0002, 0.001, 0.002, 0.01, 0.02)] == [1, 1, 1, 2, 8, 8]
    assert lanes_for(3, 0.02) == 3 and lanes_for(16, 0.1) == 8 and lanes_for(0, 0.02) == 1


def test_a_read_that_hangs_is_left_behind_and_the_others_are_read(tmp_path: Path) -> None:
    driver, clock = Driver(), Clock()
    released = driver.hang["GPU-1"] = threading.Event()
    telemetry = reader(driver, clock, tmp_path)

    async def scrapes() -> None:
        first = await telemetry.refresh(budget=2.0)
        assert [r.uuid for r in first.readings if r.stale is None] == ["GPU-0", "GPU-2"]
        (hung,) = [r for r in first.readings if r.stale]
        assert hung.uuid == "GPU-1" and "no answer from NVML" in hung.stale
        # The next second: GPU 1's read still hangs and is not started again; the others are read.
        clock.now += 1.0
        await telemetry.refresh(budget=2.0)
        assert driver.reads.count("GPU-1") == 1 and driver.reads.count("GPU-0") == 2
        released.set()
        # Its read returns: its figures are the newest.
        await until(lambda: "GPU-1" not in telemetry.status()["left_behind"])  # type: ignore[index]
        assert [r.stale for r in telemetry.latest().readings] == [None] * 3
        await telemetry.close()

    asyncio.run(scrapes())


def test_a_read_that_hangs_in_one_lane_holds_up_no_other_lane(tmp_path: Path) -> None:
    eight = gpus(8)
    driver, clock = Driver(), Clock()

    def read(uuid: str, since: Window) -> GpuRead:
        time.sleep(0.02)  # a slow driver: the passes after the first are shared by 8 threads
        return driver.read(uuid, since)

    telemetry = reader(driver, clock, tmp_path, read, eight)

    async def scrapes() -> None:
        await telemetry.refresh(budget=5.0)
        released = driver.hang["GPU-5"] = threading.Event()
        clock.now += 1.0
        got = await telemetry.refresh(budget=5.0)
        assert telemetry.lanes == 8
        assert [r.uuid for r in got.readings if r.stale] == ["GPU-5"]
        # The next second: the other seven are read again on their lanes, GPU 5's read still hangs.
        clock.now += 1.0
        got = await telemetry.refresh(budget=5.0)
        assert [r.uuid for r in got.readings if r.stale] == ["GPU-5"]
        assert driver.reads.count("GPU-5") == 2 and driver.reads.count("GPU-4") == 3
        released.set()
        await until(lambda: not telemetry.status()["left_behind"])  # type: ignore[index]
        assert [r.stale for r in telemetry.latest().readings] == [None] * 8
        await telemetry.close()

    asyncio.run(scrapes())


def test_reads_done_when_the_budget_runs_out_are_shown_and_the_one_in_progress_is_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reads of a pass reach the loop together when it ends; a scrape whose budget runs out first takes
    those done so far all the same."""
    monkeypatch.setattr(telemetry_reader, "SLOW_READ", 60.0)  # the budget runs out, not the hang limit
    driver, clock = Driver(), Clock()
    released = driver.hang["GPU-2"] = threading.Event()
    telemetry = reader(driver, clock, tmp_path)

    async def scrapes() -> None:
        await telemetry.refresh(budget=0.0)  # the pass starts; nothing read yet
        await until(lambda: driver.reads == ["GPU-0", "GPU-1", "GPU-2"])  # GPU 2's read has begun
        got = await telemetry.refresh(budget=0.0)
        assert [(r.uuid, r.stale) for r in got.readings][:2] == [("GPU-0", None), ("GPU-1", None)]
        assert "no answer from NVML in 0.0 s" in (got.readings[2].stale or "")
        released.set()
        await until(lambda: telemetry.latest().readings[2].stale is None)
        assert driver.reads == ["GPU-0", "GPU-1", "GPU-2"]  # each read once
        await telemetry.close()

    asyncio.run(scrapes())


def test_a_failing_read_keeps_the_last_figures_marked(tmp_path: Path) -> None:
    driver, clock = Driver(), Clock()
    telemetry = reader(driver, clock, tmp_path)

    async def scrapes() -> None:
        await telemetry.refresh()
        before = {r.uuid: r.figures for r in telemetry.latest().readings}
        driver.fail.add("GPU-2")
        clock.now += 1.0
        await telemetry.refresh()
        (failed,) = [r for r in telemetry.latest().readings if r.uuid == "GPU-2"]
        assert failed.stale == "GPU-2 is lost" and failed.figures == before["GPU-2"]

    asyncio.run(scrapes())


@pytest.mark.parametrize(
    "cgroup",
    [
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
        f"cri-containerd-{CID}.scope\n",
        f"12:pids:/kubepods/besteffort/pod{UID}/{CID}\n11:cpu:/\n0::/\n",
    ],
    ids=["v2-systemd", "v1-cgroupfs"],
)
def test_processes_are_placed_from_their_cgroup_and_the_kubelet_s_records(tmp_path: Path, cgroup: str) -> None:
    for pid, text in (
        (101, cgroup),
        (102, "0::/system.slice/sshd.service\n"),
        (103, f"0::/kubepods/pod{'0' * 8}-0000-0000-0000-{'0' * 12}/x\n"),
    ):
        (tmp_path / "proc" / str(pid)).mkdir(parents=True)
        (tmp_path / "proc" / str(pid) / "cgroup").write_text(text)
    (tmp_path / "log/pods" / f"ml_ts-a_{UID}").mkdir(parents=True)
    (tmp_path / "log/containers").mkdir(parents=True)
    (tmp_path / "log/containers" / f"ts-a_ml_main-{CID}.log").symlink_to(tmp_path / "nowhere")
    # 104 has gone: no /proc entry.
    placed = ProcessPlaces(tmp_path / "proc", tmp_path / "log").place([101, 102, 103, 104])
    # 102 is a host process; 103's pod has no record (its UID alone) and 104 has gone: both unattributed.
    nameless = ProcessContainer(pod_uid=f"{'0' * 8}-0000-0000-0000-{'0' * 12}")
    assert placed == {101: ProcessContainer("ml", "ts-a", "main", UID, CID), 102: HOST, 103: nameless, 104: None}
    assert [unattributed(placed[pid]) for pid in (101, 102, 103, 104)] == [False, False, True, True]


def test_a_pass_reads_the_uids_of_the_pods_the_records_name(tmp_path: Path) -> None:
    """For the pods that hold a device, whether or not a process of theirs runs on it; read again once the
    records' directory changes."""
    (tmp_path / "log/pods" / f"ml_ts-a_{UID}").mkdir(parents=True)
    telemetry = reader(Driver(), clock := Clock(), tmp_path)

    async def scrapes() -> None:
        assert (await telemetry.refresh()).pod_uids == {("ml", "ts-a"): UID}
        other = UID.replace("abcd", "ef01")
        (tmp_path / "log/pods" / f"ml_ts-b_{other}").mkdir()
        clock.now += 1.0
        assert (await telemetry.refresh()).pod_uids == {("ml", "ts-a"): UID, ("ml", "ts-b"): other}
        await telemetry.close()

    asyncio.run(scrapes())


def test_each_read_s_processes_are_placed_as_read_and_a_shared_pid_once_a_pass(tmp_path: Path) -> None:
    driver, clock = Driver(), Clock()
    (tmp_path / "proc/101").mkdir(parents=True)
    (tmp_path / "proc/101/cgroup").write_text(f"0::/kubepods/besteffort/pod{UID}/{CID}\n")
    (tmp_path / "log/pods" / f"ml_ts-a_{UID}").mkdir(parents=True)
    # 101 runs on GPU 0 and GPU 2 (one pod, two GPUs); 105 has no /proc entry: it has gone.
    for gpu in ("GPU-0", "GPU-2"):
        driver.processes[gpu] = (ProcessUse(101, gpu, "compute", 100.0), ProcessUse(105, gpu, "compute", 1.0))
    telemetry = reader(driver, clock, tmp_path)
    placed: list[list[int]] = []
    place = telemetry._places.place

    def counted(pids: Iterable[int]) -> dict[int, ProcessContainer | None]:
        placed.append(list(pids))
        return place(placed[-1])

    telemetry._places.place = counted  # type: ignore[method-assign]

    async def scrapes() -> None:
        got = await telemetry.refresh()
        assert got.container_of(101) == ProcessContainer("ml", "ts-a", "", UID, CID)
        assert got.container_of(105) == HOST and telemetry.unattributed == 1
        assert sorted(p for pids in placed for p in pids) == [101, 105]  # once each, though on two GPUs
        # The next pass places them afresh: 101 has gone too.
        (tmp_path / "proc/101/cgroup").unlink()
        clock.now += 1.0
        got = await telemetry.refresh()
        assert got.container_of(101) == HOST and telemetry.unattributed == 2
        await telemetry.close()

    asyncio.run(scrapes())


def test_nvplug_mps_stop_names_each_client_s_pod_through_the_same_placement(tmp_path: Path) -> None:
    nameless = f"{'1' * 8}-0000-0000-0000-{'0' * 12}"
    for pid, text in ((101, f"0::/kubepods/pod{UID}/{CID}\n"), (102, f"0::/kubepods/pod{nameless}/x\n")):
        (tmp_path / "proc" / str(pid)).mkdir(parents=True)
        (tmp_path / "proc" / str(pid) / "cgroup").write_text(text)
    (tmp_path / "log/pods" / f"ml_ts-a_{UID}").mkdir(parents=True)
    (tmp_path / "log/containers").mkdir(parents=True)
    (tmp_path / "log/containers" / f"ts-a_ml_main-{CID}.log").symlink_to(tmp_path / "nowhere")
    said = _clients_text((101, 102, 103), tmp_path / "proc", tmp_path / "log/pods")
    assert said == f"pid 101: pod ml/ts-a, container main; pid 102: pod UID {nameless}; pid 103"


async def until(done: Callable[[], bool], deadline: float = 30.0) -> None:
    """Waits for what another thread does, however slow the machine; fails past a generous deadline."""
    give_up = time.monotonic() + deadline
    while not done():
        assert time.monotonic() < give_up, "not done in time"
        await asyncio.sleep(0.01)


def test_a_gone_gpu_s_gpm_samples_are_freed_once_and_never_while_a_read_uses_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, clock = Driver(), Clock()
    freed: list[object] = []
    monkeypatch.setattr(telemetry_reader, "release", lambda window: freed.append(window.gpm_sample))
    telemetry = reader(driver, clock, tmp_path)

    async def scrapes() -> None:
        await telemetry.refresh()  # each GPU's first sample: reads 1 to 3
        released = driver.hang["GPU-1"] = threading.Event()
        clock.now += 1.0
        await telemetry.refresh(budget=0.5)  # GPU 1's read hangs, holding its first sample
        # GPU 2 goes, then GPU 1 while its read hangs.
        telemetry.update(StateUpdate(Snapshot(revision=2, gpus=GPUS[:2]), (), True, frozenset({"gpus"})))
        telemetry.update(StateUpdate(Snapshot(revision=3, gpus=GPUS[:1]), (), True, frozenset({"gpus"})))
        await until(lambda: len(freed) >= 1)  # on the telemetry's thread
        assert freed == [("GPU-2", 6)]  # GPU 2's newest; GPU 1's is still being read
        released.set()
        await until(lambda: len(freed) >= 2)  # GPU 1's read returns: the sample it took is freed, not the one it used
        assert freed == [("GPU-2", 6), ("GPU-1", 5)]
        assert [r.uuid for r in telemetry.latest().readings] == ["GPU-0"]
        await telemetry.close()

    asyncio.run(scrapes())
