"""The deb, then the rpm, on a real systemd: boot Debian bookworm in systemd-nspawn, install the
package built by packaging/build-deb.sh and run the unit for real; last, with the deb purged, the one
built by packaging/build-rpm.sh, through Debian's rpm.

The daemon inside loads the fake NVML (built here, bound in read-only) and
registers with the kubelet stand-in, which serves a host directory bound at
/var/lib/kubelet/device-plugins. The tests share one container and run in file
order: each step starts from the state the previous one left.

Needs root, systemd-nspawn (systemd-container), nsenter/unshare (util-linux)
and, until the image is cached, debootstrap with network to a Debian mirror.
Set NVPLUG_TEST_DEB (NVPLUG_TEST_RPM) to test a deb (an rpm) built elsewhere
instead of running the script.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support import nspawn
from support.apiserver_standin import FakeApiServer
from support.dra_kubelet_standin import DraKubelet

from nvplug.base.linked_socket_server import LISTENERS
from nvplug.status import status_client as statusclient
from nvplug.testing import fakenvml_control, fakenvml_library
from nvplug.testing import mps_control_standin as mps_control
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.fakenvml_devices import GpuProcess
from nvplug.testing.kubelet_thread import KubeletThread
from nvplug.testing.net_namespace import NetNamespace
from nvplug.testing.simulated_node import GPU_RESOURCE, device_health, registered_with

REPO = Path(__file__).resolve().parent.parent
PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
PLUGIN_SOCKET = "nvplug-nvidia.com-gpu.sock"
NVML_DIR = "/opt/fakenvml"  # the library and its scenario, read-only
CONTROL_DIR = "/var/lib/fakenvml"  # the fake's control socket: the unit must be able to bind it
# How the unit (and the maintainer scripts, in the removal check) load the fake NVML.
NVML_ENV = {
    "LD_LIBRARY_PATH": NVML_DIR,
    "FAKE_NVML_SCENARIO": f"{NVML_DIR}/node.scenario",
    "FAKE_NVML_CONTROL": f"{CONTROL_DIR}/nvml.ctl",
}
CONFIG = "/etc/nvplug/config.yaml"
# kubeadm's place for the kubelet's kubeconfig: nvplug.dra.kubeconfig's auto finds it.
KUBELET_KUBECONFIG = "/etc/kubernetes/kubelet.conf"
STATE_FILE = "/var/lib/nvplug/health.json"
CDI_SPEC = "k8s.device-plugin.nvidia.com-gpu.json"
FEATURE_FILE = "/etc/kubernetes/node-feature-discovery/features.d/nvplug"
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"
REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
KUBELET_PLUGINS_DIR = "/var/lib/kubelet/plugins"
DRA_DROPIN = "/usr/share/nvplug/systemd/nvplug-dra.conf"
METRICS_DROPIN = "/usr/share/nvplug/systemd/nvplug-metrics.conf"
UNIT = "nvplug"
DRIVER = "gpu.nvidia.com"
WATCHDOG_SEC = 3
MPS_CONTROL = "/usr/local/bin/nvidia-cuda-mps-control"
MPS_RESOURCE = "nvidia.com/gpu.mps"
MPS_PIPE = "/run/nvplug/mps/nvidia.com_gpu.mps/pipe"
MPS_SHM = "/run/nvplug/mps/shm"
MPS_DAEMON_UNIT = "nvplug-mps-nvidia.com_gpu.mps.service"
MPS_CONFIG = (
    "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      devices: [0, 1]\n"
    f"      rename: {MPS_RESOURCE}\n      replicas: 4\nnvplug:\n  mps:\n    controlPath: {MPS_CONTROL}\n"
)
TIMEOUT = 20.0

_skip = nspawn.missing_requirements()
pytestmark = [
    pytest.mark.skipif(_skip is not None, reason=f"install test: {_skip}"),
    # Includes the fixtures: a first run builds the image (debootstrap) and the deb.
    pytest.mark.timeout(900),
]


@dataclass
class Timings:
    phases: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def report(self) -> str:
        rows = [f"  {name:<38} {secs:7.2f} s" for name, secs in self.phases.items()]
        total = time.monotonic() - self.started
        return "\n".join(["install test timings:", *rows, f"  {'total (wall clock)':<38} {total:7.2f} s"])


TIMINGS = Timings()


@dataclass
class Node:
    """The booted container with the package installed, and the host side of it."""

    ctr: nspawn.Container
    kubelet: KubeletThread
    # The container's network namespace (nspawn --private-network): where its 127.0.0.1 is.
    netns: NetNamespace
    control: fakenvml_control.Control
    plugin_dir: Path  # the host's side of PLUGIN_DIR
    uuids: list[str]
    host: Path  # the host's directory of the bound ones
    # The host's end of the container's /dev/kmsg: a FIFO of records in the kernel's format.
    kmsg: int = -1
    kmsg_seq: int = 0

    def kernel_log(self, message: str) -> None:
        os.write(self.kmsg, f"3,{self.kmsg_seq},{time.monotonic_ns() // 1000},-;{message}\n".encode())
        self.kmsg_seq += 1

    def diagnose(self) -> str:
        """What an assertion message needs: the unit's state, its journal, what the stand-in saw."""
        try:
            status = self.ctr.run("systemctl", "status", "--no-pager", "--lines=0", UNIT, check=False).stdout
            log = self.ctr.journal(UNIT, "-n", "60")
        except nspawn.ContainerError as err:
            status, log = f"(cannot ask the container: {err})", ""
        return f"--- systemctl status ---\n{status}\n--- journal (tail) ---\n{log}\n--- stand-in ---\n" + (
            self.kubelet.describe()
        )

    def show(self, *properties: str) -> dict[str, str]:
        return self.ctr.show(UNIT, *properties)

    def registrations(self) -> int:
        return self.kubelet.accepted_registrations(GPU_RESOURCE)

    def wait_registered_again(self, registrations: int) -> None:
        """A new registration since `registrations` was counted, streaming 8 devices."""

        def again(k: FakeKubelet) -> bool:
            return self.registrations() > registrations and registered_with(8)(k)

        try:
            self.kubelet.wait_for(again, TIMEOUT)
        except TimeoutError as err:
            raise AssertionError(f"the restarted daemon did not register again\n{self.diagnose()}") from err


def _reload(node: Node) -> None:
    proc = node.ctr.run("systemctl", "reload", UNIT, check=False)
    assert proc.returncode == 0, (
        f"systemctl reload {UNIT} failed (exit {proc.returncode}): {proc.stderr.strip()}\n{node.diagnose()}"
    )


def _timed(phase: str, started: float) -> None:
    TIMINGS.add(phase, time.monotonic() - started)


@pytest.fixture(scope="session")
def deb() -> Path:
    TIMINGS.started = time.monotonic()
    return _package("deb", "NVPLUG_TEST_DEB")


@pytest.fixture(scope="session")
def rpm() -> Path:
    return _package("rpm", "NVPLUG_TEST_RPM")


def _package(kind: str, given: str) -> Path:
    """The package from packaging/build-<kind>.sh (its last line of output is the path), or `given`'s
    (one built elsewhere)."""
    if os.environ.get(given):
        return Path(os.environ[given]).resolve()
    started, script = time.monotonic(), f"packaging/build-{kind}.sh"
    proc = subprocess.run(["bash", script], cwd=REPO, capture_output=True, text=True, check=False, timeout=600)
    _timed(f"build the {kind} (build-{kind}.sh)", started)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{script} printed nothing:\n{proc.stderr}"
    path = Path(lines[-1].strip())
    path = path if path.is_absolute() else REPO / path
    assert path.is_file() and path.suffix == f".{kind}", f"{script}'s last line is not a {kind}: {lines[-1]!r}"
    return path


