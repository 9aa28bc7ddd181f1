"""A simulated GPU node: the fake NVML library, a kubelet stand-in and the real
daemon as a child process, all in one directory and, for udev, one network
namespace of its own. Used by the tests and the demo."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Literal

from nvplug.core.gpu import normalize_bus_id
from nvplug.core.kernel_log_records import format_record
from nvplug.mps.control_daemon import kill_leftover
from nvplug.mps.daemon_process import DaemonProcess
from nvplug.mps.daemon_records import DaemonRecords
from nvplug.mps.mps_dirs import DAEMON_PID_FILE
from nvplug.testing import fakenvml_control, fakenvml_library
from nvplug.testing import mps_control_standin as mps_control
from nvplug.testing import nvidia_smi_standin as nvidia_smi
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.kubelet_thread import KubeletThread
from nvplug.testing.net_namespace import NamespaceUnavailable, NetNamespace, isolated
from nvplug.testing.udev_sender import UdevSender

GPU_RESOURCE = "nvidia.com/gpu"
# The simulated machine's DMI product name (/sys/class/dmi/id/product_name).
MACHINE = "NVIDIA DGX H100"
# The fake library; whatever the host's loader finds (a real driver); or no library at all.
NvmlSource = Literal["fake", "host", "none"]
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# What a pipe holds where F_GETPIPE_SZ cannot tell (Linux's default).
PIPE_BYTES = 64 * 1024
# How long kernel_log waits for a running daemon to read a full pipe.
KERNEL_LOG_WRITE_TIMEOUT_S = 5.0


def registered_with(count: int, resource: str = GPU_RESOURCE) -> Callable[[FakeKubelet], bool]:
    """A wait_for predicate: registered, streaming, with `count` devices."""

    def check(k: FakeKubelet) -> bool:
        p = k.plugin(resource)
        return p is not None and p.stream_open and len(p.updates) > 0 and p.capacity == count

    return check


def device_health(uuid: str, healthy: bool, resource: str = GPU_RESOURCE) -> Callable[[FakeKubelet], bool]:
    """A wait_for predicate: the kubelet sees this device with this health."""

    def check(k: FakeKubelet) -> bool:
        p = k.plugin(resource)
        return p is not None and uuid in p.devices and p.devices[uuid].healthy is healthy

    return check


def remove_tree(path: Path) -> None:
    """shutil.rmtree of a directory a running daemon serves in: once more if its rebind landed a
    socket between rmtree's unlinks and its rmdir (ENOTEMPTY), as a kubelet wipe can race it too."""
    for _ in range(5):
        try:
            shutil.rmtree(path)
            return
        except OSError as err:
            if err.errno != errno.ENOTEMPTY:
                raise
    shutil.rmtree(path)


