"""The systemd side without systemd: sd_notify on a real datagram socket, journald
priorities on a real stream, and SIGHUP reloads of the real daemon."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.notify_socket import NotifySocket

from nvplug.cli.journal_logging import JournalFormatter, journal_stream
from nvplug.daemon.sd_notify import Notifier
from nvplug.testing.simulated_node import GPU_RESOURCE, SimulatedNode, device_health, registered_with
from nvplug.testing.udev_sender import pci_event

TIMEOUT = 15.0


def test_notifier_sends_each_message(notify: NotifySocket) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "3000000"})
    assert n.enabled and n.watchdog_interval == 1.5
    n.status("8 devices")
    n.reloading()
    n.ready()  # the last status line again, after RELOADING's
    assert notify.receive("READY") == {"READY": "1", "STATUS": "8 devices"}
    n.watchdog()
    assert notify.receive("WATCHDOG") == {"WATCHDOG": "1"}
    n.reloading()
    assert notify.receive("RELOADING")["RELOADING"] == "1"
    n.stopping()
    assert notify.receive("STOPPING")["STOPPING"] == "1"


def test_notifier_abstract_socket_and_absence() -> None:
    name = f"nvplug-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        Notifier({"NOTIFY_SOCKET": "@" + name}).status("hello")
        assert sock.recv(100) == b"STATUS=hello"
    quiet = Notifier({})
    assert not quiet.enabled and quiet.watchdog_interval is None
    quiet.ready()  # a no-op, not an error
    # A watchdog meant for another process is not ours to ping.
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "100", "WATCHDOG_PID": "1"}).watchdog_interval is None


def test_journal_formatter_prefixes_priority_and_keeps_tracebacks_on_one_line() -> None:
    fmt = JournalFormatter()
    record = logging.LogRecord("nvplug", logging.ERROR, __file__, 1, "reload refused: %s", ("bad",), None)
    assert fmt.format(record) == "<3>nvplug: reload refused: bad"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("nvplug", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = fmt.format(record)
    assert line.startswith("<3>nvplug: failed ⏎ Traceback") and "\n" not in line and "RuntimeError: boom" in line
    for level, prefix in ((logging.WARNING, "<4>"), (logging.INFO, "<6>"), (logging.DEBUG, "<7>")):
        assert fmt.format(logging.LogRecord("x", level, __file__, 1, "m", (), None)).startswith(prefix)


def test_journal_stream_matches_device_and_inode(tmp_path: Path) -> None:
    with (tmp_path / "stream").open("w") as f:
        st = os.fstat(f.fileno())
        assert journal_stream({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, f.fileno())
        assert not journal_stream({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}, f.fileno())
        assert not journal_stream({}, f.fileno())
        assert not journal_stream({"JOURNAL_STREAM": "garbage"}, f.fileno())


def test_daemon_notifies_ready_status_watchdog_reload_and_stopping(node: SimulatedNode, notify: NotifySocket) -> None:
    node.kubelet.start()
    node.start_daemon(env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "2000000"})
    ready = notify.receive("READY")
    assert "nvidia.com/gpu" in ready["STATUS"] and "8 devices, 8 healthy" in ready["STATUS"]
    notify.receive("STATUS=nvidia.com/gpu registered: 8 devices, 8 healthy")
    # Pings from the loop at half the watchdog timeout (1 s), each well within the timeout.
    pings = []
    while len(pings) < 4:
        notify.receive("WATCHDOG")
        pings.append(notify.messages[-1][0])
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert all(0.5 < g < 2.0 for g in gaps), gaps
    node.control.xid(3, 79)
    notify.receive("STATUS=nvidia.com/gpu registered: 8 devices, 7 healthy")
    assert node.daemon is not None
    node.daemon.send_signal(signal.SIGHUP)
    notify.receive("RELOADING")
    notify.receive("READY")
    assert node.stop_daemon() == 0
    notify.receive("STOPPING")


def test_a_stopped_loop_stops_the_watchdog_pings(node: SimulatedNode, notify: NotifySocket) -> None:
    node.kubelet.start()
    daemon = node.start_daemon(env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "200000"})
    notify.receive("READY")
    notify.receive("WATCHDOG")
    daemon.send_signal(signal.SIGSTOP)
    time.sleep(0.05)
    notify.sock.settimeout(0.6)
    with pytest.raises(socket.timeout):
        while True:  # drain what was sent before the stop, then nothing for 0.6 s
            notify.sock.recv(4096)
    daemon.send_signal(signal.SIGCONT)
    notify.receive("WATCHDOG")


def test_reload_applies_a_new_config_without_touching_the_stream(node: SimulatedNode) -> None:
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    uuids = [g["uuid"] for g in node.scenario_gpus()]
    node.config.write_text("version: v1\nnvplug:\n  health:\n    fatalXids: [13]\n")
    assert node.daemon is not None
    node.daemon.send_signal(signal.SIGHUP)
    node.wait_log("reloaded the config from")
    node.control.xid(2, 13)
    node.kubelet.wait_for(device_health(uuids[2], healthy=False), TIMEOUT)
    plugin = node.kubelet.plugin(GPU_RESOURCE)
    assert plugin is not None and plugin.stream_open
    assert node.kubelet.accepted_registrations(GPU_RESOURCE) == 1


def test_a_bad_config_on_reload_is_refused_and_the_old_one_stays(node: SimulatedNode) -> None:
    node.config.write_text("version: v1\nnvplug:\n  health:\n    fatalXids: [13]\n")
    node.kubelet.start()
    node.start_daemon()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    node.config.write_text("version: v1\nnvplug:\n  health:\n    fatalXids: [13]\n    reprobe: 3\n")
    assert node.daemon is not None
    node.daemon.send_signal(signal.SIGHUP)
    log = node.wait_log("reload refused")
    line = next(ln for ln in log.splitlines() if "reload refused" in ln)
    assert "ERROR" in line and "config.yaml, line 5: nvplug.health.reprobe: unknown key" in line
    # Still in force: XID 13 is fatal.
    uuid = node.scenario_gpus()[1]["uuid"]
    node.control.xid(1, 13)
    node.kubelet.wait_for(device_health(uuid, healthy=False), TIMEOUT)


def test_journald_priorities_when_stderr_is_the_journal(node: SimulatedNode, short_tmp: Path) -> None:
    """The daemon writes <N> prefixes only when $JOURNAL_STREAM names its stderr."""
    node.kubelet.start()
    node.build_library()
    log_path = short_tmp / "journal.stream"
    with log_path.open("wb") as stream:
        st = os.fstat(stream.fileno())
        env = node.daemon_env()
        env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        argv = node.isolated([sys.executable, "-m", "nvplug", "run", "--device-plugin-dir", str(node.plugin_dir),
                "--config", str(node.config), "--dev-root", str(node.dev_root),
                *node.cdi_args(), "--state-dir", str(node.state_dir),
                "--nfd-feature-file", str(node.feature_file)])  # fmt: skip
        daemon = subprocess.Popen(argv, env=env, stderr=stream, stdin=subprocess.DEVNULL)
        try:
            node.kubelet.wait_for(registered_with(8), TIMEOUT)
            node.config.write_text("bogus: 1\n")
            daemon.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + TIMEOUT
            while b"reload refused" not in log_path.read_bytes():
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.02)
        finally:
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(TIMEOUT) == 0
    lines = log_path.read_text().splitlines()
    assert lines and all(line[:3] in ("<3>", "<4>", "<6>", "<7>") for line in lines), lines
    assert any(line.startswith("<3>nvplug: reload refused") for line in lines)
    assert any(line.startswith("<6>nvplug.kubelet.registrar: nvidia.com/gpu: registered") for line in lines)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_file_verifies_clean(tmp_path: Path) -> None:
    # verify insists that the commands exist: point them at this checkout's nvplug.
    unit = (Path(__file__).parent.parent / "systemd" / "nvplug.service").read_text()
    nvplug = shutil.which("nvplug") or str(Path(sys.executable).parent / "nvplug")
    (tmp_path / "nvplug.service").write_text(unit.replace("/usr/bin/nvplug ", f"{nvplug} "))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "nvplug.service")], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result.stderr + result.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_hardening_score(tmp_path: Path) -> None:
    """`systemd-analyze security`: the exposure SECURITY.md records must not creep up."""
    unit = (Path(__file__).parent.parent / "systemd" / "nvplug.service").read_text()
    nvplug = shutil.which("nvplug") or str(Path(sys.executable).parent / "nvplug")
    (tmp_path / "nvplug.service").write_text(unit.replace("/usr/bin/nvplug ", f"{nvplug} "))
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(tmp_path / "nvplug.service")],
        capture_output=True,
        text=True,
    )
    line = next(ln for ln in result.stdout.splitlines() if "Overall exposure level" in ln)
    # 2.4 until the kernel log became a fault source: without ProtectKernelLogs= it is 2.7; 3.0 with
    # CAP_SETUID/CAP_SETGID, which the MPS control daemon needs to start its clients' servers.
    assert float(line.split(":")[1].split()[0]) <= 3.0, line


def test_ready_waits_for_a_driver_that_loads_late(node: SimulatedNode, notify: NotifySocket) -> None:
    """At boot the kubelet starts after READY=1 and fails the pods it admits against no device: READY=1
    waits for the driver (nvplug.health.driverWaitSeconds, 60 s by default), and comes with the GPUs."""
    node.scenario.write_text(node.scenario.read_text().replace("init_error 0", "init_error 9"))
    node.start_daemon(env={"NOTIFY_SOCKET": str(notify.path)})
    waiting = notify.status_with("waiting up to 60 s for the NVIDIA driver before READY=1")
    assert "Driver Not Loaded" in waiting, waiting
    assert not any("READY" in fields for _, fields in notify.messages)
    node.control.init_error(0)  # the driver finished loading, and binds its GPUs
    node.send_uevent(pci_event("bind", node.scenario_gpus()[0]["bus"], driver="nvidia"))
    ready = notify.receive("READY")
    assert "NVML unavailable" not in ready["STATUS"] and "waiting up to" not in ready["STATUS"], ready
    # The kubelet, started after READY=1 as systemd orders it, finds the GPUs at its first look.
    node.kubelet.start()
    node.kubelet.wait_for(registered_with(8), TIMEOUT)
    node.wait_log("NVML works: ready with the GPUs it found")


def test_ready_without_gpus_once_the_driver_wait_ends(node: SimulatedNode, notify: NotifySocket) -> None:
    node.scenario.write_text(node.scenario.read_text().replace("init_error 0", "init_error 9"))
    node.config.write_text("version: v1\nnvplug:\n  health:\n    driverWaitSeconds: 1\n")
    node.start_daemon(env={"NOTIFY_SOCKET": str(notify.path)})
    ready = notify.receive("READY")
    assert "NVML unavailable" in ready["STATUS"], ready
    node.wait_log("no NVIDIA driver 1 s after the start: ready without GPUs")  # the log file may lag READY=1
