"""One GPU's read (sources/nvml_telemetry.py) against the fake NVML through the real pynvml, in a child
process: hundreds of processes from the arrays unpacked out of pynvml's structures, page retirement before
Ampere, and GPM's activity over the window between two reads, with its samples handed on."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_fakenvml import Rig


@pytest.fixture
def rig(nvml_lib_dir: Path) -> Iterator[Rig]:
    root = Path(tempfile.mkdtemp(prefix="fnt-", dir="/tmp"))  # short: the control socket's path
    yield Rig(nvml_lib_dir, root)
    shutil.rmtree(root, ignore_errors=True)


SCENARIO = """
    gpu uuid=GPU-volta bus=0000:01:00.0 minor=0 cc=7.0 name="Tesla V100-SXM2-32GB"
    gpu uuid=GPU-hopper bus=0000:02:00.0 minor=1
"""


def test_hundreds_of_processes_with_their_memory_and_window(rig: Rig) -> None:
    out = rig.run(
        """
        from nvplug.sources.nvml_telemetry import Window, read_gpu, release
        from nvplug.testing.fakenvml_devices import GpuProcess
        N.nvmlInit()
        # 300 processes, every third of unknown memory (an MPS client without the privilege to see it).
        CTL.procs(1, [GpuProcess(1000 + i, None if i % 3 == 0 else i + 1) for i in range(300)])
        CTL.samples(1, [(1000 + i, i % 100, 5) for i in range(300)] + [(1001, 3, 1)])
        got = read_gpu("GPU-hopper", Window())
        by_pid = {p.pid: p for p in got.processes}
        out["count"] = len(got.processes)
        out["unknown"] = sorted(p.pid for p in got.processes if p.used_mib is None)[:3]
        out["p1001"] = [by_pid[1001].used_mib, by_pid[1001].sm_util, by_pid[1001].memory_util]
        out["p1299"] = [by_pid[1299].used_mib, by_pid[1299].sm_util]
        # The next read's window starts after the newest sample: no sample since, so every share is 0.
        again = read_gpu("GPU-hopper", got.window)
        out["window"] = [again.window.last_seen == got.window.last_seen > 0,
                         sorted({p.sm_util for p in again.processes})]
        # A few processes, and samples since, take one call a list: no call first to ask how many (1.3 ms
        # on a real H200).
        CTL.procs(1, [GpuProcess(2000 + i, 10) for i in range(5)])
        CTL.samples(1, [(2000 + i, 50, 5) for i in range(5)])
        CTL.reset_calls()
        few = read_gpu("GPU-hopper", again.window)
        release(few.window)
        calls = CTL.calls()
        out["few"] = [len(few.processes), sorted({p.sm_util for p in few.processes}),
                      calls["nvmlDeviceGetProcessUtilization"], calls["nvmlDeviceGetComputeRunningProcesses_v3"]]
        """,
        rig.scenario(SCENARIO),
    )
    assert out["few"] == [5, [50.0], 1, 1]
    assert out["count"] == 300
    assert out["unknown"] == [1000, 1003, 1006]
    assert out["p1001"] == [2.0, 2.0, 3.0]  # two samples of 1001: their mean (1 and 3 SM, 5 and 1 memory)
    assert out["p1299"] == [300.0, 99.0]
    assert out["window"] == [True, [0.0]]


def test_page_retirement_before_ampere_and_none_after(rig: Rig) -> None:
    out = rig.run(
        """
        from nvplug.sources.nvml_telemetry import Window, read_gpu
        N.nvmlInit()
        CTL.retire(0, "sbe", 2)
        CTL.retire(0, "dbe")
        volta, hopper = read_gpu("GPU-volta", Window()).figures, read_gpu("GPU-hopper", Window()).figures
        out["volta"] = [volta.retired_pages_sbe, volta.retired_pages_dbe]
        out["hopper"] = [hopper.retired_pages_sbe, hopper.retired_pages_dbe, hopper.remapped_rows_correctable]
        """,
        rig.scenario(SCENARIO),
    )
    assert out["volta"] == [2, 1]
    # Ampere and later remap rows instead: no retired pages to show, rather than a false 0.
    assert out["hopper"] == [None, None, 0]


def test_error_counts_and_energy_come_in_the_one_field_call(rig: Rig) -> None:
    """ECC totals, retired pages, remapped rows, energy and PCIe replays are read as fields, in the call that
    takes the read's other fields, with none of their own calls; a GPU that lacks one has no figure for it."""
    out = rig.run(
        """
        from nvplug.sources.nvml_telemetry import Window, read_gpu
        N.nvmlInit()
        CTL.ecc(0, "sbe", 5), CTL.ecc(0, "dbe", 2), CTL.restore(0), CTL.ecc(0, "sbe")  # volatile: 1 since
        CTL.retire(0, "dbe"), CTL.pending_pages(0, True), CTL.remap(0, False, True)
        CTL.telemetry(0, pcie_replays=4, energy_mj=9000)
        CTL.reset_calls()
        f = read_gpu("GPU-volta", Window()).figures
        calls = CTL.calls()
        out["volta"] = [f.ecc_sbe_volatile, f.ecc_dbe_volatile, f.ecc_sbe_aggregate, f.ecc_dbe_aggregate,
                        f.retired_pages_sbe, f.retired_pages_dbe, f.retired_pages_pending,
                        f.remapped_rows_correctable, f.remapped_rows_uncorrectable, f.remapped_rows_pending,
                        f.remapped_rows_failure, f.pcie_replays]
        out["energy"] = f.energy_mj
        out["calls"] = [calls["nvmlDeviceGetFieldValues"]] + [
            calls.get(name, 0) for name in ("nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRetiredPages",
                                     "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetRemappedRows",
                                     "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetPcieReplayCounter")]
        h = read_gpu("GPU-hopper", Window()).figures
        out["hopper"] = [h.ecc_sbe_volatile, h.ecc_dbe_aggregate, h.remapped_rows_correctable,
                         h.retired_pages_pending, h.energy_mj is not None]
        """,
        rig.scenario(SCENARIO.replace("minor=1", "minor=1 unsupported=ecc,remapped_rows")),
    )
    assert out["volta"] == [1, 0, 6, 2, 0, 1, True, 0, 0, False, True, 4]
    assert out["energy"] >= 9000
    assert out["calls"] == [1, 0, 0, 0, 0, 0, 0]
    # GPU-hopper has neither ECC nor remapped rows here, and retires no pages: none pending, as its call says.
    assert out["hopper"] == [None, None, None, False, True]


