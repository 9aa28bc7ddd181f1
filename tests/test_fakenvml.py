"""The fake libnvidia-ml.so.1, exercised through the real pynvml binding.

Each test runs a short child Python process whose environment (from
fakenvml_library.environ) makes pynvml load the fake.  Child bodies fill the dict
`out`, which comes back as JSON.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nvplug.testing import fakenvml_control, fakenvml_devices, fakenvml_library

REPO = Path(__file__).resolve().parents[1]

# Shared by every child: `code(fn, ...)` turns a pynvml call into its nvmlReturn_t,
# `ctl_error(fn, ...)` returns a ControlError's text, `header(key)` reads one key=value of the state
# reply's library-wide part, CTL controls this very process.
PRELUDE = """
import ctypes, json, sys, threading, time
from pathlib import Path
import pynvml as N
from nvplug.testing.fakenvml_control import Control, ControlError
CTL = Control(Path(sys.argv[1]))
def code(fn, *args):
    try:
        fn(*args)
    except N.NVMLError as e:
        return e.value
    return 0
def ctl_error(fn, *args):
    try:
        fn(*args)
    except ControlError as e:
        return str(e)
    return None
def txt(v):
    return v.decode() if isinstance(v, bytes) else v
def addr(p):
    return ctypes.cast(p, ctypes.c_void_p).value
def header(key):
    return next(w.partition("=")[2] for w in CTL.state().split(" | ")[0].split() if w.startswith(key + "="))
