"""`nvplug doctor`: each failure mode made for real on a simulated node, doctor run as a subprocess."""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from nvplug.cli.doctor.daemon_roots import resolve_roots
from nvplug.testing import fake_driver_root as driverroot
from nvplug.testing.simulated_node import SimulatedNode, device_health, registered_with

DRIVER_LINE = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024"


# --- helpers shared with test_devices.py ---------------------------------------------------------


def prepare(node: SimulatedNode) -> None:
    """What a healthy host has besides the GPUs: the driver's proc file and /dev/nvidia<minor>."""
    node.build_library()
    version = node.proc_root / "driver/nvidia/version"
    version.parent.mkdir(parents=True, exist_ok=True)
    version.write_text(f"{DRIVER_LINE}\nGCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n")
    for gpu in node.scenario_gpus():
        (node.dev_root / "dev" / f"nvidia{gpu['minor']}").touch()


def status_doc(
    node: SimulatedNode, unhealthy: Mapping[int, str] | None = None, registered: bool = True
) -> dict[str, Any]:
    """A /status document for the node's scenario, as the daemon's contract has it."""
    unhealthy = dict(unhealthy or {})
    gpus = node.scenario_gpus()
    since = time.time() - 192
    docs = []
    for i, g in enumerate(gpus):
        bad = i in unhealthy
        docs.append(
            {
                "index": i,
                "uuid": g["uuid"],
                "bus_id": g["bus"].lower(),
                "name": g["name"],
                "memory_mib": int(g["memory_mib"]),
                "numa_node": int(g["numa"]),
                "minor": int(g["minor"]),
                "health": "Unhealthy" if bad else "Healthy",
                "reason": unhealthy[i] if bad else "discovered",
                "since": since,
                "advertised": {"nvidia.com/gpu": [g["uuid"]]},
                "nvlink_peers": {o["uuid"]: 18 for o in gpus if o is not g},
                "mig": [],
            }
        )
    return {
        "version": "0.1.0",
        "revision": 12,
        "nvml_error": None,
        "health_watch_error": None,
        "plan_error": None,
        "resources": [
            {
                "name": "nvidia.com/gpu",
                "registered": registered,
                "endpoint": "nvplug-nvidia.com-gpu.sock",
                "devices": len(gpus),
                "healthy": len(gpus) - len(unhealthy),
            }
        ],
        "gpus": docs,
    }


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class FakeStatusServer:
    """The daemon's status endpoint stand-in: /status serves `doc`, /healthz says ok."""

    def __init__(self, path: Path, doc: dict[str, Any]) -> None:
        self.path = path
        self.doc = doc
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/status":
                    code, body, kind = 200, json.dumps(outer.doc), "application/json"
                elif self.path == "/healthz":
                    code, body, kind = 200, "ok", "text/plain"
                else:
                    code, body, kind = 404, "not found", "text/plain"
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def address_string(self) -> str:
                return "unix"

        self.server = _UnixHTTPServer(str(path), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def listen(self) -> str:
        return f"unix:{self.path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.path.unlink(missing_ok=True)


@pytest.fixture
def status_server(node: SimulatedNode) -> Iterator[FakeStatusServer]:
    server = FakeStatusServer(node.root / "status.sock", status_doc(node))
    yield server
    server.close()


def nvplug(node: SimulatedNode, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # On the node, as an operator runs it: in its network namespace, where its API server is.
    return subprocess.run(
        node.isolated([sys.executable, "-m", "nvplug", *args]),
        env=dict(env if env is not None else doctor_env(node)),
        text=True,
        capture_output=True,
        timeout=60,
    )


# --- doctor --------------------------------------------------------------------------------------


def doctor_args(node: SimulatedNode, listen: str | None = None) -> list[str]:
    listen_args = [] if listen == "" else ["--status-listen", listen or f"unix:{node.root}/status.sock"]
    return [
        "doctor",
        *listen_args,
        "--device-plugin-dir", str(node.plugin_dir),
        "--dev-root", str(node.dev_root),
        "--proc-root", str(node.proc_root),
        "--sys-root", str(node.sysfs_root),
        "--config", str(node.config),
        *node.cdi_args(),
        "--nfd-feature-file", str(node.feature_file),
        "--pod-resources-socket", str(node.kubelet.pod_resources.socket_path),
    ]  # fmt: skip


def doctor_env(node: SimulatedNode) -> dict[str, str]:
    """The fake library, with a control socket of its own: the daemon's stays the daemon's."""
    env = node.daemon_env()
    env["FAKE_NVML_CONTROL"] = str(node.root / "doctor.ctl")
    return env


def doctor(node: SimulatedNode, listen: str | None = None, env: Mapping[str, str] | None = None) -> Doctor:
    return Doctor(nvplug(node, *doctor_args(node, listen), env=env))


class Doctor:
    """The output, split into its numbered steps."""

    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.rc = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr
        self.steps: dict[int, tuple[str, str]] = {}
        current = None
        for line in proc.stdout.splitlines():
            m = re.match(r"(PASS|WARN|FAIL)  (\d+)\. ", line)
            if m:
                current = int(m.group(2))
                self.steps[current] = (m.group(1), line)
            elif current is not None and line.startswith(" "):
                verdict, text = self.steps[current]
                self.steps[current] = (verdict, f"{text}\n{line}")

    def verdict(self, step: int) -> str:
        return self.steps[step][0]

    def text(self, step: int) -> str:
        return self.steps[step][1]

    def __repr__(self) -> str:
        return f"rc={self.rc}\n{self.out}\n{self.err}"


def write_spec(node: SimulatedNode) -> Path:
    """A driver root with the driver's files, and the CDI spec as the daemon would write for it,
    through `nvplug cdi generate --output`."""
    drv = driverroot.build(node.root / "drv")
    cfg = yaml.safe_load(node.config.read_text()) or {}
    cfg.setdefault("flags", {})["nvidiaDriverRoot"] = str(drv.root)
    node.config.write_text(yaml.safe_dump(cfg))
    path = node.cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json"
    generate = ["cdi", "generate", "--config", str(node.config), "--dev-root", str(node.dev_root), "--sysfs-root",
                str(node.sysfs_root), "--proc-root", str(node.proc_root), "--output", str(path)]  # fmt: skip
    done = nvplug(node, *generate, env=doctor_env(node))
    assert done.returncode == 0 and path.is_file(), done
    write_labels(node)
    return path


def write_labels(node: SimulatedNode) -> None:
    """The node label file as the daemon would write it, through `nvplug devices --labels` (a direct read)."""
    node.features_dir.mkdir(exist_ok=True)
    direct = ["devices", "--labels", "--status-listen", f"unix:{node.root}/none.sock", "--config", str(node.config),
              "--sysfs-root", str(node.sysfs_root), "--proc-root", str(node.proc_root)]  # fmt: skip
    done = nvplug(node, *direct, env=doctor_env(node))
    assert done.returncode == 0 and "nvidia.com/gpu.count=8" in done.stdout, done
    node.feature_file.write_text(done.stdout)


def test_all_pass_on_a_healthy_node(node: SimulatedNode, status_server: FakeStatusServer) -> None:
    prepare(node)
    node.kubelet.start()
    write_spec(node)
    d = doctor(node, status_server.listen)
    assert d.rc == 0, d
    assert [d.verdict(i) for i in range(1, 14)] == ["PASS"] * 13, d
    assert "550.54.15" in d.text(1)
    assert f"loaded from {node.lib_dir}/libnvidia-ml.so.1" in d.text(2)
    assert "8 GPUs" in d.text(3) and "driver 550.54.15" in d.text(3)
    assert "nvidia7" in d.text(4) and "nvidiactl" in d.text(4)
    assert "gRPC channel ready" in d.text(6)
    assert "8 devices advertised, all healthy" in d.text(7)
    assert "9. CDI spec: all 8 CDI names resolve, each defined once" in d.out
    assert "10. node labels: the 25 node labels match this node" in d.out
    assert "11. kubelet's view: the kubelet's view agrees with nvplug's" in d.out
    assert "12. DRA: DRA is off (nvplug.dra.enabled: false)" in d.out
    assert "13. MPS: MPS is off (no sharing.mps resources)" in d.out
    assert "0 failed, 0 warnings, 13 passed" in d.out


def test_a_relative_device_plugin_dir(node: SimulatedNode) -> None:
    """`unix://kubelet/...` would name a host `kubelet`: the socket target is made from an absolute path."""
    prepare(node)
    node.kubelet.start()
    args = doctor_args(node)
    at = args.index("--device-plugin-dir")
    args[at + 1] = os.path.relpath(node.plugin_dir, node.root)
    proc = subprocess.run(
        [sys.executable, "-m", "nvplug", *args], env=doctor_env(node), cwd=node.root, text=True, capture_output=True,
        timeout=60,
    )  # fmt: skip
    d = Doctor(proc)
    assert d.verdict(5) == "PASS" and d.verdict(6) == "PASS", d
    assert "gRPC channel ready" in d.text(6)


def test_node_labels_missing_stale_or_doubled_by_gfd(node: SimulatedNode, status_server: FakeStatusServer) -> None:
    prepare(node)
    node.kubelet.start()
    d = doctor(node, status_server.listen)
    assert d.verdict(10) == "WARN" and "features.d does not exist" in d.out, d
    node.features_dir.mkdir()
    d = doctor(node, status_server.listen)
    assert d.verdict(10) == "FAIL" and "missing or unreadable" in d.out, d
    write_labels(node)
    node.feature_file.write_text(
        node.feature_file.read_text().replace("gpu.count=8", "gpu.count=7") + "nvidia.com/x=1\n"
    )
    d = doctor(node, status_server.listen)
    assert d.verdict(10) == "FAIL", d
    assert "nvidia.com/gpu.count: the file says '7', the node '8'" in d.text(10)
    assert "nvidia.com/x: in the file ('1'), not true of the node" in d.text(10)
    write_labels(node)
    (node.features_dir / "gfd").write_text("nvidia.com/gpu.count=8\n")
    d = doctor(node, status_server.listen)
    assert d.verdict(10) == "WARN" and "GPU Feature Discovery writes the same keys too" in d.out, d


def test_cdi_names_that_do_not_resolve_and_a_conflicting_spec(
    node: SimulatedNode, status_server: FakeStatusServer
) -> None:
    prepare(node)
    node.kubelet.start()
    node.config.write_text("version: v1\nflags:\n  plugin:\n    deviceListStrategy: cdi-cri\n")
    d = doctor(node, status_server.listen)
    assert d.verdict(9) == "FAIL", d
    # Nor does the machine's own ld cache hold the fake driver's libraries.
    assert "lists no library of driver 550.54.15" in d.text(9)
    uuid = node.scenario_gpus()[0]["uuid"]
    assert f"does not resolve: k8s.device-plugin.nvidia.com/gpu={uuid}" in d.text(9)
    assert "and 3 more" in d.text(9) and "ReadWritePaths=-" in d.out
    write_spec(node)
    foreign = node.cdi_dir / "old-plugin.yaml"
    foreign.write_text(f"cdiVersion: 0.5.0\nkind: k8s.device-plugin.nvidia.com/gpu\ndevices:\n- name: {uuid}\n")
    d = doctor(node, status_server.listen)
    assert d.verdict(9) == "FAIL", d
    assert f"{foreign} also defines CDI kind k8s.device-plugin.nvidia.com/gpu" in d.text(9)
    assert "so that one spec defines each name" in d.out
    foreign.unlink()
    assert doctor(node, status_server.listen).verdict(9) == "PASS"
    # A spec without the driver's files resolves, but a container would get no libcuda.so.1.
    node.config.write_text("version: v1\n")
    d = doctor(node, status_server.listen)
    assert d.verdict(9) == "WARN" and "lacks driver files" in d.out and "nvidiaDriverRoot" in d.out, d


def test_driver_not_loaded(node: SimulatedNode) -> None:
    prepare(node)
    shutil.rmtree(node.proc_root / "driver")
    shutil.rmtree(node.driver_module)  # the simulated node has the driver loaded: unload it
    d = doctor(node)
    assert d.rc == 1
    assert d.verdict(1) == "FAIL", d
    assert "modprobe nvidia" in d.text(1)


def test_driver_seen_through_sysfs_module(node: SimulatedNode) -> None:
    prepare(node)
    shutil.rmtree(node.proc_root / "driver")
    (node.sysfs_root / "module/nvidia").mkdir(parents=True, exist_ok=True)  # the simulated node has it
    (node.sysfs_root / "module/nvidia/version").write_text("550.54.15\n")
    d = doctor(node)
    assert d.verdict(1) == "PASS", d
    assert "module/nvidia exists (550.54.15)" in d.text(1)


def test_no_library(node: SimulatedNode) -> None:
    prepare(node)
    d = doctor(node, env=node.daemon_env("none"))
    if d.verdict(2) == "PASS":
        pytest.skip(f"this host has an NVML library of its own: {d.text(2)}")
    assert d.rc == 1
    assert d.verdict(2) == "FAIL", d
    assert "libnvidia-ml.so.1: cannot open shared object file" in d.text(2)
    assert "ldconfig" in d.text(2)
    assert d.verdict(3) == "FAIL"
    assert "see step 2" in d.text(3)


@pytest.mark.parametrize(
    ("code", "meaning", "fix"),
    [
        (4, "no permission", "run nvplug as root"),
        (18, "different driver versions", "reboot, or reload the driver"),
        (9, "kernel driver is not loaded", "modprobe nvidia"),
        (999, "NVML failed", "nvidia-smi"),
    ],
)
def test_nvml_init_errors(node: SimulatedNode, code: int, meaning: str, fix: str) -> None:
    prepare(node)
    node.scenario.write_text(node.scenario.read_text().replace("init_error 0", f"init_error {code}"))
    d = doctor(node)
    assert d.rc == 1
    assert d.verdict(2) == "PASS", d
    assert d.verdict(3) == "FAIL", d
    assert meaning in d.text(3)
    assert f"(NVML error {code})" in d.text(3)
    assert fix in d.text(3)


def test_no_gpus(node: SimulatedNode) -> None:
    prepare(node)
    kept = [line for line in node.scenario.read_text().splitlines() if not line.startswith(("gpu ", "link "))]
    node.scenario.write_text("\n".join(kept) + "\n")
    d = doctor(node)
    assert d.verdict(3) == "FAIL", d
    assert "sees no GPU" in d.text(3)
    assert "nvmlDeviceGetCount: 0" in d.text(3)


def test_missing_device_nodes(node: SimulatedNode) -> None:
    prepare(node)
    (node.dev_root / "dev/nvidia3").unlink()
    (node.dev_root / "dev/nvidiactl").unlink()
    d = doctor(node)
    assert d.verdict(4) == "FAIL", d
    assert f"missing: {node.dev_root}/dev/nvidia3" in d.text(4)
    assert f"missing: {node.dev_root}/dev/nvidiactl" in d.text(4)
    assert "nvidia-modprobe" in d.text(4)


def test_missing_plugin_dir(node: SimulatedNode) -> None:
    prepare(node)
    shutil.rmtree(node.plugin_dir)
    d = doctor(node)
    assert d.verdict(5) == "FAIL", d
    assert "does not exist" in d.text(5)


def test_read_only_plugin_dir(node: SimulatedNode) -> None:
    prepare(node)
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a read-only bind mount in a private mount namespace")
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "--bind", "-o", "ro", str(node.plugin_dir),
         str(node.plugin_dir)],
        capture_output=True, text=True,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {probe.stderr.strip()}")
    d = Doctor(
        subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount --bind -o ro "$0" "$0" && exec "$@"', str(node.plugin_dir),
             sys.executable, "-m", "nvplug", *doctor_args(node)],
            env=doctor_env(node), text=True, capture_output=True, timeout=60,
        )
    )  # fmt: skip
    assert d.verdict(5) == "FAIL", d
    assert "not writable" in d.text(5)
    assert "Read-only file system" in d.text(5)
    assert not list(node.plugin_dir.iterdir()), "no temp file left behind"