def test_gpm_activity_over_the_window_between_two_reads(rig: Rig) -> None:
    out = rig.run(
        """
        from nvplug.sources.nvml_telemetry import Window, read_gpu, release
        N.nvmlInit()
        CTL.gpm(1, tensor=60, sm=90, pcie_rx=100)
        first = read_gpu("GPU-hopper", Window())
        out["first"] = [first.figures.tensor_active, first.window.gpm_sample is not None]
        time.sleep(0.2)
        second = read_gpu("GPU-hopper", first.window)
        f = second.figures
        out["second"] = [f.tensor_active, f.sm_active, f.pcie_rx_bytes_per_second, f.fp64_active]
        # Before Hopper: no GPM, and no sample kept.
        volta = read_gpu("GPU-volta", Window())
        out["volta"] = [volta.figures.tensor_active, volta.window.gpm_sample]
        # The window hands on this read's sample (the one it used is freed).
        out["handed_on"] = addr(second.window.gpm_sample) not in (None, addr(first.window.gpm_sample))
        release(second.window)
        """,
        rig.scenario(SCENARIO),
    )
    assert out["first"] == [None, True]  # one sample is no window
    tensor, sm, rx, fp64 = out["second"]
    assert tensor == pytest.approx(0.6) and sm == pytest.approx(0.9) and fp64 == 0.0
    assert rx == pytest.approx(100 * (1 << 20))
    assert out["volta"] == [None, None]
    assert out["handed_on"]