out = {}
"""
EPILOGUE = "\nprint(json.dumps(out))\n"


def _scenario_gpus() -> list[dict[str, str]]:
    """The gpu lines of default.scenario, as key/value dicts."""
    gpus = []
    for line in fakenvml_library.DEFAULT_SCENARIO.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "gpu":
            gpus.append(dict(w.split("=", 1) for w in words[1:]))
    return gpus


GPUS = _scenario_gpus()


class Rig:
    """Runs child interpreters against the fake library with a private control socket."""

    def __init__(self, lib_dir: Path, root: Path) -> None:
        self.lib_dir = lib_dir
        self.root = root
        self.ctl = root / "ctl"

    def scenario(self, text: str) -> Path:
        path = self.root / "test.scenario"
        path.write_text(textwrap.dedent(text))
        return path

    def env(self, scenario: Path | None) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH")) if p)
        env = fakenvml_library.environ(self.lib_dir, scenario or fakenvml_library.DEFAULT_SCENARIO, self.ctl, base)
        if scenario is None and "builtin" in self.root.name:
            del env["FAKE_NVML_SCENARIO"]
        return env

    def argv(self, body: str, ctl: Path | None = None) -> list[str]:
        """`ctl`: the child's CTL, when its env names another control socket than ours."""
        return [sys.executable, "-c", PRELUDE + textwrap.dedent(body) + EPILOGUE, str(ctl or self.ctl)]

    def run(
        self, body: str, scenario: Path | None = None, env: dict[str, str] | None = None, ctl: Path | None = None
    ) -> dict[str, Any]:
        proc = subprocess.run(
            self.argv(body, ctl), env=env or self.env(scenario), capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
        result["_stderr"] = proc.stderr
        return result


@pytest.fixture
def rig(nvml_lib_dir: Path) -> Iterator[Rig]:
    # Short root: the control socket path must fit sun_path (108 bytes).
    root = Path(tempfile.mkdtemp(prefix="fnv-", dir="/tmp"))
    yield Rig(nvml_lib_dir, root)
    shutil.rmtree(root, ignore_errors=True)


# ---- the Python helper ----------------------------------------------------------


def test_build_is_cached_and_leaves_no_temp_files(tmp_path: Path) -> None:
    lib = fakenvml_library.build(tmp_path / "lib")
    assert lib == tmp_path / "lib" / "libnvidia-ml.so.1"
    first = lib.stat()
    assert fakenvml_library.build(tmp_path / "lib") == lib
    assert (lib.stat().st_ino, lib.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    assert sorted(p.name for p in lib.parent.iterdir()) == ["libnvidia-ml.so.1", "libnvidia-ml.so.1.sha256"]


def test_build_failure_reports_compiler_stderr_and_keeps_old_lib(tmp_path: Path, nvml_lib_dir: Path) -> None:
    dest = tmp_path / "lib"
    dest.mkdir()
    shutil.copy(nvml_lib_dir / "libnvidia-ml.so.1", dest)
    bad_cc = tmp_path / "bad-cc"
    bad_cc.write_text("#!/bin/sh\necho 'fakenvml.c:1: error: boom' >&2\nexit 1\n")
    bad_cc.chmod(0o755)
    with pytest.raises(fakenvml_library.FakeNvmlBuildError) as info:
        fakenvml_library.build(dest, cc=str(bad_cc))
    assert "boom" in info.value.stderr
    with pytest.raises(fakenvml_library.FakeNvmlBuildError):
        fakenvml_library.build(dest, cc=str(tmp_path / "no-such-cc"))
    assert (dest / "libnvidia-ml.so.1").read_bytes() == (nvml_lib_dir / "libnvidia-ml.so.1").read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == ["libnvidia-ml.so.1"]


def test_environ_puts_lib_dir_first() -> None:
    env = fakenvml_library.environ(Path("/x/lib"), Path("/s"), Path("/n/c"), {"LD_LIBRARY_PATH": "/old", "A": "1"})
    assert env == {
        "LD_LIBRARY_PATH": "/x/lib:/old",
        "FAKE_NVML_SCENARIO": "/s",
        "FAKE_NVML_CONTROL": "/n/c",
        "FAKE_NVML_STATE_DIR": "/n",  # the control socket's directory: one per simulated node
        "A": "1",
    }
    assert fakenvml_library.environ(Path("/x"), Path("/s"), Path("/c"), {})["LD_LIBRARY_PATH"] == "/x"
    own = fakenvml_library.environ(Path("/x"), Path("/s"), Path("/c"), {}, state_dir=Path("/st"))
    assert own["FAKE_NVML_STATE_DIR"] == "/st"


def test_control_times_out_without_a_server(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        fakenvml_control.Control(tmp_path / "nobody").send("ping", timeout=0.2)
    assert time.monotonic() - start < 2


# ---- init, inventory, argument checks --------------------------------------------


def test_init_shutdown_refcount(rig: Rig) -> None:
    out = rig.run(
        """
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        out["maps"] = [l.split()[-1] for l in open("/proc/self/maps") if "libnvidia-ml" in l][:1]
        c = ctypes.c_uint()
        out["count_before"] = lib.nvmlDeviceGetCount_v2(ctypes.byref(c))
        out["driver_before"] = lib.nvmlSystemGetDriverVersion(ctypes.create_string_buffer(80), 80)
        out["shutdown_before"] = lib.nvmlShutdown()
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        out["init_v2"] = lib.nvmlInit_v2()
        out["init_flags"] = lib.nvmlInitWithFlags(0)
        lib.nvmlShutdown(); lib.nvmlShutdown()
        out["count_nested"] = N.nvmlDeviceGetCount()
        N.nvmlShutdown()
        out["count_after"] = code(N.nvmlDeviceGetCount)
        out["handle_after"] = code(N.nvmlDeviceGetUUID, h)
        out["shutdown_extra"] = code(N.nvmlShutdown)
        N.nvmlInit()
        out["reinit_uuid"] = N.nvmlDeviceGetUUID(h)
        out["error_string"] = [N.nvmlErrorString(v) for v in (0, 1, 15, 999)]
        """
    )
    assert out["maps"] == [str(rig.lib_dir / "libnvidia-ml.so.1")]
    assert out["count_before"] == out["driver_before"] == out["shutdown_before"] == 1
    assert out["init_v2"] == out["init_flags"] == 0
    assert out["count_nested"] == 8
    assert out["count_after"] == out["handle_after"] == out["shutdown_extra"] == 1
    assert out["reinit_uuid"] == GPUS[0]["uuid"]  # handles stay valid across init cycles
    assert out["error_string"] == ["Success", "Uninitialized", "GPU is lost", "Unknown Error"]


def test_inventory_of_default_scenario(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        out["versions"] = [N.nvmlSystemGetDriverVersion(), N.nvmlSystemGetNVMLVersion(),
                           N.nvmlSystemGetCudaDriverVersion(), N.nvmlSystemGetCudaDriverVersion_v2()]
        out["gpus"] = []
        for i in range(N.nvmlDeviceGetCount()):
            h = N.nvmlDeviceGetHandleByIndex(i)
            p = N.nvmlDeviceGetPciInfo(h)
            m = N.nvmlDeviceGetMemoryInfo(h)
            m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
            out["gpus"].append(dict(
                index=N.nvmlDeviceGetIndex(h), uuid=N.nvmlDeviceGetUUID(h), name=N.nvmlDeviceGetName(h),
                serial=N.nvmlDeviceGetSerial(h), minor=N.nvmlDeviceGetMinorNumber(h),
                busId=txt(p.busId), busIdLegacy=txt(p.busIdLegacy),
                pci=[p.domain, p.bus, p.device, p.pciDeviceId],
                memory=[m.total, m.free, m.used], memory_v2=[m2.total, m2.free],
                cc=list(N.nvmlDeviceGetCudaComputeCapability(h)), numa=N.nvmlDeviceGetNumaNodeId(h),
                mig=N.nvmlDeviceGetMigMode(h), max_mig=N.nvmlDeviceGetMaxMigDeviceCount(h),
                is_mig=N.nvmlDeviceIsMigDeviceHandle(h).value, persistence=N.nvmlDeviceGetPersistenceMode(h),
                arch=N.nvmlDeviceGetArchitecture(h), brand=N.nvmlDeviceGetBrand(h),
                by_uuid=addr(N.nvmlDeviceGetHandleByUUID(N.nvmlDeviceGetUUID(h))) == addr(h),
                by_bus=addr(N.nvmlDeviceGetHandleByPciBusId(txt(p.busId))) == addr(h),
                by_legacy_bus=addr(N.nvmlDeviceGetHandleByPciBusId(txt(p.busIdLegacy).lower())) == addr(h),
            ))
        lib = N.nvmlLib
        legacy = N.nvmlPciInfo_v2_t()
        out["pci_v2"] = [lib.nvmlDeviceGetPciInfo_v2(N.nvmlDeviceGetHandleByIndex(0), ctypes.byref(legacy)),
                         txt(legacy.busId), legacy.pciSubSystemId]
        out["bad_index"] = code(N.nvmlDeviceGetHandleByIndex, 8)
        out["bad_uuid"] = code(N.nvmlDeviceGetHandleByUUID, "GPU-00000000-0000-0000-0000-000000000000")
        out["bad_bus"] = code(N.nvmlDeviceGetHandleByPciBusId, "0000:01:00.0")
        out["junk_bus"] = code(N.nvmlDeviceGetHandleByPciBusId, "not-a-bus-id")
        out["mem_v2_bad_version"] = code(N.nvmlDeviceGetMemoryInfo, N.nvmlDeviceGetHandleByIndex(0), 1)
        """
    )
    assert out["versions"] == ["550.54.15", "12.550.54.15", 12040, 12040]
    gpus = out["gpus"]
    assert len(gpus) == 8
    for i, (got, want) in enumerate(zip(gpus, GPUS, strict=True)):
        bus = int(want["bus"].split(":")[1], 16)
        assert got["index"] == got["minor"] == i
        assert got["uuid"] == want["uuid"]
        assert got["name"] == "NVIDIA H100 80GB HBM3"
        assert got["serial"] == want["serial"]
        assert got["busIdLegacy"] == want["bus"]
        assert got["busId"] == "0000" + want["bus"]
        assert got["pci"] == [0, bus, 0, 0x233010DE]
        assert got["memory"] == [81559 << 20, 81559 << 20, 0]
        assert got["memory_v2"] == [81559 << 20, 81559 << 20]
        assert got["cc"] == [9, 0]
        assert got["numa"] == (0 if i < 4 else 1)
        assert got["mig"] == [0, 0] and got["max_mig"] == 0 and got["is_mig"] == 0
        assert (got["persistence"], got["arch"], got["brand"]) == (1, 9, 14)
        assert got["by_uuid"] and got["by_bus"] and got["by_legacy_bus"]
    assert len({g["uuid"] for g in gpus}) == 8
    assert out["pci_v2"] == [0, "0000:18:00.0", 0x16C110DE]
    assert out["bad_index"] == 2
    assert out["bad_uuid"] == out["bad_bus"] == 6
    assert out["junk_bus"] == 2
    assert out["mem_v2_bad_version"] == 25


def test_short_buffers_and_bad_arguments(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        lib = N.nvmlLib
        h = N.nvmlDeviceGetHandleByIndex(0)
        uuid = N.nvmlDeviceGetUUID(h)
        buf = ctypes.create_string_buffer(128)
        out["uuid"] = [lib.nvmlDeviceGetUUID(h, buf, 10), lib.nvmlDeviceGetUUID(h, buf, len(uuid)),
                       lib.nvmlDeviceGetUUID(h, buf, len(uuid) + 1), txt(buf.value) == uuid]
        out["name"] = lib.nvmlDeviceGetName(h, buf, 5)
        out["serial"] = lib.nvmlDeviceGetSerial(h, buf, 4)
        out["driver"] = lib.nvmlSystemGetDriverVersion(buf, 3)
        out["nvml"] = lib.nvmlSystemGetNVMLVersion(buf, 3)
        out["null_buf"] = lib.nvmlDeviceGetUUID(h, None, 128)
        out["null_count"] = lib.nvmlDeviceGetCount_v2(None)
        out["null_handle_out"] = lib.nvmlDeviceGetHandleByIndex_v2(0, None)
        out["null_minor"] = lib.nvmlDeviceGetMinorNumber(h, None)
        out["foreign_handle"] = lib.nvmlDeviceGetUUID(ctypes.c_void_p(0x1000), buf, 128)
        out["null_handle"] = lib.nvmlDeviceGetUUID(None, buf, 128)
        """
    )
    assert out["uuid"] == [7, 7, 0, True]
    assert out["name"] == out["serial"] == out["driver"] == out["nvml"] == 7
    assert out["null_buf"] == out["null_count"] == out["null_handle_out"] == out["null_minor"] == 2
    assert out["foreign_handle"] == out["null_handle"] == 2


def test_builtin_single_gpu_without_scenario(rig: Rig) -> None:
    env = rig.env(None)
    del env["FAKE_NVML_SCENARIO"]
    out = rig.run('N.nvmlInit(); out["n"] = N.nvmlDeviceGetCount()', env=env)
    assert out["n"] == 1


# ---- topology ----------------------------------------------------------------------


def test_topology_and_nvswitch_links(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
        out["levels"] = [[N.nvmlDeviceGetTopologyCommonAncestor(a, b) for b in h] for a in h]
        out["links"] = [N.nvmlDeviceGetNvLinkState(h[0], l) for l in range(18)]
        out["link18"] = code(N.nvmlDeviceGetNvLinkState, h[0], 18)
        r = N.nvmlDeviceGetNvLinkRemotePciInfo(h[0], 0)
        out["remote"] = [N.nvmlDeviceGetNvLinkRemoteDeviceType(h[0], 0), r.pciDeviceId]
        out["version"] = N.nvmlDeviceGetNvLinkVersion(h[0], 17)
        out["p2p"] = [N.nvmlDeviceGetP2PStatus(h[0], h[7], N.NVML_P2P_CAPS_INDEX_NVLINK),
                      N.nvmlDeviceGetP2PStatus(h[0], h[7], 0)]  # 0: NVML_P2P_CAPS_INDEX_READ (a tuple in pynvml)
        """
    )
    single = {(0, 1), (2, 3), (4, 5), (6, 7)}
    for a in range(8):
        for b in range(8):
            if a == b:
                want = 0  # INTERNAL
            elif {a // 4} != {b // 4}:
                want = 50  # SYSTEM
            elif (min(a, b), max(a, b)) in single:
                want = 10  # SINGLE
            else:
                want = 40  # NODE
            assert out["levels"][a][b] == want, (a, b)
    assert out["links"] == [1] * 18
    assert out["link18"] == 2
    assert out["remote"] == [2, 0x22A310DE]  # an NVSwitch
    assert out["version"] == 6  # NVLink 4.0 (Hopper)
    assert out["p2p"] == [0, 0]


def test_direct_nvlinks_and_unsupported_nvlink(rig: Rig) -> None:
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a bus=0000:01:00.0 minor=0
        gpu uuid=GPU-b bus=0000:02:00.0 minor=1
        gpu uuid=GPU-c bus=0000:03:00.0 minor=2
        gpu uuid=GPU-d bus=0000:04:00.0 minor=3 unsupported=nvlink
        link 0 1 nvlink=4 pcie=HOSTBRIDGE
        link 0 2 nvlink=2 pcie=MULTIPLE
        """
    )
    out = rig.run(
        """
        N.nvmlInit()
        h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
        out["states0"] = [N.nvmlDeviceGetNvLinkState(h[0], l) for l in range(18)]
        out["remote0"] = [txt(N.nvmlDeviceGetNvLinkRemotePciInfo(h[0], l).busId) for l in range(6)]
        out["types0"] = [N.nvmlDeviceGetNvLinkRemoteDeviceType(h[0], l) for l in range(6)]
        out["remote0_inactive"] = code(N.nvmlDeviceGetNvLinkRemotePciInfo, h[0], 6)
        out["remote2"] = [txt(N.nvmlDeviceGetNvLinkRemotePciInfo(h[2], l).busId) for l in range(2)]
        out["states1"] = sum(N.nvmlDeviceGetNvLinkState(h[1], l) for l in range(18))
        out["levels"] = [N.nvmlDeviceGetTopologyCommonAncestor(h[0], h[i]) for i in (1, 2, 3)]
        out["d_state"] = code(N.nvmlDeviceGetNvLinkState, h[3], 0)
        out["p2p_nvlink"] = N.nvmlDeviceGetP2PStatus(h[1], h[2], N.NVML_P2P_CAPS_INDEX_NVLINK)
        out["p2p_read"] = N.nvmlDeviceGetP2PStatus(h[0], h[3], 0)  # READ
        """,
        scenario,
    )
    assert out["states0"] == [1] * 6 + [0] * 12
    assert out["remote0"] == ["00000000:02:00.0"] * 4 + ["00000000:03:00.0"] * 2
    assert out["types0"] == [0] * 6
    assert out["remote0_inactive"] == 3
    assert out["remote2"] == ["00000000:01:00.0"] * 2
    assert out["states1"] == 4
    assert out["levels"] == [30, 20, 50]
    assert out["d_state"] == 3
    assert out["p2p_nvlink"] == 5  # NOT_SUPPORTED: no NVLink between 1 and 2
    assert out["p2p_read"] == 3  # IOH_TOPOLOGY_NOT_SUPPORTED across the CPU interconnect


# ---- events ------------------------------------------------------------------------


def test_event_wait_times_out_and_delivers_injected_events(rig: Rig) -> None:
    out = rig.run(
        f"""
        N.nvmlInit()
        h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
        s = N.nvmlEventSetCreate()
        out["supported"] = N.nvmlDeviceGetSupportedEventTypes(h[0])
        N.nvmlDeviceRegisterEvents(h[0], N.nvmlEventTypeXidCriticalError | N.nvmlEventTypeDoubleBitEccError, s)
        N.nvmlDeviceRegisterEvents(h[3], N.nvmlEventTypeXidCriticalError, s)
        out["register_pstate"] = code(N.nvmlDeviceRegisterEvents, h[0], N.nvmlEventTypePState, s)
        t = time.monotonic()
        out["timeout"] = code(N.nvmlEventSetWait_v2, s, 100)
        out["timeout_s"] = time.monotonic() - t

        # A blocked waiter must wake as soon as the event is injected.
        sent = {{}}
        def inject():
            time.sleep(0.2)
            sent["t"] = time.monotonic()
            sent["reply"] = CTL.xid(0, 79)
        th = threading.Thread(target=inject)
        th.start()
        e = N.nvmlEventSetWait_v2(s, 10000)
        woke = time.monotonic()
        th.join()
        out["latency_s"] = woke - sent["t"]
        out["reply"] = sent["reply"]
        out["xid"] = [N.nvmlDeviceGetIndex(e.device), e.eventType, e.eventData, e.gpuInstanceId,
                      e.computeInstanceId]

        out["queued"] = [CTL.xid("{GPUS[3]["uuid"]}", 48, 1, 2), CTL.ecc(0, "dbe"), CTL.ecc(0, "sbe"),
                         CTL.xid(1, 13), CTL.event(0, 0x8, 94)]
        got = []
        for _ in range(3):
            e = N.nvmlEventSetWait_v2(s, 1000)
            got.append([N.nvmlDeviceGetIndex(e.device), e.eventType, e.eventData, e.gpuInstanceId,
                        e.computeInstanceId])
        out["fifo"] = got
        out["drained"] = code(N.nvmlEventSetWait_v2, s, 0)

        # The legacy entry point fills the three-field struct only.
        CTL.xid(0, 31, 5, 6)
        d = N.c_nvmlEventData_t()
        d.gpuInstanceId = 77
        out["v1"] = [N.nvmlLib.nvmlEventSetWait(s, ctypes.byref(d), 1000), d.eventType, d.eventData,
                     d.gpuInstanceId]

        # A full queue drops the oldest events (one raw client socket: Control.send is slower).
        import socket, tempfile
        with tempfile.TemporaryDirectory() as d, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as c:
            c.bind(d + "/c")
            for i in range(4096 + 3):
                c.sendto(b"xid 0 %d" % i, sys.argv[1])
                assert c.recv(100) == b"ok queued=1"
        out["state"] = CTL.state()
        e = N.nvmlEventSetWait_v2(s, 0)
        out["oldest_kept"] = e.eventData
        N.nvmlEventSetFree(s)
        out["free_again"] = code(N.nvmlEventSetFree, s)
        """
    )
    assert out["supported"] == 0xE10B
    assert out["register_pstate"] == 3
    assert out["timeout"] == 10
    assert 0.09 <= out["timeout_s"] < 1.0
    assert out["reply"] == "ok queued=1"
    assert out["xid"] == [0, 0x8, 79, 0xFFFFFFFF, 0xFFFFFFFF]
    print(f"wake latency incl. control round trip: {out['latency_s'] * 1e3:.2f} ms")
    # Woken by the event, not by the wait's 10 s timeout (the figure itself is printed above).
    assert out["latency_s"] < 2.0, out["latency_s"]
    assert out["queued"] == ["ok queued=1", "ok queued=1", "ok queued=0", "ok queued=0", "ok queued=1"]
    assert out["fifo"] == [[3, 8, 48, 1, 2], [0, 2, 0, 0xFFFFFFFF, 0xFFFFFFFF], [0, 8, 94, 0xFFFFFFFF, 0xFFFFFFFF]]
    assert out["drained"] == 10
    assert out["v1"] == [0, 8, 31, 77]
    assert "dropped=3" in out["state"]
    assert out["oldest_kept"] == 3
    assert out["free_again"] == 2


def test_events_injected_from_another_process(rig: Rig) -> None:
    body = """
        N.nvmlInit()
        s = N.nvmlEventSetCreate()
        for i in range(8):
            N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByIndex(i), N.nvmlEventTypeXidCriticalError, s)
        print("ready", flush=True)
        e = N.nvmlEventSetWait_v2(s, 20000)
        out["event"] = [N.nvmlDeviceGetUUID(e.device), e.eventType, e.eventData]
        """
    proc = subprocess.Popen(
        rig.argv(body), env=rig.env(None), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        assert fakenvml_control.Control(rig.ctl).xid(GPUS[5]["uuid"], 79) == "ok queued=1"
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert json.loads(stdout.splitlines()[-1])["event"] == [GPUS[5]["uuid"], 8, 79]


CHILD = """
import json, sys
import pynvml as N
N.nvmlInit()
found = []
for i in range(N.nvmlDeviceGetCount()):
    try:
        found.append(N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByIndex(i)))
    except N.NVMLError as e:
        found.append(e.value)
s = N.nvmlEventSetCreate()
for u in found:
    if isinstance(u, str):
        N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByUUID(u), N.nvmlEventTypeXidCriticalError, s)
print(json.dumps(found), flush=True)
e = N.nvmlEventSetWait_v2(s, 20000)
print(json.dumps([N.nvmlDeviceGetUUID(e.device), e.eventData]), flush=True)
"""


def test_a_child_of_the_owner_shares_its_driver_state_and_hears_the_events_sent_to_it(rig: Rig) -> None:
    """As every process on a node shares the driver: what the owner's control socket changed, by index or
    by UUID, before the child started or after, is the child's too; its queries are not written."""
    body = f"""
        import subprocess
        N.nvmlInit()
        CTL.lose(2)
        CTL.remove(3)
        out["add"] = CTL.add("bus=0000:99:00.0 minor=42").split()[-1]
        CTL.state()
        N.nvmlShutdown()
        N.nvmlInit()   # the owner's own count: the removed GPU gone, the added one in, so index 1 is still GPU 1
        child = subprocess.Popen([sys.executable, "-c", {CHILD!r}],
                                 stdout=subprocess.PIPE, text=True)
        out["child"] = json.loads(child.stdout.readline())
        out["xid"] = CTL.xid(1, 79)
        out["event"] = json.loads(child.stdout.readline())
        out["rc"] = child.wait(20)
        out["journal"] = Path(str(CTL.path) + ".journal").read_text().splitlines()
        out["owner"] = __import__("os").getpid()
        """
    out = rig.run(body)
    named = [u for u in out["child"] if isinstance(u, str)]
    assert sorted(named) == sorted([g["uuid"] for g in GPUS if g not in (GPUS[2], GPUS[3])] + [out["add"]])
    assert [u for u in out["child"] if not isinstance(u, str)] == [15]  # GPU 2: GPU_IS_LOST
    assert out["event"] == [GPUS[1]["uuid"], 79]
    assert out["rc"] == 0
    # The owner's replies: the XID reached no set of its own, only the child's.
    assert out["xid"] == "ok queued=0"
    assert out["journal"] == [
        f"owner {out['owner']}",
        f"lose {GPUS[2]['uuid']}",
        f"remove {GPUS[3]['uuid']}",
        f"add bus=0000:99:00.0 minor=42 uuid={out['add']}",
        f"xid {GPUS[1]['uuid']} 79",
    ]


def test_wait_error_wakes_a_blocked_waiter_then_counts_down(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        s = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByIndex(0), N.nvmlEventTypeXidCriticalError, s)
        sent = {}
        def inject():
            time.sleep(0.2)
            sent["t"] = time.monotonic()
            CTL.wait_error(999, 2)
        th = threading.Thread(target=inject)
        th.start()
        out["blocked"] = code(N.nvmlEventSetWait_v2, s, 10000)
        out["latency_s"] = time.monotonic() - sent["t"]
        th.join()

        # The second (and last) injected failure comes at once and leaves the queue alone.
        CTL.xid(0, 79)
        t = time.monotonic()
        out["second"] = code(N.nvmlEventSetWait_v2, s, 5000)
        out["second_s"] = time.monotonic() - t
        out["event"] = N.nvmlEventSetWait_v2(s, 0).eventData
        out["drained"] = code(N.nvmlEventSetWait_v2, s, 0)

        # -1 lasts, for the legacy entry point too, until cleared.
        CTL.wait_error(15, -1)
        d = N.c_nvmlEventData_t()
        out["forever"] = [code(N.nvmlEventSetWait_v2, s, 1000) for _ in range(5)]
        out["legacy"] = N.nvmlLib.nvmlEventSetWait(s, ctypes.byref(d), 1000)
        out["state"] = CTL.state()
        CTL.wait_error(0, 0)
        out["cleared"] = code(N.nvmlEventSetWait_v2, s, 0)
        out["bad"] = [ctl_error(CTL.send, c) for c in
                      ("wait_error", "wait_error 15", "wait_error 0 1", "wait_error 15 -2", "wait_error x 1",
                       "wait_error 1000 1")]
        """
    )
    assert out["blocked"] == 999
    # Woken by the injected failure, not by the waits' 10 s and 5 s timeouts.
    assert out["latency_s"] < 2.0, out["latency_s"]
    assert out["second"] == 999 and out["second_s"] < 1.0
    assert out["event"] == 79
    assert out["drained"] == 10
    assert out["forever"] == [15] * 5 and out["legacy"] == 15
    assert "wait_error=15 wait_left=-1" in out["state"]
    assert out["cleared"] == 10
    assert all(e is not None and e.startswith("error: ") for e in out["bad"]), out["bad"]


def test_wait_error_count_is_shared_by_all_waiters(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        sets = [N.nvmlEventSetCreate() for _ in range(2)]
        got = []
        def wait(s):
            t = time.monotonic()
            got.append([code(N.nvmlEventSetWait_v2, s, 3000), time.monotonic() - t])
        threads = [threading.Thread(target=wait, args=(s,)) for s in sets]
        for th in threads:
            th.start()
        time.sleep(0.2)  # both blocked
        CTL.wait_error(999, 1)
        for th in threads:
            th.join()
        out["got"] = got
        """
    )
    (first, first_s), (second, second_s) = out["got"]
    assert (first, second) == (999, 10)  # one failure to hand out; the other waiter times out
    # The first woken long before its 3 s timeout, the second only by it.
    assert first_s < 1.5 and second_s >= 2.9


# ---- faults -------------------------------------------------------------------------


def test_lost_gpu_and_restore(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        s = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(h1, N.nvmlEventTypeGpuUnavailableError, s)
        out["lose"] = [CTL.lose(1), CTL.lose(1)]
        e = N.nvmlEventSetWait_v2(s, 1000)
        out["event"] = [addr(e.device) == addr(h1), e.eventType]
        out["calls"] = [code(f, h1) for f in (N.nvmlDeviceGetUUID, N.nvmlDeviceGetName, N.nvmlDeviceGetMemoryInfo,
                                              N.nvmlDeviceGetIndex, N.nvmlDeviceGetPciInfo)]
        out["register"] = code(N.nvmlDeviceRegisterEvents, h1, N.nvmlEventTypeXidCriticalError, s)
        out["topology"] = code(N.nvmlDeviceGetTopologyCommonAncestor, h0, h1)
        out["other"] = N.nvmlDeviceGetUUID(h0)
        out["count"] = N.nvmlDeviceGetCount()
        out["relookup"] = code(N.nvmlDeviceGetUUID, N.nvmlDeviceGetHandleByIndex(1))
        N.nvmlShutdown(); N.nvmlInit()
        out["still_lost"] = code(N.nvmlDeviceGetUUID, h1)
        out["restore"] = CTL.restore(1)
        out["restored"] = N.nvmlDeviceGetUUID(h1)
        """
    )
    assert out["lose"] == ["ok queued=1", "ok queued=0"]  # reported once
    assert out["event"] == [True, 0x4000]
    assert out["calls"] == [15] * 5
    assert out["register"] == out["topology"] == 15
    assert out["other"] == GPUS[0]["uuid"]
    assert out["count"] == 8
    assert out["relookup"] == 15
    assert out["still_lost"] == 15
    assert out["restore"] == "ok"
    assert out["restored"] == GPUS[1]["uuid"]


def test_remove_and_add_take_effect_at_next_real_init(rig: Rig) -> None:
    out = rig.run(
        f"""
        N.nvmlInit()
        h7 = N.nvmlDeviceGetHandleByIndex(7)
        out["remove"] = CTL.remove(7)
        out["removed_calls"] = code(N.nvmlDeviceGetUUID, h7)
        out["count_now"] = N.nvmlDeviceGetCount()
        N.nvmlInit(); N.nvmlShutdown()           # nested: not a real (0 -> 1) init
        out["count_nested"] = N.nvmlDeviceGetCount()
        N.nvmlShutdown(); N.nvmlInit()
        out["count_after"] = N.nvmlDeviceGetCount()
        out["lookup"] = code(N.nvmlDeviceGetHandleByUUID, "{GPUS[7]["uuid"]}")
        out["stale"] = code(N.nvmlDeviceGetUUID, h7)

        out["add"] = CTL.add('uuid=GPU-11111111-2222-3333-4444-555555555555 name="NVIDIA H100 80GB HBM3 Spare" '
                             'minor=9 bus=0000:E1:00.0 numa=1')
        out["dup"] = ctl_error(CTL.add, "uuid={GPUS[0]["uuid"]} minor=10 bus=0000:E2:00.0")
        out["count_pending"] = N.nvmlDeviceGetCount()
        N.nvmlShutdown(); N.nvmlInit()
        out["count_added"] = N.nvmlDeviceGetCount()
        h = N.nvmlDeviceGetHandleByIndex(7)
        out["new"] = [N.nvmlDeviceGetUUID(h), N.nvmlDeviceGetName(h), N.nvmlDeviceGetMinorNumber(h),
                      txt(N.nvmlDeviceGetPciInfo(h).busId), N.nvmlDeviceGetNumaNodeId(h)]
        out["state"] = CTL.state()
        """
    )
    assert out["remove"] == "ok queued=0"
    assert out["removed_calls"] == 15
    assert out["count_now"] == out["count_nested"] == 8
    assert out["count_after"] == 7
    assert out["lookup"] == 6
    assert out["stale"] == 15
    assert out["add"] == "ok pending GPU-11111111-2222-3333-4444-555555555555"
    assert out["dup"].startswith("error: add: duplicate uuid")
    assert out["count_pending"] == 7
    assert out["count_added"] == 8
    assert out["new"] == [
        "GPU-11111111-2222-3333-4444-555555555555",
        "NVIDIA H100 80GB HBM3 Spare",
        9,
        "00000000:E1:00.0",
        1,
    ]
    # The removed GPU was gone for good, so the new one took its slot.
    assert "count=8" in out["state"] and "removed" not in out["state"]


def test_health_probes(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(2)
        s = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeGpuRecoveryAction, s)
        fid = N.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
        def probe():
            v = N.nvmlDeviceGetFieldValues(h, [fid, 1])
            return [N.nvmlDeviceGetRetiredPagesPendingStatus(h), list(N.nvmlDeviceGetRemappedRows(h)),
                    v[0].nvmlReturn, v[0].valueType, v[0].value.uiVal, v[1].nvmlReturn]
        out["healthy"] = probe()
        CTL.pending_pages(2, True)
        CTL.send("remap 2 1 0 3 1")
        out["action"] = CTL.recovery_action(2, 2)
        e = N.nvmlEventSetWait_v2(s, 1000)
        out["event"] = [e.eventType, e.eventData]
        out["sick"] = probe()
        CTL.restore(2)
        out["restored"] = probe()
        """
    )
    assert out["healthy"] == [0, [0, 0, 0, 0], 0, 1, 0, 3]
    assert out["action"] == "ok queued=1"
    assert out["event"] == [0x8000, 2]
    assert out["sick"] == [1, [3, 1, 1, 0], 0, 1, 2, 3]
    assert out["restored"] == [0, [3, 1, 0, 0], 0, 1, 0, 3]


def test_faults_from_scenario_and_add_are_there_at_first_probe(rig: Rig) -> None:
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a bus=0000:01:00.0 minor=0 lost=0 pending_pages=0 remap_pending=0 remap_failure=0
        gpu uuid=GPU-b bus=0000:02:00.0 minor=1 lost=1
        gpu uuid=GPU-c bus=0000:03:00.0 minor=2 pending_pages=1
        gpu uuid=GPU-d bus=0000:04:00.0 minor=3 remap_pending=1
        gpu uuid=GPU-e bus=0000:05:00.0 minor=4 remap_failure=1 recovery_action=3
        """
    )
    out = rig.run(
        """
        N.nvmlInit()
        s = N.nvmlEventSetCreate()
        def probe(i):
            # What a daemon checks when it starts: each call's nvmlReturn_t, then its value.
            h = N.nvmlDeviceGetHandleByIndex(i)
            calls = [(N.nvmlDeviceGetUUID, h), (N.nvmlDeviceGetRetiredPagesPendingStatus, h),
                     (N.nvmlDeviceGetRemappedRows, h),
                     (N.nvmlDeviceGetFieldValues, h, [N.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION]),
                     (N.nvmlDeviceRegisterEvents, h, N.nvmlEventTypeXidCriticalError, s)]
            rcs = [code(*c) for c in calls]
            if any(rcs):
                return rcs
            return [N.nvmlDeviceGetRetiredPagesPendingStatus(h), list(N.nvmlDeviceGetRemappedRows(h))[2:],
                    N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0].value.uiVal]
        out["count"] = N.nvmlDeviceGetCount()
        out["probes"] = [probe(i) for i in range(5)]
        out["state"] = CTL.state()
        out["add"] = CTL.add("uuid=GPU-f bus=0000:06:00.0 minor=5 lost=1")
        out["add2"] = CTL.add("uuid=GPU-g bus=0000:07:00.0 minor=6 pending_pages=1 recovery_action=2")
        out["bad_add"] = ctl_error(CTL.add, "uuid=GPU-h bus=0000:08:00.0 minor=7 remap_failure=2")
        N.nvmlShutdown(); N.nvmlInit()
        s = N.nvmlEventSetCreate()  # a full shutdown released the old set
        out["added"] = [probe(5), probe(6)]
        CTL.restore(1); CTL.restore(4)
        out["restored"] = [probe(1), probe(4)]
        """,
        scenario,
    )
    assert out["count"] == 5
    assert out["probes"] == [
        [0, [0, 0], 0],
        [15] * 5,  # GPU_IS_LOST from the very first call
        [1, [0, 0], 0],
        [0, [1, 0], 0],
        [0, [0, 1], 3],
    ]
    assert out["state"].split(" | ")[1:] == [
        "0 GPU-a ok ra=0 cm=0",
        "1 GPU-b lost ra=0 cm=0",
        "2 GPU-c pages ra=0 cm=0",
        "3 GPU-d remap ra=0 cm=0",
        "4 GPU-e remap ra=3 cm=0",
    ]
    assert out["add"] == "ok pending GPU-f" and out["add2"] == "ok pending GPU-g"
    assert out["bad_add"] == "error: add: bad value for remap_failure: '2'"
    assert out["added"] == [[15] * 5, [1, [0, 0], 2]]
    assert out["restored"] == [[0, [0, 0], 0], [0, [0, 0], 0]]


def test_full_shutdown_releases_event_sets(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        old = N.nvmlEventSetCreate()
        N.nvmlInit(); N.nvmlShutdown()  # not the last reference: the set lives on
        out["alive"] = code(N.nvmlEventSetWait_v2, old, 0)
        N.nvmlShutdown(); N.nvmlInit()
        out["stale"] = code(N.nvmlEventSetWait_v2, old, 0)
        out["sets"] = next(w for w in CTL.state().split() if w.startswith("sets="))
        """
    )
    assert out["alive"] == 10  # TIMEOUT: a valid set with nothing queued
    assert out["stale"] == 2  # INVALID_ARGUMENT: released by the full shutdown
    assert out["sets"] == "sets=0"


def test_the_last_shutdown_and_a_free_wait_out_an_event_wait_as_the_driver_does(rig: Rig) -> None:
    # On the real driver the last nvmlShutdown, and nvmlEventSetFree, return only when another thread's
    # nvmlEventSetWait has: the shutdown does not cut the wait short. Here an event ends each wait.
    out = rig.run(
        with_hang(
            """
            N.nvmlInit()
            s = N.nvmlEventSetCreate()
            N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByIndex(0), N.nvmlEventTypeXidCriticalError, s)
            def waiting(n):
                deadline = time.monotonic() + 30
                while header("event_waits") != str(n):
                    assert time.monotonic() < deadline, f"{n} event waits"
                    time.sleep(0.01)

            waited = hang(N.nvmlEventSetWait_v2, s, 60000)
            waiting(1)
            N.nvmlInit(); N.nvmlShutdown()  # not the last reference: at once
            freed = hang(N.nvmlEventSetFree, s)
            time.sleep(0.3)
            out["free_waits"] = [freed["thread"].is_alive(), header("sets")]
            CTL.xid(0, 79)
            out["free"] = [finish(waited, 30).get("rc"), finish(freed, 30).get("rc"), header("sets"),
                           header("shutdown_waits")]

            s = N.nvmlEventSetCreate()
            N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByIndex(0), N.nvmlEventTypeXidCriticalError, s)
            waited = hang(N.nvmlEventSetWait_v2, s, 60000)
            waiting(1)
            closed = hang(N.nvmlShutdown)
            time.sleep(0.3)
            late = hang(N.nvmlEventSetWait_v2, s, 60000)  # waits behind the shutdown
            time.sleep(0.3)
            out["shutdown_waits"] = [closed["thread"].is_alive(), late["thread"].is_alive(), header("refcount")]
            CTL.xid(0, 43)
            out["shutdown"] = [finish(waited, 30).get("rc"), finish(closed, 30).get("rc"),
                               finish(late, 30).get("rc"), header("refcount"), header("sets"),
                               header("event_waits"), header("shutdown_waits")]
            """
        )
    )
    assert out["free_waits"] == [True, "1"]
    assert out["free"] == [0, 0, "0", "1"]  # the wait got its event; then the set went
    assert out["shutdown_waits"] == [True, True, "1"]
    # The wait got its event, the shutdown then released every set, and the wait behind it found none.
    assert out["shutdown"] == [0, 0, 1, "0", "0", "0", "2"]


def test_latency_is_spent_beside_other_calls_as_a_driver_s_is(rig: Rig) -> None:
    out = rig.run(
        with_hang(
            """
            N.nvmlInit()
            h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
            out["set"] = [CTL.latency("*", 3000000), CTL.latency(3, 1), header("any_latency"),
                          gpu_field("latency", 3), gpu_field("latency", 0)]
            t = time.monotonic()
            three = [hang(N.nvmlDeviceGetTemperature, h[i], 0) for i in range(3)]
            deadline = time.monotonic() + 30
            while header("latency_waiting") != "3":  # all three in their latency at once: side by side
                assert time.monotonic() < deadline, header("latency_waiting")
                time.sleep(0.01)
            # GPU 3's own figure over "*", and no lock held by the three: it answers while they sleep.
            out["own"] = [N.nvmlDeviceGetTemperature(h[3], 0) > 0, header("latency_waiting")]
            out["three"] = [finish(r, 30).get("rc") for r in three]
            out["slept"] = time.monotonic() - t
            CTL.latency("*", 0)
            CTL.latency(3, 0)
            out["off"] = [header("any_latency"), gpu_field("latency", 3)]
            out["bad"] = [ctl_error(CTL.latency, 9, 5), ctl_error(CTL.send, "latency * -1")]
            """
        )
    )
    assert out["set"] == ["ok", "ok", "3000000", "1", None]  # GPU 0 has the "*" figure, none of its own
    assert out["own"] == [True, "3"]
    assert out["three"] == [0, 0, 0]
    assert out["slept"] >= 3.0  # each call took its latency
    assert out["off"] == ["0", None]
    assert out["bad"] == ["error: latency: unknown gpu '9'", "error: latency: want microseconds, 0-10000000"]


def test_unsupported_queries(rig: Rig) -> None:
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a bus=0000:01:00.0 minor=0 unsupported=numa,cc,memory,minor,serial,name,events,topology,\
nvlink,retired_pages,remapped_rows,mig,persistence,recovery_action
        gpu uuid=GPU-b bus=0000:02:00.0 minor=1 events=0x8
        """
    )
    out = rig.run(
        """
        N.nvmlInit()
        a, b = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        s = N.nvmlEventSetCreate()
        calls = [N.nvmlDeviceGetNumaNodeId, N.nvmlDeviceGetCudaComputeCapability, N.nvmlDeviceGetMemoryInfo,
                 N.nvmlDeviceGetMinorNumber, N.nvmlDeviceGetSerial, N.nvmlDeviceGetName,
                 N.nvmlDeviceGetSupportedEventTypes, N.nvmlDeviceGetRetiredPagesPendingStatus,
                 N.nvmlDeviceGetRemappedRows, N.nvmlDeviceGetMigMode, N.nvmlDeviceGetPersistenceMode]
        out["a"] = [code(f, a) for f in calls]
        out["b"] = [code(f, b) for f in calls]
        out["a_other"] = [code(N.nvmlDeviceRegisterEvents, a, 8, s),
                          code(N.nvmlDeviceGetTopologyCommonAncestor, a, b),
                          code(N.nvmlDeviceGetNvLinkState, a, 0),
                          N.nvmlDeviceGetFieldValues(a, [N.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0].nvmlReturn,
                          code(N.nvmlDeviceGetUUID, a)]
        out["b_events"] = [N.nvmlDeviceGetSupportedEventTypes(b), code(N.nvmlDeviceRegisterEvents, b, 8, s),
                           code(N.nvmlDeviceRegisterEvents, b, 8 | 2, s)]
        """,
        scenario,
    )
    assert out["a"] == [3] * 11
    assert out["b"] == [0] * 11
    assert out["a_other"] == [3, 3, 3, 3, 0]
    assert out["b_events"] == [0x8, 0, 3]


def test_ecc_counts_grow_whether_or_not_an_event_set_hears(rig: Rig) -> None:
    """nvmlDeviceGetTotalEccErrors(handle, errorType, counterType): volatile counts start again at a reset,
    aggregate ones never; the control line counts and queues one event to the sets that exist."""
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a bus=0000:01:00.0 minor=0
        gpu uuid=GPU-b bus=0000:02:00.0 minor=1 unsupported=ecc
        """
    )
    out = rig.run(
        """
        N.nvmlInit()
        a, b = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        def counts(h):
            return [N.nvmlDeviceGetTotalEccErrors(h, kind, counter) for kind in (0, 1) for counter in (0, 1)]
        out["start"] = counts(a)
        out["no_set"] = [CTL.ecc(0, "dbe", 3), CTL.ecc(0, "sbe")]
        s = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(a, 2, s)
        out["with_set"] = CTL.ecc(0, "dbe")
        out["event"] = N.nvmlEventSetWait_v2(s, 1000).eventType
        out["counted"] = counts(a)
        out["restore"] = CTL.restore(0)
        out["after_reset"] = counts(a)
        out["b"] = [code(N.nvmlDeviceGetTotalEccErrors, b, 1, 0), ctl_error(CTL.ecc, 1, "dbe")]
        out["bad"] = [code(N.nvmlDeviceGetTotalEccErrors, a, 2, 0), code(N.nvmlDeviceGetTotalEccErrors, a, 0, 2),
                      ctl_error(CTL.ecc, 0, "dbe", 0)]
        """,
        scenario,
    )
    assert out["start"] == [0, 0, 0, 0]
    assert out["no_set"] == ["ok queued=0", "ok queued=0"]
    assert out["with_set"] == "ok queued=1" and out["event"] == 2
    # [corrected volatile, corrected aggregate, uncorrected volatile, uncorrected aggregate]
    assert out["counted"] == [1, 1, 4, 4]
    assert out["restore"] == "ok"
    assert out["after_reset"] == [0, 1, 0, 4]
    assert out["b"][0] == 3 and "unsupported=ecc" in out["b"][1]
    assert out["bad"][:2] == [2, 2] and "count must be" in out["bad"][2]


def test_device_figures_as_nvml_gives_them(rig: Rig) -> None:
    """Utilization, temperature, power and energy, clocks, clock event reasons, PCIe replays and the
    framebuffer used (what the driver keeps plus the processes' memory), each on a GPU handle; a MIG
    device handle has none of them, and a GPU in MIG mode no utilization. The video engines' utilization
    comes with its sampling period, and the memory's temperature is field 82 (an unsigned int), which a GPU
    without it refuses in the field's own return code."""
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a bus=0000:01:00.0 minor=0 procs=11:1024,12:512:mps
        gpu uuid=GPU-b bus=0000:02:00.0 minor=1 unsupported=telemetry
        gpu uuid=GPU-c bus=0000:03:00.0 minor=2 mig=1
        mig 2 3g.40gb
        mig 2 3g.40gb
        gpu uuid=GPU-d bus=0000:04:00.0 minor=3 unsupported=memory_temp
        """
    )
    out = rig.run(
        """
        N.nvmlInit()
        a, b, c, d = (N.nvmlDeviceGetHandleByIndex(i) for i in range(4))
        def extra(h):
            f = N.nvmlDeviceGetFieldValues(h, [82])[0]
            return [N.nvmlDeviceGetEncoderUtilization(h), N.nvmlDeviceGetDecoderUtilization(h),
                    [f.nvmlReturn, f.valueType, f.value.uiVal]]
        def figures(h):
            u = N.nvmlDeviceGetUtilizationRates(h)
            return [u.gpu, u.memory, N.nvmlDeviceGetTemperature(h, 0), N.nvmlDeviceGetPowerUsage(h),
                    N.nvmlDeviceGetClockInfo(h, 1), N.nvmlDeviceGetClockInfo(h, 2),
                    N.nvmlDeviceGetCurrentClocksEventReasons(h), N.nvmlDeviceGetCurrentClocksThrottleReasons(h),
                    N.nvmlDeviceGetPcieReplayCounter(h)]
        out["idle"] = figures(a)
        out["set"] = CTL.telemetry(0, util=87, mem_util=40, temp=71, power_mw=612000, sm_clock=1755, mem_clock=2619,
                                   throttle=0x4, pcie_replays=3, reserved_mib=600, energy_mj=1000)
        out["busy"] = figures(a)
        out["extra_idle"] = extra(d)
        CTL.telemetry(0, mem_temp=66, enc_util=12, dec_util=48)
        out["extra"] = extra(a)
        out["memory_temp_refused"] = N.nvmlDeviceGetFieldValues(d, [82])[0].nvmlReturn
        CTL.telemetry(3, mem_temp=50)
        out["still_refused"] = N.nvmlDeviceGetFieldValues(d, [82])[0].nvmlReturn
        out["video_unsupported"] = code(N.nvmlDeviceGetEncoderUtilization, b)
        e1 = N.nvmlDeviceGetTotalEnergyConsumption(a)
        time.sleep(0.2)
        e2 = N.nvmlDeviceGetTotalEnergyConsumption(a)
        out["energy"] = [e1, e2]
        m = N.nvmlDeviceGetMemoryInfo(a)
        out["memory"] = [m.total >> 20, m.used >> 20, m.free >> 20]
        out["unsupported"] = [code(N.nvmlDeviceGetTemperature, b, 0), code(N.nvmlDeviceGetPowerUsage, b)]
        mig = N.nvmlDeviceGetMigDeviceHandleByIndex(c, 0)
        out["mig"] = [code(N.nvmlDeviceGetTemperature, mig, 0), code(N.nvmlDeviceGetUtilizationRates, mig),
                      code(N.nvmlDeviceGetUtilizationRates, c), N.nvmlDeviceGetTemperature(c, 0)]
        out["bad"] = [code(N.nvmlDeviceGetTemperature, a, 1), code(N.nvmlDeviceGetClockInfo, a, 4),
                      ctl_error(CTL.send, "telemetry 0 util=101"), ctl_error(CTL.send, "telemetry 0 volts=3"),
                      ctl_error(CTL.send, "telemetry 0")]
        """,
        scenario,
    )
    assert out["idle"] == [0, 0, 34, 69000, 1980, 2619, 1, 1, 0]
    assert out["set"] == "ok"
    assert out["busy"] == [87, 40, 71, 612000, 1755, 2619, 4, 4, 3]
    assert out["extra_idle"][:2] == [[0, 167000], [0, 167000]]
    assert out["extra"] == [[12, 167000], [48, 167000], [0, 1, 66]]
    # GPU-d refuses field 82 in its entry (3, NOT_SUPPORTED) while the call itself succeeds, even once set.
    assert out["memory_temp_refused"] == out["still_refused"] == 3
    assert out["video_unsupported"] == 3
    e1, e2 = out["energy"]
    # 612 W for at least 0.2 s is at least 122 J more; a busy machine may take longer, never less.
    assert e1 >= 1000 and e2 - e1 >= 122_000, out["energy"]
    assert out["memory"] == [81559, 600 + 1024 + 512, 81559 - 2136]
    assert out["unsupported"] == [3, 3]
    assert out["mig"] == [3, 3, 3, 34]
    assert out["bad"][:2] == [2, 2]
    assert "bad value in 'util=101'" in out["bad"][2]
    assert "unknown item 'volts=3'" in out["bad"][3] and "usage: telemetry" in out["bad"][4]


def test_nvlink_throughput_counts_as_nvml_gives_them(rig: Rig) -> None:
    """Fields 138 to 141: the KiB sent and received over NVLink since the GPU's last reset (the raw ones with
    the protocol's overhead), unsigned long long, growing at the rate set; scopeId UINT_MAX sums the links,
    a link's own count is its share and an inactive link's 0, a link past the most a GPU has is refused in
    the field's own return code. A GPU without NVLink refuses them all; a reset starts them afresh."""
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a bus=0000:01:00.0 minor=0
        gpu uuid=GPU-b bus=0000:02:00.0 minor=1
        gpu uuid=GPU-c bus=0000:03:00.0 minor=2 unsupported=nvlink
        link 0 1 nvlink=4 pcie=NODE
        """
    )
    out = rig.run(
        """
        N.nvmlInit()
        a, b, c = (N.nvmlDeviceGetHandleByIndex(i) for i in range(3))
        ALL = 0xFFFFFFFF
        def counts(h, fields):
            return [[f.nvmlReturn, f.valueType, f.value.ullVal] for f in N.nvmlDeviceGetFieldValues(h, fields)]
        out["idle"] = counts(a, [(138, ALL), (139, ALL)])
        out["set"] = CTL.telemetry(0, nvlink_tx=100, nvlink_rx=50)
        t1 = N.nvmlDeviceGetFieldValues(a, [(138, ALL)])[0]
        time.sleep(0.5)
        both = N.nvmlDeviceGetFieldValues(a, [(138, ALL), (139, ALL), (140, ALL), (141, ALL)])
        out["grown"] = [f.value.ullVal for f in both]
        out["seconds"] = (both[0].timestamp - t1.timestamp) / 1e6
        out["first"] = t1.value.ullVal
        CTL.telemetry(0, nvlink_tx=0, nvlink_rx=0)  # idle links: the counts hold still to be compared
        links = N.nvmlDeviceGetFieldValues(a, [(138, k) for k in range(6)] + [(138, ALL), (138, 18)])
        out["links"] = [f.value.ullVal for f in links[:7]]
        out["past"] = links[7].nvmlReturn
        out["none"] = counts(c, [(138, ALL), (141, 0)])
        out["none_set"] = ctl_error(CTL.send, "telemetry 2 nvlink_tx=1")
        CTL.restore(0)
        out["reset"] = counts(a, [(138, ALL), (139, ALL)])
        """,
        scenario,
    )
    assert out["idle"] == [[0, 3, 0], [0, 3, 0]]
    assert out["set"] == "ok"
    tx, rx, raw_tx, raw_rx = out["grown"]
    # 100 MiB/s is 102,400 KiB a second, over at least the half second slept (a busy machine: longer).
    assert tx - out["first"] >= 0.9 * 102_400 * out["seconds"] and out["seconds"] >= 0.5
    assert tx == pytest.approx(2 * rx, rel=0.01)
    assert raw_tx == pytest.approx(tx * 17 / 16, rel=0.01) and raw_rx == pytest.approx(rx * 17 / 16, rel=0.01)
    # The four active links share the sum; the others carry none.
    *per_link, whole = out["links"]
    assert sum(per_link[:4]) == whole and per_link[4:] == [0, 0]
    assert max(per_link[:4]) - min(per_link[:4]) <= 1
    assert out["past"] == 2
    assert out["none"] == [[3, 0, 0], [3, 0, 0]]
    assert "no NVLink" in out["none_set"]
    assert out["reset"] == [[0, 3, 0], [0, 3, 0]]


def test_violation_times_grow_while_their_reasons_hold_the_clocks(rig: Rig) -> None:
    """The ns each performance policy held the clocks down: fields 74 to 80 (unsigned long long, what DCGM
    reads) and nvmlDeviceGetViolationStatus (policies 0-5 and 10, with the reading's time in us). Each grows
    while the clocks event reasons behind it are set: the power cap's for power, idle's for low
    utilization, any of them for the total; the total below base clocks is not given."""
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a bus=0000:01:00.0 minor=0
        gpu uuid=GPU-b bus=0000:02:00.0 minor=1 unsupported=telemetry
        """
    )
    out = rig.run(
        """
        N.nvmlInit()
        a, b = (N.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        def times(h):
            fields = N.nvmlDeviceGetFieldValues(h, list(range(74, 82)))
            return [[f.nvmlReturn, f.valueType, f.value.ullVal] for f in fields]
        CTL.telemetry(0, throttle=0x4)  # the power cap, no longer idle
        before = times(a)
        time.sleep(0.3)
        after = times(a)
        out["grown"] = [x[2] - y[2] for x, y in zip(after[:7], before[:7])]
        out["types"] = sorted({(f[0], f[1]) for f in after[:7]})
        out["base"] = after[7][0]
        v = N.nvmlDeviceGetViolationStatus(a, 0)
        out["call"] = [v.violationTime >= after[0][2], abs(v.referenceTime / 1e6 - time.time()) < 5]
        out["total"] = N.nvmlDeviceGetViolationStatus(a, 10).violationTime >= after[6][2]
        out["refused"] = [code(N.nvmlDeviceGetViolationStatus, a, 11), code(N.nvmlDeviceGetViolationStatus, a, 7),
                          code(N.nvmlDeviceGetViolationStatus, b, 0), times(b)[0][0]]
        """,
        scenario,
    )
    power, thermal, sync, board, idle, reliability, total = out["grown"]
    assert power >= 0.3e9 and total >= power, out["grown"]
    assert thermal == sync == board == idle == reliability == 0
    assert out["types"] == [[0, 3]]  # each given, an unsigned long long
    assert out["base"] == 3
    assert out["call"] == [True, True] and out["total"]
    assert out["refused"] == [3, 2, 3, 3]


def test_fields_that_have_a_call_of_their_own_answer_as_it_does(rig: Rig) -> None:
    """Fields 3-6 (ECC totals), 29-31 (retired pages), 83 (total energy), 94 (PCIe replays) and 142-145
    (remapped rows) give what their calls give, and a GPU that refuses a call refuses its field in the
    field's own return code, the call itself succeeding."""
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a bus=0000:01:00.0 minor=0 cc=7.0
        gpu uuid=GPU-b bus=0000:02:00.0 minor=1 unsupported=ecc,remapped_rows,telemetry
        """
    )
    out = rig.run(
        """
        N.nvmlInit()
        a, b = (N.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        IDS = [3, 4, 5, 6, 29, 30, 31, 83, 94, 142, 143, 144, 145]
        def fields(h):
            return [(f.nvmlReturn, f.valueType, f.value.ullVal if f.valueType == 3 else f.value.uiVal)
                    for f in N.nvmlDeviceGetFieldValues(h, IDS)]
        def calls(h):
            ecc = [N.nvmlDeviceGetTotalEccErrors(h, kind, counter) for counter in (0, 1) for kind in (0, 1)]
            retired = [len(N.nvmlDeviceGetRetiredPages(h, cause)) for cause in (0, 1)]
            return [*ecc, *retired, N.nvmlDeviceGetRetiredPagesPendingStatus(h),
                    N.nvmlDeviceGetTotalEnergyConsumption(h), N.nvmlDeviceGetPcieReplayCounter(h),
                    *N.nvmlDeviceGetRemappedRows(h)]
        CTL.ecc(0, "sbe", 5), CTL.ecc(0, "dbe", 2), CTL.retire(0, "sbe", 3), CTL.retire(0, "dbe")
        CTL.pending_pages(0, True), CTL.remap(0, True, False)
        CTL.telemetry(0, pcie_replays=7, energy_mj=5000)  # power stays at idle's 69 W: energy grows
        out["fields"], out["calls"] = fields(a), calls(a)
        out["refused"] = fields(b)
        out["b_calls"] = [code(N.nvmlDeviceGetTotalEccErrors, b, 0, 0), code(N.nvmlDeviceGetRemappedRows, b),
                          code(N.nvmlDeviceGetTotalEnergyConsumption, b), code(N.nvmlDeviceGetRetiredPages, b, 0),
                          N.nvmlDeviceGetRetiredPagesPendingStatus(b)]
        """,
        scenario,
    )
    got, called = out["fields"], out["calls"]
    assert [f[0] for f in got] == [0] * 13
    # ECC totals, retired counts and energy are unsigned long long, the flags and small counts unsigned int.
    assert [f[1] for f in got] == [3, 3, 3, 3, 3, 3, 1, 3, 1, 1, 1, 1, 1]
    values = [f[2] for f in got]
    assert values[:7] == called[:7] == [5, 2, 5, 2, 3, 1, 1]
    # Energy grows between the field and the call; the call comes after.
    assert 5000 <= values[7] <= called[7], (values[7], called[7])
    assert values[8:] == called[8:] == [7, 0, 0, 1, 0]
    # GPU-b: no ECC, no remapped rows, no figures; it retires no pages (cc 8.0 and later remap rows), but
    # says none is pending, as its call does.
    assert [f[0] for f in out["refused"]] == [3] * 6 + [0] + [3] * 6
    assert out["refused"][6] == [0, 1, 0]
    assert out["b_calls"] == [3, 3, 3, 3, 0]


def test_process_utilization_samples_newer_than_the_last_seen(rig: Rig) -> None:
    """nvmlDeviceGetProcessUtilization: one entry per process with samples after lastSeenTimeStamp, their
    mean stamped with the newest, as the driver gives them; NOT_FOUND when none is newer; INSUFFICIENT_SIZE
    with the count for a NULL buffer; NOT_SUPPORTED with MIG on."""
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a bus=0000:01:00.0 minor=0
        gpu uuid=GPU-c bus=0000:03:00.0 minor=2 mig=1
        """
    )
    out = rig.run(
        """
        N.nvmlInit()
        a, c = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        out["none"] = code(N.nvmlDeviceGetProcessUtilization, a, 0)
        first = CTL.samples(0, [(101, 60, 20), (102, 30, 10)])
        got = N.nvmlDeviceGetProcessUtilization(a, 0)
        out["all"] = [[s.pid, s.smUtil, s.memUtil] for s in got]
        out["stamps_rise"] = got[0].timeStamp < got[1].timeStamp == first
        out["seen"] = code(N.nvmlDeviceGetProcessUtilization, a, first)
        CTL.samples(0, [(101, 70, 25)])
        out["window"] = [[s.pid, s.smUtil] for s in N.nvmlDeviceGetProcessUtilization(a, first)]
        count = ctypes.c_uint(0)
        rc = N.nvmlLib.nvmlDeviceGetProcessUtilization(a, None, ctypes.byref(count), ctypes.c_ulonglong(0))
        out["size"] = [rc, count.value]
        every = N.nvmlDeviceGetProcessUtilization(a, 0)
        out["mean"] = [[u.pid, u.smUtil, u.memUtil, u.timeStamp > first] for u in every]
        out["mig"] = code(N.nvmlDeviceGetProcessUtilization, c, 0)
        out["cleared"] = [CTL.samples(0, []), code(N.nvmlDeviceGetProcessUtilization, a, 0)]
        out["bad"] = [ctl_error(CTL.send, "samples 0 1:101:0"), ctl_error(CTL.send, "samples 0 0:1:1"),
                      ctl_error(CTL.send, "samples 0 1:1")]
        """,
        scenario,
    )
    assert out["none"] == 6  # NVML_ERROR_NOT_FOUND
    assert out["all"] == [[101, 60, 20], [102, 30, 10]] and out["stamps_rise"]
    assert out["seen"] == 6
    assert out["window"] == [[101, 70]]
    assert out["size"] == [7, 2]  # NVML_ERROR_INSUFFICIENT_SIZE, and the count needed: two processes
    assert out["mean"] == [[101, 65, 22, True], [102, 30, 10, False]]  # 101's two samples: (60+70)/2, (20+25)/2
    assert out["mig"] == 3
    assert out["cleared"] == [0, 6]
    assert all(e is not None and "want pid:sm:mem" in e for e in out["bad"]), out["bad"]


def test_init_error_from_scenario_and_control(rig: Rig) -> None:
    scenario = rig.scenario(
        """
        init_error 9
        gpu uuid=GPU-a
        """
    )
    out = rig.run(
        """
        out["init"] = code(N.nvmlInit)
        out["type"] = type(ctypes.CDLL("libnvidia-ml.so.1")) and code(N.nvmlDeviceGetCount)
        out["clear"] = CTL.init_error(0)
        N.nvmlInit()
        out["count"] = N.nvmlDeviceGetCount()
        CTL.init_error(18)
        out["nested_init"] = code(N.nvmlInit)
        N.nvmlShutdown()
        out["reinit"] = code(N.nvmlInit)
        """,
        scenario,
    )
    assert out["init"] == 9
    assert out["type"] == 1
    assert out["clear"] == "ok"
    assert out["count"] == 1
    assert out["nested_init"] == out["reinit"] == 18


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("gpu uuid=GPU-a bogus=1", "unknown gpu key 'bogus'"),
        ("frobnicate 1", "unknown keyword 'frobnicate'"),
        ("link 0 5 nvlink=2", "link needs two indices"),
        ('gpu name="unterminated', "unterminated quote"),
        ("gpu unsupported=numa,warp", "unknown unsupported= item 'warp'"),
        ("gpu cc=nine", "bad value for cc"),
        ("gpu lost=yes", "bad value for lost"),
        ("gpu pending_pages=2", "bad value for pending_pages"),
        ("gpu remap_pending=-1", "bad value for remap_pending"),
        ("gpu recovery_action=65536", "bad value for recovery_action"),
    ],
)
def test_bad_scenario_fails_init_with_unknown(rig: Rig, line: str, message: str) -> None:
    scenario = rig.scenario(f"# header\ngpu uuid=GPU-ok minor=7 bus=0000:07:00.0\n{line}\n")
    out = rig.run('out["init"] = code(N.nvmlInit); out["again"] = code(N.nvmlInit)', scenario)
    assert out["init"] == out["again"] == 999
    assert f"{scenario}:3: {message}" in out["_stderr"]
    assert line in out["_stderr"]