def test_no_kubelet_sock(node: SimulatedNode) -> None:
    prepare(node)
    d = doctor(node)
    assert d.verdict(6) == "FAIL", d
    assert "kubelet.sock does not exist" in d.text(6)
    assert "start the kubelet" in d.text(6)


def test_kubelet_sock_refuses(node: SimulatedNode) -> None:
    prepare(node)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(node.plugin_dir / "kubelet.sock"))  # bound, never listening
        d = doctor(node)
    assert d.verdict(6) == "FAIL", d
    assert "refuses connections" in d.text(6)
    assert "Connection refused" in d.text(6)
    assert "restart the kubelet" in d.text(6)


def test_kubelet_sock_not_a_socket(node: SimulatedNode) -> None:
    prepare(node)
    (node.plugin_dir / "kubelet.sock").write_text("")
    d = doctor(node)
    assert d.verdict(6) == "FAIL", d
    assert "not a socket" in d.text(6)


def test_daemon_not_running(node: SimulatedNode) -> None:
    prepare(node)
    d = doctor(node)
    assert d.rc == 1
    assert d.verdict(7) == "FAIL", d
    assert "does not answer" in d.text(7)
    assert f"no status socket at unix:{node.root}/status.sock" in d.text(7)
    assert "systemctl status nvplug" in d.text(7)