@pytest.fixture(scope="module")
def node(deb: Path, request: pytest.FixtureRequest) -> Iterator[Node]:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")

    def say(line: str) -> None:
        """Straight to the terminal, past pytest's capture: the timings are wanted on every run."""
        if reporter is None or capture is None:
            print(line)
            return
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(line)

    started = time.monotonic()
    image = nspawn.ensure_image(log=say)
    _timed("image (cached or debootstrap)", started)

    # Short host paths: the stand-in's and the plugin's unix sockets live in plugin_dir.
    host = Path(tempfile.mkdtemp(prefix="nvp-inst-", dir="/tmp"))
    plugin_dir, nvml_dir, control_dir = host / "dp", host / "nvml", host / "ctl"
    registry_dir, plugins_dir = host / "reg", host / "plugins"
    for d in (plugin_dir, control_dir, registry_dir, plugins_dir):
        d.mkdir()
    # The container's /dev/kmsg: what nvplug reads there, the test writes (the host's real
    # kernel log stays untouched). Held open here, so the FIFO never reads as closed.
    kmsg = host / "kmsg"
    os.mkfifo(kmsg)
    kmsg_fd = os.open(kmsg, os.O_RDWR | os.O_NONBLOCK)
    fakenvml_library.build(nvml_dir)
    shutil.copyfile(fakenvml_library.DEFAULT_SCENARIO, nvml_dir / "node.scenario")
    uuids = re.findall(r"^gpu .*?\buuid=(\S+)", fakenvml_library.DEFAULT_SCENARIO.read_text(), re.MULTILINE)

    kubelet = KubeletThread(plugin_dir)
    kubelet.pod_resources.socket_path.parent.mkdir()
    netns: NetNamespace | None = None
    ctr = nspawn.Container(
        image,
        binds=[
            nspawn.Bind(plugin_dir, PLUGIN_DIR),
            nspawn.Bind(nvml_dir, NVML_DIR, read_only=True),
            nspawn.Bind(control_dir, CONTROL_DIR),
            # The stand-in's PodResources socket, where the kubelet serves it.
            nspawn.Bind(kubelet.pod_resources.socket_path.parent, POD_RESOURCES_DIR),
            # The kubelet's DRA directories, for the DRA stand-in here.
            nspawn.Bind(registry_dir, REGISTRY_DIR),
            nspawn.Bind(plugins_dir, KUBELET_PLUGINS_DIR),
            nspawn.Bind(kmsg, "/dev/kmsg"),
        ],
        log=say,
    )
    try:
        kubelet.start()
        ctr.start()
        TIMINGS.add("snapshot + boot to running", ctr.timings["snapshot"] + ctr.timings["boot"])

        started = time.monotonic()
        # journald would read the FIFO too (a pipe has one reader per record): leave it to nvplug.
        ctr.write_file("/etc/systemd/journald.conf.d/no-kmsg.conf", "[Journal]\nReadKMsg=no\n")
        ctr.run("systemctl", "restart", "systemd-journald")
        # The driver's nodes, as on a GPU node (Allocate hands them out, so nvplug checks they exist).
        ctr.sh(
            "for i in 0 1 2 3 4 5 6 7; do mknod -m 0666 /dev/nvidia$i c 195 $i 2>/dev/null || touch /dev/nvidia$i; done"
        )
        # Before the package: its postinst starts the unit, which must load the fake from the start.
        ctr.write_file(
            f"/etc/systemd/system/{UNIT}.service.d/test.conf",
            nspawn.service_dropin(
                environment=NVML_ENV,
                read_write_paths=[CONTROL_DIR],
                watchdog_sec=WATCHDOG_SEC,
                # The checks restart the unit on purpose, one after another: a restart, a SIGKILL and a
                # start within a few seconds of the last check's made systemd refuse the start.
                unlimited_starts=True,
            ),
        )
        ctr.copy_in(deb, f"/var/tmp/{deb.name}")
        _install(ctr, f"/var/tmp/{deb.name}")
        _timed("install the deb (apt-get, postinst)", started)

        # The library replies to an abstract address, which must be in the container's network namespace.
        netns = NetNamespace.of_process(ctr.leader)
        control = fakenvml_control.Control(control_dir / "nvml.ctl", netns)
        yield Node(ctr, kubelet, netns, control, plugin_dir, uuids, host, kmsg_fd)
    finally:
        if netns is not None:
            netns.close()
        os.close(kmsg_fd)
        try:
            ctr.close()
            TIMINGS.add("poweroff + cleanup", ctr.timings.get("poweroff", 0.0))
        finally:
            kubelet.stop()
            shutil.rmtree(host, ignore_errors=True)
            say("\n" + TIMINGS.report())


def _install(ctr: nspawn.Container, path: str, *options: str) -> None:
    """apt-get install of a local deb. The image holds its dependencies: the container has no
    network (a namespace of its own), so none can be downloaded."""
    argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "Dpkg::Use-Pty=0", *options, path]
    first = ctr.run(*argv, check=False, timeout=300)
    if first.returncode == 0:
        return
    # Unpacked at all: the dependencies were there and the package itself failed.
    status = ctr.run("dpkg-query", "-W", "-f=${db:Status-Abbrev}", "nvplug", check=False).stdout.strip()
    if status not in ("", "un"):
        raise AssertionError(f"apt-get install failed (dpkg status {status!r}):\n{first.stdout}\n{first.stderr}")
    raise AssertionError(
        f"apt-get install failed: a dependency is missing from the image (add it to nspawn.IMAGE_PACKAGES):\n"
        f"{first.stdout}\n{first.stderr}"
    )


def _next_build(deb: Path, out: Path) -> Path:
    """The same package again with a higher revision (`-1` to `-2`): what an upgrade installs."""
    tree = out / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True, capture_output=True)
    control = tree / "DEBIAN" / "control"
    text = control.read_text()
    version = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Version:"))
    newer = version.rsplit("-", 1)[0] + "-2"
    control.write_text(text.replace(f"Version: {version}", f"Version: {newer}"))
    built = out / f"nvplug_{newer}_amd64.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(built)], check=True, capture_output=True)
    return built


# ---------------------------------------------------------------------------
# The checks, in order
# ---------------------------------------------------------------------------


def test_unit_is_active_running_and_sent_ready(node: Node) -> None:
    started = time.monotonic()
    props = node.show("ActiveState", "SubState", "Type", "NRestarts", "StatusText", "WatchdogUSec")
    # Type=notify: systemctl start (in postinst) returns, and the unit is running, only after READY=1.
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), f"{props}\n{node.diagnose()}"
    assert props["Type"] == "notify", props
    assert props["NRestarts"] == "0", f"it restarted already: {props}\n{node.diagnose()}"
    assert props["WatchdogUSec"] in (f"{WATCHDOG_SEC}s", str(WATCHDOG_SEC * 1_000_000)), props
    want = f"{GPU_RESOURCE} registered: 8 devices, 8 healthy"
    seen = props

    def status_ok() -> bool:
        nonlocal seen
        seen = node.show("StatusText")
        return want in seen["StatusText"]

    nspawn.wait_until(status_ok, TIMEOUT, f"StatusText {want!r}", lambda: f"{seen}\n{node.diagnose()}")
    # systemd logs "Started" for a Type=notify unit only once READY=1 came.
    log = node.ctr.journal(UNIT, "-o", "cat")
    assert "Started nvplug.service" in log, f"no READY=1 seen by systemd\n{node.diagnose()}"
    _timed("check 1: active, READY, STATUS", started)


def test_stand_in_sees_registration_and_eight_devices(node: Node) -> None:
    started = time.monotonic()
    try:
        node.kubelet.wait_for(registered_with(8), TIMEOUT)
    except TimeoutError as err:
        raise AssertionError(f"no registration with 8 devices at the stand-in\n{node.diagnose()}") from err
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    assert node.registrations() == 1, node.diagnose()
    assert plugin.endpoint == PLUGIN_SOCKET
    assert sorted(plugin.devices) == sorted(node.uuids), plugin.describe()
    assert plugin.allocatable == 8, plugin.describe()
    assert (node.plugin_dir / PLUGIN_SOCKET).is_socket()
    _timed("check 2: registration at the stand-in", started)