def test_bad_control_commands_get_errors(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        bad = ["", "bogus", "xid", "xid 8 79", "xid GPU-nope 79", "xid 0", "xid 0 abc", "ecc 0 tbe",
               "event 0 0 1", "remap 0 2 0", "pending_pages 0", "recovery_action 0 x", "add minor=0",
               "add colour=red", 'add name="x', "link 0 0 nvlink=1", "init_error -1", "lose 0 extra",
               "calls now", "calls reset all"]
        out["errors"] = {c: ctl_error(CTL.send, c) for c in bad}
        out["ping"] = CTL.ping()
        out["alive"] = N.nvmlDeviceGetCount()
        """
    )
    assert all(e is not None and e.startswith("error: ") for e in out["errors"].values()), out["errors"]
    assert out["errors"]["bogus"] == "error: unknown command 'bogus'"
    assert out["errors"]["xid 8 79"] == "error: xid: unknown gpu '8'"
    assert out["errors"]["add minor=0"] == "error: add: duplicate minor 0"
    assert out["ping"] == "ok"
    assert out["alive"] == 8


# ---- call counting --------------------------------------------------------------------


def test_calls_are_counted_per_entry_point_and_reset(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        N.nvmlDeviceGetUUID(h)
        N.nvmlDeviceGetUUID(h)
        N.nvmlDeviceGetPciInfo(h)
        N.nvmlLib.nvmlDeviceGetCount(ctypes.byref(ctypes.c_uint()))  # a wrapper counts as itself only
        out["failed"] = code(N.nvmlDeviceGetHandleByIndex, 99)  # failed calls count too
        N.nvmlErrorString(15)  # not counted
        out["raw"] = CTL.send("calls")
        out["first"] = CTL.calls()
        CTL.reset_calls()
        out["reset"] = [CTL.send("calls"), CTL.calls()]

        # A blocked wait is counted on entry, so a watcher sees it while it waits.
        s = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, s)
        th = threading.Thread(target=lambda: N.nvmlEventSetWait_v2(s, 10000))
        th.start()
        deadline = time.monotonic() + 5
        while "nvmlEventSetWait_v2" not in CTL.calls() and time.monotonic() < deadline:
            time.sleep(0.01)
        out["waiting"] = CTL.calls()
        CTL.xid(0, 79)
        th.join()
        """
    )
    first = {
        "nvmlDeviceGetCount": 1,
        "nvmlDeviceGetHandleByIndex_v2": 2,
        "nvmlDeviceGetPciInfo_v3": 1,
        "nvmlDeviceGetUUID": 2,
        "nvmlInitWithFlags": 1,
    }
    assert out["failed"] == 2
    assert out["first"] == first
    assert out["raw"] == "ok total=7 " + " ".join(f"{k}={v}" for k, v in sorted(first.items()))
    assert out["reset"] == ["ok total=0", {}]
    assert out["waiting"] == {
        "nvmlDeviceRegisterEvents": 1,
        "nvmlEventSetCreate": 1,
        "nvmlEventSetWait_v2": 1,
    }