def test_daemon_with_an_unhealthy_gpu(node: SimulatedNode, status_server: FakeStatusServer) -> None:
    prepare(node)
    node.kubelet.start()
    status_server.doc = status_doc(node, {3: "XID 79 (GPU has fallen off the bus)"})
    write_spec(node)
    d = doctor(node, status_server.listen)
    assert d.rc == 0, d  # a WARN alone does not fail
    assert d.verdict(7) == "WARN", d
    assert "8 devices advertised, 7 healthy" in d.text(7)
    uuid = node.scenario_gpus()[3]["uuid"]
    assert f"unhealthy: gpu 3 {uuid} (0000:5d:00.0): XID 79 (GPU has fallen off the bus)" in d.text(7)
    # A GPU that needs a reset stays Unhealthy until one: the fix names the ways out, no self-healing.
    assert "`nvplug devices` says what each Unhealthy GPU waits for" in d.text(7)
    assert "`nvidia-smi -r -i <bus id>`" in d.text(7) and "`nvplug heal GPU --reset`" in d.text(7)
    assert "Healthy by itself" not in d.text(7)
    assert "1 warnings" in d.out


def test_daemon_whose_metrics_port_is_held_by_another_program(
    node: SimulatedNode, status_server: FakeStatusServer
) -> None:
    prepare(node)
    node.kubelet.start()
    doc = status_doc(node)
    held = "[Errno 98] error while attempting to bind on address ('0.0.0.0', 9400): address already in use"
    doc["metrics endpoint"] = {"listen": "0.0.0.0:9400", "serving": False, "error": held}
    status_server.doc = doc
    write_spec(node)
    d = doctor(node, status_server.listen)
    assert d.rc == 0, d  # the GPUs are served: a warning
    assert d.verdict(7) == "WARN", d
    assert f"metrics endpoint 0.0.0.0:9400 is not served: {held}" in d.text(7)
    assert "`ss -ltnp` names what holds it" in d.text(7)
    assert "`nvplug devices`" not in d.text(7)  # no GPU to see to