def test_gpm_per_gpu_instance_in_mig_mode(rig: Rig) -> None:
    out = rig.run(
        """
        from nvplug.sources.nvml_telemetry import Window, read_gpu, release
        N.nvmlInit()
        CTL.gpm(0, tensor=30)
        first = read_gpu("GPU-mig", Window())
        out["first"] = [first.window.gpm_sample, sorted(gi for gi, _ in first.window.gpm_instances),
                        [m.tensor_active for m in first.mig]]
        time.sleep(0.2)
        second = read_gpu("GPU-mig", first.window)
        out["second"] = sorted((m.uuid, m.tensor_active) for m in second.mig)
        out["gpu"] = second.figures.tensor_active  # a GPU in MIG mode has its instances' figures only
        release(second.window)
        """,
        rig.scenario(
            """
            gpu uuid=GPU-mig bus=0000:01:00.0 minor=0 mig=1
            mig 0 3g.40gb gi=2 uuid=MIG-two
            mig 0 2g.20gb gi=5 uuid=MIG-five
            """
        ),
    )
    assert out["first"] == [None, [2, 5], [None, None]]
    assert [uuid for uuid, _ in out["second"]] == ["MIG-five", "MIG-two"]
    assert [tensor for _, tensor in out["second"]] == [pytest.approx(0.3)] * 2
    assert out["gpu"] is None


def test_nvlink_counts_and_dcgms_rate_over_the_window(rig: Rig) -> None:
    """NVLink's data counts each way, and DCGM's field 449 over the window between two reads (KiB/s both
    ways over 1000): none on a first read, on a GPU without NVLink, or across a reset that started the
    counts afresh. In MIG mode the GPU keeps them: the links are the whole GPU's."""
    out = rig.run(
        """
        from nvplug.sources.nvml_telemetry import Window, read_gpu, release
        N.nvmlInit()
        CTL.telemetry(0, nvlink_tx=300, nvlink_rx=100)
        CTL.telemetry(2, nvlink_tx=10)
        first = read_gpu("GPU-a", Window())
        out["first"] = [first.figures.nvlink_bandwidth_total, first.figures.nvlink_tx_kib > 0]
        time.sleep(0.3)
        second = read_gpu("GPU-a", first.window)
        f = second.figures
        out["second"] = [f.nvlink_tx_kib - first.figures.nvlink_tx_kib, f.nvlink_rx_kib - first.figures.nvlink_rx_kib,
                         f.nvlink_bandwidth_total, (second.window.nvlink[1] - first.window.nvlink[1]) / 1e6]
        CTL.restore(0)
        after = read_gpu("GPU-a", second.window)
        out["reset"] = [after.figures.nvlink_bandwidth_total, after.figures.nvlink_tx_kib < f.nvlink_tx_kib]
        none = read_gpu("GPU-none", Window())
        again = read_gpu("GPU-none", none.window)
        out["none"] = [again.figures.nvlink_tx_kib, again.figures.nvlink_bandwidth_total, again.window.nvlink]
        mig = read_gpu("GPU-mig", Window())
        time.sleep(0.1)
        mig = read_gpu("GPU-mig", mig.window)
        out["mig"] = [mig.figures.nvlink_tx_kib > 0, mig.figures.nvlink_bandwidth_total]
        for read in (after, again, mig):
            release(read.window)
        """,
        rig.scenario(
            """
            gpu uuid=GPU-a bus=0000:01:00.0 minor=0
            gpu uuid=GPU-b bus=0000:02:00.0 minor=1
            gpu uuid=GPU-mig bus=0000:03:00.0 minor=2 mig=1
            gpu uuid=GPU-none bus=0000:04:00.0 minor=3 unsupported=nvlink
            mig 2 3g.40gb
            link 0 1 nvlink=18 pcie=NODE
            link 1 2 nvlink=18 pcie=NODE
            """
        ),
    )
    assert out["first"] == [None, True]
    tx, rx, rate, seconds = out["second"]
    assert seconds >= 0.3
    # 300 and 100 MiB/s: 400 x 1024 KiB a second, over 1000 as DCGM has it.
    assert tx == pytest.approx(3 * rx, rel=0.02)
    assert rate == pytest.approx((tx + rx) / seconds / 1000, rel=0.02)
    assert rate == pytest.approx(409, abs=3)
    assert out["reset"] == [None, True]
    assert out["none"] == [None, None, None]
    assert out["mig"] == [True, pytest.approx(10.24, abs=1)]