def test_every_exported_function_is_counted(rig: Rig) -> None:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    symbols = subprocess.run(
        [nm, "-D", "--defined-only", str(rig.lib_dir / "libnvidia-ml.so.1")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    exported = sorted(name for name in symbols if name.startswith("nvml"))
    assert "nvmlEventSetWait_v2" in exported and "nvmlErrorString" in exported
    out = rig.run(
        f"""
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        N.nvmlInit()
        CTL.reset_calls()
        # NULL for every argument: each function bails out early (or inits / shuts down).
        null = [ctypes.c_void_p(None)] * 6
        for name in {exported!r}:
            getattr(lib, name)(*null)
        out["calls"] = CTL.calls()
        """
    )
    assert out["calls"] == {name: 1 for name in exported if name != "nvmlErrorString"}


def test_add_reuses_the_slots_of_gpus_gone_for_good(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        out["before"] = N.nvmlDeviceGetCount()
        for i in range(100):  # far more than MAX_GPUS slots
            CTL.add(f"uuid=GPU-cycle-{i} bus=0001:{i:02x}:00.0 minor={100 + i}")
            N.nvmlShutdown(); N.nvmlInit()
            CTL.remove(f"GPU-cycle-{i}")
            N.nvmlShutdown(); N.nvmlInit()
        out["count"] = N.nvmlDeviceGetCount()
        out["last"] = CTL.add("uuid=GPU-last bus=0001:ff:00.0 minor=255")
        N.nvmlShutdown(); N.nvmlInit()
        h = N.nvmlDeviceGetHandleByUUID(b"GPU-last")
        out["index"] = N.nvmlDeviceGetIndex(h)
        """
    )
    assert out["count"] == out["before"]
    assert out["last"] == "ok pending GPU-last"
    assert out["index"] == out["before"]


# ---- MIG ------------------------------------------------------------------------------

MIG_SCENARIO = """
    gpu uuid=GPU-mig0 bus=0000:01:00.0 minor=0 mig=1
    gpu uuid=GPU-full bus=0000:02:00.0 minor=1
    gpu uuid=GPU-mig2 bus=0000:03:00.0 minor=2 mig=1
    mig 0 3g.40gb gi=2 ci=0
    mig 0 2g.20gb gi=5 ci=0
    mig 0 1g.10gb+me gi=9 ci=0 uuid=MIG-custom-0009
    mig 0 1g.20gb
    mig 2 7g.80gb gi=0
    """

# (profile, attributes as in c_nvmlDeviceAttributes field order, memory MiB)
MIG_ATTRS = {
    "1g.10gb": [16, 1, 1, 0, 1, 0, 1, 1, 9856],
    "1g.10gb+me": [16, 1, 1, 0, 1, 1, 1, 1, 9856],
    "1g.20gb": [16, 1, 1, 0, 1, 0, 1, 1, 19968],
    "2g.20gb": [32, 2, 2, 0, 2, 0, 2, 2, 19968],
    "3g.40gb": [48, 3, 3, 0, 3, 0, 3, 3, 40192],
    "4g.40gb": [64, 4, 4, 0, 4, 0, 4, 4, 40192],
    "7g.80gb": [132, 7, 7, 0, 7, 1, 7, 7, 80896],
}

# Child helper: everything a client learns about a MIG device handle.
MIG_DESCRIBE = """
def describe(m):
    a = N.nvmlDeviceGetAttributes_v2(m)
    mem = N.nvmlDeviceGetMemoryInfo(m)
    mem2 = N.nvmlDeviceGetMemoryInfo(m, version=N.nvmlMemory_v2)
    return dict(
        uuid=N.nvmlDeviceGetUUID(m), name=N.nvmlDeviceGetName(m),
        gi=N.nvmlDeviceGetGpuInstanceId(m), ci=N.nvmlDeviceGetComputeInstanceId(m),
        is_mig=N.nvmlDeviceIsMigDeviceHandle(m).value,
        attrs=[getattr(a, f) for f, _ in N.c_nvmlDeviceAttributes._fields_],
        memory=[mem.total, mem.free, mem.used], memory_v2=[mem2.total, mem2.free],
        parent=N.nvmlDeviceGetUUID(N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)),
        by_uuid=addr(N.nvmlDeviceGetHandleByUUID(N.nvmlDeviceGetUUID(m))) == addr(m),
    )
def migs(h):
    out = []
    for i in range(N.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            out.append(N.nvmlDeviceGetMigDeviceHandleByIndex(h, i))
        except N.NVMLError_NotFound:
            continue
    return out
"""


def test_mig_devices_from_scenario(rig: Rig) -> None:
    out = rig.run(
        MIG_DESCRIBE
        + textwrap.dedent(
            """
        N.nvmlInit()
        h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]
        out["count"] = len(h)
        out["mode"] = [N.nvmlDeviceGetMigMode(x) for x in h]
        out["max"] = [N.nvmlDeviceGetMaxMigDeviceCount(x) for x in h]
        out["migs"] = [[describe(m) for m in migs(x)] for x in h]
        m0 = N.nvmlDeviceGetMigDeviceHandleByIndex(h[0], 0)
        out["distinct"] = len({addr(m) for x in h for m in migs(x)} | {addr(x) for x in h})
        out["same_handle"] = addr(N.nvmlDeviceGetMigDeviceHandleByIndex(h[0], 0)) == addr(m0)
        out["parent_is_gpu_handle"] = addr(N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m0)) == addr(h[0])
        out["past_end"] = [code(N.nvmlDeviceGetMigDeviceHandleByIndex, h[0], 4),
                           code(N.nvmlDeviceGetMigDeviceHandleByIndex, h[0], 7)]
        out["attrs_v1"] = N.nvmlLib.nvmlDeviceGetAttributes(m0, ctypes.byref(N.c_nvmlDeviceAttributes()))
        # Queries that are not MIG-aware, and MIG-only queries on a full GPU.
        out["mig_unsupported"] = [code(f, m0) for f in (
            N.nvmlDeviceGetIndex, N.nvmlDeviceGetMinorNumber, N.nvmlDeviceGetPciInfo, N.nvmlDeviceGetMigMode,
            N.nvmlDeviceGetMaxMigDeviceCount, N.nvmlDeviceGetSerial, N.nvmlDeviceGetSupportedEventTypes)]
        out["mig_by_index_on_mig"] = code(N.nvmlDeviceGetMigDeviceHandleByIndex, m0, 0)
        out["full_gpu"] = [code(N.nvmlDeviceGetAttributes_v2, h[1]), code(N.nvmlDeviceGetGpuInstanceId, h[1]),
                           code(N.nvmlDeviceGetComputeInstanceId, h[1]),
                           code(N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, h[1]),
                           N.nvmlDeviceIsMigDeviceHandle(h[1]).value,
                           code(N.nvmlDeviceGetMigDeviceHandleByIndex, h[1], 0)]
        out["state"] = CTL.state()
        """
        ),
        rig.scenario(MIG_SCENARIO),
    )
    assert out["count"] == 3  # MIG devices are not enumerated as GPUs
    assert out["mode"] == [[1, 1], [0, 0], [1, 1]]
    assert out["max"] == [7, 0, 7]
    gpu0, full, gpu2 = out["migs"]
    assert full == []
    want0 = [
        ("3g.40gb", 2, fakenvml_devices.mig_uuid("GPU-mig0", 2, 0)),
        ("2g.20gb", 5, fakenvml_devices.mig_uuid("GPU-mig0", 5, 0)),
        ("1g.10gb+me", 9, "MIG-custom-0009"),
        ("1g.20gb", 1, fakenvml_devices.mig_uuid("GPU-mig0", 1, 0)),  # lowest free gi from 1
    ]
    for got, (profile, gi, uuid) in zip(gpu0, want0, strict=True):
        attrs = MIG_ATTRS[profile]
        assert got == {
            "uuid": uuid,
            "name": f"NVIDIA H100 80GB HBM3 MIG {profile}",
            "gi": gi,
            "ci": 0,
            "is_mig": 1,
            "attrs": attrs,
            "memory": [attrs[-1] << 20, attrs[-1] << 20, 0],
            "memory_v2": [attrs[-1] << 20, attrs[-1] << 20],
            "parent": "GPU-mig0",
            "by_uuid": True,
        }
    assert [(m["gi"], m["attrs"], m["uuid"]) for m in gpu2] == [
        (0, MIG_ATTRS["7g.80gb"], fakenvml_devices.mig_uuid("GPU-mig2", 0, 0))
    ]
    assert all(m["uuid"].startswith("MIG-") and len(m["uuid"]) == 40 for m in gpu0[:2] + gpu2)
    assert out["distinct"] == 3 + 5
    assert out["same_handle"] and out["parent_is_gpu_handle"]
    assert out["past_end"] == [6, 2]  # NOT_FOUND below the max count, INVALID_ARGUMENT at it
    assert out["attrs_v1"] == 0
    assert out["mig_unsupported"] == [3] * 7
    assert out["mig_by_index_on_mig"] == 3
    assert out["full_gpu"] == [3, 3, 3, 2, 0, 2]
    gpu0_state = out["state"].split(" | ")[1]
    assert gpu0_state.startswith("0 GPU-mig0 ok ra=0 cm=0 mig=3g.40gb/2/0/MIG-")
    assert "1g.10gb+me/9/0/MIG-custom-0009,1g.20gb/1/0/" in gpu0_state
    assert out["state"].split(" | ")[2] == "1 GPU-full ok ra=0 cm=0"


def test_mig_layout_changes_apply_at_once_with_an_event(rig: Rig) -> None:
    out = rig.run(
        MIG_DESCRIBE
        + textwrap.dedent(
            """
        N.nvmlInit()
        h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        s = N.nvmlEventSetCreate()
        out["supported"] = N.nvmlDeviceGetSupportedEventTypes(h0) & N.nvmlEventMigConfigChange
        N.nvmlDeviceRegisterEvents(h0, N.nvmlEventMigConfigChange, s)
        old = migs(h0)
        out["before"] = [describe(m)["gi"] for m in old]

        # A waiter blocked in nvmlEventSetWait wakes for the layout change.
        got = {}
        def wait():
            e = N.nvmlEventSetWait_v2(s, 10000)
            got["e"] = [N.nvmlDeviceGetUUID(e.device), e.eventType, e.eventData, e.gpuInstanceId,
                        e.computeInstanceId]
        th = threading.Thread(target=wait)
        th.start()
        time.sleep(0.1)
        out["reply"] = CTL.mig_layout(0, ["1g.10gb", "1g.10gb", "4g.40gb"])
        th.join()
        out["event"] = got["e"]
        new = migs(h0)
        out["after"] = [[d["gi"], d["ci"], d["attrs"][-1], d["uuid"]] for d in map(describe, new)]
        out["stale"] = [code(N.nvmlDeviceGetUUID, m) for m in old]
        out["stale_by_uuid"] = code(N.nvmlDeviceGetHandleByUUID, "MIG-custom-0009")

        out["clear"] = CTL.mig_layout(0, [])
        out["cleared"] = [len(migs(h0)), N.nvmlDeviceGetMigMode(h0),
                          code(N.nvmlDeviceGetMigDeviceHandleByIndex, h0, 0)]
        CTL.mig_layout(0, ["7g.80gb"])
        m = N.nvmlDeviceGetMigDeviceHandleByIndex(h0, 0)
        out["mode_off"] = CTL.mig_mode(0, False)
        out["off"] = [N.nvmlDeviceGetMigMode(h0), N.nvmlDeviceGetMaxMigDeviceCount(h0),
                      code(N.nvmlDeviceGetMigDeviceHandleByIndex, h0, 0), code(N.nvmlDeviceGetUUID, m)]
        out["layout_when_off"] = ctl_error(CTL.mig_layout, 0, ["1g.10gb"])
        # Turning MIG on for a GPU that had it off: empty layout until one is set.
        out["mode_on"] = CTL.mig_mode(1, True)
        out["on"] = [N.nvmlDeviceGetMigMode(h1), N.nvmlDeviceGetMaxMigDeviceCount(h1), len(migs(h1))]
        CTL.mig_layout("GPU-full", ["2g.20gb"])
        out["on_layout"] = [describe(m)["uuid"] for m in migs(h1)]
        out["events"] = []
        while True:
            try:
                e = N.nvmlEventSetWait_v2(s, 0)
            except N.NVMLError_Timeout:
                break
            out["events"].append(e.eventType)
        out["errors"] = [ctl_error(CTL.send, c) for c in (
            "mig 0 layout 7g.80gb,1g.10gb", "mig 1 layout 8g.90gb", "mig 1 mode 2", "mig 1 frob",
            "mig 1 layout", "mig 9 mode 1")]
        out["kept"] = len(migs(h1))
        """
        ),
        rig.scenario(MIG_SCENARIO),
    )
    assert out["supported"] == 0x100
    assert out["before"] == [2, 5, 9, 1]
    assert out["reply"] == "ok queued=1"
    assert out["event"] == ["GPU-mig0", 0x100, 0, 0xFFFFFFFF, 0xFFFFFFFF]
    assert out["after"] == [
        [1, 0, 9856, fakenvml_devices.mig_uuid("GPU-mig0", 1, 0)],
        [2, 0, 9856, fakenvml_devices.mig_uuid("GPU-mig0", 2, 0)],
        [3, 0, 40192, fakenvml_devices.mig_uuid("GPU-mig0", 3, 0)],
    ]
    assert out["stale"] == [2, 2, 2, 2]
    assert out["stale_by_uuid"] == 6
    assert out["clear"] == "ok queued=1"
    assert out["cleared"] == [0, [1, 1], 6]
    assert out["mode_off"] == "ok queued=1"
    assert out["off"] == [[0, 0], 0, 2, 2]
    assert out["layout_when_off"] == "error: mig: MIG mode is off on this GPU"
    assert out["mode_on"] == "ok queued=0"  # GPU 1 is not registered for it
    assert out["on"] == [[1, 1], 7, 0]
    assert out["on_layout"] == [fakenvml_devices.mig_uuid("GPU-full", 1, 0)]
    assert out["events"] == [0x100, 0x100, 0x100]  # clear, 7g layout, mode off (first one already taken)
    assert out["errors"][0] == "error: mig: MIG mode is off on this GPU"
    assert out["errors"][1] == "error: mig: unknown MIG profile '8g.90gb'"
    assert all(e and e.startswith("error: ") for e in out["errors"]), out["errors"]
    assert out["kept"] == 1  # failed commands leave the layout alone


def test_mig_layout_over_seven_slices_is_rejected_and_kept(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        out["err"] = ctl_error(CTL.mig_layout, 0, ["4g.40gb", "3g.40gb", "1g.10gb"])
        out["count"] = N.nvmlDeviceGetMaxMigDeviceCount(N.nvmlDeviceGetHandleByIndex(0))
        out["n"] = len(CTL.state().split(" | ")[1].split("mig=")[1].split(","))
        out["full"] = CTL.mig_layout(0, ["1g.10gb"] * 7)
        try:
            CTL.mig_layout(0, "1g.10gb")
        except TypeError as e:
            out["type"] = str(e)
        """,
        rig.scenario(MIG_SCENARIO),
    )
    assert out["err"] == "error: mig: layout over 7 slices"
    assert out["count"] == 7 and out["n"] == 4  # unchanged
    assert out["full"] == "ok queued=0"
    assert out["type"] == "profiles must be a sequence of profile names, not one string"


def test_mig_lost_parent_and_instance_scoped_xid(rig: Rig) -> None:
    out = rig.run(
        MIG_DESCRIBE
        + textwrap.dedent(
            """
        N.nvmlInit()
        h0 = N.nvmlDeviceGetHandleByIndex(0)
        s = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(h0, N.nvmlEventTypeXidCriticalError | N.nvmlEventTypeGpuUnavailableError, s)
        m = migs(h0)
        out["register_on_mig"] = code(N.nvmlDeviceRegisterEvents, m[0], N.nvmlEventTypeXidCriticalError, s)
        CTL.xid(0, 31, 5, 0)   # inside GPU instance 5
        CTL.xid("GPU-mig0", 79)  # the whole GPU
        ev = []
        for _ in range(2):
            e = N.nvmlEventSetWait_v2(s, 1000)
            ev.append([N.nvmlDeviceGetUUID(e.device), e.eventData, e.gpuInstanceId, e.computeInstanceId])
        out["xids"] = ev
        CTL.lose(0)
        out["lost"] = [code(f, m[0]) for f in (N.nvmlDeviceGetUUID, N.nvmlDeviceGetGpuInstanceId,
                                               N.nvmlDeviceGetAttributes_v2, N.nvmlDeviceGetMemoryInfo,
                                               N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
                                               N.nvmlDeviceGetIndex)]
        out["lost_by_index"] = code(N.nvmlDeviceGetMigDeviceHandleByIndex, h0, 0)
        CTL.restore(0)
        out["restored"] = describe(m[0])["gi"]
        out["calls"] = CTL.calls()
        """
        ),
        rig.scenario(MIG_SCENARIO),
    )
    assert out["register_on_mig"] == 3
    assert out["xids"] == [["GPU-mig0", 31, 5, 0], ["GPU-mig0", 79, 0xFFFFFFFF, 0xFFFFFFFF]]
    assert out["lost"] == [15] * 6
    assert out["lost_by_index"] == 15
    assert out["restored"] == 2
    calls = out["calls"]
    for name in (
        "nvmlDeviceGetAttributes_v2",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceIsMigDeviceHandle",
    ):
        assert calls.get(name, 0) >= 1, name


def test_mig_gpu_removed_and_its_slot_reused(rig: Rig) -> None:
    out = rig.run(
        MIG_DESCRIBE
        + textwrap.dedent(
            """
        N.nvmlInit()
        m = migs(N.nvmlDeviceGetHandleByIndex(2))[0]
        uuid = N.nvmlDeviceGetUUID(m)
        CTL.remove(2)
        out["removing"] = code(N.nvmlDeviceGetUUID, m)
        N.nvmlShutdown(); N.nvmlInit()
        out["removed"] = [code(N.nvmlDeviceGetUUID, m), code(N.nvmlDeviceGetHandleByUUID, uuid)]
        CTL.add("uuid=GPU-new bus=0000:09:00.0 minor=9 mig=1")
        N.nvmlShutdown(); N.nvmlInit()
        out["reused"] = [code(N.nvmlDeviceGetUUID, m), len(migs(N.nvmlDeviceGetHandleByUUID("GPU-new")))]
        """
        ),
        rig.scenario(MIG_SCENARIO),
    )
    assert out["removing"] == 15
    assert out["removed"] == [15, 6]
    assert out["reused"] == [2, 0]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("mig 0 1g.10gb", "MIG device on a GPU with mig=0"),
        ("mig 1 9g.99gb", "unknown MIG profile '9g.99gb'"),
        ("mig 5 1g.10gb", "mig needs the index of a GPU defined above"),
        ("mig 1 1g.10gb gi=15", "bad value for gi=15"),
        ("mig 1 1g.10gb ci=8", "bad value for ci=8"),
        ("mig 1 1g.10gb uuid=GPU-x", "bad value for uuid=GPU-x"),
        ("mig 1 1g.10gb colour=red", "unknown mig key 'colour'"),
        ("mig 1 4g.40gb gi=3", "duplicate gi 3"),
        ("mig 1 7g.80gb", "MIG layout over 7 slices (3 used, 7g.80gb needs 7)"),
        ("mig 1 1g.10gb uuid=MIG-taken", "duplicate uuid MIG-taken"),
        ("gpu uuid=GPU-c minor=2 bus=0000:09:00.0 mig=1 unsupported=mig", "mig=1 on a GPU with unsupported=mig"),
        ("gpu uuid=GPU-c minor=2 bus=0000:09:00.0 mig=2", "bad value for mig"),
    ],
)
def test_bad_mig_scenario_lines(rig: Rig, line: str, message: str) -> None:
    scenario = rig.scenario(
        "gpu uuid=GPU-ok minor=7 bus=0000:07:00.0\n"
        "gpu uuid=GPU-m minor=8 bus=0000:08:00.0 mig=1\n"
        "mig 1 3g.40gb gi=3 uuid=MIG-taken\n"
        f"{line}\n"
    )
    out = rig.run('out["init"] = code(N.nvmlInit)', scenario)
    assert out["init"] == 999
    assert f"{scenario}:4: {message}" in out["_stderr"]
    assert line in out["_stderr"]