def test_daemon_not_registered(node: SimulatedNode, status_server: FakeStatusServer) -> None:
    prepare(node)
    status_server.doc = status_doc(node, registered=False)
    d = doctor(node, status_server.listen)
    assert d.rc == 1
    assert d.verdict(7) == "FAIL", d
    assert "nvidia.com/gpu is not registered with the kubelet" in d.text(7)


def test_daemon_with_nvml_error(node: SimulatedNode, status_server: FakeStatusServer) -> None:
    prepare(node)
    doc = status_doc(node)
    doc.update(nvml_error="NVML initialisation failed: Driver Not Loaded", resources=[], gpus=[])
    status_server.doc = doc
    d = doctor(node, status_server.listen)
    assert d.verdict(7) == "FAIL", d
    assert "nvml error: NVML initialisation failed: Driver Not Loaded" in d.text(7)


def test_invalid_config(node: SimulatedNode) -> None:
    prepare(node)
    node.config.write_text("version: v1\nflags:\n  migStrategy: sometimes\n")
    d = doctor(node)
    assert d.verdict(8) == "FAIL", d
    assert "migStrategy" in d.text(8)
    assert "config.yaml" in d.text(8)


def test_mps_config_nvplug_cannot_serve_is_refused(node: SimulatedNode) -> None:
    prepare(node)
    node.config.write_text(
        "version: v1\nsharing:\n  mps:\n    failRequestsGreaterThanOne: false\n    resources:\n"
        "    - name: nvidia.com/gpu\n      replicas: 2\n"
    )
    d = doctor(node)
    assert d.verdict(8) == "FAIL", d
    assert "sharing.mps.failRequestsGreaterThanOne: must be true for MPS" in d.text(8)