def test_violation_times_each_policy_in_one_call(rig: Rig) -> None:
    """NVML's violation times (ns since the driver loaded), read as DCGM reads them: fields 74 to 79, in the
    one call that takes a read's fields; a GPU whose figures the driver does not give has none."""
    out = rig.run(
        """
        from nvplug.sources.nvml_telemetry import Window, read_gpu, release
        N.nvmlInit()
        CTL.telemetry(1, throttle=0x40)  # a hardware thermal slowdown
        first = read_gpu("GPU-hopper", Window())
        time.sleep(0.2)
        CTL.reset_calls()
        second = read_gpu("GPU-hopper", first.window)
        out["calls"] = CTL.calls()["nvmlDeviceGetFieldValues"]
        f, g = first.figures, second.figures
        out["grown"] = [g.thermal_violation_ns - f.thermal_violation_ns, g.power_violation_ns - f.power_violation_ns,
                        g.reliability_violation_ns]
        volta = read_gpu("GPU-volta", Window()).figures
        out["none"] = [volta.thermal_violation_ns, volta.low_utilization_violation_ns]
        release(second.window)
        """,
        rig.scenario(SCENARIO.replace("cc=7.0", "cc=7.0 unsupported=telemetry")),
    )
    thermal, power, reliability = out["grown"]
    assert thermal >= 0.2e9 and power == 0 and reliability == 0
    assert out["calls"] == 1  # the memory's temperature, NVLink's counts and the violation times at once
    assert out["none"] == [None, None]


def test_memory_temperature_and_video_engines_where_the_gpu_gives_them(rig: Rig) -> None:
    """A GPU without HBM refuses field 82 in the field's own return code: no figure, and the read goes on."""
    out = rig.run(
        """
        from nvplug.sources.nvml_telemetry import Window, read_gpu
        N.nvmlInit()
        CTL.telemetry(1, mem_temp=63, enc_util=7, dec_util=9, temp=55)
        volta, hopper = read_gpu("GPU-volta", Window()).figures, read_gpu("GPU-hopper", Window()).figures
        out["volta"] = [volta.memory_temperature_c, volta.temperature_c]
        out["hopper"] = [hopper.memory_temperature_c, hopper.util_encoder, hopper.util_decoder, hopper.temperature_c]
        """,
        rig.scenario(SCENARIO.replace("cc=7.0", "cc=7.0 unsupported=memory_temp")),
    )
    assert out["volta"] == [None, 34]
    assert out["hopper"] == [63, 7, 9, 55]


@pytest.mark.parametrize(
    ("value_type", "member", "given"),
    [
        (0, "dVal", 41.5),
        (1, "uiVal", 70),
        (3, "ullVal", 2**40),
        (4, "sllVal", -(2**40)),
        (5, "siVal", -3),
        (6, "usVal", 9),
    ],
)
def test_a_field_is_read_as_the_type_the_driver_gives(value_type: int, member: str, given: float) -> None:
    """Each answer unpacked from the array's bytes as the type the driver gives, beside a refused field and one
    of a type unknown here, with the time NVML read each."""
    import pynvml

    from nvplug.sources.nvml_field_values import FieldValue, decode

    answers = (pynvml.c_nvmlFieldValue_t * 3)()
    answers[0].valueType, answers[0].nvmlReturn, answers[0].timestamp = value_type, pynvml.NVML_SUCCESS, 1000
    setattr(answers[0].value, member, given)
    answers[1].nvmlReturn, answers[1].timestamp = pynvml.NVML_ERROR_NOT_SUPPORTED, 1001
    answers[2].valueType, answers[2].nvmlReturn, answers[2].value.uiVal = 99, pynvml.NVML_SUCCESS, 5
    assert decode(bytes(answers)) == [
        FieldValue(given, pynvml.NVML_SUCCESS, 1000),
        FieldValue(None, pynvml.NVML_ERROR_NOT_SUPPORTED, 1001),
        FieldValue(None, pynvml.NVML_SUCCESS, 0),
    ]