def test_mig_unsupported_gpu(rig: Rig) -> None:
    scenario = rig.scenario("gpu uuid=GPU-a unsupported=mig\n")
    out = rig.run(
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        out["q"] = [code(N.nvmlDeviceGetMigMode, h), N.nvmlDeviceGetMaxMigDeviceCount(h),
                    code(N.nvmlDeviceGetMigDeviceHandleByIndex, h, 0)]
        out["ctl"] = ctl_error(CTL.mig_mode, 0, True)
        """,
        scenario,
    )
    assert out["q"] == [3, 0, 3]
    assert out["ctl"] == "error: mig: the GPU has unsupported=mig"


def test_mig_uuid_is_stable_and_distinct() -> None:
    a = fakenvml_devices.mig_uuid("GPU-x", 1, 0)
    assert a == fakenvml_devices.mig_uuid("GPU-x", 1, 0)
    others = [
        fakenvml_devices.mig_uuid("GPU-x", 2, 0),
        fakenvml_devices.mig_uuid("GPU-x", 1, 1),
        fakenvml_devices.mig_uuid("GPU-y", 1, 0),
    ]
    assert len({a, *others}) == 4
    assert a.startswith("MIG-") and [len(p) for p in a[4:].split("-")] == [8, 4, 4, 4, 12]


def test_write_mig_minors(tmp_path: Path) -> None:
    path = tmp_path / "proc" / "mig-minors"
    fakenvml_devices.write_mig_minors(path, {1: [(0, 0)], 0: [(2, 1), (1, 0), (2, 0)]})
    assert path.read_text().splitlines() == [
        "config 1",
        "monitor 2",
        "gpu0/gi1/access 12",
        "gpu0/gi1/ci0/access 13",
        "gpu0/gi2/access 21",
        "gpu0/gi2/ci0/access 22",
        "gpu0/gi2/ci1/access 23",
        "gpu1/gi0/access 138",
        "gpu1/gi0/ci0/access 139",
    ]
    assert (
        fakenvml_devices.mig_minor(0, 0) == 3
        and fakenvml_devices.mig_minor(0, 0, 7) == 11
        and fakenvml_devices.mig_minor(0, 14, 7) == 137
    )
    # Unique over the whole space.
    minors = [fakenvml_devices.mig_minor(g, gi, ci) for g in range(4) for gi in range(15) for ci in (None, *range(8))]
    assert len(set(minors)) == len(minors) and min(minors) == 3
    with pytest.raises(ValueError):
        fakenvml_devices.write_mig_minors(path, {0: [(15, 0)]})
    with pytest.raises(ValueError):
        fakenvml_devices.mig_minor(0, 1, 8)


# ---- running processes ------------------------------------------------------------------

# Child helper: a process list as pynvml's wrappers return it, and the nine entry points.
PROCS_HELPERS = """
def plist(fn, h):
    return [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in fn(h)]
def lists(h):
    return [plist(f, h) for f in (N.nvmlDeviceGetComputeRunningProcesses,
                                  N.nvmlDeviceGetGraphicsRunningProcesses,
                                  N.nvmlDeviceGetMPSComputeRunningProcesses)]
PROC_FUNCS = [f"nvmlDevice{k}RunningProcesses{v}" for k in ("GetCompute", "GetGraphics", "GetMPSCompute")
              for v in ("", "_v2", "_v3")]
"""

NA = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of a process not on a MIG device
GIB = 1 << 30


def test_running_processes_none_then_set_over_control(rig: Rig) -> None:
    out = rig.run(
        PROCS_HELPERS
        + textwrap.dedent(
            """
        from nvplug.testing.fakenvml_devices import GpuProcess as P
        N.nvmlInit()
        h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        out["empty"] = lists(h0)
        out["empty_v2"] = [f(h0) for f in (N.nvmlDeviceGetComputeRunningProcesses_v2,
                                           N.nvmlDeviceGetGraphicsRunningProcesses_v2,
                                           N.nvmlDeviceGetMPSComputeRunningProcesses_v2)]
        out["set"] = CTL.procs(0, [4242, P(100, 1024), P(200, 0, ("graphics",)), P(300, 512, ("compute", "graphics")),
                                   P(400, 2048, ("mps",))])
        out["lists"] = lists(h0)
        out["lists_v2"] = [plist(f, h0) for f in (N.nvmlDeviceGetComputeRunningProcesses_v2,
                                                  N.nvmlDeviceGetGraphicsRunningProcesses_v2,
                                                  N.nvmlDeviceGetMPSComputeRunningProcesses_v2)]
        out["other_gpu"] = lists(h1)
        out["state"] = CTL.state().split(" | ")[1:3]
        out["by_uuid"] = CTL.procs(N.nvmlDeviceGetUUID(h1), [7])
        out["gpu1"] = lists(h1)
        out["cleared"] = [CTL.procs(0, []), lists(h0)]
        CTL.reset_calls()
        N.nvmlDeviceGetComputeRunningProcesses(h1)  # size query, then the fetch
        N.nvmlDeviceGetGraphicsRunningProcesses(h1)  # nothing running: the size query only
        out["calls"] = CTL.calls()
        """
        )
    )
    assert out["empty"] == [[], [], []]
    assert out["empty_v2"] == [[], [], []]
    assert out["set"] == "ok"
    compute, graphics, mps = out["lists"]
    assert compute == [[4242, None, NA, NA], [100, GIB, NA, NA], [300, GIB // 2, NA, NA]]
    assert graphics == [[200, 0, NA, NA], [300, GIB // 2, NA, NA]]
    assert mps == [[400, 2 * GIB, NA, NA]]
    assert out["lists_v2"] == out["lists"]
    assert out["other_gpu"] == [[], [], []]
    assert out["state"] == [
        f"0 {GPUS[0]['uuid']} ok ra=0 cm=0 procs=4242,100:1024,200:0:graphics,300:512:compute+graphics,400:2048:mps",
        f"1 {GPUS[1]['uuid']} ok ra=0 cm=0",
    ]
    assert out["by_uuid"] == "ok"
    assert out["gpu1"] == [[[7, None, NA, NA]], [], []]
    assert out["cleared"] == ["ok", [[], [], []]]
    assert out["calls"] == {
        "nvmlDeviceGetComputeRunningProcesses_v3": 2,
        "nvmlDeviceGetGraphicsRunningProcesses_v3": 1,
    }


def test_running_processes_size_query_and_layouts_by_raw_calls(rig: Rig) -> None:
    out = rig.run(
        PROCS_HELPERS
        + textwrap.dedent(
            """
        N.nvmlInit()
        lib = N.nvmlLib
        h = N.nvmlDeviceGetHandleByIndex(3)
        fn = lib.nvmlDeviceGetComputeRunningProcesses_v3
        def call(f, count, infos):
            c = ctypes.c_uint(count)
            rc = f(h, ctypes.byref(c), infos)
            return [rc, c.value]
        Info = N.c_nvmlProcessInfo_v3_t
        out["sizes"] = [ctypes.sizeof(N.c_nvmlProcessInfo_v2_t), ctypes.sizeof(Info)]
        out["none"] = [call(fn, 0, None), call(fn, 4, (Info * 4)())]
        CTL.procs(3, [11, 22, 33])
        arr = (Info * 3)()
        arr[0].pid = 99
        out["query"] = call(fn, 0, None)          # the size query pynvml starts with
        out["small"] = call(fn, 2, arr)
        out["untouched"] = arr[0].pid
        out["null_infos"] = call(fn, 3, None)
        out["null_count"] = fn(h, None, arr)
        out["exact"] = call(fn, 3, arr)
        out["got"] = [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in arr]
        big = (Info * 5)()
        out["roomy"] = call(fn, 5, big) + [big[3].pid]

        # The unversioned entry points take the two-field nvmlProcessInfo_v1_t: 16 bytes apart.
        class V1(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
        from nvplug.testing.fakenvml_devices import GpuProcess as P
        CTL.procs(3, [P(11, 1), P(22, 2, ("compute", "graphics", "mps"))])
        out["v1_size"] = ctypes.sizeof(V1)
        out["v1"] = {}
        for name in PROC_FUNCS:
            if name.endswith(("_v2", "_v3")):
                continue
            v1 = (V1 * 3)()
            rc = call(getattr(lib, name), 3, v1)
            out["v1"][name] = rc + [[p.pid, p.usedGpuMemory] for p in v1]
        out["v2"] = {}
        for name in PROC_FUNCS:
            if not name.endswith("_v2"):
                continue
            arr = (N.c_nvmlProcessInfo_v2_t * 3)()
            rc = call(getattr(lib, name), 3, arr)
            out["v2"][name] = rc + [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in arr]
        out["bad_handle"] = [getattr(lib, name)(ctypes.c_void_p(0x1000), ctypes.byref(ctypes.c_uint(0)), None)
                             for name in PROC_FUNCS]
        N.nvmlShutdown()
        out["uninit"] = [getattr(lib, name)(h, ctypes.byref(ctypes.c_uint(0)), None) for name in PROC_FUNCS]
        """
        )
    )
    assert out["sizes"] == [24, 24]
    assert out["none"] == [[0, 0], [0, 0]]
    assert out["query"] == [7, 3]  # INSUFFICIENT_SIZE with the count needed
    assert out["small"] == [7, 3]
    assert out["untouched"] == 99
    assert out["null_infos"] == [2, 3]  # NULL infos only with *infoCount 0
    assert out["null_count"] == 2
    assert out["exact"] == [0, 3]
    assert out["got"] == [[11, 2**64 - 1, NA, NA], [22, 2**64 - 1, NA, NA], [33, 2**64 - 1, NA, NA]]
    assert out["roomy"] == [0, 3, 0]  # count set to what was returned; the rest of the array left alone
    assert out["v1_size"] == 16
    mib = 1 << 20
    assert out["v1"] == {
        "nvmlDeviceGetComputeRunningProcesses": [0, 2, [11, mib], [22, 2 * mib], [0, 0]],
        "nvmlDeviceGetGraphicsRunningProcesses": [0, 1, [22, 2 * mib], [0, 0], [0, 0]],
        "nvmlDeviceGetMPSComputeRunningProcesses": [0, 1, [22, 2 * mib], [0, 0], [0, 0]],
    }
    assert out["v2"] == {
        "nvmlDeviceGetComputeRunningProcesses_v2": [0, 2, [11, mib, NA, NA], [22, 2 * mib, NA, NA], [0, 0, 0, 0]],
        "nvmlDeviceGetGraphicsRunningProcesses_v2": [0, 1, [22, 2 * mib, NA, NA], [0, 0, 0, 0], [0, 0, 0, 0]],
        "nvmlDeviceGetMPSComputeRunningProcesses_v2": [0, 1, [22, 2 * mib, NA, NA], [0, 0, 0, 0], [0, 0, 0, 0]],
    }
    assert out["bad_handle"] == [2] * 9
    assert out["uninit"] == [1] * 9


PROCS_MIG_SCENARIO = """
    gpu uuid=GPU-mig0 bus=0000:01:00.0 minor=0 mig=1 procs=500:100@2/0,501@5/0,502:300@2/0,503:7
    gpu uuid=GPU-full bus=0000:02:00.0 minor=1 procs=600:1:graphics,601:2:compute+mps
    mig 0 3g.40gb gi=2 ci=0
    mig 0 2g.20gb gi=5 ci=0
    mig 0 1g.10gb gi=9 ci=0
    """


def test_running_processes_on_mig_devices(rig: Rig) -> None:
    out = rig.run(
        MIG_DESCRIBE
        + PROCS_HELPERS
        + textwrap.dedent(
            """
        from nvplug.testing.fakenvml_devices import GpuProcess as P
        N.nvmlInit()
        h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        m = migs(h0)
        out["parent"] = lists(h0)
        out["migs"] = [plist(N.nvmlDeviceGetComputeRunningProcesses, x) for x in m]
        out["mig_graphics"] = [plist(N.nvmlDeviceGetGraphicsRunningProcesses, x) for x in m]
        out["full"] = lists(h1)
        out["state"] = CTL.state().split(" | ")[1:3]
        # The raw size query on a MIG handle counts its own processes only.
        c = ctypes.c_uint(0)
        out["mig_query"] = [N.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3(m[0], ctypes.byref(c), None), c.value]
        out["set"] = CTL.procs("GPU-mig0", [P(700, 10, mig=(9, 0)), P(701, mig=(5, 0)), 702])
        out["after_set"] = [plist(N.nvmlDeviceGetComputeRunningProcesses, x) for x in [h0, *m]]
        out["no_such_mig"] = ctl_error(CTL.procs, 0, [P(1, mig=(3, 0))])
        out["no_such_ci"] = ctl_error(CTL.procs, 0, [P(1, mig=(2, 1))])
        out["not_mig"] = ctl_error(CTL.procs, 1, [P(1, mig=(0, 0))])
        out["kept"] = len(N.nvmlDeviceGetComputeRunningProcesses(h0))
        # A new layout ends the processes on the old MIG devices; the rest run on.
        CTL.mig_layout(0, ["7g.80gb"])
        out["relayout"] = plist(N.nvmlDeviceGetComputeRunningProcesses, h0)
        out["stale_mig"] = code(N.nvmlDeviceGetComputeRunningProcesses, m[0])
        CTL.procs(0, [P(800, mig=(1, 0)), 801])
        CTL.mig_mode(0, False)
        out["mig_off"] = plist(N.nvmlDeviceGetComputeRunningProcesses, h0)
        """
        ),
        rig.scenario(PROCS_MIG_SCENARIO),
    )
    mib = 1 << 20
    compute, graphics, mps = out["parent"]
    assert compute == [
        [500, 100 * mib, 2, 0],
        [501, None, 5, 0],
        [502, 300 * mib, 2, 0],
        [503, 7 * mib, NA, NA],
    ]
    assert graphics == mps == []
    assert out["migs"] == [
        [[500, 100 * mib, 2, 0], [502, 300 * mib, 2, 0]],
        [[501, None, 5, 0]],
        [],
    ]
    assert out["mig_graphics"] == [[], [], []]
    assert out["full"] == [[[601, 2 * mib, NA, NA]], [[600, mib, NA, NA]], [[601, 2 * mib, NA, NA]]]
    assert out["state"][0].endswith(" procs=500:100@2/0,501@5/0,502:300@2/0,503:7")
    assert out["state"][1] == "1 GPU-full ok ra=0 cm=0 procs=600:1:graphics,601:2:compute+mps"
    assert out["mig_query"] == [7, 2]
    assert out["set"] == "ok"
    assert out["after_set"] == [
        [[700, 10 * mib, 9, 0], [701, None, 5, 0], [702, None, NA, NA]],
        [],
        [[701, None, 5, 0]],
        [[700, 10 * mib, 9, 0]],
    ]
    assert out["no_such_mig"] == "error: procs: process 1: no MIG device with gi 3 ci 0 on GPU-mig0"
    assert out["no_such_ci"] == "error: procs: process 1: no MIG device with gi 2 ci 1 on GPU-mig0"
    assert out["not_mig"] == "error: procs: process 1: no MIG device with gi 0 ci 0 on GPU-full"
    assert out["kept"] == 3  # failed commands change nothing
    assert out["relayout"] == [[702, None, NA, NA]]
    assert out["stale_mig"] == 2
    assert out["mig_off"] == [[801, None, NA, NA]]


def test_running_processes_of_a_lost_gpu_and_restore(rig: Rig) -> None:
    out = rig.run(
        MIG_DESCRIBE
        + PROCS_HELPERS
        + textwrap.dedent(
            """
        N.nvmlInit()
        h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        m = migs(h0)[0]
        CTL.lose(0)
        CTL.lose(1)
        c = ctypes.c_uint(0)
        out["raw"] = [getattr(N.nvmlLib, name)(h, ctypes.byref(c), None) for name in PROC_FUNCS for h in (h1, m)]
        out["pynvml"] = [code(f, h1) for f in (N.nvmlDeviceGetComputeRunningProcesses,
                                               N.nvmlDeviceGetGraphicsRunningProcesses,
                                               N.nvmlDeviceGetMPSComputeRunningProcesses)]
        out["ctl_while_lost"] = CTL.procs(1, [5])
        out["restore"] = [CTL.restore(0), CTL.restore(1)]
        out["after"] = [lists(h0), lists(m), lists(h1)]
        CTL.remove(1)
        out["removed"] = code(N.nvmlDeviceGetComputeRunningProcesses, h1)
        """
        ),
        rig.scenario(PROCS_MIG_SCENARIO),
    )
    mib = 1 << 20
    assert out["raw"] == [15] * 18
    assert out["pynvml"] == [15] * 3
    assert out["ctl_while_lost"] == "ok"
    h0, m, h1 = out["after"]
    assert [len(x) for x in h0] == [4, 0, 0]  # restore keeps the processes
    assert m == [[[500, 100 * mib, 2, 0], [502, 300 * mib, 2, 0]], [], []]
    assert h1 == [[[5, None, NA, NA]], [], []]
    assert out["removed"] == 15


def test_running_processes_unsupported(rig: Rig) -> None:
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a bus=0000:01:00.0 minor=0 unsupported=processes procs=10
        gpu uuid=GPU-b bus=0000:02:00.0 minor=1 unsupported=numa
        """
    )
    out = rig.run(
        PROCS_HELPERS
        + textwrap.dedent(
            """
        N.nvmlInit()
        a, b = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        c = ctypes.c_uint(0)
        out["raw"] = [getattr(N.nvmlLib, name)(a, ctypes.byref(c), None) for name in PROC_FUNCS]
        out["count"] = c.value
        out["pynvml"] = [code(f, a) for f in (N.nvmlDeviceGetComputeRunningProcesses,
                                              N.nvmlDeviceGetGraphicsRunningProcesses,
                                              N.nvmlDeviceGetMPSComputeRunningProcesses)]
        out["b"] = lists(b)
        """
        ),
        scenario,
    )
    assert out["raw"] == [3] * 9
    assert out["count"] == 0  # untouched
    assert out["pynvml"] == [3] * 3
    assert out["b"] == [[], [], []]


def test_running_processes_from_add_and_bad_commands(rig: Rig) -> None:
    out = rig.run(
        PROCS_HELPERS
        + textwrap.dedent(
            """
        N.nvmlInit()
        out["add"] = CTL.add("uuid=GPU-new bus=0000:E1:00.0 minor=20 procs=77:5,78:graphics")
        out["add_mig"] = ctl_error(CTL.add, "uuid=GPU-new2 bus=0000:E2:00.0 minor=21 mig=1 procs=1@1/0")
        N.nvmlShutdown(); N.nvmlInit()
        out["added"] = lists(N.nvmlDeviceGetHandleByUUID("GPU-new"))
        bad = ["procs", "procs 0", "procs 0 1 2", "procs 0 0", "procs 0 x", "procs 0 1:x", "procs 0 1:5:gpu",
               "procs 0 1:5:compute:6", "procs 0 1:-5", "procs 0 1,,2", "procs 0 1,", "procs 0 1,1",
               "procs 0 4294967296", "procs 0 1@1", "procs 0 1@15/0", "procs 0 1@1/8", "procs 0 1:compute+",
               "procs 0 " + ",".join(str(p) for p in range(1, 514)), "procs 9 1", "procs 0 1:1073741825"]
        out["errors"] = {c: ctl_error(CTL.send, c) for c in bad}
        out["max"] = CTL.send("procs 0 " + ",".join(str(p) for p in range(1, 513)))
        out["n"] = len(N.nvmlDeviceGetComputeRunningProcesses(N.nvmlDeviceGetHandleByIndex(0)))
        out["dash"] = [CTL.send("procs 0 -"), lists(N.nvmlDeviceGetHandleByIndex(0))]
        """
        )
    )
    mib = 1 << 20
    assert out["add"] == "ok pending GPU-new"
    assert out["add_mig"] == "error: add: process 1: no MIG device with gi 1 ci 0 on GPU-new2"
    assert out["added"] == [[[77, 5 * mib, NA, NA]], [[78, None, NA, NA]], []]
    errors = out["errors"]
    assert all(e is not None and e.startswith("error: ") for e in errors.values()), errors
    assert errors["procs"] == "error: procs: missing gpu (index or UUID)"
    assert errors["procs 0"].startswith("error: usage: procs <gpu> ")
    assert errors["procs 0 1:x"] == ("error: procs: bad process '1:x' (want PID[:MIB][:compute|graphics|mps][@GI/CI])")
    assert errors["procs 0 1,1"] == "error: procs: duplicate pid 1"
    assert errors["procs 0 " + ",".join(str(p) for p in range(1, 514))] == "error: procs: more than 512 processes"
    assert errors["procs 9 1"] == "error: procs: unknown gpu '9'"
    assert out["max"] == "ok" and out["n"] == 512
    assert out["dash"] == ["ok", [[], [], []]]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("gpu uuid=GPU-b minor=1 bus=0000:02:00.0 procs=", "bad process ''"),
        ("gpu uuid=GPU-b minor=1 bus=0000:02:00.0 procs=12:big", "bad process '12:big'"),
        ("gpu uuid=GPU-b minor=1 bus=0000:02:00.0 procs=3,4,3", "duplicate pid 3"),
        ("gpu uuid=GPU-b minor=1 bus=0000:02:00.0 unsupported=procs", "unknown unsupported= item 'procs'"),
    ],
)
def test_bad_procs_scenario_lines(rig: Rig, line: str, message: str) -> None:
    scenario = rig.scenario(f"gpu uuid=GPU-a minor=0 bus=0000:01:00.0\n{line}\n")
    out = rig.run('out["init"] = code(N.nvmlInit)', scenario)
    assert out["init"] == 999
    assert f"{scenario}:2: {message}" in out["_stderr"]


def test_procs_on_a_mig_device_the_scenario_never_makes(rig: Rig) -> None:
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a minor=0 bus=0000:01:00.0 mig=1 procs=9@1/0,10@2/0
        mig 0 1g.10gb gi=1
        """
    )
    out = rig.run('out["init"] = code(N.nvmlInit)', scenario)
    assert out["init"] == 999
    assert f"fakenvml: {scenario}: gpu 0: process 10: no MIG device with gi 2 ci 0 on GPU-a" in out["_stderr"]


def test_gpu_process_spec_and_checks() -> None:
    P = fakenvml_devices.GpuProcess
    assert P(1).spec() == "1"
    assert P(2, 0).spec() == "2:0"
    assert P(3, 512, ("graphics", "compute")).spec() == "3:512:compute+graphics"
    assert P(4, None, ("mps",), (5, 1)).spec() == "4:mps@5/1"
    bad: list[dict[str, Any]] = [
        {"pid": 0},
        {"pid": 1 << 32},
        {"pid": 1, "used_mib": -1},
        {"pid": 1, "used_mib": (1 << 30) + 1},
        {"pid": 1, "kinds": ()},
        {"pid": 1, "kinds": ("compute", "compute")},
        {"pid": 1, "kinds": ("gpu",)},
        {"pid": 1, "kinds": "compute"},
        {"pid": 1, "mig": (15, 0)},
        {"pid": 1, "mig": (0, 8)},
    ]
    for kwargs in bad:
        with pytest.raises(ValueError):
            P(**kwargs)
    control = fakenvml_control.Control(Path("/nonexistent"))
    with pytest.raises(TypeError):
        control.procs(0, "123")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        control.procs(0, list(range(1, 514)))


# ---- blocked calls: a hung driver -------------------------------------------------------

# Child helpers: `hang(fn, *args)` runs a pynvml call on a daemon thread (a stuck one must not
# keep the child from exiting) and returns a dict that gets "rc" and "value" when it returns;
# `gpu_field(key, i)` reads one key=value of GPU index i's part of the state reply.
HANG = """
def hang(fn, *args):
    res = {}
    def run():
        try:
            res["value"] = fn(*args)
            res["rc"] = 0
        except N.NVMLError as e:
            res["rc"] = e.value
    res["thread"] = th = threading.Thread(target=run, daemon=True)
    th.start()
    return res