def test_end_to_end_with_the_daemon(node: SimulatedNode) -> None:
    """The real daemon's endpoint; doctor finds it through the config's nvplug.status.listen."""
    prepare(node)
    node.config.write_text(f"version: v1\nnvplug:\n  status:\n    listen: unix:{node.root}/status.sock\n")
    node.kubelet.start()
    node.start_daemon("--status-listen", f"unix:{node.root}/status.sock")
    node.kubelet.wait_for(registered_with(8), 30)
    d = doctor(node, listen="")
    assert d.rc == 0, d
    assert [d.verdict(i) for i in range(1, 9)] == ["PASS"] * 8, d
    assert f"unix:{node.root}/status.sock: nvplug 0.1.0" in d.text(7)

    uuid = node.scenario_gpus()[3]["uuid"]
    node.control.xid(3, 79)
    node.kubelet.wait_for(device_health(uuid, False), 30)
    d = doctor(node, listen="")
    assert d.rc == 0, d
    assert d.verdict(7) == "WARN", d
    assert "8 devices advertised, 7 healthy" in d.text(7)
    assert f"unhealthy: gpu 3 {uuid} (0000:5d:00.0): XID 79" in d.text(7)

    node.stop_daemon()
    d = doctor(node, listen="")
    assert d.rc == 1
    assert d.verdict(7) == "FAIL", d


