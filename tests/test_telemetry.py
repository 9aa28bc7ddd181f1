"""GPU telemetry on /metrics, through the daemon: per GPU in dcgm-exporter's names (Grafana 12239's queries)
or nvplug's, and per container from real processes in real cgroups named as the kubelet names them, placed in
their pods by the kubelet's log records; a GPU whose read hangs is stale, never the scrape."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.notify_socket import NotifySocket
from support.scraped_metrics import Samples, scrape, value
from test_status import get

from nvplug.status import status_client
from nvplug.testing.fakenvml_devices import GpuProcess
from nvplug.testing.pod_cgroups import CgroupsUnavailable, PodCgroups
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with

TIMEOUT = 15.0
MIB = 1 << 20


def serving(node: SimulatedNode, config: str = "", replicas: int = 1) -> list[dict[str, str]]:
    """The daemon serving the node's GPUs, `replicas` devices each, with `config` under `version: v1`."""
    node.config.write_text(f"version: v1\n{config}")
    gpus = node.scenario_gpus()
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(len(gpus) * replicas), TIMEOUT)
    return gpus


@pytest.fixture
def pods(node: SimulatedNode) -> Iterator[PodCgroups]:
    try:
        cgroups = PodCgroups(node.pod_log_root)
    except CgroupsUnavailable as err:
        pytest.skip(str(err))
    try:
        yield cgroups
    finally:
        cgroups.close()


def scrape_later(node: SimulatedNode) -> Samples:
    """A scrape past the once-a-second bound, so that what was just set is read."""
    time.sleep(1.1)
    return scrape(node)