class SimulatedNode:
    """Keep `root` short: unix socket paths are limited to 107 bytes."""

    def __init__(
        self, root: Path, scenario: Path = fakenvml_library.DEFAULT_SCENARIO, lib_dir: Path | None = None
    ) -> None:
        self.root = root
        self.plugin_dir = root / "device-plugins"
        self.dev_root = root / "dev-root"
        self.sysfs_root = root / "sys"
        # Where the daemon reads driver/nvidia-caps/mig-minors.
        self.proc_root = root / "proc"
        # The daemon's /healthz, /status and /metrics.
        self.status_socket = root / "status.sock"
        self.config = root / "config.yaml"
        self.control_path = root / "nvml.ctl"
        self.log_path = root / "nvplug.log"
        self.scenario = root / "node.scenario"
        self.lib_dir = lib_dir or root / "lib"
        # The health state file's directory, and this simulated boot's id (proc/sys/kernel/random/boot_id).
        self.state_dir = root / "state"
        # Where the daemon writes its CDI spec, and where this node's runtimes read specs: never the
        # machine's /etc/cdi and /var/run/cdi, which a real nvplug on the machine owns.
        self.cdi_dir = root / "cdi"
        self.cdi_runtime_dirs = (root / "etc/cdi", root / "var/run/cdi")
        # Where nvidia-ctk would be: absent (no hook in the spec), whatever the machine has installed.
        self.nvidia_ctk = root / "usr/bin/nvidia-ctk"
        # NFD's features.d and the daemon's label file in it (made by a test that wants labels).
        self.features_dir = root / "features.d"
        self.feature_file = self.features_dir / "nvplug"
        self.boot_id_file = self.proc_root / "sys/kernel/random/boot_id"
        # /sys/module/nvidia: its inode tells one load of the driver from the next.
        self.driver_module = self.sysfs_root / "module/nvidia"
        # A stand-in nvidia-smi on the daemon's PATH, recording its calls here.
        self.bin_dir = root / "bin"
        self.nvidia_smi_log = root / "nvidia-smi.log"
        # The daemon's MPS root (--mps-root: never the machine's /run/nvplug/mps), and the stand-in
        # control binary a test that runs MPS names.
        self.mps_root = root / "mps"
        self.pod_log_root = root / "var/log"  # the kubelet's pods/ and containers/ log records
        self.mps_control = self.bin_dir / mps_control.BINARY_NAME
        self.kubelet = KubeletThread(self.plugin_dir)
        # The daemon's network namespace, where this node's udev messages go; None where none can be
        # made (not root), and then why: such a node sends no udev message at all.
        self.netns: NetNamespace | None = None
        self.no_netns_reason = ""
        if os.geteuid() != 0:
            self.no_netns_reason = "sending udev netlink messages needs root"
        else:
            try:
                self.netns = NetNamespace()
            except NamespaceUnavailable as exc:
                self.no_netns_reason = str(exc)
        self.daemon: subprocess.Popen[bytes] | None = None
        # What copies the daemon's log into log_path: a thread here (to echo it), or a process of its own.
        self._log_pump: threading.Thread | subprocess.Popen[bytes] | None = None

        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.sysfs_root.mkdir(exist_ok=True)
        (self.dev_root / "dev").mkdir(parents=True, exist_ok=True)
        for name in CONTROL_NODES:
            (self.dev_root / "dev" / name).touch()
        self.config.write_text("version: v1\n")
        shutil.copyfile(scenario, self.scenario)
        self.new_boot()
        self.driver_module.mkdir(parents=True, exist_ok=True)
        # What the node labels read beside NVML: the machine's DMI product name, each GPU's PCI class.
        dmi = self.sysfs_root / "class/dmi/id/product_name"
        dmi.parent.mkdir(parents=True, exist_ok=True)
        dmi.write_text(f"{MACHINE}\n")
        for gpu in self.scenario_gpus():
            self.add_device_node(gpu.get("minor"))
            self.add_pci_device(gpu.get("bus"))
        nvidia_smi.install(self.bin_dir, self.nvidia_smi_log)
        # The kernel log stand-in: a FIFO of /dev/kmsg records. The node holds it open for reading
        # and writing, so writes never block and the pipe keeps its records while no daemon reads.
        self.kernel_log_path = root / "kmsg"
        with contextlib.suppress(FileExistsError):
            os.mkfifo(self.kernel_log_path)
        self._kernel_log_fd = os.open(self.kernel_log_path, os.O_RDWR | os.O_NONBLOCK)
        # Every record written (as formatted), oldest first: a (re)started daemon reads them all.
        self.kernel_log_history: list[str] = []
        self._kernel_log_seq = 0

    def new_boot(self) -> str:
        """A fresh boot id, as after a reboot: the kernel log starts empty again."""
        self.kernel_log_history = []
        self._kernel_log_seq = 0
        self.boot_id_file.parent.mkdir(parents=True, exist_ok=True)
        boot = str(uuid.uuid4())
        self.boot_id_file.write_text(boot + "\n")
        return boot

    def reload_driver(self) -> None:
        """What a reloaded kernel module looks like in sysfs: /sys/module/nvidia made anew."""
        fresh = self.driver_module.with_name("nvidia.new")
        fresh.mkdir()
        # Both exist at once, so the new one cannot reuse the old inode number.
        shutil.rmtree(self.driver_module)
        fresh.rename(self.driver_module)

    def add_device_node(self, minor: str | int | None) -> None:
        """/dev/nvidia<minor> under the dev root, as the driver creates it for each GPU."""
        if minor is not None:
            (self.dev_root / "dev" / f"nvidia{minor}").touch()

    def add_pci_device(self, bus_id: str | None, pci_class: int = 0x030200) -> None:
        """A PCI device in sysfs as the kernel shows it: its directory under its root complex
        (/sys/devices/pci<domain>:<bus>/<port>/<address>), linked from /sys/bus/pci/devices, with
        its class (a 3D controller, as datacenter GPUs are). Buses 0x10 apart share a root complex."""
        if bus_id is None:
            return
        address = normalize_bus_id(bus_id)
        domain, bus = address.split(":")[:2]
        root = f"{domain}:{int(bus, 16) & 0xF0:02x}"
        device = self.sysfs_root / "devices" / f"pci{root}" / f"{root}:01.0" / address
        device.mkdir(parents=True, exist_ok=True)
        (device / "class").write_text(f"0x{pci_class:06x}\n")
        link = self.sysfs_root / "bus/pci/devices" / address
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(device, link.parent))

    def add_gpu(self, spec: str) -> str:
        """Hot-add a GPU to the fake library (`gpu` line syntax) with its device node and sysfs entry."""
        words = dict(w.split("=", 1) for w in shlex.split(spec) if "=" in w)
        self.add_device_node(words.get("minor"))
        self.add_pci_device(words.get("bus"))
        return self.control.add(spec)

    def kernel_log(self, message: str, prio: int = 3) -> int:
        """Adds a record to the kernel log stand-in (prio 3: the kernel's KERN_ERR); returns its seq."""
        seq = self._kernel_log_seq
        self._kernel_log_seq += 1
        record = format_record(prio, seq, time.monotonic_ns() // 1000, message)
        self.kernel_log_history.append(record)
        self._write_kernel_log(record.encode())
        return seq

    def kernel_log_gap(self, n: int) -> None:
        """Skips `n` seq numbers, as records the ring buffer dropped before a reader saw them."""
        if n < 0:
            raise ValueError(f"a gap of {n} records")
        self._kernel_log_seq += n

    def _write_kernel_log(self, data: bytes) -> None:
        view = memoryview(data)
        deadline = time.monotonic() + KERNEL_LOG_WRITE_TIMEOUT_S
        while view:
            try:
                view = view[os.write(self._kernel_log_fd, view) :]
            except BlockingIOError:
                if self.daemon is None or self.daemon.poll() is not None:
                    # Nobody reads: the pipe is the whole ring buffer, so the oldest records go.
                    self.replay_kernel_log()
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the daemon has not read the kernel log stand-in {self.kernel_log_path} "
                        f"for {KERNEL_LOG_WRITE_TIMEOUT_S:.0f}s"
                    ) from None
                select.select([], [self._kernel_log_fd], [], 0.05)

    def replay_kernel_log(self) -> None:
        """Empties the pipe and writes the history again, as much of it as fits, oldest first:
        what a reader that opens /dev/kmsg anew sees. `start_daemon` does it."""
        while True:
            try:
                if not os.read(self._kernel_log_fd, PIPE_BYTES):
                    break
            except BlockingIOError:
                break
        try:
            capacity = fcntl.fcntl(self._kernel_log_fd, fcntl.F_GETPIPE_SZ)
        except (AttributeError, OSError):
            capacity = PIPE_BYTES
        # A page of room: the pipe counts pages, and the last one may not be filled.
        budget = capacity - 4096
        keep = 0
        for record in reversed(self.kernel_log_history):
            budget -= len(record.encode())
            if budget < 0:
                break
            keep += 1
        del self.kernel_log_history[: len(self.kernel_log_history) - keep]
        data = "".join(self.kernel_log_history).encode()
        try:
            written = os.write(self._kernel_log_fd, data) if data else 0
        except BlockingIOError:
            written = 0
        if written != len(data):
            raise OSError(errno.EAGAIN, f"the kernel log stand-in took {written} of {len(data)} bytes")

    def mps_config(self, resources: str, extra: str = "") -> str:
        """A config running MPS on this node: `resources` are sharing.mps.resources' entries (YAML lines),
        `extra` more nvplug.mps keys; the stand-in control binary is installed."""
        mps_control.install(self.bin_dir, build_dir=self.lib_dir / "mps-control")
        # A server runs as its client's UID and must pass every parent of the root (mkdtemp's are 0700).
        self.root.chmod(0o755)
        return (
            f"version: v1\nsharing:\n  mps:\n    resources:\n{resources}nvplug:\n  mps:\n"
            f"    controlPath: {self.mps_control}\n{extra}"
        )

    def build_library(self) -> Path:
        return fakenvml_library.build(self.lib_dir)

    @property
    def control(self) -> fakenvml_control.Control:
        return fakenvml_control.Control(self.control_path, self.netns)

    @property
    def plugin_socket(self) -> Path:
        return self.plugin_dir / "nvplug-nvidia.com-gpu.sock"

    def udev(self) -> UdevSender:
        """A udevd stand-in that sends in this node's network namespace only."""
        if self.netns is None:
            raise NamespaceUnavailable(errno.EPERM, f"no network namespace for udev: {self.no_netns_reason}")
        return UdevSender(self.netns)

    def send_uevent(self, properties: Mapping[str, str | bytes]) -> None:
        """One uevent on a throwaway socket (SEQNUM 1): use udev() for sequences."""
        with self.udev() as sender:
            sender.send(properties)

    def isolated(self, argv: Sequence[str]) -> list[str]:
        """`argv` in this node's network namespace (or one of its own, not root): every daemon runs so."""
        return isolated(argv, self.netns)

    def daemon_env(self, nvml: NvmlSource = "fake") -> dict[str, str]:
        env = dict(os.environ)
        if nvml != "host":
            env.pop("LD_LIBRARY_PATH", None)
        if nvml == "fake":
            env = fakenvml_library.environ(self.lib_dir, self.scenario, self.control_path, env)
            env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start_daemon(
        self,
        *extra: str,
        nvml: NvmlSource = "fake",
        log_level: str = "debug",
        env: Mapping[str, str] | None = None,
        echo: Callable[[str], None] | None = None,
        dev_root_flag: bool = True,
    ) -> subprocess.Popen[bytes]:
        """Start `nvplug run`. Its log goes to log_path and, if given, line by line to `echo`.
        Without `dev_root_flag`, the config's flags.nvidiaDevRoot says where the dev root is."""
        if nvml == "fake":
            self.build_library()
        # A real /dev/kmsg shows each reader the log from its oldest record: a restarted daemon sees it all again.
        self.replay_kernel_log()
        argv = self.isolated(
            [
                sys.executable,
                "-m",
                "nvplug",
                "run",
                "--device-plugin-dir",
                str(self.plugin_dir),
                *(["--dev-root", str(self.dev_root)] if dev_root_flag else []),
                "--sysfs-root",
                str(self.sysfs_root),
                "--proc-root",
                str(self.proc_root),
                "--status-listen",
                f"unix:{self.status_socket}",
                "--config",
                str(self.config),
                "--state-dir",
                str(self.state_dir),
                *self.cdi_args(),
                "--nfd-feature-file",
                str(self.feature_file),
                "--pod-resources-socket",
                str(self.kubelet.pod_resources.socket_path),
                "--log-level",
                log_level,
                *("--kernel-log", str(self.kernel_log_path), "--mps-root", str(self.mps_root)),
                *("--pod-log-root", str(self.pod_log_root)),
                *extra,
            ]
        )
        full_env = self.daemon_env(nvml)
        full_env.update(env or {})
        if echo is None:
            # A pipe read by a process of its own, as the journal's stream is: no thread of this process
            # (which may be the kubelet stand-in's, timed) copies each line.
            read_end, write_end = os.pipe()
            try:
                with self.log_path.open("ab") as log:
                    self._log_pump = subprocess.Popen(["cat"], stdin=read_end, stdout=log)
                self.daemon = subprocess.Popen(argv, env=full_env, stdin=subprocess.DEVNULL, stderr=write_end)
            finally:
                os.close(read_end)
                os.close(write_end)
            return self.daemon
        self.daemon = subprocess.Popen(argv, env=full_env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert self.daemon.stderr is not None
        self._log_pump = threading.Thread(
            target=_pump, args=(self.daemon.stderr, self.log_path, echo), name="nvplug log", daemon=True
        )
        self._log_pump.start()
        return self.daemon

    def cdi_args(self) -> list[str]:
        """This node's CDI paths, for `nvplug run` and `nvplug doctor` alike."""
        return [
            "--cdi-spec-dir",
            str(self.cdi_dir),
            "--cdi-runtime-dirs",
            ",".join(str(d) for d in self.cdi_runtime_dirs),
            "--nvidia-ctk-path",
            str(self.nvidia_ctk),
        ]

    def stop_daemon(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 10.0) -> int:
        daemon = self.daemon
        if daemon is None:
            raise RuntimeError("the daemon was not started")
        if daemon.poll() is None:
            daemon.send_signal(sig)
        try:
            code = daemon.wait(timeout)
        except subprocess.TimeoutExpired:
            daemon.kill()
            code = daemon.wait()
        if isinstance(self._log_pump, threading.Thread):
            self._log_pump.join(5)
        elif self._log_pump is not None:
            # The daemon's end is the pipe's, unless a child of its holds it still (cleaned up at close).
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._log_pump.wait(5)
        return code

    def scenario_gpus(self) -> list[dict[str, str]]:
        """The scenario's `gpu` lines as key=value maps, in index order."""
        gpus = []
        for line in self.scenario.read_text().splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "gpu":
                gpus.append(dict(w.split("=", 1) for w in words[1:]))
        return gpus

    def wait_log(self, text: str, timeout: float = 15.0, after: int = 0) -> str:
        """Wait for `text` in the daemon's log past offset `after`. The log is a file: re-read it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log_text()
            if text in log[after:]:
                return log
            time.sleep(0.02)
        raise AssertionError(f"{text!r} not in the daemon log:\n{self.log_text()[after:]}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.stop_daemon(signal.SIGKILL)
        self.kubelet.stop()
        # The MPS control daemons outlive the daemons here, as on a node (sessions of their own): ended, by
        # their record, and by their own pid files (one started but not recorded yet); then the shm.
        ended = set()
        for record in DaemonRecords(self.state_dir, None).load().values():
            proc = DaemonProcess.adopt(record.pid, record.started, record.binary, self.mps_root)
            if proc is not None:
                proc.kill()
                proc.close()
                ended.add(record.pid)
        for pid_file in self.mps_root.glob(f"*/pipe/{DAEMON_PID_FILE}"):
            if mps_control.read_pid_file(pid_file.parent) not in ended:
                kill_leftover(pid_file, mps_control.BINARY_NAME)
        # Every shm a daemon mounted under this node's root (a test may move the MPS root).
        for mount in self._mounts_below_root():
            subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
        if self._kernel_log_fd >= 0:
            os.close(self._kernel_log_fd)
            self._kernel_log_fd = -1
        if isinstance(self._log_pump, subprocess.Popen) and self._log_pump.poll() is None:
            self._log_pump.kill()
            self._log_pump.wait()
        if self.netns is not None:
            self.netns.close()

    def _mounts_below_root(self) -> list[str]:
        try:
            lines = Path("/proc/self/mountinfo").read_text().splitlines()
        except OSError:
            return []
        # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
        points = [bytes(line.split()[4], "ascii").decode("unicode_escape") for line in lines]
        return sorted((p for p in points if p.startswith(f"{self.root}/")), reverse=True)

    def __enter__(self) -> SimulatedNode:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _pump(stream: IO[bytes], path: Path, echo: Callable[[str], None] | None) -> None:
    with path.open("ab") as log:
        for raw in iter(stream.readline, b""):
            log.write(raw)
            log.flush()
            if echo is not None:
                echo(raw.decode(errors="replace").rstrip("\n"))