def test_against_the_daemon_doctor_reads_where_it_does(node: SimulatedNode) -> None:
    """Given no --device-plugin-dir, --dev-root, --proc-root or --sysfs-root, doctor reads the node
    where the daemon it asks does (its /status shows its roots), not the machine's /sys, /proc, /dev."""
    prepare(node)
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), 30)
    args = doctor_args(node, f"unix:{node.status_socket}")
    for flag in ("--device-plugin-dir", "--dev-root", "--proc-root", "--sys-root"):
        at = args.index(flag)
        del args[at : at + 2]
    d = Doctor(nvplug(node, *args))
    taken = f"--device-plugin-dir {node.plugin_dir}, --dev-root {node.dev_root}, --proc-root {node.proc_root}, "
    assert f"reading the node where the running daemon does: {taken}--sysfs-root {node.sysfs_root}" in d.out, d
    assert d.verdict(1) == "PASS" and f"{node.proc_root}/driver/nvidia/version: NVRM" in d.text(1), d
    assert d.verdict(4) == "PASS" and f"{node.dev_root}/dev: " in d.text(4), d
    assert d.verdict(5) == "PASS" and f"{node.plugin_dir}: " in d.text(5), d
    assert d.verdict(6) == "PASS" and f"{node.plugin_dir}/kubelet.sock: gRPC channel ready" in d.text(6), d
    # No proc file: the driver is found by its sysfs module, under the daemon's --sysfs-root.
    (node.proc_root / "driver/nvidia/version").unlink()
    d = Doctor(nvplug(node, *args))
    assert d.verdict(1) == "PASS" and f"{node.driver_module} exists" in d.text(1), d