def finish(res, timeout=5):
    res.pop("thread").join(timeout)
    return res
def gpu_field(key, i):
    part = CTL.state().split(" | ")[1 + i].split()
    return next((w.partition("=")[2] for w in part if w.startswith(key + "=")), None)
"""


def with_hang(body: str) -> str:
    """A child body with the HANG helpers in front."""
    return HANG + textwrap.dedent(body)


def test_block_holds_one_gpu_and_function_until_released(rig: Rig) -> None:
    out = rig.run(
        with_hang(
            """
            N.nvmlInit()
            h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
            CTL.reset_calls()
            out["block"] = CTL.block(0, "nvmlDeviceGetPciInfo_v3")
            first = hang(N.nvmlDeviceGetPciInfo, h0)
            CTL.wait_blocked(1)
            # The same call on another GPU, other calls on this one and the control socket all answer.
            t = time.monotonic()
            out["other_gpu"] = txt(N.nvmlDeviceGetPciInfo(h1).busId)
            out["other_fn"] = [txt(N.nvmlDeviceGetUUID(h0)), N.nvmlDeviceGetMinorNumber(h0), N.nvmlDeviceGetCount()]
            out["others_s"] = time.monotonic() - t
            out["ping"] = CTL.ping()
            second = hang(N.nvmlDeviceGetPciInfo, h0)  # entering while blocked blocks too
            CTL.wait_blocked(2)
            time.sleep(0.2)
            out["still_blocked"] = [first["thread"].is_alive(), "rc" in first, "rc" in second]
            out["waiting"] = [header("blocked_waiting"), header("blocked_calls"), header("any_blocks"),
                              gpu_field("blocks", 0), gpu_field("waiting", 0), gpu_field("blocks", 1),
                              gpu_field("waiting", 1)]
            out["calls"] = CTL.calls()
            out["release"] = CTL.release(0, "nvmlDeviceGetPciInfo_v3")
            out["released"] = [finish(r) for r in (first, second)]
            out["bus"] = [txt(r["value"].busId) for r in out["released"]]
            out["after"] = [header("blocked_waiting"), header("blocked_calls"), gpu_field("blocks", 0),
                            gpu_field("waiting", 0)]
            out["direct"] = txt(N.nvmlDeviceGetPciInfo(h0).busId)
            out["release_again"] = ctl_error(CTL.release, 0, "nvmlDeviceGetPciInfo_v3")
            for r in out["released"]:
                del r["value"]
            """
        )
    )
    bus0 = "00000000:18:00.0"
    assert out["block"] == "ok"
    assert out["other_gpu"] == "00000000:2A:00.0"
    assert out["other_fn"] == [GPUS[0]["uuid"], 0, 8]
    assert out["others_s"] < 1.0
    assert out["ping"] == "ok"
    assert out["still_blocked"] == [True, False, False]
    assert out["waiting"] == ["2", "2", "-", "nvmlDeviceGetPciInfo_v3", "2", None, None]
    assert out["calls"]["nvmlDeviceGetPciInfo_v3"] == 3  # blocked calls are counted on entry
    assert out["release"] == "ok"
    assert out["released"] == [{"rc": 0}, {"rc": 0}]
    assert out["bus"] == [bus0, bus0] and out["direct"] == bus0
    assert out["after"] == ["0", "2", None, None]
    assert out["release_again"] == "error: release: 0 nvmlDeviceGetPciInfo_v3 is not blocked"


def test_block_by_uuid_any_gpu_and_lookups(rig: Rig) -> None:
    out = rig.run(
        with_hang(
            f"""
            N.nvmlInit()
            h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(8)]
            uuid1 = "{GPUS[1]["uuid"]}"
            CTL.block(uuid1, "nvmlDeviceGetUUID")
            one = hang(N.nvmlDeviceGetUUID, h[1])
            CTL.wait_blocked(1)
            out["gpu0"] = txt(N.nvmlDeviceGetUUID(h[0]))
            out["by_uuid"] = [gpu_field("blocks", 1), gpu_field("waiting", 1), gpu_field("blocks", 0)]
            out["release_by_index"] = CTL.release(1, "nvmlDeviceGetUUID")  # the same GPU
            out["one"] = txt(finish(one)["value"])

            # "*" blocks a per-device call on every GPU.
            CTL.block("*", "nvmlDeviceGetMinorNumber")
            any_gpu = [hang(N.nvmlDeviceGetMinorNumber, h[i]) for i in (0, 5)]
            CTL.wait_blocked(2)
            out["any"] = [header("any_blocks"), gpu_field("waiting", 0), gpu_field("waiting", 5)]
            CTL.release("*", "nvmlDeviceGetMinorNumber")
            out["minors"] = [finish(r)["value"] for r in any_gpu]

            # A lookup blocks for the GPU it finds: by index, by UUID; one that finds nothing does not.
            CTL.block(2, "nvmlDeviceGetHandleByIndex_v2")
            CTL.block(uuid1, "nvmlDeviceGetHandleByUUID")
            by_index = hang(N.nvmlDeviceGetHandleByIndex, 2)
            by_uuid = hang(N.nvmlDeviceGetHandleByUUID, uuid1.encode())
            CTL.wait_blocked(2)
            out["lookups_free"] = [N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByIndex(3)),
                                   code(N.nvmlDeviceGetHandleByIndex, 99),
                                   N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(b"{GPUS[0]["uuid"]}")),
                                   code(N.nvmlDeviceGetHandleByUUID, b"GPU-nope")]
            out["release_all"] = CTL.release_all()
            out["lookups"] = [N.nvmlDeviceGetIndex(finish(r)["value"]) for r in (by_index, by_uuid)]
            out["release_none"] = CTL.release_all()

            # With both a GPU and a "*" block set, releasing one leaves the caller blocked by the other.
            CTL.block(0, "nvmlDeviceGetName")
            CTL.block("*", "nvmlDeviceGetName")
            both = hang(N.nvmlDeviceGetName, h[0])
            CTL.wait_blocked(1)
            CTL.release(0, "nvmlDeviceGetName")
            time.sleep(0.2)
            out["both"] = ["rc" in both, CTL.blocked_waiting()]
            with CTL.blocked(0, "nvmlDeviceGetSerial"):
                out["in_with"] = gpu_field("blocks", 0)
            out["after_with"] = gpu_field("blocks", 0)
            CTL.release("*", "nvmlDeviceGetName")
            out["name"] = txt(finish(both)["value"])
            """
        )
    )
    assert out["gpu0"] == GPUS[0]["uuid"]
    assert out["by_uuid"] == ["nvmlDeviceGetUUID", "1", None]
    assert out["release_by_index"] == "ok"
    assert out["one"] == GPUS[1]["uuid"]
    assert out["any"] == ["nvmlDeviceGetMinorNumber", "1", "1"]
    assert out["minors"] == [0, 5]
    assert out["lookups_free"] == [3, 2, 0, 6]
    assert out["release_all"] == "ok released=2"
    assert out["lookups"] == [2, 1]
    assert out["release_none"] == "ok released=0"
    assert out["both"] == [False, 1]
    assert out["in_with"] == "nvmlDeviceGetSerial" and out["after_with"] is None
    assert out["name"] == GPUS[0]["name"]


def test_bad_block_commands_get_errors(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        bad = ["block", "block 0", "block 0 nvmlDeviceGetUUID extra", "block 0 nvmlDeviceGetFrobnicate",
               "block 0 nvmlDeviceGetPciInfo_v4", "block 0 nvmlErrorString", "block 0 nvmldevicegetuuid",
               "block 8 nvmlDeviceGetUUID", "block GPU-nope nvmlDeviceGetUUID", "block 0 nvmlInit_v2",
               "block 0 nvmlShutdown", "block 0 nvmlDeviceGetCount_v2", "release 0 nvmlDeviceGetUUID",
               "release * nvmlInit_v2", "release", "release everything"]
        out["errors"] = {c: ctl_error(CTL.send, c) for c in bad}
        out["python"] = [ctl_error(CTL.block, 0, "nvmlDeviceGetFrobnicate")]
        for args in [(0, "two words"), ("", "nvmlDeviceGetUUID"), (0, '"q"')]:
            try:
                CTL.block(*args)
            except ValueError:
                out["python"].append("ValueError")
        out["state"] = CTL.state().split(" | ")[0]
        out["alive"] = txt(N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByIndex(0)))
        """
    )
    errors = out["errors"]
    assert all(e is not None and e.startswith("error: ") for e in errors.values()), errors
    assert errors["block 0 nvmlDeviceGetFrobnicate"] == (
        "error: block: unknown function 'nvmlDeviceGetFrobnicate' (an NVML entry point this fake exports)"
    )
    assert errors["block 0 nvmlErrorString"].startswith("error: block: unknown function")
    assert errors["block 8 nvmlDeviceGetUUID"] == "error: block: unknown gpu '8'"
    assert errors["block 0 nvmlInit_v2"] == "error: block: nvmlInit_v2 takes no device: use '*'"
    assert errors["release 0 nvmlDeviceGetUUID"] == "error: release: 0 nvmlDeviceGetUUID is not blocked"
    assert out["python"][0].startswith("error: block: unknown function")
    assert out["python"][1:] == ["ValueError"] * 3
    assert "blocked_waiting=0 blocked_calls=0 any_blocks=-" in out["state"]
    assert out["alive"] == GPUS[0]["uuid"]


def test_shutdown_under_a_blocked_call_and_blocked_init_shutdown_wait(rig: Rig) -> None:
    out = rig.run(
        with_hang(
            """
            N.nvmlInit()
            h0 = N.nvmlDeviceGetHandleByIndex(0)
            s = N.nvmlEventSetCreate()
            N.nvmlDeviceRegisterEvents(h0, N.nvmlEventTypeXidCriticalError, s)
            CTL.block(0, "nvmlDeviceGetUUID")
            CTL.block("*", "nvmlEventSetWait_v2")
            uuid = hang(N.nvmlDeviceGetUUID, h0)
            wait = hang(N.nvmlEventSetWait_v2, s, 10000)
            CTL.wait_blocked(2)
            t = time.monotonic()
            N.nvmlShutdown()  # the last reference: NVML is down under both callers
            out["shutdown_s"] = time.monotonic() - t
            out["down"] = [code(N.nvmlDeviceGetCount), header("refcount"), header("blocked_waiting")]
            CTL.release_all()
            out["after_shutdown"] = [finish(uuid), finish(wait)]

            # Blocked nvmlInit / nvmlShutdown themselves: released, they do their work.
            CTL.block("*", "nvmlInitWithFlags")
            init = hang(N.nvmlInit)
            CTL.wait_blocked(1)
            out["init_blocked"] = [header("refcount"), header("any_blocks"), CTL.calls().get("nvmlInitWithFlags")]
            CTL.release("*", "nvmlInitWithFlags")
            out["init"] = [finish(init), header("refcount")]
            N.nvmlInit()
            CTL.block("*", "nvmlShutdown")
            shut = hang(N.nvmlShutdown)
            CTL.wait_blocked(1)
            out["shutdown_blocked"] = [header("refcount"), N.nvmlDeviceGetCount()]
            CTL.release("*", "nvmlShutdown")
            out["shutdown"] = [finish(shut), header("refcount")]

            # A block released after nvmlShutdown and a new nvmlInit answers normally again.
            CTL.block(0, "nvmlDeviceGetUUID")
            again = hang(N.nvmlDeviceGetUUID, h0)
            CTL.wait_blocked(1)
            N.nvmlShutdown()
            N.nvmlInit()
            CTL.release(0, "nvmlDeviceGetUUID")
            out["reinit"] = [finish(again)["rc"], txt(again.get("value"))]
            out["total"] = header("blocked_calls")
            """
        )
    )
    assert out["shutdown_s"] < 1.0
    assert out["down"] == [1, "0", "2"]
    assert out["after_shutdown"] == [{"rc": 1}, {"rc": 1}]  # NVML_ERROR_UNINITIALIZED
    assert out["init_blocked"] == ["0", "nvmlInitWithFlags", 2]  # the child's first nvmlInit and this one
    assert out["init"] == [{"rc": 0, "value": None}, "1"]
    assert out["shutdown_blocked"] == ["2", 8]
    assert out["shutdown"] == [{"rc": 0, "value": None}, "1"]
    assert out["reinit"] == [0, GPUS[0]["uuid"]]
    assert out["total"] == "5"


def test_lost_gpu_under_a_blocked_call_and_fork(rig: Rig) -> None:
    out = rig.run(
        with_hang(
            """
            import os
            N.nvmlInit()
            h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
            CTL.block(0, "nvmlDeviceGetRemappedRows")
            rows = hang(N.nvmlDeviceGetRemappedRows, h0)
            CTL.wait_blocked(1)
            CTL.lose(0)
            # A fork child has none of the parent's blocked callers; its NVML still answers.
            pid = os.fork()
            if pid == 0:
                os._exit(0 if N.nvmlDeviceGetRemappedRows(h1) == (0, 0, 0, 0) else 3)
            out["child"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            out["lost_now"] = code(N.nvmlDeviceGetRemappedRows, h0)  # fails at once, does not block
            CTL.release(0, "nvmlDeviceGetRemappedRows")
            out["rows"] = finish(rows)
            """
        )
    )
    assert out["child"] == 0
    assert out["lost_now"] == 15
    assert out["rows"] == {"rc": 15}  # GPU_IS_LOST: validated again once released


# Child body: nvplug's own probe, scan, process-listing and event-watch paths, each run once to
# learn which entry points it uses, then once per entry point with that one blocked on GPU 0 (by
# "*" for calls without a device), which they all use; blocked, the path must hang, and released,
# return what it returned unblocked.
NVPLUG_PATHS = """
import dataclasses
from nvplug.sources import nvml_discovery as D
N.nvmlInit()
uuid0 = txt(N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByIndex(0)))
nvml = D.Nvml(Path("/nonexistent"), Path("/nonexistent"))
def watch():  # the calls of nvml_events.py's subscribe and wait loop
    s = N.nvmlEventSetCreate()
    h = N.nvmlDeviceGetHandleByUUID(uuid0)
    N.nvmlDeviceRegisterEvents(h, N.nvmlDeviceGetSupportedEventTypes(h) & N.nvmlEventTypeXidCriticalError, s)
    rc = code(N.nvmlEventSetWait_v2, s, 0)
    N.nvmlEventSetFree(s)
    return rc
def timeless(probe):  # a probe says when its reads began: the same findings later are the same result
    return dataclasses.replace(probe, started=None)
def scan():
    found = nvml.scan()
    return dataclasses.replace(found, probes=tuple(map(timeless, found.probes)))
paths = [("probe", lambda: timeless(D.probe_gpu(uuid0, "test"))), ("scan", scan),
         ("processes", lambda: nvml.processes(uuid0)), ("watch", watch)]
out["paths"] = {}
for name, path in paths:
    CTL.reset_calls()
    normal = path()
    used = sorted(CTL.calls())
    held = {}
    for fn in used:
        try:
            CTL.block(0, fn)
        except ControlError:  # no device to name it by
            CTL.block("*", fn)
        res = {}
        th = threading.Thread(target=lambda: res.setdefault("r", path()), daemon=True)
        th.start()
        CTL.wait_blocked(1)
        time.sleep(0.02)
        stuck = th.is_alive()
        CTL.release_all()
        th.join(10)
        held[fn] = [stuck, res.get("r") == normal]
    out["paths"][name] = held
out["mig"] = [len(g.mig) for g in nvml.scan().discovery.gpus]
out["pids"] = nvml.processes(uuid0)
"""


@pytest.mark.parametrize("mig", [False, True], ids=["default", "mig"])
def test_every_call_of_nvplugs_paths_can_block(rig: Rig, mig: bool) -> None:
    scenario = None
    if mig:  # a MIG GPU 0, so that the scan reads MIG handles: they block as their parent GPU
        scenario = rig.scenario(
            """
            gpu uuid=GPU-m0 bus=0000:01:00.0 minor=0 mig=1 procs=100,200:graphics@2/0
            gpu uuid=GPU-m1 bus=0000:02:00.0 minor=1
            link 0 1 nvlink=4 pcie=NODE
            mig 0 3g.40gb gi=2
            mig 0 1g.10gb
            """
        )
    out = rig.run(NVPLUG_PATHS, scenario)
    paths = out["paths"]
    # What these paths call today; a new call there shows up here and is checked the same way.
    assert {
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetRemappedRows",
    } <= set(paths["probe"])
    assert {"nvmlInitWithFlags", "nvmlShutdown", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2"} <= set(
        paths["scan"]
    )
    assert {"nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2", "nvmlEventSetFree"} <= set(
        paths["watch"]
    )
    assert len(paths["processes"]) >= 3
    if mig:
        assert out["mig"] == [2, 0] and out["pids"] == [100, 200]
        assert {"nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetAttributes_v2", "nvmlDeviceGetGpuInstanceId"} <= (
            set(paths["scan"])
        )
    for name, held in paths.items():
        assert held == {fn: [True, True] for fn in held}, (name, held)


# ---- compute mode --------------------------------------------------------------------------

# pynvml's NVML_COMPUTEMODE_* values and the nvmlReturn_t codes these tests expect.
DEFAULT, EXCLUSIVE_THREAD, PROHIBITED, EXCLUSIVE_PROCESS = 0, 1, 2, 3
INVALID_ARGUMENT, NOT_SUPPORTED, NO_PERMISSION, GPU_IS_LOST = 2, 3, 4, 15

CM_HELPERS = """
def modes(n):
    return [N.nvmlDeviceGetComputeMode(N.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
def set_mode(i, mode):
    return code(N.nvmlDeviceSetComputeMode, N.nvmlDeviceGetHandleByIndex(i), mode)
"""


def cm_body(body: str) -> str:
    """A child body with the compute-mode helpers in front."""
    return CM_HELPERS + textwrap.dedent(body)


def test_compute_mode_get_set_and_return_codes(rig: Rig) -> None:
    scenario = rig.scenario(
        """
        gpu uuid=GPU-a minor=0 bus=0000:01:00.0
        gpu uuid=GPU-b minor=1 bus=0000:02:00.0 compute_mode=2
        gpu uuid=GPU-c minor=2 bus=0000:03:00.0 compute_mode=EXCLUSIVE_PROCESS
        gpu uuid=GPU-d minor=3 bus=0000:04:00.0 unsupported=compute_mode
        """
    )
    out = rig.run(
        cm_body(
            """
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            h0 = ctypes.c_void_p()
            out["uninit"] = [lib.nvmlDeviceGetComputeMode(h0, ctypes.byref(ctypes.c_int())),
                             lib.nvmlDeviceSetComputeMode(h0, 3)]
            N.nvmlInit()
            out["initial"] = modes(3)
            CTL.reset_calls()
            out["set3"] = [set_mode(0, N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS), modes(3)]
            out["set2"] = [set_mode(0, N.NVML_COMPUTEMODE_PROHIBITED), modes(1)]
            out["bad"] = [set_mode(0, m) for m in (N.NVML_COMPUTEMODE_EXCLUSIVE_THREAD, 4, 99, -1)]
            out["after_bad"] = modes(1)
            out["set0"] = [set_mode(0, N.NVML_COMPUTEMODE_DEFAULT), set_mode(2, 0), modes(3)]
            out["null"] = lib.nvmlDeviceGetComputeMode(N.nvmlDeviceGetHandleByIndex(0), None)
            h3 = N.nvmlDeviceGetHandleByIndex(3)
            out["unsupported"] = [code(N.nvmlDeviceGetComputeMode, h3), code(N.nvmlDeviceSetComputeMode, h3, 0),
                                  ctl_error(CTL.compute_mode, 3), ctl_error(CTL.set_compute_mode, 3, 0)]
            out["calls"] = CTL.calls()
            set_mode(1, 3)
            out["state"] = CTL.state().split(" | ")[1:]
            out["ctl"] = [CTL.compute_mode(i) for i in range(3)] + [CTL.compute_mode("GPU-b")]
            CTL.lose(1)
            h1 = N.nvmlDeviceGetHandleByIndex(1)
            out["lost"] = [code(N.nvmlDeviceGetComputeMode, h1), code(N.nvmlDeviceSetComputeMode, h1, 0),
                           ctl_error(CTL.set_compute_mode, 1, 0), CTL.compute_mode(1)]
            CTL.restore(1)
            N.nvmlShutdown()
            out["shut"] = [code(N.nvmlDeviceGetComputeMode, h1), code(N.nvmlDeviceSetComputeMode, h1, 0)]
            """
        ),
        scenario,
    )
    assert out["uninit"] == [1, 1]
    assert out["initial"] == [DEFAULT, PROHIBITED, EXCLUSIVE_PROCESS]
    assert out["set3"] == [0, [EXCLUSIVE_PROCESS, PROHIBITED, EXCLUSIVE_PROCESS]]
    assert out["set2"] == [0, [PROHIBITED]]
    # EXCLUSIVE_THREAD's support is removed; the others are no mode at all; nothing changes.
    assert out["bad"] == [INVALID_ARGUMENT] * 4
    assert out["after_bad"] == [PROHIBITED]
    assert out["set0"] == [0, 0, [DEFAULT, PROHIBITED, DEFAULT]]
    assert out["null"] == INVALID_ARGUMENT
    assert out["unsupported"] == [
        NOT_SUPPORTED,
        NOT_SUPPORTED,
        "error: compute_mode: the GPU has unsupported=compute_mode",
        "error: compute_mode: the GPU has unsupported=compute_mode",
    ]
    assert out["calls"]["nvmlDeviceSetComputeMode"] == 9
    assert out["state"] == [
        "0 GPU-a ok ra=0 cm=0",
        "1 GPU-b ok ra=0 cm=3",
        "2 GPU-c ok ra=0 cm=0",
        "3 GPU-d ok ra=0 cm=0",
    ]
    assert out["ctl"] == [DEFAULT, EXCLUSIVE_PROCESS, DEFAULT, EXCLUSIVE_PROCESS]
    assert out["lost"] == [GPU_IS_LOST, GPU_IS_LOST, "error: compute_mode: the GPU is lost", EXCLUSIVE_PROCESS]
    assert out["shut"] == [1, 1]
    # Every successful set went to the state file: the GPUs set since, by UUID, the last mode each.
    assert fakenvml_library.persisted_compute_modes(rig.env(scenario)) == {"GPU-a": 0, "GPU-b": 3, "GPU-c": 0}
    assert fakenvml_library.persisted_compute_modes(rig.root) == fakenvml_library.persisted_compute_modes(
        rig.root / fakenvml_library.STATE_FILE
    )
    assert sorted(p.name for p in rig.root.iterdir()) == [
        "ctl",
        "ctl.journal",
        "fakenvml.state",
        "fakenvml.state.lock",
        "test.scenario",
    ]