def test_a_kubelet_restart_is_served_again_by_a_link_to_the_listener_under_the_hardened_unit(node: Node) -> None:
    """The listener in the plugin directory's .nvplug/, made by the unit, outlives the kubelet's restart;
    the name it removed is linked to it again and registered once."""
    started = time.monotonic()
    (listener,) = (node.plugin_dir / LISTENERS).iterdir()
    assert (node.plugin_dir / PLUGIN_SOCKET).samefile(listener)
    registrations = node.registrations()
    node.kubelet.restart()
    node.wait_registered_again(registrations)
    time.sleep(0.3)  # a second Register would come now
    assert node.registrations() == registrations + 1, node.diagnose()
    assert (node.plugin_dir / PLUGIN_SOCKET).samefile(listener), node.diagnose()
    assert "serving on /var/lib/kubelet/device-plugins/nvplug-nvidia.com-gpu.sock again" in node.ctr.journal(UNIT)
    _timed("check 2a: a kubelet restart, served again by a link", started)


def test_the_service_writes_the_cdi_spec_under_the_hardened_unit(node: Node) -> None:
    """ProtectSystem=strict makes /run read-only; the unit allows /run/cdi, which tmpfiles.d made."""
    started = time.monotonic()
    path = f"/run/cdi/{CDI_SPEC}"
    nspawn.wait_until(lambda: node.ctr.exists(path), TIMEOUT, path, lambda: node.ctr.journal(UNIT, "-o", "cat"))
    out = node.ctr.sh(f"stat -c '%a %U' /run/cdi {path} && cat {path}").stdout
    modes, _, text = out.partition("{")
    assert modes.split() == ["755", "root", "644", "root"], out
    spec = json.loads("{" + text)
    assert spec["kind"] == "k8s.device-plugin.nvidia.com/gpu" and spec["cdiVersion"] == "0.5.0", spec
    assert sorted(d["name"] for d in spec["devices"]) == sorted([*node.uuids, "all"]), spec
    assert "cannot write the CDI spec" not in node.ctr.journal(UNIT, "-o", "cat")
    _timed("check 2b: the CDI spec in /run/cdi", started)


def test_node_labels_once_nfd_is_there(node: Node) -> None:
    """The unit started without NFD's features.d (its ReadWritePaths= entry is optional); once NFD made
    it, a restart lets the hardened unit write the labels there."""
    started = time.monotonic()
    journal = node.ctr.journal(UNIT, "-o", "cat")
    assert f"cannot write the NFD feature file {FEATURE_FILE}" in journal, journal
    node.ctr.sh(f"mkdir -p {shlex.quote(str(Path(FEATURE_FILE).parent))}")
    registrations = node.registrations()
    node.ctr.run("systemctl", "restart", UNIT, timeout=60)
    node.wait_registered_again(registrations)
    nspawn.wait_until(lambda: node.ctr.exists(FEATURE_FILE), TIMEOUT, FEATURE_FILE, node.diagnose)
    text = node.ctr.sh(f"stat -c %a {FEATURE_FILE} && cat {FEATURE_FILE}").stdout
    mode, _, body = text.partition("\n")
    labels = dict(line.split("=", 1) for line in body.splitlines() if "=" in line and not line.startswith("#"))
    assert mode == "644", text
    assert labels["nvidia.com/gpu.count"] == "8" and labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3", text
    assert labels["nvidia.com/cuda.driver-version.full"] == "550.54.15", text
    props = node.show("ActiveState", "SubState")
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
    _timed("check 2c: node labels in features.d", started)


def test_the_service_reads_podresources_under_its_sandbox(node: Node) -> None:
    """The stand-in serves PodResources on the host; the hardened unit asks it when `nvplug devices` reads."""
    started = time.monotonic()
    node.kubelet.admit("ml", "trainer-0", "main", GPU_RESOURCE, [node.uuids[2]])
    out = node.ctr.run("nvplug", "devices", timeout=60).stdout
    assert "pods: ml/trainer-0 (container main)" in out, f"{out}\n{node.diagnose()}"
    assert node.kubelet.pod_resources.calls["List"] >= 1
    node.kubelet.delete_pod("ml", "trainer-0")
    _timed("check 2d: PodResources from the unit", started)


def test_journal_has_no_errors_and_a_forced_error_shows_at_err(node: Node) -> None:
    started = time.monotonic()
    errors = node.ctr.journal(UNIT, "-p", "err", "-o", "cat")
    assert errors.strip() == "", f"errors in the journal of a healthy start:\n{errors}\n{node.diagnose()}"
    info = node.ctr.journal(UNIT, "-p", "info", "-o", "cat")
    assert "nvplug starting" in info, f"the daemon's own lines are not in the journal:\n{info}"

    # An unknown key: the reload is refused at error level and the config in force stays.
    node.ctr.write_file(CONFIG, "version: v1\nnvplug:\n  noSuchKey: 1\n")
    try:
        _reload(node)
        errors = node.ctr.wait_journal(UNIT, "reload refused", "-p", "err", "-o", "cat", timeout=TIMEOUT)
    finally:
        # A restart in a later step must not meet the broken config.
        node.ctr.write_file(CONFIG, "version: v1\n")
    assert "noSuchKey" in errors, errors
    # The <N> prefix sets the priority and is not part of the message.
    leaked = [line for line in node.ctr.journal(UNIT, "-o", "cat").splitlines() if re.match(r"<\d>", line)]
    assert not leaked, f"priority prefixes leaked into the messages: {leaked[:3]}"
    props = node.show("ActiveState", "SubState", "NRestarts")
    assert (props["ActiveState"], props["SubState"], props["NRestarts"]) == ("active", "running", "0"), props
    _timed("check 3: journal priorities", started)


def test_reload_keeps_the_stream_and_applies_the_config(node: Node) -> None:
    started = time.monotonic()
    before = node.kubelet.plugin(GPU_RESOURCE)
    assert before is not None and before.stream_open, node.diagnose()
    registrations = node.registrations()
    gpu0 = node.uuids[0]

    # XID 13 is an application error: harmless under the default policy.
    node.control.xid(0, 13)
    node.ctr.wait_journal(UNIT, "xid, stays healthy", "-o", "cat", timeout=TIMEOUT)
    # It came through the NVML event process: the daemon's child, in the unit's cgroup, under its sandbox.
    status = node.ctr.run("systemctl", "status", "--no-pager", "--full", UNIT).stdout
    assert "nvml_event_pump.py" in status, status
    now = node.kubelet.plugin(GPU_RESOURCE)
    assert now is not None and now.devices[gpu0].healthy, f"XID 13 took {gpu0} down by default\n{node.diagnose()}"

    node.ctr.write_file(CONFIG, "version: v1\nnvplug:\n  health:\n    fatalXids: [13]\n")
    _reload(node)
    node.ctr.wait_journal(UNIT, f"reloaded the config from {CONFIG}", "-o", "cat", timeout=TIMEOUT)
    node.control.xid(0, 13)
    try:
        node.kubelet.wait_for(device_health(gpu0, healthy=False), TIMEOUT)
    except TimeoutError as err:
        raise AssertionError(f"fatalXids [13] after reload did not make {gpu0} Unhealthy\n{node.diagnose()}") from err

    after = node.kubelet.plugin(GPU_RESOURCE)
    assert after is not None
    assert node.registrations() == registrations, f"the reload re-registered\n{node.diagnose()}"
    assert after.serial == before.serial and after.stream_open, (
        f"the ListAndWatch stream did not survive the reload: before {before.describe()}\nafter {after.describe()}"
    )
    assert after.allocatable == 7, after.describe()
    props = node.show("ActiveState", "SubState", "NRestarts")
    assert (props["ActiveState"], props["SubState"], props["NRestarts"]) == ("active", "running", "0"), props
    _timed("check 4: reload", started)