def test_grafana_12239_queries_are_answered_in_dcgm_names(node: SimulatedNode) -> None:
    gpus = serving(node)
    node.control.telemetry(2, util=87, temp=71, power_mw=612500, sm_clock=1755)
    node.control.gpm(2, tensor=35)
    node.control.procs(2, [GpuProcess(4242, 3000)])
    scrape_later(node)  # the first read's GPM sample: the tensor activity needs a window of two
    got = scrape_later(node)
    uuid = gpus[2]["uuid"]
    # The dashboard's panels: temperature, power, SM clock (MHz), utilization (%), framebuffer used (MiB),
    # and tensor core activity (a ratio, as DCGM's profiling fields are).
    assert value(got, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", gpu="2", UUID=uuid) == pytest.approx(0.35)
    assert value(got, "DCGM_FI_DEV_GPU_TEMP", gpu="2", UUID=uuid) == 71
    assert value(got, "DCGM_FI_DEV_POWER_USAGE", gpu="2") == 612.5
    assert value(got, "DCGM_FI_DEV_SM_CLOCK", gpu="2") == 1755
    assert value(got, "DCGM_FI_DEV_GPU_UTIL", gpu="2") == 87
    assert value(got, "DCGM_FI_DEV_FB_USED", gpu="2") == 3000
    (labels, _), *_ = got["DCGM_FI_DEV_GPU_TEMP"]
    assert {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"} <= set(labels), labels
    assert len(got["DCGM_FI_DEV_GPU_TEMP"]) == len(gpus)  # one series per GPU: `label_values(..., gpu)`


def test_dcgm_exporters_default_counters_in_its_units(node: SimulatedNode) -> None:
    """The fields of dcgm-exporter's default-counters.csv that NVML gives: the memory's temperature (°C),
    the video engines' utilization (%) and NVLink's throughput (DCGM's own unit, over the window between two
    reads) among them."""
    serving(node)
    node.control.telemetry(1, mem_temp=61, enc_util=30, dec_util=45, pcie_replays=2, mem_clock=2619)
    node.control.telemetry(1, nvlink_tx=200, nvlink_rx=100)
    assert "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" not in scrape_later(node)  # one read is no window yet
    got = scrape_later(node)
    # 300 MiB/s both ways: 307,200 KiB a second, over 1000.
    assert value(got, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="1") == pytest.approx(307, abs=3)
    assert value(got, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="0") == 0
    assert "nvplug_gpu_nvlink_data_bytes_total" not in got  # nvplug's naming has the counters instead
    # How long the power cap held the clocks down, in ns as DCGM gives it: GPU 1 was capped a second and more.
    node.control.telemetry(1, throttle=0x4)
    capped = value(got, "DCGM_FI_DEV_POWER_VIOLATION", gpu="1")
    assert value(scrape_later(node), "DCGM_FI_DEV_POWER_VIOLATION", gpu="1") - capped >= 1e9
    assert value(got, "DCGM_FI_DEV_MEMORY_TEMP", gpu="1") == 61
    assert value(got, "DCGM_FI_DEV_ENC_UTIL", gpu="1") == 30
    assert value(got, "DCGM_FI_DEV_DEC_UTIL", gpu="1") == 45
    assert value(got, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", gpu="1") == 2
    assert value(got, "DCGM_FI_DEV_MEM_CLOCK", gpu="1") == 2619
    assert value(got, "DCGM_FI_DEV_ENC_UTIL", gpu="0") == 0  # idle: 0, not none


def test_nvplug_naming_in_base_units(node: SimulatedNode) -> None:
    serving(node, "nvplug:\n  telemetry:\n    naming: nvplug\n")
    node.control.telemetry(1, util=50, sm_clock=1500, power_mw=250000, energy_mj=5000, mem_temp=58, dec_util=20)
    node.control.ecc(1, "sbe", 3)
    got = scrape_later(node)
    assert value(got, "nvplug_gpu_utilization_ratio", gpu="1") == 0.5
    assert value(got, "nvplug_gpu_memory_temperature_celsius", gpu="1") == 58
    assert value(got, "nvplug_gpu_decoder_utilization_ratio", gpu="1") == 0.2
    assert value(got, "nvplug_gpu_sm_clock_hertz", gpu="1") == 1.5e9
    assert value(got, "nvplug_gpu_framebuffer_total_bytes", gpu="1") == 81559 * MIB
    assert value(got, "nvplug_gpu_ecc_errors_total", gpu="1", error="corrected", counter="volatile") == 3
    assert value(got, "nvplug_gpu_energy_joules_total", gpu="1") >= 5.0
    # NVLink's counters as NVML keeps them, in bytes: a rate() of them is the throughput.
    node.control.telemetry(1, nvlink_rx=100)
    before = value(got, "nvplug_gpu_nvlink_data_bytes_total", gpu="1", direction="rx")
    got = scrape_later(node)
    grown = value(got, "nvplug_gpu_nvlink_data_bytes_total", gpu="1", direction="rx") - before
    assert grown >= 100 * MIB and grown % 1024 == 0, grown  # over a second and more, at 100 MiB/s
    assert value(got, "nvplug_gpu_nvlink_data_bytes_total", gpu="1", direction="tx") == 0
    # Idle (the simulated GPUs' clocks event reasons) holds the clocks down for low utilization, in seconds.
    assert value(got, "nvplug_gpu_violation_seconds_total", gpu="1", policy="low_utilization") > 1.0
    assert value(got, "nvplug_gpu_violation_seconds_total", gpu="1", policy="thermal") == 0
    assert not any(name.startswith("DCGM_") for name in got)


def test_gpm_activity_is_the_mean_over_the_window_between_two_reads(node: SimulatedNode) -> None:
    serving(node, "nvplug:\n  telemetry:\n    naming: nvplug\n")
    node.control.gpm(3, tensor=40, sm=80, fp16=25, pcie_tx=512)
    first = scrape_later(node)
    assert "nvplug_gpu_tensor_active_ratio" not in first  # one sample is no window yet
    # Half-way through the next window the tensor cores go idle: the figure is the window's mean, between.
    time.sleep(0.6)
    node.control.gpm(3, tensor=0)
    got = scrape_later(node)
    assert 0.0 < value(got, "nvplug_gpu_tensor_active_ratio", gpu="3") < 0.4
    assert value(got, "nvplug_gpu_sm_active_ratio", gpu="3") == pytest.approx(0.8)
    assert value(got, "nvplug_gpu_pipe_active_ratio", gpu="3", pipe="fp16") == pytest.approx(0.25)
    assert value(got, "nvplug_gpu_pcie_throughput_bytes_per_second", gpu="3", direction="tx") == pytest.approx(
        512 * MIB
    )
    assert [v for lab, v in got["nvplug_gpu_sm_active_ratio"] if lab["gpu"] == "2"] == [0.0]  # idle: 0, not none
    # The next window: idle all through.
    assert value(scrape_later(node), "nvplug_gpu_tensor_active_ratio", gpu="3") == pytest.approx(0.0)


def test_two_pods_sharing_a_gpu_each_have_their_own_figures(node: SimulatedNode, pods: PodCgroups) -> None:
    gpus = serving(node)
    a = pods.start("ml", "ts-a")
    b = pods.start("ml", "ts-b", qos="burstable")
    node.control.procs(0, [GpuProcess(a.pid, 1024), GpuProcess(b.pid, 4096)])
    node.control.samples(0, [(a.pid, 60, 20), (b.pid, 10, 4), (a.pid, 40, 10)])
    got = scrape_later(node)
    uuid = gpus[0]["uuid"]
    for pod, mib, util in (("ts-a", 1024, 0.5), ("ts-b", 4096, 0.1)):
        at = {"namespace": "ml", "pod": pod, "container": "main", "device_uuid": uuid}
        assert value(got, "nvplug_container_gpu_memory_used_bytes", **at) == mib * MIB, (pod, got)
        assert value(got, "nvplug_container_gpu_utilization_ratio", **at) == pytest.approx(util), pod
    # The next window has no samples: nobody was busy, and each says so.
    got = scrape_later(node)
    assert value(got, "nvplug_container_gpu_utilization_ratio", pod="ts-a") == 0.0


def test_pod_labels_on_a_time_sliced_gpu_give_each_pod_its_own_dcgm_figures(
    node: SimulatedNode, pods: PodCgroups
) -> None:
    """dcgm-exporter's --kubernetes series, from PodResources: the pods that hold each device; on a shared GPU
    each pod's own utilization and memory, where dcgm-exporter before 4.5.3 copied the device's to each."""
    sliced = "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n"
    gpus = serving(node, sliced + "nvplug:\n  telemetry:\n    podLabels: true\n", replicas=4)
    shared, whole = gpus[0]["uuid"], gpus[1]["uuid"]
    a, b, c = pods.start("ml", "ts-a"), pods.start("ml", "ts-b"), pods.start("ml", "trainer")
    node.kubelet.admit("ml", "ts-a", "main", GPU_RESOURCE, [f"{shared}::0"])
    node.kubelet.admit("ml", "ts-b", "main", GPU_RESOURCE, [f"{shared}::1"])
    node.kubelet.admit("ml", "trainer", "main", GPU_RESOURCE, [f"{whole}::0", f"{whole}::1"])
    node.control.telemetry(0, util=70, temp=64)
    node.control.telemetry(1, util=55)
    node.control.procs(0, [GpuProcess(a.pid, 1024), GpuProcess(b.pid, 4096)])
    node.control.samples(0, [(a.pid, 60, 20), (b.pid, 10, 4)])
    node.control.procs(1, [GpuProcess(c.pid, 2000)])
    got = scrape_later(node)
    for pod, util, mib in (("ts-a", 60, 1024), ("ts-b", 10, 4096)):
        at = {"UUID": shared, "namespace": "ml", "pod": pod, "container": "main"}
        assert value(got, "DCGM_FI_DEV_GPU_UTIL", **at) == util, (pod, got["DCGM_FI_DEV_GPU_UTIL"])
        assert value(got, "DCGM_FI_DEV_FB_USED", **at) == mib, pod
        assert value(got, "DCGM_FI_DEV_GPU_TEMP", **at) == 64, pod  # the device's own, copied
    # One pod on two replicas of a GPU: one series, the device's figures.
    assert [v for lab, v in got["DCGM_FI_DEV_GPU_UTIL"] if lab["UUID"] == whole] == [55]
    assert value(got, "DCGM_FI_DEV_GPU_UTIL", UUID=whole, pod="trainer") == 55
    # A GPU nobody holds: one series, no pod.
    ((free, _),) = [s for s in got["DCGM_FI_DEV_GPU_TEMP"] if s[0]["UUID"] == gpus[2]["uuid"]]
    assert "pod" not in free, free
    # Turned off by a reload: the shared GPU's one series, the device's own.
    node.config.write_text(f"version: v1\n{sliced}")
    assert node.daemon is not None
    node.daemon.send_signal(signal.SIGHUP)
    node.wait_log("reloaded the config")
    got = scrape_later(node)
    assert [(lab.get("pod"), v) for lab, v in got["DCGM_FI_DEV_GPU_UTIL"] if lab["UUID"] == shared] == [(None, 70)]


def test_pod_uid_on_the_series_of_the_pods_that_hold_a_gpu(node: SimulatedNode, pods: PodCgroups) -> None:
    """dcgm-exporter's --kubernetes-enable-pod-uid: on a holder's device series the UID the kubelet's records
    give its name, a pod with no process on its GPU too; on a container's series its cgroup's."""
    gpus = serving(node, "nvplug:\n  telemetry:\n    podLabels: true\n    podUid: true\n")
    idle, busy = pods.start("ml", "idle"), pods.start("ml", "busy")
    node.kubelet.admit("ml", "idle", "main", GPU_RESOURCE, [gpus[0]["uuid"]])
    node.kubelet.admit("ml", "busy", "main", GPU_RESOURCE, [gpus[1]["uuid"]])
    node.control.procs(1, [GpuProcess(busy.pid, 512)])
    got = scrape_later(node)
    assert value(got, "DCGM_FI_DEV_FB_TOTAL", UUID=gpus[0]["uuid"], pod="idle", pod_uid=idle.pod_uid) > 0
    assert value(got, "DCGM_FI_DEV_FB_USED", UUID=gpus[1]["uuid"], pod="busy", pod_uid=busy.pod_uid) >= 512
    assert value(got, "nvplug_container_gpu_memory_used_bytes", pod="busy", pod_uid=busy.pod_uid) == 512 * MIB
    # A GPU nobody holds: no pod, so no pod_uid.
    ((free, _),) = [s for s in got["DCGM_FI_DEV_FB_TOTAL"] if s[0]["UUID"] == gpus[2]["uuid"]]
    assert "pod_uid" not in free, free


def test_an_mps_client_and_a_mig_device_are_attributed(node: SimulatedNode, pods: PodCgroups) -> None:
    gpus = serving(node)
    client = pods.start("ml", "mps-client")
    mig_user = pods.start("ml", "mig-user")
    node.control.procs(1, [GpuProcess(client.pid, 512, ("mps",))])
    node.control.mig_mode(4, True)
    node.control.mig_layout(4, ["3g.40gb"])
    node.control.procs(4, [GpuProcess(mig_user.pid, 2048, mig=(1, 0))])
    node.control.gpm(4, tensor=20)
    node.wait_log("scan 2:")  # the MIG layout's rescan names the MIG device
    scrape_later(node)  # the GPU instance's first GPM sample
    got = scrape_later(node)
    assert value(got, "nvplug_container_gpu_memory_used_bytes", pod="mps-client", device_uuid=gpus[1]["uuid"]) == (
        512 * MIB
    )
    ((labels, used),) = [s for s in got["nvplug_container_gpu_memory_used_bytes"] if s[0]["pod"] == "mig-user"]
    assert used == 2048 * MIB and labels["device_uuid"].startswith("MIG-"), labels
    # NVML gives no per-process utilization on MIG: no series, rather than a false 0.
    assert not [s for s in got.get("nvplug_container_gpu_utilization_ratio", []) if s[0]["pod"] == "mig-user"]
    assert value(got, "DCGM_FI_DEV_FB_USED", gpu="4", GPU_I_PROFILE="3g.40gb", GPU_I_ID="1") == 2048
    # The GPU instance's tensor activity, from its own GPM samples.
    assert value(got, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", gpu="4", GPU_I_ID="1") == pytest.approx(0.2)


def test_a_pid_that_went_or_was_reused_is_never_the_old_pod_s(node: SimulatedNode, pods: PodCgroups) -> None:
    serving(node)
    a = pods.start("ml", "first")
    node.control.procs(0, [GpuProcess(a.pid, 100)])
    assert value(scrape_later(node), "nvplug_container_gpu_processes", pod="first") == 1
    # Its process ends and another pod's takes its PID, between two scrapes: the new pod's at once.
    pods.stop(a)
    b = pods.start("ml", "second", pid=a.pid)
    got = scrape_later(node)
    assert value(got, "nvplug_container_gpu_processes", pod="second") == 1
    assert value(got, "nvplug_container_gpu_processes", pod="first") == 0
    # Gone from /proc while NVML still lists it: counted, under no pod.
    pods.stop(b)
    got = scrape_later(node)
    assert value(got, "nvplug_container_gpu_processes", pod="") == 1
    assert value(got, "nvplug_container_gpu_processes", pod="second") == 0
    # A live process is held, and its cgroup not read again while it lives.
    c = pods.start("ml", "third")
    node.control.procs(0, [GpuProcess(c.pid, 100)])
    assert value(scrape_later(node), "nvplug_container_gpu_processes", pod="third") == 1
    status = status_client.status(f"unix:{node.status_socket}")
    assert status["GPU telemetry"]["processes_held"] == 1


def test_a_gpu_whose_read_hangs_is_stale_and_the_scrape_answers(node: SimulatedNode) -> None:
    serving(node)
    node.control.telemetry(3, temp=50)
    assert value(scrape_later(node), "DCGM_FI_DEV_GPU_TEMP", gpu="3") == 50
    with node.control.blocked(3, "nvmlDeviceGetTemperature"):
        node.control.telemetry(3, temp=90)
        time.sleep(1.1)
        got = scrape(node)
        # Answered while GPU 3's read still hangs in the driver: the scrape did not wait for it.
        assert node.control.blocked_waiting() == 1
        assert value(got, "nvplug_gpu_metrics_stale", gpu="3") == 1
        # Every other GPU is read meanwhile, those after it in NVML's order too.
        assert all(value(got, "nvplug_gpu_metrics_stale", gpu=str(i)) == 0 for i in (0, 1, 2, 4, 5, 6, 7)), got
        assert value(got, "DCGM_FI_DEV_GPU_TEMP", gpu="3") == 50  # the last figure that was read
    got = scrape_later(node)
    assert value(got, "nvplug_gpu_metrics_stale", gpu="3") == 0
    assert value(got, "DCGM_FI_DEV_GPU_TEMP", gpu="3") == 90


def test_each_gpu_is_read_at_most_once_a_second(node: SimulatedNode) -> None:
    gpus = serving(node)
    time.sleep(1.1)
    node.control.reset_calls()
    began = time.monotonic()
    for _ in range(5):
        assert get(node, "/metrics")[0] == 200
    seconds = time.monotonic() - began
    reads = node.control.calls().get("nvmlDeviceGetTemperature", 0)
    # One read of each GPU in each second the 5 scrapes spanned, however slow the machine made them.
    assert len(gpus) <= reads <= len(gpus) * (int(seconds) + 1), (reads, seconds)


def test_metrics_alone_on_a_tcp_port(node: SimulatedNode) -> None:
    if node.netns is None:
        pytest.skip(node.no_netns_reason)
    serving(node, "nvplug:\n  status:\n    metricsListen: 127.0.0.1:9400\n")
    node.wait_log("metrics endpoint on 127.0.0.1:9400 (/metrics)")
    netns = node.netns

    def ask(method: str, path: str) -> tuple[int, str]:
        body = b"{}" if method == "POST" else None
        return netns.run(lambda: status_client.fetch("127.0.0.1:9400", path, timeout=5, body=body))

    code, text = ask("GET", "/metrics")
    assert code == 200 and "DCGM_FI_DEV_GPU_TEMP{" in text
    for method, path in (("GET", "/status"), ("GET", "/healthz"), ("POST", "/heal"), ("POST", "/status")):
        assert ask(method, path)[0] == 404, (method, path)
    assert ask("POST", "/metrics")[0] == 405
    # The unix socket still serves everything.
    assert get(node, "/status")[0] == 200


def test_a_reload_moves_the_metrics_port_and_takes_one_in_use_once_it_is_free(
    node: SimulatedNode, notify: NotifySocket
) -> None:
    """An operator moving off dcgm-exporter: the port set by a reload, and a port the exporter still holds
    tried again until it lets go, /status and the status line saying why meanwhile; the GPUs served
    throughout."""
    if node.netns is None:
        pytest.skip(node.no_netns_reason)
    node.config.write_text("version: v1\n")  # metricsListen: off
    node.kubelet.start()
    node.start_daemon(env={"NOTIFY_SOCKET": str(notify.path)})
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    serving_line = "STATUS=nvidia.com/gpu registered: 8 devices, 8 healthy"
    notify.receive(serving_line)
    netns = node.netns

    def ask(port: int) -> tuple[int, str]:
        return netns.run(lambda: status_client.fetch(f"127.0.0.1:{port}", "/metrics", timeout=5))

    def reload(listen: str) -> int:
        at = len(node.log_text())
        node.config.write_text(f"version: v1\nnvplug:\n  status:\n    metricsListen: {listen}\n")
        assert node.daemon is not None
        node.daemon.send_signal(signal.SIGHUP)
        return at

    def exporter() -> socket.socket:
        held = socket.socket()
        held.bind(("127.0.0.1", 9401))
        held.listen()
        return held

    node.wait_log("metrics endpoint on 127.0.0.1:9400 (/metrics)", after=reload("127.0.0.1:9400"))
    code, text = ask(9400)
    assert code == 200 and "DCGM_FI_DEV_GPU_TEMP{" in text
    held = netns.run(exporter)
    try:
        node.wait_log("metrics endpoint 127.0.0.1:9401 unavailable", after=reload("127.0.0.1:9401"))
        with pytest.raises(status_client.StatusUnavailable):
            ask(9400)  # let go
        status = json.loads(get(node, "/status")[1])
        assert status["metrics endpoint"]["listen"] == "127.0.0.1:9401", status["metrics endpoint"]
        assert not status["metrics endpoint"]["serving"] and "in use" in status["metrics endpoint"]["error"]
        said = notify.status_with("metrics endpoint 127.0.0.1:9401 unavailable")
        assert said.startswith(serving_line[7:] + "; metrics endpoint 127.0.0.1:9401 unavailable: "), said
    finally:
        held.close()
    deadline = time.monotonic() + 60  # the next try comes within the backoff's cap, 30 s
    while True:
        with contextlib.suppress(status_client.StatusUnavailable):
            code, text = ask(9401)
            break
        assert time.monotonic() < deadline, node.log_text()
        time.sleep(0.1)
    assert code == 200 and "DCGM_FI_DEV_GPU_TEMP{" in text
    assert json.loads(get(node, "/status")[1])["metrics endpoint"] == {
        "listen": "127.0.0.1:9401",
        "serving": True,
        "error": None,
    }
    notify.receive(serving_line, timeout=60)  # the status line without it again
    node.kubelet.wait_for(registered_with(8), TIMEOUT)


def test_nvplug_top_plain_and_on_a_terminal(node: SimulatedNode, pods: PodCgroups) -> None:
    serving(node)
    a = pods.start("ml", "ts-a")
    node.control.telemetry(0, util=70, temp=61, power_mw=410000, throttle=0x24)  # the power cap and the heat
    node.control.procs(0, [GpuProcess(a.pid, 20480), GpuProcess(777, 512)])
    node.control.xid(3, 79)
    node.kubelet.wait_for(device_health(node.scenario_gpus()[3]["uuid"], False), TIMEOUT)
    node.control.gpm(0, tensor=40)
    assert get(node, "/telemetry")[0] == 200  # the first GPM sample: top's read, a second on, has a window
    node.control.samples(0, [(a.pid, 50, 20)])  # in that window
    time.sleep(1.1)
    argv = [sys.executable, "-m", "nvplug", "top", "--status-listen", f"unix:{node.status_socket}"]
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    print(plain.stdout)
    assert plain.returncode == 0, plain.stderr
    assert "\x1b[" not in plain.stdout and plain.stdout.count("nvplug top") == 1
    rows = plain.stdout.splitlines()
    assert re.match(r"\s+0\s+70%\s+40%\s+20\.5/79\.6 GiB\s+61C\s+410W\s+power,heat\s+Healthy$", rows[2]), rows[2]
    assert re.match(r"\s+1\s.*\s+none\s+Healthy$", rows[5]), rows  # an idle GPU's clocks: its own choice
    assert re.search(r"ml/ts-a \(main\)\s+pid \d+\s+compute\s+20\.0 GiB\s+25% of memory\s+50% SM", rows[3]), rows
    assert "(no pod)" in rows[4] and "pid 777" in rows[4]
    assert any(r.lstrip().startswith("3 ") and "Unhealthy: XID 79" in r for r in rows), rows
    # On a terminal: redrawn in place, once a second or as asked.
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([*argv, "--count", "2", "--interval", "0.2"], stdout=follower, timeout=30)
        assert proc.returncode == 0
        os.close(follower)
        follower = -1
        drawn = b""
        with contextlib.suppress(OSError):  # EIO once the writer has gone and all is read
            while chunk := os.read(leader, 65536):
                drawn += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert drawn.count(b"\x1b[H\x1b[2J") == 2 and drawn.count(b"nvplug top") == 2, drawn[:400]


DASHBOARD = Path(__file__).resolve().parents[1] / "packaging/grafana/nvplug-gpus.json"


@pytest.mark.parametrize("naming", ["dcgm", "nvplug"])
def test_the_shipped_dashboard_asks_for_series_the_daemon_serves(node: SimulatedNode, naming: str) -> None:
    """Every panel and variable of packaging/grafana/nvplug-gpus.json, in either naming, names a series that a
    scrape with a pod's process on a GPU has."""
    serving(node, f"nvplug:\n  telemetry:\n    naming: {naming}\n")
    node.control.procs(0, [GpuProcess(4242, 100)])
    node.control.samples(0, [(4242, 10, 1)])
    scrape_later(node)  # GPM's figures need a window of two reads
    served = set(scrape_later(node))
    served |= {name.removesuffix("_total") for name in served}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 10
    for expr in exprs:
        names = set(re.findall(r"\b(DCGM_FI_\w+|nvplug_\w+)\b", expr))
        assert names & served, f"{expr!r}: none of {sorted(names)} is served in the {naming} naming"


def test_xids_per_code_and_the_last_one(node: SimulatedNode) -> None:
    gpus = serving(node)
    for code in (13, 31, 13):
        node.control.xid(5, code)
    node.wait_log("XID 13", TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while value(got := scrape_later(node), "nvplug_gpu_xid_errors_total", gpu="5") < 3:
        assert time.monotonic() < deadline, got.get("nvplug_gpu_xid_errors_total")
    assert value(got, "nvplug_gpu_xid_errors_total", gpu="5", code="13", UUID=gpus[5]["uuid"]) == 2
    assert value(got, "nvplug_gpu_xid_errors_total", gpu="5", code="31") == 1
    assert value(got, "DCGM_FI_DEV_XID_ERRORS", gpu="5") == 13
    assert value(got, "DCGM_FI_DEV_XID_ERRORS", gpu="4") == 0  # none taken in: no series