def test_compute_mode_is_driver_state_surviving_a_sigkilled_process(rig: Rig) -> None:
    u = [g["uuid"] for g in GPUS]
    # A daemon: sets GPU 2 to EXCLUSIVE_PROCESS, then reads all modes when told to, and hangs.
    daemon_body = cm_body(
        """
        N.nvmlInit()
        out["set"] = set_mode(2, N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        print("set", flush=True)
        sys.stdin.readline()
        out["seen"] = modes(4)
        print(json.dumps(out), flush=True)
        sys.stdin.readline()
        """
    )
    daemon = subprocess.Popen(
        rig.argv(daemon_body),
        env=rig.env(None),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert daemon.stdout is not None and daemon.stdin is not None
        assert daemon.stdout.readline() == "set\n"
        persisted_while_running = fakenvml_library.persisted_compute_modes(rig.env(None))
        # Another process of the node, with a control socket of its own beside the daemon's
        # (as `nvplug doctor` has): it sees the daemon's mode and sets one the daemon then sees.
        cli_env = rig.env(None)
        cli_env["FAKE_NVML_CONTROL"] = str(rig.root / "cli.ctl")
        cli = rig.run(
            cm_body(
                """
                N.nvmlInit()
                out["modes"] = modes(4)
                out["set"] = set_mode(3, N.NVML_COMPUTEMODE_PROHIBITED)
                out["ctl"] = CTL.compute_mode(3)
                """
            ),
            env=cli_env,
            ctl=rig.root / "cli.ctl",
        )
        daemon.stdin.write("go\n")
        daemon.stdin.flush()
        seen = json.loads(daemon.stdout.readline())
        assert fakenvml_control.Control(rig.ctl).compute_mode(2) == EXCLUSIVE_PROCESS
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(10)
    finally:
        daemon.kill()
        daemon.wait(10)
    assert daemon.returncode == -signal.SIGKILL
    assert persisted_while_running == {u[2]: EXCLUSIVE_PROCESS}
    assert [cli["modes"], cli["set"], cli["ctl"]] == [[DEFAULT, DEFAULT, EXCLUSIVE_PROCESS, DEFAULT], 0, PROHIBITED]
    assert seen == {"set": 0, "seen": [DEFAULT, DEFAULT, EXCLUSIVE_PROCESS, PROHIBITED]}
    # Nobody has the library loaded now: the modes are in the state file.
    assert fakenvml_library.persisted_compute_modes(rig.env(None)) == {u[2]: EXCLUSIVE_PROCESS, u[3]: PROHIBITED}

    # A restarted daemon reads them and restores the old modes, one through NVML, one as an operator.
    out = rig.run(
        cm_body(
            """
            N.nvmlInit()
            out["restart"] = modes(8)
            out["state"] = CTL.state().split(" | ")[3]
            out["restore"] = [set_mode(2, N.NVML_COMPUTEMODE_DEFAULT), CTL.set_compute_mode(3, 0)]
            out["after"] = modes(4)
            """
        )
    )
    assert out["restart"] == [DEFAULT, DEFAULT, EXCLUSIVE_PROCESS, PROHIBITED] + [DEFAULT] * 4
    assert out["state"] == f"2 {u[2]} ok ra=0 cm=3"
    assert out["restore"] == [0, "ok"]
    assert out["after"] == [DEFAULT] * 4
    assert fakenvml_library.persisted_compute_modes(rig.env(None)) == {u[2]: DEFAULT, u[3]: DEFAULT}
    assert not [p.name for p in rig.root.iterdir() if p.name.endswith(".tmp")]

    # Another simulated node (another directory) has driver state of its own.
    other = rig.root / "other"
    other.mkdir()
    other_env = fakenvml_library.environ(rig.lib_dir, fakenvml_library.DEFAULT_SCENARIO, other / "ctl", rig.env(None))
    assert other_env["FAKE_NVML_STATE_DIR"] == str(other)
    rig.run(
        cm_body('N.nvmlInit(); set_mode(5, 3); CTL.send("compute_mode 6 EXCLUSIVE_PROCESS")'),
        env=other_env,
        ctl=other / "ctl",
    )
    assert fakenvml_library.persisted_compute_modes(other_env) == {u[5]: 3, u[6]: 3}
    assert fakenvml_library.persisted_compute_modes(rig.env(None)) == {u[2]: DEFAULT, u[3]: DEFAULT}


def test_compute_mode_kept_by_uuid_across_remove_and_add_and_lost_with_the_file(rig: Rig) -> None:
    u7 = GPUS[7]["uuid"]
    out = rig.run(
        cm_body(
            f"""
            import os
            N.nvmlInit()
            out["set"] = set_mode(7, 3)
            CTL.remove(7)
            N.nvmlShutdown(); N.nvmlInit()
            out["count"] = N.nvmlDeviceGetCount()
            out["gone"] = CTL.compute_mode("{u7}")
            out["add"] = CTL.add("uuid={u7} minor=7 bus=0000:DB:00.0 compute_mode=0")
            out["add2"] = CTL.add("uuid=GPU-new minor=9 bus=0000:E1:00.0 compute_mode=PROHIBITED")
            N.nvmlShutdown(); N.nvmlInit()
            out["back"] = [N.nvmlDeviceGetComputeMode(N.nvmlDeviceGetHandleByUUID(u)) for u in ("{u7}", "GPU-new")]
            out["names"] = [CTL.set_compute_mode(0, 1), N.nvmlDeviceGetComputeMode(N.nvmlDeviceGetHandleByIndex(0)),
                            CTL.send("compute_mode 0 exclusive_process"), CTL.compute_mode(0)]
            # The driver reloaded: every GPU back to its gpu line's mode.
            os.unlink(os.path.join(os.path.dirname(sys.argv[1]), "{fakenvml_library.STATE_FILE}"))
            out["reload"] = [modes(1), N.nvmlDeviceGetComputeMode(N.nvmlDeviceGetHandleByUUID("{u7}")),
                             N.nvmlDeviceGetComputeMode(N.nvmlDeviceGetHandleByUUID("GPU-new"))]
            bad = ["compute_mode", "compute_mode 0 4", "compute_mode 0 -1", "compute_mode 0 x", "compute_mode 0 1 2",
                   "compute_mode 99", "compute_mode GPU-nope 0"]
            out["errors"] = {{c: ctl_error(CTL.send, c) for c in bad}}
            """
        )
    )
    assert out["set"] == 0
    assert out["count"] == 7
    assert out["gone"] == EXCLUSIVE_PROCESS
    assert out["add"] == f"ok pending {u7}" and out["add2"] == "ok pending GPU-new"
    # The driver state knows the GPU by UUID: its line's compute_mode=0 is what it had before a set.
    assert out["back"] == [EXCLUSIVE_PROCESS, PROHIBITED]
    assert out["names"] == ["ok", EXCLUSIVE_THREAD, "ok", EXCLUSIVE_PROCESS]
    assert out["reload"] == [[DEFAULT], DEFAULT, PROHIBITED]
    errors = out["errors"]
    assert errors["compute_mode"] == "error: compute_mode: missing gpu (index or UUID)"
    assert errors["compute_mode 0 4"] == "error: compute_mode: bad mode '4' (0-3 or a name)"
    assert errors["compute_mode 0 1 2"].startswith("error: usage: compute_mode <gpu> [0-3|DEFAULT|")
    assert errors["compute_mode 99"] == "error: compute_mode: unknown gpu '99'"
    assert all(e is not None and e.startswith("error: ") for e in errors.values()), errors


def test_compute_mode_limits_the_processes(rig: Rig) -> None:
    out = rig.run(
        PROCS_HELPERS
        + cm_body(
            """
            from nvplug.testing.fakenvml_devices import GpuProcess as P
            N.nvmlInit()
            h0, h1, h2 = (N.nvmlDeviceGetHandleByIndex(i) for i in range(3))
            out["default_two"] = CTL.procs(0, [1, 2])
            CTL.procs(0, [])
            out["set"] = CTL.set_compute_mode(0, 3)
            out["two"] = ctl_error(CTL.procs, 0, [1, P(2, kinds=("compute", "graphics"))])
            # MPS: the server is the one compute process, its clients are KIND mps.
            out["mps"] = CTL.procs(0, [P(10, 100), P(11, 5, ("mps",)), P(12, 6, ("mps",)), P(13, kinds=("graphics",))])
            out["mps_lists"] = lists(h0)
            out["state"] = CTL.state().split(" | ")[1]
            CTL.set_compute_mode(0, 1)   # the removed EXCLUSIVE_THREAD: one context too
            out["thread"] = ctl_error(CTL.procs, 0, [1, 2])
            CTL.set_compute_mode(1, 2)
            out["prohibited"] = [ctl_error(CTL.procs, 1, [5]), ctl_error(CTL.procs, 1, [P(6, kinds=("mps",))]),
                                 CTL.procs(1, [P(7, kinds=("graphics",))])]
            # Setting a mode over processes that break it: NVML succeeds, they keep running.
            CTL.procs(2, [20, 21, P(22, kinds=("mps",))])
            out["over"] = [set_mode(2, 3), set_mode(2, 2), lists(h2)]
            set_mode(2, 3)
            out["again"] = [ctl_error(CTL.procs, 2, [20, 21]), CTL.procs(2, [20]), CTL.procs(2, [])]
            out["add"] = ctl_error(CTL.add, "uuid=GPU-new minor=9 bus=0000:E1:00.0 compute_mode=3 procs=1,2")
            """
        )
    )
    uuid = GPUS[0]["uuid"]
    assert out["default_two"] == "ok"
    assert out["set"] == "ok"
    assert out["two"] == (
        f"error: procs: process 2: {uuid} is in compute mode EXCLUSIVE_PROCESS (3): "
        "one compute process at most (an MPS server; its clients are KIND mps)"
    )
    assert out["mps"] == "ok"
    mib = 1 << 20
    assert out["mps_lists"] == [
        [[10, 100 * mib, NA, NA]],
        [[13, None, NA, NA]],
        [[11, 5 * mib, NA, NA], [12, 6 * mib, NA, NA]],
    ]
    assert out["state"] == f"0 {uuid} ok ra=0 cm=3 procs=10:100,11:5:mps,12:6:mps,13:graphics"
    assert "is in compute mode EXCLUSIVE_THREAD (1): one compute process at most" in out["thread"]
    uuid1 = GPUS[1]["uuid"]
    assert out["prohibited"] == [
        f"error: procs: process 5: {uuid1} is in compute mode PROHIBITED (2): no compute or MPS processes",
        f"error: procs: process 6: {uuid1} is in compute mode PROHIBITED (2): no compute or MPS processes",
        "ok",
    ]
    assert out["over"] == [0, 0, [[[20, None, NA, NA], [21, None, NA, NA]], [], [[22, None, NA, NA]]]]
    assert out["again"][0].startswith("error: procs: process 21: ") and out["again"][1:] == ["ok", "ok"]
    assert out["add"] == (
        "error: add: process 2: GPU-new is in compute mode EXCLUSIVE_PROCESS (3): "
        "one compute process at most (an MPS server; its clients are KIND mps)"
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("gpu uuid=GPU-b minor=1 bus=0000:02:00.0 compute_mode=4", "bad value for compute_mode: '4'"),
        ("gpu uuid=GPU-b minor=1 bus=0000:02:00.0 compute_mode=exclusive", "bad value for compute_mode"),
        ("gpu uuid=GPU-b minor=1 bus=0000:02:00.0 compute_mode=3 procs=1,2:mps,3", "process 3: GPU-b is in compute"),
        ("gpu uuid=GPU-b minor=1 bus=0000:02:00.0 procs=1:mps compute_mode=PROHIBITED", "process 1: GPU-b is in"),
    ],
)
def test_bad_compute_mode_scenario_lines(rig: Rig, line: str, message: str) -> None:
    scenario = rig.scenario(f"gpu uuid=GPU-a minor=0 bus=0000:01:00.0\n{line}\n")
    out = rig.run('out["init"] = code(N.nvmlInit)', scenario)
    assert out["init"] == 999
    assert message in out["_stderr"]


def test_compute_mode_of_mig_gpus_and_mig_handles(rig: Rig) -> None:
    scenario = rig.scenario(
        """
        gpu uuid=GPU-mig0 bus=0000:01:00.0 minor=0 mig=1 compute_mode=3 procs=1@1/0,2@2/0
        gpu uuid=GPU-full bus=0000:02:00.0 minor=1
        mig 0 3g.40gb gi=1
        mig 0 2g.20gb gi=2
        """
    )
    out = rig.run(
        cm_body(
            """
            from nvplug.testing.fakenvml_devices import GpuProcess as P
            N.nvmlInit()
            h = N.nvmlDeviceGetHandleByIndex(0)
            m = N.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
            out["gpu"] = [N.nvmlDeviceGetComputeMode(h), set_mode(0, 0), set_mode(0, 3), set_mode(0, 1)]
            out["mig"] = [code(N.nvmlDeviceGetComputeMode, m), code(N.nvmlDeviceSetComputeMode, m, 0)]
            out["ctl"] = [CTL.compute_mode(0), ctl_error(CTL.set_compute_mode, 0, 0)]
            # No compute-mode reservations in MIG mode: one compute process per MIG device and more.
            out["procs"] = CTL.procs(0, [P(3, mig=(1, 0)), P(4, mig=(1, 0)), P(5, mig=(2, 0))])
            CTL.mig_mode(0, False)
            out["mig_off"] = [N.nvmlDeviceGetComputeMode(h), ctl_error(CTL.procs, 0, [6, 7]), set_mode(0, 0),
                              modes(2)]
            """
        ),
        scenario,
    )
    assert out["gpu"] == [EXCLUSIVE_PROCESS, NOT_SUPPORTED, NOT_SUPPORTED, INVALID_ARGUMENT]
    assert out["mig"] == [NOT_SUPPORTED, NOT_SUPPORTED]
    assert out["ctl"] == [EXCLUSIVE_PROCESS, "error: compute_mode: not supported on a GPU in MIG mode"]
    assert out["procs"] == "ok"
    assert out["mig_off"][0] == EXCLUSIVE_PROCESS
    assert out["mig_off"][1].startswith("error: procs: process 7: GPU-mig0 is in compute mode EXCLUSIVE_PROCESS (3)")
    assert out["mig_off"][2:] == [0, [DEFAULT, DEFAULT]]


def test_compute_mode_set_can_block(rig: Rig) -> None:
    out = rig.run(
        with_hang(
            """
            N.nvmlInit()
            h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
            CTL.block(0, "nvmlDeviceSetComputeMode")
            res = hang(N.nvmlDeviceSetComputeMode, h0, 3)
            CTL.wait_blocked(1)
            out["other_gpu"] = code(N.nvmlDeviceSetComputeMode, h1, 3)
            out["while"] = [N.nvmlDeviceGetComputeMode(h0), gpu_field("blocks", 0), CTL.compute_mode(0)]
            CTL.release(0, "nvmlDeviceSetComputeMode")
            out["res"] = finish(res)
            out["after"] = [N.nvmlDeviceGetComputeMode(h0), N.nvmlDeviceGetComputeMode(h1)]
            """
        )
    )
    assert out["other_gpu"] == 0
    assert out["while"] == [DEFAULT, "nvmlDeviceSetComputeMode", DEFAULT]
    assert out["res"] == {"value": None, "rc": 0}
    assert out["after"] == [EXCLUSIVE_PROCESS, EXCLUSIVE_PROCESS]


