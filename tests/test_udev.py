"""The udev source and the test-side udevd stand-in, through real netlink (no mocks).

Each test sends and receives in a network namespace of its own (`netns`), so no
other test's daemon, nor the machine's own nvplug, hears it or is heard. Bus ids
are in the made-up PCI domain 7e57 all the same, and assertions look only there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pyudev  # type: ignore[import-untyped]

from nvplug.core.events import Event, PciChanged
from nvplug.sources.udev_monitor import UdevSource, WarningLimiter
from nvplug.testing.net_namespace import NetNamespace
from nvplug.testing.udev_sender import UdevSender, encode_uevent, murmur_hash2, pci_event

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="udev messages from a uid other than 0 are dropped by receivers; needs root"
)

DOMAIN = "7e57:"
GPU = "7E57:AB:00.0"  # upper case on purpose: the source must normalise it
GPU_NORM = "7e57:ab:00.0"
SENTINEL = "7e57:ff:1f.7"
LOGGER = "nvplug.sources.udev_monitor"


@dataclass
class Run:
    events: list[PciChanged] = field(default_factory=list)
    overflows: int = 0
    loop_errors: list[dict[str, Any]] = field(default_factory=list)

    def seen(self, bus_id: str) -> bool:
        return any(e.bus_id == bus_id for e in self.events)


async def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


def run_source(
    netns: NetNamespace,
    send: Callable[[UdevSender], None],
    done: Callable[[Run], bool],
    *,
    timeout: float = 3.0,
    after: Callable[[Run, UdevSender], None] | None = None,
    receive_buffer_size: int | None = None,
) -> Run:
    """Starts a UdevSource in `netns`, sends there, and collects our domain's events until `done` (or timeout).

    `after`, if given, runs once `done` holds (or timed out) and must itself send
    a SENTINEL event, which is then awaited.
    """
    run = Run()

    def emit(event: Event) -> None:
        if isinstance(event, PciChanged) and event.bus_id.startswith(DOMAIN):
            run.events.append(event)

    def overflowed() -> None:
        run.overflows += 1

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # An exception escaping the reader callback would land here.
        loop.set_exception_handler(lambda _loop, context: run.loop_errors.append(context))
        source = UdevSource(emit, overflowed, receive_buffer_size=receive_buffer_size)
        source.start()
        try:
            with UdevSender(netns) as sender:
                send(sender)
                await _wait(lambda: done(run), timeout)
                if after is not None:
                    await asyncio.sleep(0.05)  # let the reader drain what is queued
                    after(run, sender)
                    await _wait(lambda: run.seen(SENTINEL), timeout)
        finally:
            await source.stop()

    # The loop runs in a thread inside the namespace: the source's socket is made there.
    netns.run(lambda: asyncio.run(main()))
    assert run.loop_errors == []
    return run


def _with_sentinel(*messages: Mapping[str, str | bytes]) -> Callable[[UdevSender], None]:
    def send(sender: UdevSender) -> None:
        for message in messages:
            sender.send(message)
        sender.send(pci_event("bind", SENTINEL))

    return send


def _sentinel_seen(run: Run) -> bool:
    return run.seen(SENTINEL)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_subsystem_hash_matches_systemd() -> None:
    assert murmur_hash2(b"pci") == 0x59163B92


def test_header_layout() -> None:
    message = encode_uevent({"ACTION": "add", "DEVPATH": "/devices/x", "SUBSYSTEM": "pci", "SEQNUM": "1"})
    body = b"ACTION=add\0DEVPATH=/devices/x\0SUBSYSTEM=pci\0SEQNUM=1\0"
    assert message[:8] == b"libudev\0"
    assert message[8:12] == b"\xfe\xed\xca\xfe"
    # Sizes in host order, as systemd's struct monitor_netlink_header has them.
    assert struct.unpack("=III", message[12:24]) == (40, 40, len(body))
    assert struct.unpack("!IIII", message[24:40]) == (0x59163B92, 0, 0, 0)
    assert message[40:] == body


def test_pci_event_follows_the_kernel() -> None:
    bound = pci_event("bind", "0000:18:00.0", seqnum=7)
    assert bound == {
        "ACTION": "bind",
        "DEVPATH": "/devices/pci0000:00/0000:00:01.0/0000:18:00.0",
        "SUBSYSTEM": "pci",
        "DRIVER": "nvidia",
        "PCI_CLASS": "30200",
        "PCI_ID": "10DE:2330",
        "PCI_SUBSYS_ID": "10DE:16C1",
        "PCI_SLOT_NAME": "0000:18:00.0",
        "MODALIAS": "pci:v000010DEd00002330sv000010DEsd000016C1bc03sc02i00",
        "SEQNUM": "7",
    }
    # The driver is not bound yet at add, and already gone at unbind and remove.
    for action in ("add", "unbind", "remove"):
        assert "DRIVER" not in pci_event(action, "0000:18:00.0")


def test_plain_pyudev_monitor_receives_what_the_sender_sends(netns: NetNamespace) -> None:
    monitor = netns.run(lambda: pyudev.Monitor.from_netlink(pyudev.Context(), source="udev"))
    monitor.filter_by(subsystem="pci")
    monitor.start()
    sent = pci_event("bind", GPU)
    with UdevSender(netns) as sender:
        sender.send(sent)
    deadline = time.monotonic() + 3
    got = None
    while got is None and time.monotonic() < deadline:
        device = monitor.poll(timeout=0.5)
        if device is not None and device.properties.get("PCI_SLOT_NAME") == GPU:
            got = dict(device.properties)
    assert got is not None, "the uevent never reached a udev-source monitor"
    assert got.pop("SEQNUM").isdigit()  # filled in by the sender
    assert got == sent
    assert device.action == "bind"
    assert device.subsystem == "pci"
    assert device.driver == "nvidia"


def test_a_namespace_keeps_its_messages_to_itself(netns: NetNamespace) -> None:
    """What is sent in one namespace reaches a monitor there, and neither the machine's own
    namespace (this process's) nor another namespace: a node's uevents stay with its daemon."""
    elsewhere = NetNamespace()
    try:
        monitors = {
            "inside": netns.run(lambda: pyudev.Monitor.from_netlink(pyudev.Context(), source="udev")),
            "machine": pyudev.Monitor.from_netlink(pyudev.Context(), source="udev"),
            "elsewhere": elsewhere.run(lambda: pyudev.Monitor.from_netlink(pyudev.Context(), source="udev")),
        }
        for monitor in monitors.values():
            monitor.start()
        with UdevSender(netns) as sender:
            sender.send(pci_event("bind", GPU))
            sender.send(pci_event("bind", SENTINEL))
        heard: dict[str, list[str]] = {name: [] for name in monitors}
        deadline = time.monotonic() + 10
        while SENTINEL not in heard["inside"] and time.monotonic() < deadline:
            device = monitors["inside"].poll(timeout=0.5)
            if device is not None:
                heard["inside"].append(device.properties.get("PCI_SLOT_NAME", ""))
        # Whatever leaked would be queued by now: it was sent before what "inside" heard last.
        for name in ("machine", "elsewhere"):
            while (device := monitors[name].poll(timeout=0)) is not None:
                heard[name].append(device.properties.get("PCI_SLOT_NAME", ""))
        assert heard["inside"] == [GPU, SENTINEL]
        assert [bus for bus in heard["machine"] if bus.lower().startswith(DOMAIN)] == []
        assert heard["elsewhere"] == []
    finally:
        elsewhere.close()


def test_source_emits_nvidia_actions_with_normalised_bus_ids(
    netns: NetNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    actions = ["add", "bind", "change", "unbind", "remove"]

    def send(sender: UdevSender) -> None:
        for action in actions:
            sender.send(pci_event(action, GPU))
        sender.send(pci_event("add", "7e57:ac:00.1", pci_id="10de:2331", driver=None))

    run = run_source(netns, send, lambda r: len(r.events) >= 6)
    assert run.events == [
        PciChanged("add", GPU_NORM, None, "10DE:2330"),
        PciChanged("bind", GPU_NORM, "nvidia", "10DE:2330"),
        PciChanged("change", GPU_NORM, "nvidia", "10DE:2330"),
        PciChanged("unbind", GPU_NORM, None, "10DE:2330"),
        PciChanged("remove", GPU_NORM, None, "10DE:2330"),
        PciChanged("add", "7e57:ac:00.1", None, "10DE:2331"),
    ]
    assert _warnings(caplog) == []


def test_source_ignores_other_vendors_and_subsystems(netns: NetNamespace, caplog: pytest.LogCaptureFixture) -> None:
    virtio = pci_event("add", "7e57:01:00.0", pci_id="1AF4:1041", pci_class="20000", subsys_id="1AF4:1100")
    usb = {"ACTION": "add", "DEVPATH": "/devices/usb9/9-1", "SUBSYSTEM": "usb", "PCI_SLOT_NAME": "7e57:02:00.0"}

    def send(sender: UdevSender) -> None:
        sender.send(virtio)
        # Right hash and property, still not pci: the in-kernel filter drops it.
        sender.send({**usb, "PCI_ID": "10DE:2330"}, subsystem="usb")
        sender.send(pci_event("bind", SENTINEL))

    run = run_source(netns, send, _sentinel_seen)
    assert [e.bus_id for e in run.events] == [SENTINEL]
    assert _warnings(caplog) == []


def _without(props: dict[str, str], key: str) -> dict[str, str]:
    return {k: v for k, v in props.items() if k != key}


GARBAGE: dict[str, tuple[Mapping[str, str | bytes], str]] = {
    "no PCI_SLOT_NAME": (_without(pci_event("add", GPU), "PCI_SLOT_NAME"), "no PCI_SLOT_NAME"),
    "bad PCI_SLOT_NAME": ({**pci_event("add", GPU), "PCI_SLOT_NAME": "7e57:zz:00.0"}, "is no bus id"),
    "no PCI_ID": (_without(pci_event("add", GPU), "PCI_ID"), "no PCI_ID"),
    "bad PCI_ID": ({**pci_event("add", GPU), "PCI_ID": "nvidia"}, "is not VENDOR:DEVICE"),
    # libudev knows "online" but we do not.
    "ACTION online": (pci_event("online", GPU), "ACTION 'online'"),
    # libudev itself rejects actions it does not know (EINVAL).
    "ACTION explode": (pci_event("explode", GPU), "libudev rejected"),
    "undecodable": ({**pci_event("add", GPU), "PCI_SLOT_NAME": b"7e57:ab:00.0\xff"}, "is not UTF-8"),
}


@pytest.mark.parametrize("case", GARBAGE)
def test_source_drops_garbage_with_one_warning_and_keeps_working(
    netns: NetNamespace, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    message, fragment = GARBAGE[case]
    caplog.set_level(logging.WARNING, LOGGER)
    run = run_source(netns, _with_sentinel(message), _sentinel_seen)
    assert [e.bus_id for e in run.events] == [SENTINEL]
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert fragment in warnings[0]


def test_repeated_warnings_are_rate_limited(netns: NetNamespace, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    bad = {**pci_event("add", GPU), "PCI_ID": "nvidia"}
    run = run_source(netns, _with_sentinel(*[bad] * 20), _sentinel_seen)
    assert [e.bus_id for e in run.events] == [SENTINEL]
    assert len(_warnings(caplog)) == 1


def test_warning_limiter_counts_what_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "limiter-test")
    now = [0.0]
    limiter = WarningLimiter(logging.getLogger("limiter-test"), interval=60, clock=lambda: now[0])
    assert limiter.warn("a", "first")
    assert not limiter.warn("a", "again")
    assert limiter.warn("b", "other kind")
    now[0] = 10
    assert not limiter.warn("a", "again")
    now[0] = 61
    assert limiter.warn("a", "later")
    assert [r.getMessage() for r in caplog.records] == [
        "first",
        "other kind",
        "later (2 more like this in the last 61s)",
    ]


def _burst_bus_id(i: int) -> str:
    return f"7e57:{i // 256:02x}:{i // 8 % 32:02x}.{i % 8}"


BURST = 2000


def _send_burst(sender: UdevSender) -> None:
    for i in range(BURST):
        sender.send(pci_event("change", _burst_bus_id(i)))


def test_burst_arrives_whole(netns: NetNamespace) -> None:
    run = run_source(netns, _send_burst, lambda r: len(r.events) >= BURST or r.overflows > 0)
    # With the 16 MiB floor (libudev itself asks for 128 MiB) nothing should be lost.
    assert run.overflows == 0
    assert [e.bus_id for e in run.events] == [_burst_bus_id(i) for i in range(BURST)]


def test_overflow_calls_back_and_the_source_recovers(netns: NetNamespace, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)

    def send_sentinel(_run: Run, sender: UdevSender) -> None:
        sender.send(pci_event("bind", SENTINEL))

    # 64 KiB holds a few dozen messages; the burst is sent before the loop reads any.
    run = run_source(
        netns,
        _send_burst,
        lambda r: r.overflows > 0,
        after=send_sentinel,
        receive_buffer_size=64 * 1024,
    )
    assert run.overflows >= 1
    assert len(run.events) <= BURST  # some of the burst was lost, the sentinel was not
    assert run.events[-1].bus_id == SENTINEL
    assert any("overflowed" in w for w in _warnings(caplog))


def test_stop_closes_the_socket(netns: NetNamespace) -> None:
    async def main() -> tuple[str | None, int]:
        loop = asyncio.get_running_loop()
        source = UdevSource(lambda _event: None)
        source.start()
        fd = source.fileno()
        link = _fd_target(fd)
        with socket.socket(fileno=os.dup(fd)) as sock:
            assert sock.family == socket.AF_NETLINK
        await source.stop()
        await source.stop()  # twice is harmless
        assert source.fileno() == -1
        assert not loop.remove_reader(fd)
        return link, fd

    link, fd = netns.run(lambda: asyncio.run(main()))
    assert link is not None
    assert _fd_target(fd) != link  # closed, or the number reused for something else


def _fd_target(fd: int) -> str | None:
    try:
        return str(Path(f"/proc/self/fd/{fd}").readlink())
    except FileNotFoundError:
        return None