def test_roots_given_stay_and_without_a_daemon_are_the_defaults(short_tmp: Path) -> None:
    """A root on the command line is never the daemon's; one the daemon does not give is the option's default."""
    args = argparse.Namespace(
        status_listen=f"unix:{short_tmp}/none.sock",
        config=short_tmp / "none.yaml",
        device_plugin_dir=None,
        dev_root=None,
        proc_root=short_tmp / "proc",
        sysfs_root=None,
    )
    resolved, taken = resolve_roots(args)
    assert taken == []
    assert (resolved.device_plugin_dir, resolved.dev_root, resolved.proc_root, resolved.sysfs_root) == (
        Path("/var/lib/kubelet/device-plugins"),
        None,  # the config's flags.nvidiaDevRoot, as before
        short_tmp / "proc",
        Path("/sys"),
    )
    roots = {"device_plugin_dir": "/var/lib/kubelet/device-plugins", "dev_root": "/n/dev-root", "proc_root": "/n/proc"}
    server = FakeStatusServer(short_tmp / "status.sock", {"roots": roots})
    try:
        resolved, taken = resolve_roots(argparse.Namespace(**{**vars(args), "status_listen": server.listen}))
    finally:
        server.close()
    # The plugin dir is where doctor would look anyway; --proc-root was given; no sysfs root was shown.
    assert taken == ["--dev-root /n/dev-root"]
    assert (resolved.device_plugin_dir, resolved.dev_root, resolved.proc_root, resolved.sysfs_root) == (
        Path("/var/lib/kubelet/device-plugins"),
        Path("/n/dev-root"),
        short_tmp / "proc",
        Path("/sys"),
    )


def test_the_kubelets_view_against_nvplugs(node: SimulatedNode) -> None:
    """With the real daemon: agreement, then devices the kubelet's checkpoint gives to a pod that is gone."""
    prepare(node)
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), 15.0)
    gpus = node.scenario_gpus()
    # Two GPUs: two PodResources entries for one container, as the real kubelet lists them.
    node.kubelet.admit("ml", "trainer-0", "main", "nvidia.com/gpu", [gpus[0]["uuid"], gpus[1]["uuid"]])
    d = doctor(node)
    assert d.verdict(11) == "PASS", d
    assert "8 allocatable devices, 1 containers holding devices" in d.text(11)
    entries = [
        {
            "PodUID": uid,
            "ContainerName": "main",
            "ResourceName": "nvidia.com/gpu",
            "DeviceIDs": {"0": [gpus[i]["uuid"]]},
        }
        for uid, i in (("uid-1", 0), ("uid-gone", 5))
    ]
    (node.plugin_dir / "kubelet_internal_checkpoint").write_text(json.dumps({"Data": {"PodDeviceEntries": entries}}))
    d = doctor(node)
    assert d.verdict(11) == "FAIL", d
    assert (
        f"gives nvidia.com/gpu {gpus[5]['uuid']} to pod uid-gone (container main), which no running pod holds" in d.out
    )
    assert "systemctl restart kubelet" in d.out