def test_an_unhealthy_gpu_stays_unhealthy_across_a_restart_and_heals_by_reset(node: Node) -> None:
    """The state file under StateDirectory= survives `systemctl restart`; `nvplug heal --reset` runs
    nvidia-smi from the hardened unit, through the root-only status socket."""
    started = time.monotonic()
    gpu0 = node.uuids[0]
    # Check 4 left GPU 0 Unhealthy: XID 13, fatal by config, needs a reset.
    saved = node.ctr.run("cat", STATE_FILE, check=False)
    assert saved.returncode == 0 and gpu0 in saved.stdout, f"no state file: {saved.stderr}\n{node.diagnose()}"
    registrations = node.registrations()
    node.ctr.run("systemctl", "restart", UNIT, timeout=60)
    node.wait_registered_again(registrations)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None
    assert all(not next(d for d in u.devices if d.id == gpu0).healthy for u in plugin.updates), plugin.describe()
    node.ctr.wait_journal(UNIT, "was Unhealthy before this start", "-o", "cat", timeout=TIMEOUT)
    # A stand-in nvidia-smi where the unit's PATH finds it; it records its arguments.
    node.ctr.write_file(
        "/usr/local/bin/nvidia-smi", f'#!/bin/sh\necho "$@" >> {CONTROL_DIR}/nvidia-smi.calls\necho reset done\n'
    )
    node.ctr.run("chmod", "755", "/usr/local/bin/nvidia-smi")
    healed = node.ctr.run("nvplug", "heal", "0", "--reset", check=False, timeout=60)
    assert healed.returncode == 0, f"{healed.stdout}{healed.stderr}\n{node.diagnose()}"
    assert "is Healthy: recovered: GPU reset by nvidia-smi" in healed.stdout, healed.stdout
    assert node.ctr.run("cat", f"{CONTROL_DIR}/nvidia-smi.calls").stdout.split() == ["-r", "-i", "0000:18:00.0"]
    node.kubelet.wait_for(device_health(gpu0, healthy=True), TIMEOUT)
    node.ctr.wait_journal(UNIT, "heal with a reset asked by uid 0", "-o", "cat", timeout=TIMEOUT)

    # The saver thread writes the file just after the kubelet has the news.
    def healed() -> bool:
        return gpu0 not in node.ctr.run("cat", STATE_FILE).stdout

    nspawn.wait_until(healed, TIMEOUT, "GPU 0 out of the state file", node.diagnose)
    errors = node.ctr.journal(UNIT, "-p", "err", "-o", "cat")
    assert "reload refused" in errors and "health state" not in errors, errors
    _timed("check 5: health across a restart, heal --reset", started)