def test_compute_mode_set_needs_root(rig: Rig) -> None:
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root (to run a child as another user) and a system python3")
    import pynvml

    # Everything the other user's child needs, readable by it: /tmp/fnv-* and the venv are root's.
    shared = Path(tempfile.mkdtemp(prefix="fnv-user-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        shutil.copy(rig.lib_dir / fakenvml_library.LIB_NAME, shared)
        shutil.copy(pynvml.__file__, shared)
        shutil.copy(fakenvml_library.DEFAULT_SCENARIO, shared / "node.scenario")
        env = fakenvml_library.environ(shared, shared / "node.scenario", rig.ctl, rig.env(None), state_dir=shared)
        rig.run(cm_body("N.nvmlInit(); out['set'] = set_mode(1, 3)"), env=env)
        user_env = {k: env[k] for k in ("LD_LIBRARY_PATH", "FAKE_NVML_SCENARIO", "FAKE_NVML_STATE_DIR")}
        user_env["PYTHONPATH"] = str(shared)
        child = textwrap.dedent(
            """
            import json, os
            import pynvml as N
            def code(fn, *args):
                try:
                    fn(*args)
                except N.NVMLError as e:
                    return e.value
                return 0
            N.nvmlInit()
            h0, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
            print(json.dumps({
                "euid": os.geteuid(),
                "read": [N.nvmlDeviceGetComputeMode(h0), N.nvmlDeviceGetComputeMode(h1)],
                "set": [code(N.nvmlDeviceSetComputeMode, h0, 3), code(N.nvmlDeviceSetComputeMode, h1, 0)],
                "bad_mode": code(N.nvmlDeviceSetComputeMode, h0, 7),
                "after": [N.nvmlDeviceGetComputeMode(h0), N.nvmlDeviceGetComputeMode(h1)],
            }))
            """
        )
        proc = subprocess.run(
            [python, "-c", child],
            env=user_env,
            cwd=shared,
            user=1001,
            group=1001,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.splitlines()[-1])
        persisted = fakenvml_library.persisted_compute_modes(shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert result == {
        "euid": 1001,
        "read": [DEFAULT, EXCLUSIVE_PROCESS],  # reading needs no root: the mode root set
        "set": [NO_PERMISSION, NO_PERMISSION],
        "bad_mode": INVALID_ARGUMENT,
        "after": [DEFAULT, EXCLUSIVE_PROCESS],
    }
    assert persisted == {GPUS[1]["uuid"]: EXCLUSIVE_PROCESS}


def test_state_file_and_persisted_compute_modes_helpers(tmp_path: Path) -> None:
    assert fakenvml_library.state_file({"FAKE_NVML_STATE_DIR": "/s", "FAKE_NVML_CONTROL": "/n/c"}) == Path(
        "/s/fakenvml.state"
    )
    assert fakenvml_library.state_file({"FAKE_NVML_STATE_DIR": "", "FAKE_NVML_CONTROL": "/n/c"}) is None
    assert fakenvml_library.state_file({"FAKE_NVML_CONTROL": "/n/c"}) == Path("/n/fakenvml.state")
    assert fakenvml_library.state_file({}) is None
    assert fakenvml_library.persisted_compute_modes({}) == {}
    assert fakenvml_library.persisted_compute_modes(tmp_path) == {}
    (tmp_path / fakenvml_library.STATE_FILE).write_text(
        "# comment\n\nGPU-a compute_mode=3\nGPU-b other=1 compute_mode=2  # note\nGPU-c compute_mode=9\nGPU-d\n"
    )
    expected = {"GPU-a": 3, "GPU-b": 2}
    assert fakenvml_library.persisted_compute_modes(tmp_path) == expected
    assert fakenvml_library.persisted_compute_modes(tmp_path / fakenvml_library.STATE_FILE) == expected
    assert fakenvml_library.persisted_compute_modes({"FAKE_NVML_STATE_DIR": str(tmp_path)}) == expected
    assert list(fakenvml_devices.ComputeMode) == [0, 1, 2, 3]


# ---- page retirement lists (before Ampere) -------------------------------------------------

NOT_FOUND, INSUFFICIENT_SIZE, ARGUMENT_VERSION_MISMATCH = 6, 7, 25


def test_retired_pages_before_ampere(rig: Rig) -> None:
    """nvmlDeviceGetRetiredPages(_v2): a cause's pages in retirement order, sized as nvml.h says (the size
    query, INSUFFICIENT_SIZE with the count needed), kept across a reset; NOT_SUPPORTED from Ampere on."""
    scenario = rig.scenario(
        """
        gpu uuid=GPU-v bus=0000:01:00.0 minor=0 cc=7.0
        gpu uuid=GPU-h bus=0000:02:00.0 minor=1
        gpu uuid=GPU-u bus=0000:03:00.0 minor=2 cc=7.0 unsupported=retired_pages
        gpu uuid=GPU-a bus=0000:04:00.0 minor=3 cc=8.0
        """
    )
    out = rig.run(
        """
        N.nvmlInit()
        v, h, u, a = (N.nvmlDeviceGetHandleByIndex(i) for i in range(4))
        SBE = N.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
        DBE = N.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        lib = N.nvmlLib
        out["none"] = [N.nvmlDeviceGetRetiredPages(v, SBE), N.nvmlDeviceGetRetiredPages_v2(v, DBE)]
        before = time.time_ns() // 1000
        out["retire"] = [CTL.retire(0, "dbe", 3), CTL.retire(0, "sbe"), CTL.retire("GPU-v", "dbe")]
        after = time.time_ns() // 1000
        out["window"] = [before, after]
        # pynvml's own wrappers: a size query (count 0, NULL buffers), then a call with room.
        CTL.reset_calls()
        out["dbe"] = N.nvmlDeviceGetRetiredPages(v, DBE)
        out["dbe_calls"] = CTL.calls()
        out["dbe_v2"] = N.nvmlDeviceGetRetiredPages_v2(v, DBE)
        out["sbe"] = N.nvmlDeviceGetRetiredPages(v, SBE)
        # The same by raw calls.
        def raw(v2, room, buffers=True):
            count = ctypes.c_uint(room)
            pages, stamps = (ctypes.c_ulonglong * 8)(), (ctypes.c_ulonglong * 8)()
            args = [v, DBE, ctypes.byref(count), pages if buffers else None]
            if v2:
                args.append(stamps if buffers else None)
            rc = (lib.nvmlDeviceGetRetiredPages_v2 if v2 else lib.nvmlDeviceGetRetiredPages)(*args)
            if rc:
                return [rc, count.value, [], []]
            return [rc, count.value, list(pages[:count.value]), list(stamps[:count.value])]
        out["raw"] = {"size": raw(False, 0, False), "size_v2": raw(True, 0, False), "small": raw(False, 3),
                      "small_v2": raw(True, 2), "exact_v2": raw(True, 4), "room": raw(False, 8),
                      "null_with_room": raw(False, 8, False)}
        out["bad_cause"] = [code(N.nvmlDeviceGetRetiredPages, v, 2), code(N.nvmlDeviceGetRetiredPages_v2, v, 7)]
        out["restore"] = CTL.restore(0)
        out["kept"] = [len(N.nvmlDeviceGetRetiredPages(v, DBE)), len(N.nvmlDeviceGetRetiredPages(v, SBE))]
        # The pending status is its own probe, answered on every GPU as before.
        out["pending"] = [N.nvmlDeviceGetRetiredPagesPendingStatus(x) for x in (v, h, a)]
        out["unsupported"] = [code(f, x, c) for f in (N.nvmlDeviceGetRetiredPages, N.nvmlDeviceGetRetiredPages_v2)
                              for x in (h, u, a) for c in (SBE, DBE)]
        out["ctl_errors"] = [ctl_error(CTL.retire, 1, "dbe"), ctl_error(CTL.retire, 2, "sbe"),
                             ctl_error(CTL.retire, 3, "sbe"), ctl_error(CTL.send, "retire 0 tbe"),
                             ctl_error(CTL.send, "retire 0 sbe 0"), ctl_error(CTL.send, "retire 0"),
                             ctl_error(CTL.send, "retire 0 sbe 256")]
        out["full"] = [CTL.retire(0, "sbe", 255), ctl_error(CTL.retire, 0, "sbe")]
        CTL.lose(0)
        out["lost"] = [code(N.nvmlDeviceGetRetiredPages, v, SBE), code(N.nvmlDeviceGetRetiredPages_v2, v, DBE)]
        """,
        scenario,
    )
    assert out["none"] == [[], []]
    assert out["retire"] == ["ok pages=3", "ok pages=1", "ok pages=4"]
    dbe, sbe = out["dbe"], out["sbe"]
    assert len(dbe) == 4 and len(sbe) == 1
    assert len(set(dbe + sbe)) == 5 and all(p > 0 and p % 4096 == 0 for p in dbe + sbe)
    assert out["dbe_calls"] == {"nvmlDeviceGetRetiredPages": 2}
    assert [p["address"] for p in out["dbe_v2"]] == dbe
    stamps = [p["timestamp"] for p in out["dbe_v2"]]
    # One command stamps its pages alike; realtime microseconds of about now (a clock step aside).
    assert stamps[0] == stamps[1] == stamps[2] <= stamps[3], stamps
    before, after = out["window"]
    assert before - 60_000_000 <= stamps[0] <= stamps[3] <= after + 60_000_000, (stamps, out["window"])
    raw = out["raw"]
    assert raw["size"] == raw["size_v2"] == [INSUFFICIENT_SIZE, 4, [], []]
    assert raw["small"] == raw["small_v2"] == [INSUFFICIENT_SIZE, 4, [], []]
    assert raw["exact_v2"] == [0, 4, dbe, stamps]
    assert raw["room"] == [0, 4, dbe, [0, 0, 0, 0]]  # the unversioned call has no timestamps
    assert raw["null_with_room"][0] == INVALID_ARGUMENT
    assert out["bad_cause"] == [INVALID_ARGUMENT, INVALID_ARGUMENT]
    assert out["restore"] == "ok" and out["kept"] == [4, 1]
    assert out["pending"] == [0, 0, 0]
    assert out["unsupported"] == [NOT_SUPPORTED] * 12
    errors = out["ctl_errors"]
    assert "cc 8.0 or later" in errors[0] and "cc 8.0 or later" in errors[2]
    assert "unsupported=retired_pages" in errors[1]
    assert "cause must be sbe or dbe" in errors[3] and "count must be 1 to 256" in errors[4]
    assert "usage: retire" in errors[5]
    assert "at most 256 kept" in errors[6]
    assert out["full"][0] == "ok pages=256" and "at most 256 kept" in out["full"][1]
    assert out["lost"] == [GPU_IS_LOST, GPU_IS_LOST]


def test_retired_pages_on_the_default_h100s_are_not_supported(rig: Rig) -> None:
    out = rig.run(
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        out["codes"] = [code(N.nvmlDeviceGetRetiredPages, h, 0), code(N.nvmlDeviceGetRetiredPages_v2, h, 1)]
        out["pending"] = N.nvmlDeviceGetRetiredPagesPendingStatus(h)
        out["retire"] = ctl_error(CTL.retire, 0, "sbe")
        """
    )
    assert out["codes"] == [NOT_SUPPORTED, NOT_SUPPORTED]
    assert out["pending"] == 0
    assert out["retire"] is not None and "remaps rows" in out["retire"]


# ---- GPM (Hopper and later) ------------------------------------------------------------------

GPM_IDS = [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 20, 21]

GPM_HELPERS = """
def sample(h, gi=None):
    # Apart from the sample before it even on a coarse clock: a window must have a length.
    time.sleep(0.01)
    s = N.nvmlGpmSampleAlloc()
    if gi is None:
        N.nvmlGpmSampleGet(h, s)
    else:
        N.nvmlGpmMigSampleGet(h, gi, s)
    return s
def metrics(s1, s2, ids=IDS, version=None, num=None):
    # [[id, nvmlReturn, value, shortName, unit], ...], or the call's nvmlReturn_t when it fails
    g = N.c_nvmlGpmMetricsGet_t()
    g.version = N.NVML_GPM_METRICS_GET_VERSION if version is None else version
    g.numMetrics = len(ids) if num is None else num
    g.sample1, g.sample2 = s1, s2
    for i, m in enumerate(ids):
        g.metrics[i].metricId = m
    rc = N.nvmlLib.nvmlGpmMetricsGet(ctypes.byref(g))
    if rc:
        return rc
    return [[m.metricId, m.nvmlReturn, m.value, txt(m.metricInfo.shortName), txt(m.metricInfo.unit)]
            for m in g.metrics[:len(ids)]]
def values(s1, s2, ids=IDS):
    got = metrics(s1, s2, ids)
    assert not isinstance(got, int) and all(m[1] == 0 for m in got), got
    return [m[2] for m in got]
"""


def gpm_body(body: str) -> str:
    """A child body with the GPM helpers in front (IDS: the metric ids the fake models)."""
    return f"IDS = {GPM_IDS!r}\n" + GPM_HELPERS + textwrap.dedent(body)


def test_gpm_support_and_a_constant_level(rig: Rig) -> None:
    """nvmlGpmQueryDeviceSupport: Hopper and later without unsupported=gpm; a window over constant levels
    gives those levels; unmodelled metric ids get NOT_SUPPORTED in their own entry; restore idles the GPU."""
    scenario = rig.scenario(
        """
        gpu uuid=GPU-h bus=0000:01:00.0 minor=0
        gpu uuid=GPU-i bus=0000:02:00.0 minor=1
        gpu uuid=GPU-a bus=0000:03:00.0 minor=2 cc=8.0
        gpu uuid=GPU-n bus=0000:04:00.0 minor=3 unsupported=gpm
        gpu uuid=GPU-b bus=0000:05:00.0 minor=4 cc=10.0
        """
    )
    out = rig.run(
        gpm_body(
            """
            N.nvmlInit()
            h, i, a, n, b = (N.nvmlDeviceGetHandleByIndex(k) for k in range(5))
            out["support"] = [N.nvmlGpmQueryDeviceSupport(x).isSupportedDevice for x in (h, i, a, n, b)]
            out["set"] = CTL.gpm(0, graphics=80, sm=62.5, sm_occupancy=30, integer=5, tensor=45, dfma=1, hmma=40,
                                 imma=4, dram=55, fp64=2, fp32=20, fp16=10, pcie_tx=1500, pcie_rx=2500.25)
            CTL.gpm(4, sm=100)
            s1 = sample(h)
            time.sleep(0.05)
            s2 = sample(h)
            out["constant"] = metrics(s1, s2)
            i1 = sample(i)
            i2 = sample(i)
            out["idle"] = values(i1, i2)
            b1 = sample(b)
            b2 = sample(b)
            out["blackwell"] = values(b1, b2, [2])
            out["other_ids"] = [m[:2] for m in metrics(s1, s2, [2, 8, 30, 60, 0, 476, 1000])]
            out["no_gpm"] = [code(N.nvmlGpmSampleGet, x, N.nvmlGpmSampleAlloc()) for x in (a, n)]
            out["ctl_errors"] = [ctl_error(lambda: CTL.gpm(2, sm=1)), ctl_error(lambda: CTL.gpm(3, sm=1)),
                                 ctl_error(CTL.send, "gpm 0 volts=1"), ctl_error(CTL.send, "gpm 0 sm=100.5"),
                                 ctl_error(CTL.send, "gpm 0 pcie_tx=-1"), ctl_error(CTL.send, "gpm 0 sm=nan"),
                                 ctl_error(CTL.send, "gpm 0 sm"), ctl_error(CTL.send, "gpm 0"),
                                 ctl_error(CTL.send, "gpm 0 fp64=3 bogus=1")]
            k1 = sample(h)
            k2 = sample(h)
            out["kept"] = values(k1, k2, [11])  # the bad line set nothing, not even fp64
            out["restore"] = CTL.restore(0)
            r1 = sample(h)
            r2 = sample(h)
            out["restored"] = values(r1, r2)
            out["window_across_restore"] = values(k1, r2, [2])
            CTL.lose(1)
            out["lost"] = [code(N.nvmlGpmSampleGet, i, N.nvmlGpmSampleAlloc()),
                           code(N.nvmlGpmQueryDeviceSupport, i), values(i1, i2, [2])]
            for s in (s1, s2, i1, i2, b1, b2, k1, k2, r1, r2):
                N.nvmlGpmSampleFree(s)
            """
        ),
        scenario,
    )
    assert out["support"] == [1, 1, 0, 0, 1]
    assert out["set"] == "ok"
    expected = [80, 62.5, 30, 5, 45, 1, 40, 4, 55, 2, 20, 10, 1500, 2500.25]
    constant = out["constant"]
    assert [m[0] for m in constant] == GPM_IDS and all(m[1] == 0 for m in constant), constant
    assert [m[2] for m in constant] == pytest.approx(expected, rel=1e-9)
    assert all(m[3] for m in constant) and [m[4] for m in constant] == ["%"] * 12 + ["MiB/s"] * 2
    assert out["idle"] == [0.0] * len(GPM_IDS)
    assert out["blackwell"] == pytest.approx([100.0], rel=1e-9)
    assert out["other_ids"] == [[2, 0], [8, 3], [30, 3], [60, 3], [0, 3], [476, 3], [1000, 3]]
    assert out["no_gpm"] == [NOT_SUPPORTED, NOT_SUPPORTED]
    errors = out["ctl_errors"]
    assert all(e is not None and e.startswith("error: ") for e in errors), errors
    assert "cc before 9.0" in errors[0] and "unsupported=gpm" in errors[1]
    assert "unknown item 'volts=1'" in errors[2] and "unknown item 'sm'" in errors[6]
    assert "bad value in 'sm=100.5'" in errors[3] and "bad value in 'pcie_tx=-1'" in errors[4]
    assert "bad value in 'sm=nan'" in errors[5] and "usage: gpm" in errors[7]
    assert out["kept"] == pytest.approx([2.0], rel=1e-9)
    assert out["restore"] == "ok" and out["restored"] == [0.0] * len(GPM_IDS)
    # 62.5 % until the restore, 0 after it: some mean in between.
    assert 0 < out["window_across_restore"][0] < 62.5
    assert out["lost"][:2] == [GPU_IS_LOST, GPU_IS_LOST]
    assert out["lost"][2] == [0.0]  # samples taken before keep their figures


def test_gpm_a_level_changed_mid_window_gives_the_time_weighted_mean(rig: Rig) -> None:
    """The mean over a window is time-weighted.  The child brackets each sample and the level change with
    time.monotonic() (CLOCK_MONOTONIC, the clock the fake stamps samples with), so the bounds below hold
    however slow the machine is; the two metrics that changed in one command must agree exactly."""
    out = rig.run(
        gpm_body(
            """
            N.nvmlInit()
            h = N.nvmlDeviceGetHandleByIndex(0)
            CTL.gpm(0, sm=100, pcie_rx=1000)
            s1, s2, s3 = N.nvmlGpmSampleAlloc(), N.nvmlGpmSampleAlloc(), N.nvmlGpmSampleAlloc()
            t = []
            t.append(time.monotonic()); N.nvmlGpmSampleGet(h, s1); t.append(time.monotonic())
            time.sleep(0.2)
            t.append(time.monotonic()); CTL.gpm(0, sm=0, pcie_rx=3000); t.append(time.monotonic())
            time.sleep(0.1)
            t.append(time.monotonic()); N.nvmlGpmSampleGet(h, s2); t.append(time.monotonic())
            time.sleep(0.05)
            N.nvmlGpmSampleGet(h, s3)
            out["t"] = t
            out["mixed"] = values(s1, s2, [2, 21])
            out["after"] = values(s2, s3, [2, 21])
            """
        )
    )
    a1, b1, a2, b2, a3, b3 = out["t"]
    sm, rx = out["mixed"]
    # x: time at the old levels, y: at the new ones; sm = 100 x / (x + y), rx = 1000 + 2000 y / (x + y).
    x_min, x_max = a2 - b1, b2 - a1
    y_min, y_max = a3 - b2, b3 - a2
    assert 100 * x_min / (x_min + y_max) - 1e-6 <= sm <= 100 * x_max / (x_max + y_min) + 1e-6, (sm, out["t"])
    assert 1000 + 2000 * y_min / (y_min + x_max) - 1e-6 <= rx <= 1000 + 2000 * y_max / (y_max + x_min) + 1e-6
    assert 0 < sm < 100 and 1000 < rx < 3000
    assert sm / 100 + (rx - 1000) / 2000 == pytest.approx(1.0, abs=1e-9)
    assert out["after"] == pytest.approx([0.0, 3000.0], rel=1e-9)


def test_gpm_argument_and_sample_checks(rig: Rig) -> None:
    """Versions, numMetrics (any header's NVML_GPM_METRIC_MAX up to 477), and samples: allocated ones only,
    taken, of one GPU, the second later than the first."""
    out = rig.run(
        gpm_body(
            """
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            spare = N.c_nvmlGpmSample_t()
            out["uninit"] = lib.nvmlGpmSampleAlloc(ctypes.byref(spare))
            N.nvmlInit()
            h, h1 = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
            sup = N.c_nvmlGpmSupport_t()
            sup.version = 2
            out["support_version"] = [lib.nvmlGpmQueryDeviceSupport(h, ctypes.byref(sup)), sup.isSupportedDevice,
                                      lib.nvmlGpmQueryDeviceSupport(h, None)]
            CTL.gpm(0, sm=25)
            s1 = sample(h)
            s2 = sample(h)
            other = sample(h1)
            fresh = N.nvmlGpmSampleAlloc()
            # A pointer at memory that even holds the magic number is still not a sample.
            fake = ctypes.cast(ctypes.pointer((ctypes.c_uint * 64)(0x47504D53)), N.c_nvmlGpmSample_t)
            null = N.c_nvmlGpmSample_t()
            out["version"] = [metrics(s1, s2, version=0), metrics(s1, s2, version=2)]
            out["num"] = [metrics(s1, s2, [2], num=478), metrics(s1, s2, [], num=0), len(metrics(s1, s2, [2] * 477))]
            out["samples"] = [metrics(s2, s1), metrics(s1, s1), metrics(s1, other), metrics(other, s2),
                              metrics(s1, fresh), metrics(fake, s2), metrics(s1, null)]
            out["sample_get"] = [code(N.nvmlGpmSampleGet, h, fake), code(N.nvmlGpmSampleGet, h, null),
                                 lib.nvmlGpmSampleAlloc(None), code(N.nvmlGpmSampleFree, fake)]
            out["free"] = [code(N.nvmlGpmSampleFree, fresh), code(N.nvmlGpmSampleFree, fresh),
                           metrics(s1, fresh), code(N.nvmlGpmSampleGet, h, fresh)]
            # A caller built with an older nvml.h: NVML_GPM_METRIC_MAX 98, entries past numMetrics untouched.
            class Old(ctypes.Structure):
                _fields_ = [("version", ctypes.c_uint), ("numMetrics", ctypes.c_uint),
                            ("sample1", N.c_nvmlGpmSample_t), ("sample2", N.c_nvmlGpmSample_t),
                            ("metrics", N.c_nvmlGpmMetric_t * 98), ("guard", ctypes.c_ubyte * 256)]
            old = Old()
            old.version, old.numMetrics, old.sample1, old.sample2 = 1, 98, s1, s2
            for k in range(98):
                old.metrics[k].metricId = 2
            ctypes.memset(old.guard, 0xAB, 256)
            out["old"] = [lib.nvmlGpmMetricsGet(ctypes.byref(old)), sorted({round(m.value, 6) for m in old.metrics}),
                          sorted(set(old.guard))]
            old.numMetrics = 1
            old.metrics[1].metricId = 5
            old.metrics[1].value = -7.0
            out["old_one"] = [lib.nvmlGpmMetricsGet(ctypes.byref(old)), old.metrics[1].value]
            N.nvmlShutdown()
            out["after_shutdown"] = [lib.nvmlGpmMetricsGet(None), lib.nvmlGpmSampleFree(s1)]
            N.nvmlInit()
            out["across_init"] = values(s1, s2, [2])
            """
        )
    )
    assert out["uninit"] == 1  # NVML_ERROR_UNINITIALIZED
    assert out["support_version"] == [ARGUMENT_VERSION_MISMATCH, 0, INVALID_ARGUMENT]
    assert out["version"] == [ARGUMENT_VERSION_MISMATCH, ARGUMENT_VERSION_MISMATCH]
    assert out["num"] == [INVALID_ARGUMENT, [], 477]
    assert out["samples"] == [INVALID_ARGUMENT] * 7
    assert out["sample_get"] == [INVALID_ARGUMENT] * 4
    assert out["free"] == [0, INVALID_ARGUMENT, INVALID_ARGUMENT, INVALID_ARGUMENT]
    assert out["old"] == [0, [25.0], [0xAB]]
    assert out["old_one"] == [0, -7.0]
    assert out["after_shutdown"] == [1, 1]
    assert out["across_init"] == pytest.approx([25.0], rel=1e-9)


def test_gpm_in_mig_mode_samples_gpu_instances(rig: Rig) -> None:
    """A GPU in MIG mode has no whole-GPU sample: nvmlGpmMigSampleGet takes one GPU instance's (NOT_FOUND
    for an id no instance has); samples of different instances, or of an instance and the whole GPU, do
    not make a window."""
    scenario = rig.scenario(
        """
        gpu uuid=GPU-m bus=0000:01:00.0 minor=0 mig=1
        gpu uuid=GPU-p bus=0000:02:00.0 minor=1
        mig 0 3g.40gb gi=2
        mig 0 1g.10gb gi=5
        """
    )
    out = rig.run(
        gpm_body(
            """
            N.nvmlInit()
            m, p = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
            mh = N.nvmlDeviceGetMigDeviceHandleByIndex(m, 0)
            s = N.nvmlGpmSampleAlloc()
            out["support"] = N.nvmlGpmQueryDeviceSupport(m).isSupportedDevice
            out["whole"] = code(N.nvmlGpmSampleGet, m, s)
            CTL.gpm(0, sm=40, dram=12.5)
            g1 = sample(m, 2)
            time.sleep(0.02)
            g2 = sample(m, 2)
            g5 = sample(m, 5)
            out["gi2"] = values(g1, g2, [2, 10])
            out["gi5_after_gi2"] = metrics(g1, g5)
            out["missing"] = [code(N.nvmlGpmMigSampleGet, m, 3, s), code(N.nvmlGpmMigSampleGet, m, 99, s)]
            out["not_mig"] = [code(N.nvmlGpmMigSampleGet, p, 0, s), code(N.nvmlGpmSampleGet, p, s)]
            out["mig_handle"] = [code(N.nvmlGpmSampleGet, mh, s), code(N.nvmlGpmMigSampleGet, mh, 2, s),
                                 code(N.nvmlGpmQueryDeviceSupport, mh)]
            CTL.mig_layout(0, ["7g.80gb"])
            out["relaid"] = [code(N.nvmlGpmMigSampleGet, m, 2, s), code(N.nvmlGpmMigSampleGet, m, 1, s)]
            CTL.mig_mode(0, False)
            out["mig_off"] = [code(N.nvmlGpmMigSampleGet, m, 1, s), code(N.nvmlGpmSampleGet, m, s)]
            out["instance_then_gpu"] = metrics(g2, s)
            """
        ),
        scenario,
    )
    assert out["support"] == 1
    assert out["whole"] == NOT_SUPPORTED
    assert out["gi2"] == pytest.approx([40.0, 12.5], rel=1e-9)
    assert out["gi5_after_gi2"] == INVALID_ARGUMENT
    assert out["missing"] == [NOT_FOUND, NOT_FOUND]
    assert out["not_mig"] == [NOT_SUPPORTED, 0]
    assert out["mig_handle"] == [NOT_SUPPORTED] * 3
    assert out["relaid"] == [NOT_FOUND, 0]
    assert out["mig_off"] == [NOT_SUPPORTED, 0]
    assert out["instance_then_gpu"] == INVALID_ARGUMENT


def test_control_retire_and_gpm_commands(tmp_path: Path) -> None:
    ctl = fakenvml_control.Control(tmp_path / "nobody")
    with pytest.raises(ValueError, match="at least one level"):
        ctl.gpm(0)
    with pytest.raises(ValueError, match="single control-command word"):
        ctl.retire(0, "sbe dbe")  # type: ignore[arg-type]