def test_the_hardened_unit_reads_the_kernel_log(node: Node) -> None:
    """Without ProtectKernelLogs=, /dev/kmsg is the unit's to read: an Xid there takes its GPU out,
    and a driver load line there is the evidence that brings it back."""
    started = time.monotonic()
    scenario = fakenvml_library.DEFAULT_SCENARIO.read_text()
    bus = re.findall(r"^gpu .*?\bbus=(\S+)", scenario, re.MULTILINE)[7].lower()
    gpu7 = node.uuids[7]
    node.kernel_log(f"NVRM: Xid (PCI:{bus[:-2]}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    try:
        node.kubelet.wait_for(device_health(gpu7, healthy=False), TIMEOUT)
    except TimeoutError as err:
        raise AssertionError(f"an Xid in /dev/kmsg did not reach the kubelet\n{node.diagnose()}") from err
    node.ctr.wait_journal(UNIT, "(from the kernel log)", "-o", "cat", timeout=TIMEOUT)
    node.kernel_log("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024")
    node.kubelet.wait_for(device_health(gpu7, healthy=True), TIMEOUT)
    assert "kernel log unread" not in node.show("StatusText")["StatusText"]
    _timed("check 5b: the kernel log under the hardened unit", started)


def test_the_hardened_unit_places_a_pod_s_gpu_process_in_its_pod(node: Node) -> None:
    """A process of another UID in a cgroup the kubelet's systemd driver would make (a scope of containerd's
    under its pod's slice), named by the kubelet's log records: the unit's /metrics and `nvplug top` put
    its memory and utilization under its pod, and holds it by a pidfd. The unit's ProtectProc=invisible hides
    other users' processes from any process outside group 0: nvplug, root:root, reads them."""
    started = time.monotonic()
    uid, cid = "6f1b2c3d-0a0b-4c0d-8e0f-00000000abcd", "ab" * 32
    logs = f"/var/log/pods/ml_ts-a_{uid}/main"
    node.ctr.sh(
        f"mkdir -p {logs} /var/log/containers && touch {logs}/0.log && "
        f"ln -sf {logs}/0.log /var/log/containers/ts-a_ml_main-{cid}.log"
    )
    slice_name = f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice"
    # The container's systemd makes the scope for a process already in its tree (ours, entered from the
    # host, is not): a transient service asks for it, and the scope outlives the service.
    scope = (
        f"systemd-run --quiet --scope --unit=cri-containerd-{cid} --slice={slice_name} -- "
        "setpriv --reuid=4242 --regid=4242 --clear-groups sleep 600 >/dev/null 2>&1 & sleep 2"
    )
    node.ctr.run("systemd-run", "--quiet", "--wait", "--collect", "-p", "Type=oneshot", "sh", "-c", scope)
    # The image has no pgrep: the scope's own cgroup lists it (v2, or the hybrid's two hierarchies).
    find = (
        f"cg=$(systemctl show -p ControlGroup --value cri-containerd-{cid}.scope); "
        "for base in /sys/fs/cgroup/unified /sys/fs/cgroup/systemd /sys/fs/cgroup; do "
        '[ -f "$base$cg/cgroup.procs" ] && head -n1 "$base$cg/cgroup.procs" && break; done; true'
    )
    deadline = time.monotonic() + TIMEOUT
    while not (pid := node.ctr.sh(find).stdout.strip()):
        assert time.monotonic() < deadline, f"the pod's process did not start\n{node.diagnose()}"
        time.sleep(0.1)
    cgroup = node.ctr.sh(f"cat /proc/{pid}/cgroup").stdout
    assert f"{slice_name}/cri-containerd-{cid}.scope" in cgroup, cgroup
    try:
        node.control.procs(1, [GpuProcess(int(pid), 2048)])
        node.control.samples(1, [(int(pid), 40, 10)])
        time.sleep(1.1)  # past the last read's second
        scrape = (
            "from nvplug.status import status_client as s; "
            "print(s.fetch('unix:/run/nvplug/status.sock', '/metrics', timeout=5)[1])"
        )
        metrics = node.ctr.run("/opt/nvplug/venv/bin/python", "-c", scrape, timeout=60).stdout
        series = [line for line in metrics.splitlines() if line.startswith("nvplug_container_gpu_memory_used_bytes{")]
        print("\n".join(series))
        assert any(
            'namespace="ml",pod="ts-a",container="main"' in s and s.endswith(f" {2048 * 1024 * 1024}.0") for s in series
        ), f"{series}\n{node.diagnose()}"
        top = node.ctr.run("nvplug", "top", timeout=60).stdout
        print(top)
        assert re.search(rf"ml/ts-a \(main\)\s+pid {pid}\s+compute\s+2\.0 GiB", top), top
        # Held by a pidfd under the unit's syscall filter, so the next scrapes do not read its cgroup again.
        held = (
            "from nvplug.status import status_client as s; "
            "print(s.status('unix:/run/nvplug/status.sock', timeout=5)['GPU telemetry']['processes_held'])"
        )
        assert node.ctr.run("/opt/nvplug/venv/bin/python", "-c", held, timeout=60).stdout.strip() == "1"
    finally:
        node.control.procs(1, [])
        node.ctr.sh(f"kill {pid}", check=False)
    _timed("check 5c: a pod's GPU process under the hardened unit", started)


def test_the_hardened_unit_resets_an_idle_gpu_itself_and_runs_its_check(node: Node) -> None:
    """nvplug.health.autoReset: idle, from a reload: the unit runs nvidia-smi (check 5's stand-in)
    and the validation command, a child process of the hardened unit, before the GPU is Healthy."""
    started = time.monotonic()
    gpu5 = node.uuids[5]
    node.ctr.write_file(
        "/usr/local/bin/gpu-check", f'#!/bin/sh\necho "$NVPLUG_GPU_BUS_ID" >> {CONTROL_DIR}/gpu-check.calls\n', 0o755
    )
    node.ctr.write_file(
        CONFIG,
        "version: v1\nnvplug:\n  health:\n    fatalXids: [13]\n    autoReset: idle\n"
        "    autoResetQuietSeconds: 0.5\n    allowFabricReset: true\n    validateCommand: /usr/local/bin/gpu-check\n",
    )
    _reload(node)
    node.ctr.wait_journal(UNIT, f"reloaded the config from {CONFIG}", "-o", "cat", timeout=TIMEOUT)
    node.control.xid(5, 109)  # the catalog asks for a GPU reset and nothing more
    node.kubelet.wait_for(device_health(gpu5, healthy=False), TIMEOUT)
    try:
        node.kubelet.wait_for(device_health(gpu5, healthy=True), TIMEOUT)
    except TimeoutError as err:
        raise AssertionError(f"the idle GPU was not reset and checked\n{node.diagnose()}") from err
    calls = node.ctr.run("cat", f"{CONTROL_DIR}/nvidia-smi.calls").stdout.split()
    assert calls[-3:] == ["-r", "-i", "0000:ab:00.0"], calls
    assert node.ctr.run("cat", f"{CONTROL_DIR}/gpu-check.calls").stdout.split() == ["0000:ab:00.0"]
    node.ctr.wait_journal(UNIT, "auto-reset checked", "-o", "cat", timeout=TIMEOUT)
    _timed("check 5c: auto-reset under the hardened unit", started)


def mps_lists(node: Node) -> list[int]:
    """How many devices each list of the MPS resource had, across registrations."""
    return [len(u.devices) for v in node.kubelet.views(MPS_RESOURCE) for u in v.updates]


def test_the_hardened_unit_runs_mps_whose_clients_outlive_restarts_of_nvplug(node: Node, deb: Path) -> None:
    """sharing.mps under the shipped unit: the tmpfs mounted outside its sandbox, the control daemon in a unit
    of its own, a server started as UID 1001 for a client outside the unit. The client stays connected through
    `systemctl restart`, a SIGKILL of nvplug, a deb upgrade and a downgrade, `systemctl stop` and a refused
    `nvplug mps stop`: the same daemon, compute modes and shm. A daemon no config asks for runs on while its
    client does, then quits and gives the modes back."""
    started = time.monotonic()
    node.ctr.copy_in(mps_control.build(node.host / "mps-build"), MPS_CONTROL, 0o755)
    node.ctr.write_file(CONFIG, MPS_CONFIG)
    node.ctr.run("systemctl", "restart", UNIT)
    try:
        node.kubelet.wait_for(lambda k: k.allocatable(MPS_RESOURCE) == 8, TIMEOUT)
    except TimeoutError as err:
        raise AssertionError(f"the MPS devices did not turn Healthy under the unit\n{node.diagnose()}") from err
    exclusive = {node.uuids[0]: 3, node.uuids[1]: 3}
    assert fakenvml_library.persisted_compute_modes(node.host / "ctl") == exclusive
    # Mounted by `nvplug mps prepare` where the whole host sees it, not in the unit's namespace.
    mounted = node.ctr.run("findmnt", "-n", "-o", "FSTYPE", MPS_SHM, check=False).stdout.strip()
    assert mounted == "tmpfs", f"{MPS_SHM}: {mounted or 'not mounted'}\n{node.ctr.journal(UNIT, '-o', 'cat')}"
    assert node.ctr.run("stat", "-c", "%a", "/run/nvplug").stdout.strip() == "755"
    # The daemon in a unit of its own, out of nvplug's cgroup.
    daemon = node.ctr.show(MPS_DAEMON_UNIT, "MainPID", "ActiveState", "ControlGroup")
    assert daemon["ActiveState"] == "active" and daemon["MainPID"] not in ("", "0"), f"{daemon}\n{node.diagnose()}"
    assert daemon["ControlGroup"].endswith(f"/{MPS_DAEMON_UNIT}"), daemon
    # A CUDA process of UID 1001 that holds its connection and a segment in the shm, as a workload does.
    # In a pod's slice, as the kubelet's systemd driver places a container, and with the pod's log directory:
    # what `nvplug mps stop` names it by.
    pod_uid = "6a1f0c2e-93b4-4d57-8e0a-1c2b3d4e5f60"
    node.ctr.run("mkdir", "-p", f"/var/log/pods/default_mps-client_{pod_uid}")
    node.ctr.run(
        "systemd-run", "--unit=mps-client", f"--slice=kubepods-besteffort-pod{pod_uid.replace('-', '_')}.slice",
        "--", "setpriv", "--reuid=1001", "--regid=1001", "--clear-groups",
        "env", f"CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE}", MPS_CONTROL, "--fake-cuda-client",
        "--hold", f"{MPS_SHM}/client.segment",
    )  # fmt: skip
    node.ctr.wait_journal("mps-client", "holding the connection", "-o", "cat")
    client = node.ctr.show("mps-client", "MainPID")["MainPID"]
    assert "(user 1001, active thread percentage 25.0" in node.ctr.journal("mps-client", "-o", "cat")
    shm = node.ctr.run("stat", "-c", "%d", MPS_SHM).stdout.strip()

    seen = [len(mps_lists(node))]  # lists the kubelet got so far

    def unchanged(after: str) -> None:
        now = node.ctr.show(MPS_DAEMON_UNIT, "MainPID", "ActiveState")
        held = node.ctr.show("mps-client", "MainPID", "ActiveState")
        lists = mps_lists(node)
        print(
            f"after {after}: daemon pid {now['MainPID']} (was {daemon['MainPID']}), client pid {held['MainPID']} "
            f"(was {client}); the kubelet got {len(lists) - seen[0]} lists of {MPS_RESOURCE}, the smallest "
            f"{min(lists[seen[0] :], default=None)} devices"
        )
        seen[0] = len(lists)
        assert now == {"MainPID": daemon["MainPID"], "ActiveState": "active"}, f"{after}: {now}\n{node.diagnose()}"
        assert held == {"MainPID": client, "ActiveState": "active"}, (
            f"{after}: the client lost its daemon: {held}\n{node.ctr.journal('mps-client', '-o', 'cat')}"
        )
        assert fakenvml_library.persisted_compute_modes(node.host / "ctl") == exclusive, after
        assert node.ctr.run("stat", "-c", "%d", MPS_SHM).stdout.strip() == shm, f"{after}: another shm"
        assert node.ctr.exists(f"{MPS_SHM}/client.segment"), after

    def back_after(what: str, act: Callable[[], object], within: float) -> None:
        """`act`, then nvplug back (another main pid, registered again) with its MPS devices Healthy, no list
        in between with fewer, and all the client uses unchanged."""
        registrations, before = node.registrations(), node.show("MainPID")["MainPID"]
        act()

        def back() -> bool:
            pid, served = node.show("MainPID")["MainPID"], node.kubelet.allocatable(MPS_RESOURCE)
            return pid not in ("0", "", before) and node.registrations() > registrations and served == 8

        nspawn.wait_until(back, within, f"nvplug back after {what}, its MPS devices Healthy", node.diagnose)
        unchanged(what)
        assert min(mps_lists(node)) == 8, f"a list had fewer MPS devices: {mps_lists(node)}"

    for action in (("restart", UNIT), ("kill", "--signal=SIGKILL", UNIT)):
        back_after(f"systemctl {' '.join(action[:-1])}", functools.partial(node.ctr.run, "systemctl", *action), 30)
    # An upgrade to the next build, and a downgrade back: the old prerm leaves the unit running, the new
    # postinst rebuilds the venv and restarts it.
    newer = _next_build(deb, node.host)
    for package, options, what in ((newer, (), "an upgrade"), (deb, ("--allow-downgrades",), "a downgrade")):
        node.ctr.copy_in(package, f"/var/tmp/{package.name}")
        version = subprocess.run(["dpkg-deb", "-f", str(package), "Version"], capture_output=True, text=True)
        back_after(
            f"{what} to {version.stdout.strip()}",
            functools.partial(_install, node.ctr, f"/var/tmp/{package.name}", *options),
            60,
        )
        installed = node.ctr.run("dpkg-query", "-W", "-f=${Version}", "nvplug").stdout.strip()
        assert installed == version.stdout.strip(), (what, installed, version.stdout)
    journal = node.ctr.journal(UNIT, "-o", "cat")
    adopted = journal.count(f"the control daemon pid {daemon['MainPID']} an earlier nvplug started adopted")
    assert adopted == 4, journal[-3000:]
    node.ctr.run("systemctl", "stop", UNIT)
    unchanged("systemctl stop")
    # The teardown refuses while the client is connected, and names its pod.
    refused = node.ctr.run("nvplug", "mps", "stop", "--config", CONFIG, check=False)
    assert refused.returncode == 1, f"{refused.stdout}\n{refused.stderr}"
    assert f"(pid {client}: pod default/mps-client)" in refused.stderr, refused.stderr
    print(f"nvplug mps stop with the client connected: {refused.stderr.strip()}")
    unchanged("nvplug mps stop (refused)")
    # Started again without MPS: the daemon, which has a client, runs on; once the client is gone, a reload
    # asks again, the daemon quits, its unit goes, and the compute modes go back.
    registrations = node.registrations()
    node.ctr.write_file(CONFIG, "version: v1\n")
    node.ctr.run("systemctl", "start", UNIT)
    node.wait_registered_again(registrations)
    node.ctr.wait_journal(UNIT, "runs on while its clients", "-o", "cat")
    unchanged("a start without MPS")
    node.ctr.run("systemctl", "stop", "mps-client")
    _reload(node)
    nspawn.wait_until(
        lambda: (
            node.ctr.show(MPS_DAEMON_UNIT, "ActiveState")["ActiveState"] != "active"
            and fakenvml_library.persisted_compute_modes(node.host / "ctl") == {node.uuids[0]: 0, node.uuids[1]: 0}
        ),
        TIMEOUT,
        "the leftover daemon to quit with its client gone, and the compute modes to go back",
        node.diagnose,
    )
    _timed("check 5d: MPS under the hardened unit", started)


def test_watchdog_kills_a_hung_daemon_and_systemd_restarts_it(node: Node) -> None:
    started = time.monotonic()
    before = node.show("MainPID", "NRestarts")
    registrations = node.registrations()
    assert before["MainPID"] not in ("", "0"), f"no main process: {before}\n{node.diagnose()}"

    node.ctr.run("systemctl", "kill", "--signal=SIGSTOP", UNIT)
    seen = before

    def restarted() -> bool:
        nonlocal seen
        seen = node.show("MainPID", "NRestarts", "ActiveState", "SubState")
        return (
            int(seen["NRestarts"]) > int(before["NRestarts"])
            and seen["MainPID"] not in ("0", before["MainPID"])
            and (seen["ActiveState"], seen["SubState"]) == ("active", "running")
        )

    nspawn.wait_until(
        restarted, 30, "a watchdog kill and a restart", lambda: f"before {before}, now {seen}\n{node.diagnose()}"
    )
    stopped_to_running = time.monotonic() - started
    log = node.ctr.journal(UNIT, "-o", "cat")
    assert "Watchdog timeout" in log, f"the restart was not the watchdog's\n{node.diagnose()}"
    node.wait_registered_again(registrations)
    TIMINGS.add("  (SIGSTOP to active again)", stopped_to_running)
    TIMINGS.add("  (SIGSTOP to registered again)", time.monotonic() - started)
    _timed("check 6: watchdog restart", started)


def test_the_dra_plugin_needs_and_works_with_its_drop_in(node: Node) -> None:
    """DRA under the hardened unit: without the shipped drop-in the API server (TCP) and the kubelet's
    plugin directories are out of reach, and the device plugin carries on; with it, the kubelet's
    DRA stand-in registers the plugin, the slices reach the API-server stand-in and a claim is prepared.
    No kubeconfig of nvplug's own: it speaks with the kubelet's (nvplug.dra.kubeconfig: auto)."""
    started = time.monotonic()
    original = node.ctr.sh(f"cat {CONFIG}").stdout
    with FakeApiServer(netns=node.netns) as api:
        kubeconfig = api.write_kubeconfig(node.host / "kubeconfig")
        node.ctr.write_file(KUBELET_KUBECONFIG, kubeconfig.read_text(), mode=0o600)
        node.ctr.copy_in(mps_control.build(node.host / "mps-build"), MPS_CONTROL, 0o755)
        node.ctr.write_file(CONFIG, "version: v1\nnvplug:\n  dra:\n    enabled: true\n    nodeName: node-a\n"
                            f"    devices: [6, 7]\n  mps:\n    controlPath: {MPS_CONTROL}\n")  # fmt: skip
        kubelet = DraKubelet(node.host / "reg", "node-a", "1.34", api, {KUBELET_PLUGINS_DIR: node.host / "plugins"})
        registrations = node.registrations()
        node.ctr.run("systemctl", "restart", UNIT, timeout=60)
        node.ctr.wait_journal(UNIT, "ResourceSlices of node-a not published", "-o", "cat", timeout=TIMEOUT)
        journal = node.ctr.journal(UNIT, "-o", "cat")
        assert "Read-only file system: '/var/lib/kubelet/plugins/gpu.nvidia.com'" in journal, journal
        assert "see the unit's DRA drop-in" in journal and "Address family not supported by protocol" in journal
        # The device plugin serves the six GPUs DRA does not have.
        node.kubelet.wait_for(lambda k: node.registrations() > registrations and registered_with(6)(k), TIMEOUT)
        props = node.show("ActiveState", "SubState")
        assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
        node.ctr.sh(f"install -D -m 0644 {DRA_DROPIN} /etc/systemd/system/{UNIT}.service.d/dra.conf")
        node.ctr.run("systemctl", "daemon-reload")
        node.ctr.run("systemctl", "restart", UNIT, timeout=60)
        kubelet.start()
        try:
            nspawn.wait_until(lambda: kubelet.accepted(DRIVER) >= 1, TIMEOUT, "DRA registration", node.diagnose)
            journal = node.ctr.journal(UNIT, "-o", "cat")
            assert f"with the credentials of {KUBELET_KUBECONFIG}" in journal, journal[-3000:]

            def devices() -> list[str]:
                return [d["name"] for s in api.slices(node="node-a") for d in s["spec"]["devices"]]

            nspawn.wait_until(lambda: devices() == ["gpu-6", "gpu-7"], TIMEOUT, "the ResourceSlices", node.diagnose)
            result = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-7"}
            allocation = {"devices": {"results": [result]}}
            meta = {"namespace": "ml", "name": "c", "uid": "u1"}
            api.add_claim({"metadata": meta, "status": {"allocation": allocation}})
            answer = kubelet.prepare(DRIVER, [("ml", "c", "u1")])["u1"]
            assert answer.error == "" and answer.devices[0][3] == (f"k8s.device-plugin.nvidia.com/gpu={node.uuids[7]}",)
            assert node.ctr.exists("/var/lib/nvplug/dra-claims.json")
            assert kubelet.unprepare(DRIVER, [("ml", "c", "u1")]) == {"u1": ""}
            _shared_claims_under_the_unit(node, api, kubelet)
        finally:
            kubelet.stop()
    _drop_in_removed(node, "dra.conf", original, KUBELET_KUBECONFIG)
    _timed("check 7b: DRA with its drop-in", started)


def _drop_in_removed(node: Node, drop_in: str, config: str, *files: str) -> None:
    """The drop-in and `files` gone, the config as it was, and the unit restarted and registered again: the
    operator's files go with the operator (dpkg --purge leaves files it did not install)."""
    node.ctr.sh(f"rm -f /etc/systemd/system/{UNIT}.service.d/{drop_in} {' '.join(files)}")
    node.ctr.write_file(CONFIG, config)
    node.ctr.run("systemctl", "daemon-reload")
    registrations = node.registrations()
    node.ctr.run("systemctl", "restart", UNIT, timeout=60)
    node.wait_registered_again(registrations)


def _shared_claims_under_the_unit(node: Node, api: FakeApiServer, kubelet: DraKubelet) -> None:
    """A time-sliced claim (nvidia-smi, the unit's child) and an MPS claim: its control daemon the unit's
    child, its spec in /run/cdi, a server of UID 1001 for a client outside the unit; both undone."""

    def shared(uid: str, device: str, sharing: dict[str, object]) -> str:
        parameters = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": sharing}
        config = [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}]
        result = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": device}
        allocation = {"devices": {"results": [result], "config": config}}
        api.add_claim({"metadata": {"namespace": "ml", "name": uid, "uid": uid}, "status": {"allocation": allocation}})
        answer = kubelet.prepare(DRIVER, [("ml", uid, uid)])[uid]
        assert answer.error == "", f"{answer.error}\n{node.diagnose()}"
        return " ".join(answer.devices[0][3])

    node.ctr.sh(f"rm -f {CONTROL_DIR}/nvidia-smi.calls")
    shared("ts", "gpu-6", {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
    calls = node.ctr.run("cat", f"{CONTROL_DIR}/nvidia-smi.calls").stdout.splitlines()
    assert calls == [f"compute-policy -i {node.uuids[6]} --set-timeslice 3"], calls
    names = shared("mps", "gpu-7", {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}})
    assert names.endswith(" k8s.gpu.nvidia.com/claim=mps-gpu-7"), names
    spec = "/run/cdi/k8s.gpu.nvidia.com-claim_mps.json"
    assert node.ctr.exists(spec)
    assert fakenvml_library.persisted_compute_modes(node.host / "ctl")[node.uuids[7]] == 3
    client = node.ctr.run(
        "setpriv", "--reuid=1001", "--regid=1001", "--clear-groups",
        "env", "CUDA_MPS_PIPE_DIRECTORY=/run/nvplug/mps/claim-mps/pipe", MPS_CONTROL, "--fake-cuda-client",
        check=False,
    )  # fmt: skip
    assert client.returncode == 0 and "(user 1001, active thread percentage 50.0" in client.stdout, (
        f"{client.stdout}{client.stderr}\n{node.diagnose()}"
    )
    # A restart of nvplug with the claim prepared: the claim's daemon runs on in its own unit and is adopted,
    # its spec stays, and the kubelet is served again.
    claim_unit = "nvplug-mps-claim-mps.service"
    daemon = node.ctr.show(claim_unit, "MainPID", "ActiveState")
    assert daemon["ActiveState"] == "active", f"{daemon}\n{node.diagnose()}"
    registered = kubelet.accepted(DRIVER)
    node.ctr.run("systemctl", "restart", UNIT)
    nspawn.wait_until(lambda: kubelet.accepted(DRIVER) > registered, TIMEOUT, "DRA registered again", node.diagnose)
    journal = node.ctr.wait_journal(
        UNIT, f"the control daemon pid {daemon['MainPID']} an earlier nvplug started adopted"
    )
    assert node.ctr.show(claim_unit, "MainPID", "ActiveState") == daemon, journal[-2000:]
    assert node.ctr.exists(spec)
    print(f"the MPS claim's daemon across systemctl restart nvplug: pid {daemon['MainPID']}, adopted, spec kept")
    assert kubelet.unprepare(DRIVER, [("ml", "ts", "ts"), ("ml", "mps", "mps")]) == {"ts": "", "mps": ""}
    calls = node.ctr.run("cat", f"{CONTROL_DIR}/nvidia-smi.calls").stdout.splitlines()
    assert calls[-1] == f"compute-policy -i {node.uuids[6]} --set-timeslice 0", calls
    assert not node.ctr.exists(spec)
    assert fakenvml_library.persisted_compute_modes(node.host / "ctl")[node.uuids[7]] == 0


def test_the_metrics_port_needs_and_works_with_its_drop_in(node: Node) -> None:
    """nvplug.status.metricsListen under the hardened unit: without the shipped drop-in TCP is refused, said
    once, and the GPUs are served all the same; with it, /metrics alone answers on the port, and a reload
    moves it."""
    started = time.monotonic()
    original = node.ctr.sh(f"cat {CONFIG}").stdout
    node.ctr.write_file(CONFIG, "version: v1\nnvplug:\n  status:\n    metricsListen: 127.0.0.1:9400\n")
    registrations = node.registrations()
    node.ctr.run("systemctl", "restart", UNIT, timeout=60)
    node.wait_registered_again(registrations)
    node.ctr.wait_journal(UNIT, "metrics endpoint 127.0.0.1:9400 unavailable", "-o", "cat", timeout=TIMEOUT)
    said = [line for line in node.ctr.journal(UNIT, "-o", "cat").splitlines() if "127.0.0.1:9400 unavailable" in line]
    # Said once, with what to do: no retry can make the family the unit refuses.
    assert len(said) == 1 and "Address family not supported by protocol" in said[0], said
    assert "install its drop-in for TCP and restart" in said[0], said

    def ask(path: str, port: int = 9400) -> tuple[int, str]:
        return node.netns.run(lambda: statusclient.fetch(f"127.0.0.1:{port}", path, timeout=5))

    try:
        node.ctr.sh(f"install -D -m 0644 {METRICS_DROPIN} /etc/systemd/system/{UNIT}.service.d/metrics.conf")
        node.ctr.run("systemctl", "daemon-reload")
        registrations = node.registrations()
        node.ctr.run("systemctl", "restart", UNIT, timeout=60)
        node.wait_registered_again(registrations)
        node.ctr.wait_journal(UNIT, "metrics endpoint on 127.0.0.1:9400 (/metrics)", "-o", "cat", timeout=TIMEOUT)
        code, text = ask("/metrics")
        assert code == 200 and "DCGM_FI_DEV_GPU_TEMP{" in text, f"{code} {text[:300]}\n{node.diagnose()}"
        assert ask("/status")[0] == 404
        # Moved by a reload, as the unit's ExecReload sends it.
        node.ctr.write_file(CONFIG, "version: v1\nnvplug:\n  status:\n    metricsListen: 127.0.0.1:9401\n")
        node.ctr.run("systemctl", "reload", UNIT, timeout=60)
        node.ctr.wait_journal(UNIT, "metrics endpoint on 127.0.0.1:9401 (/metrics)", "-o", "cat", timeout=TIMEOUT)
        code, text = ask("/metrics", 9401)
        assert code == 200 and "DCGM_FI_DEV_GPU_TEMP{" in text, f"{code} {text[:300]}"
        with pytest.raises(statusclient.StatusUnavailable):
            ask("/metrics")
    finally:
        _drop_in_removed(node, "metrics.conf", original)
    _timed("check 7c: /metrics on TCP with its drop-in", started)


def test_at_boot_the_kubelet_ordered_after_nvplug_finds_the_gpus_in_its_first_second(node: Node) -> None:
    """nvplug.service is Before=kubelet.service with Type=notify: started in one transaction, as at boot, the
    kubelet starts only after READY=1, and its first second (when it admits the pods bound to the node) sees
    the GPUs registered. The kubelet here is the stand-in, as a unit of the container's own systemd."""
    started = time.monotonic()
    node.ctr.write_file(CONFIG, "version: v1\n")
    node.ctr.write_file(
        "/etc/systemd/system/kubelet.service",
        "[Unit]\nDescription=kubelet stand-in\n[Service]\n"
        f"ExecStart=/opt/nvplug/venv/bin/python -m nvplug.testing.kubelet_standin --dir {PLUGIN_DIR}\n",
    )
    node.ctr.run("systemctl", "daemon-reload")
    node.ctr.run("systemctl", "stop", UNIT)
    node.kubelet.stop()  # the host's stand-in: the container's kubelet.sock is the unit's now
    try:
        node.ctr.run("systemctl", "start", UNIT, "kubelet.service")  # one transaction, ordered as at boot
        seen = node.ctr.wait_journal("kubelet", "update nvidia.com/gpu: 8 devices, 8 healthy", "-o", "cat")
        lines = [line for line in seen.splitlines() if line.startswith("[")]
        print("the kubelet stand-in, started after nvplug by systemd:\n" + "\n".join(lines[:6]))

        def at(text: str) -> float:
            return float(next(line for line in lines if text in line).split("]")[0].strip("[ "))

        assert at("register 'nvidia.com/gpu'") < 1.0 and at("update nvidia.com/gpu: 8 devices, 8 healthy") < 1.0, lines
        ready = node.ctr.journal(UNIT, "-o", "cat")
        assert "NVML unavailable" not in ready[-2000:], ready[-2000:]
    finally:
        node.ctr.run("systemctl", "stop", "kubelet.service", check=False)
        node.ctr.run("rm", "-f", "/etc/systemd/system/kubelet.service")
        node.ctr.run("systemctl", "daemon-reload")
        node.kubelet.start()
        node.ctr.run("systemctl", "restart", UNIT)
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    _timed("check 6b: boot order with a kubelet unit", started)


def test_stop_is_clean(node: Node) -> None:
    started = time.monotonic()
    node.ctr.run("systemctl", "stop", UNIT, timeout=60)
    props = node.show("ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
    assert props["ActiveState"] == "inactive", f"{props}\n{node.diagnose()}"
    # ExecMainCode 1 is CLD_EXITED: it exited by itself on SIGTERM, with status 0.
    assert (props["Result"], props["ExecMainCode"], props["ExecMainStatus"]) == ("success", "1", "0"), (
        f"{props}\n{node.diagnose()}"
    )
    assert not (node.plugin_dir / PLUGIN_SOCKET).exists(), "the plugin's socket was left behind"
    log = node.ctr.journal(UNIT, "-o", "cat")
    assert "nvplug stopped" in log, f"no 'nvplug stopped' in the journal\n{log[-3000:]}"
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and not plugin.stream_open, "the stand-in's stream is still open"
    _timed("check 7: stop", started)


def test_remove_and_purge(node: Node) -> None:
    started = time.monotonic()
    apt = ("apt-get", "-y", "-q", "-o", "Dpkg::Use-Pty=0")
    # MPS running, as on a node that shares GPUs: removal is the teardown a stop is not.
    node.ctr.copy_in(mps_control.build(node.host / "mps-build"), MPS_CONTROL, 0o755)
    node.ctr.write_file(CONFIG, MPS_CONFIG)
    node.ctr.run("systemctl", "restart", UNIT)
    node.kubelet.wait_for(lambda k: k.allocatable(MPS_RESOURCE) == 8, TIMEOUT)

    def mps_modes() -> dict[str, int | None]:
        persisted = fakenvml_library.persisted_compute_modes(node.host / "ctl")
        return {uuid: persisted.get(uuid) for uuid in node.uuids[:2]}

    assert mps_modes() == {node.uuids[0]: 3, node.uuids[1]: 3}
    # The maintainer scripts reach the fake NVML as the unit does (apt-get passes its environment on).
    fake = [f"{k}={v}" for k, v in NVML_ENV.items()]
    removed = node.ctr.run("env", *fake, *apt, "remove", "nvplug", timeout=120)
    said = [line for line in (removed.stdout + removed.stderr).splitlines() if "nvplug" in line and "mps" in line]
    print(f"apt-get remove said: {said}")
    assert node.ctr.show(MPS_DAEMON_UNIT, "ActiveState")["ActiveState"] != "active", removed.stdout + removed.stderr
    assert mps_modes() == {node.uuids[0]: 0, node.uuids[1]: 0}, f"{removed.stdout}\n{removed.stderr}"
    assert node.ctr.run("findmnt", MPS_SHM, check=False).returncode != 0, "the clients' shm is still mounted"
    for path in ("/lib/systemd/system/nvplug.service", "/usr/bin/nvplug", f"/run/cdi/{CDI_SPEC}", FEATURE_FILE):
        assert not node.ctr.exists(path), f"{path} is still there after apt-get remove"
    assert node.ctr.exists(CONFIG), "apt-get remove must keep the conffile (only purge removes it)"
    load = node.show("LoadState")["LoadState"]
    assert load == "not-found", f"systemd still knows the unit after remove: LoadState={load}"

    node.ctr.run(*apt, "purge", "nvplug", timeout=120)
    status = node.ctr.run("dpkg-query", "-W", "-f=${db:Status-Abbrev}", "nvplug", check=False).stdout.strip()
    assert status in ("", "un"), f"dpkg still lists nvplug after purge: {status!r}"
    left = node.ctr.sh(
        "for p in /etc/nvplug /opt/nvplug /usr/bin/nvplug /lib/systemd/system/nvplug.service "
        "/etc/systemd/system/multi-user.target.wants/nvplug.service; do "
        '[ -e "$p" ] || [ -L "$p" ] && echo "$p"; done; true'
    ).stdout.split()
    assert not left, f"left behind after purge: {shlex.join(left)}"
    _timed("check 8: remove and purge", started)


def test_the_rpm_s_scriptlets_install_restart_on_upgrade_and_erase(node: Node, rpm: Path) -> None:
    """The RPM, with the deb purged: its scriptlets on the same systemd (Debian's rpm, whose database holds
    none of the dependencies: --nodeps)."""
    started = time.monotonic()
    fake = [f"{k}={v}" for k, v in NVML_ENV.items()]
    command = ("env", *fake, "rpm", "--force-debian", "--nodeps")
    node.ctr.copy_in(rpm, f"/var/tmp/{rpm.name}")

    def rpm_run(*args: str) -> str:
        proc = node.ctr.run(*command, *args, check=False, timeout=300)
        said = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"rpm {shlex.join(args)} failed ({proc.returncode}):\n{said}\n{node.diagnose()}"
        return said

    # %posttrans: the venv built, the unit enabled and started.
    registrations = node.registrations()
    print(f"rpm -i said: {rpm_run('-i', f'/var/tmp/{rpm.name}').strip()!r}")
    node.wait_registered_again(registrations)
    props = node.show("ActiveState", "UnitFileState", "MainPID")
    assert (props["ActiveState"], props["UnitFileState"]) == ("active", "enabled"), f"{props}\n{node.diagnose()}"

    # An upgrade (the same package again): restarted, still enabled; nothing of an erase runs.
    registrations = node.registrations()
    rpm_run("-U", "--replacepkgs", f"/var/tmp/{rpm.name}")
    node.wait_registered_again(registrations)
    after = node.show("ActiveState", "UnitFileState", "MainPID")
    assert (after["ActiveState"], after["UnitFileState"]) == ("active", "enabled"), f"{after}\n{node.diagnose()}"
    assert after["MainPID"] != props["MainPID"], "the upgrade did not restart the daemon"
    assert node.ctr.exists("/opt/nvplug/venv/bin/nvplug")

    # %preun of an erase: stopped and disabled, the venv and what it wrote for others removed.
    rpm_run("-e", "nvplug")
    assert node.show("LoadState")["LoadState"] == "not-found", node.diagnose()
    for path in (
        "/opt/nvplug/venv",
        "/usr/bin/nvplug",
        f"/run/cdi/{CDI_SPEC}",
        "/usr/lib/systemd/system/nvplug.service",
    ):
        assert not node.ctr.exists(path), f"{path} is still there after rpm -e"
    assert not (node.plugin_dir / PLUGIN_SOCKET).exists(), "the plugin's socket was left behind"
    listed = node.ctr.run("rpm", "-q", "nvplug", check=False)
    assert listed.returncode != 0, f"rpm still lists nvplug after an erase: {listed.stdout}"
    _timed("check 9: the rpm's scriptlets", started)
