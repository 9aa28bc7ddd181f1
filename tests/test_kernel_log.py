"""The kernel log source: the record parser, the driver's lines, and the reader over a real FIFO.

One test goes through the machine's own /dev/kmsg where it may write and read it. Whatever it
writes stays there for the rest of the boot, so it writes exactly two lines: a fake Xid on bus
0000:fe:1f (no scenario uses it), then a driver load, so that any later nvplug start on this
machine takes that Xid for one of a previous driver load.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nvplug.core.events import (
    DriverLoaded,
    Event,
    GpuFellOffBus,
    GpuNamedInLog,
    KernelLogLost,
    KernelLogState,
    KernelXid,
    SwitchXid,
)
from nvplug.core.kernel_log_records import (
    MAX_RECORD_BYTES,
    Record,
    RecordError,
    RecordSplitter,
    classify,
    format_record,
    parse_record,
)
from nvplug.sources import kernel_log
from nvplug.sources.kernel_log import KernelLogSource
from nvplug.testing.simulated_node import SimulatedNode

LOGGER = "nvplug.sources.kernel_log"
UUID = "GPU-b850f46d-d5ea-c752-ddf3-c4453e44d3f7"


def rec(message: str, seq: int = 0) -> Record:
    return Record(prio=3, seq=seq, usec=1000, message=message)


# --- parse_record -----------------------------------------------------------------------------


def test_parse_record_reads_the_prefix_and_the_message() -> None:
    r = parse_record("4,339,5140900,-;NVRM: Xid (PCI:0000:cb:00): 13, pid=1, name=x\n")
    assert (r.prio, r.seq, r.usec) == (4, 339, 5140900)
    assert r.message == "NVRM: Xid (PCI:0000:cb:00): 13, pid=1, name=x"
    assert r.fields == {}
    assert (r.facility, r.level) == (0, 4)


def test_parse_record_takes_continuation_lines_as_fields() -> None:
    r = parse_record("6,197,376749,-;pci 0000:18:00.0: [10de:2330]\n SUBSYSTEM=pci\n DEVICE=+pci:0000:18:00.0\n")
    assert r.message == "pci 0000:18:00.0: [10de:2330]"
    assert r.fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:18:00.0"}


def test_parse_record_accepts_more_prefix_fields_and_keeps_semicolons_in_the_message() -> None:
    r = parse_record("12,348,8513024046,c,caller=T1234;a; b;c")
    assert (r.prio, r.seq, r.facility, r.level) == (12, 348, 1, 4)
    assert r.message == "a; b;c"


def test_parse_record_undoes_the_kernels_escapes() -> None:
    r = parse_record(r"6,1,2,-;back\x5cslash and\x0anewline, caf\xc3\xa9, \xzz stays" + "\n")
    assert r.message == "back\\slash and\nnewline, café, \\xzz stays"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "no ';'"),
        ("6,1,2,-NVRM: no separator", "no ';'"),
        ("6,1,2;message", "is not <prio>,<seq>,<usec>,<flags>"),
        ("x,1,2,-;message", "prio 'x' is not a number"),
        ("6,-1,2,-;message", "seq '-1' is not a number"),
        ("6,1,2.5,-;message", "usec '2.5' is not a number"),
        ("6,1," + "9" * 30 + ",-;message", "is not a number"),
        ("6,1,2,-;message\nSUBSYSTEM=pci", "lacks its space"),
        ("6,1,2,-;message\n SUBSYSTEM", "is not KEY=value"),
    ],
)
def test_parse_record_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(RecordError, match=re.escape(says)):
        parse_record(text)
    assert issubclass(RecordError, ValueError)


def test_format_record_round_trips_through_parse_record() -> None:
    text = format_record(3, 7, 99, "two\nlines \\ and é", {"SUBSYSTEM": "pci"})
    assert text.startswith("3,7,99,-;two\\x0alines \\x5c and \\xc3\\xa9\n SUBSYSTEM=pci")
    assert text.endswith("\n") and text.count("\n") == 2
    assert parse_record(text) == Record(3, 7, 99, "two\nlines \\ and é", {"SUBSYSTEM": "pci"})


# --- RecordSplitter ---------------------------------------------------------------------------

STREAM = (
    "6,1,10,-;first\n SUBSYSTEM=pci\n DEVICE=+pci:0000:18:00.0\n"
    "3,2,20,-;NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.\n"
    "4,3,30,-;third\n SUBSYSTEM=acpi\n"
)


def test_splitter_cuts_records_with_their_continuation_lines() -> None:
    s = RecordSplitter()
    got = s.feed(STREAM.encode())
    # The last record may still get a continuation line: it waits for flush().
    assert got == ["6,1,10,-;first\n SUBSYSTEM=pci\n DEVICE=+pci:0000:18:00.0\n", STREAM.splitlines(True)[3]]
    assert s.pending == len("4,3,30,-;third\n SUBSYSTEM=acpi\n")
    assert s.flush() == ["4,3,30,-;third\n SUBSYSTEM=acpi\n"]
    assert s.pending == 0 and s.flush() == []


@pytest.mark.parametrize("size", [1, 2, 7, 13, 64])
def test_splitter_reassembles_arbitrary_chunks(size: int) -> None:
    data = STREAM.encode()
    s = RecordSplitter()
    got: list[str] = []
    for i in range(0, len(data), size):
        got += s.feed(data[i : i + size])
    got += s.flush()
    assert [parse_record(t).seq for t in got] == [1, 2, 3]
    assert "".join(got) == STREAM
    assert parse_record(got[0]).fields["DEVICE"] == "+pci:0000:18:00.0"


def test_splitter_keeps_a_continuation_that_comes_in_the_next_chunk() -> None:
    s = RecordSplitter()
    assert s.feed("6,1,10,-;first\n") == []
    assert s.feed(" SUBSYSTEM=pci\n6,2,20,-;second\n") == ["6,1,10,-;first\n SUBSYSTEM=pci\n"]
    assert s.flush() == ["6,2,20,-;second\n"]


def test_splitter_holds_a_partial_record_until_it_ends() -> None:
    s = RecordSplitter()
    assert s.feed(b"6,1,10,-;no newline yet") == []
    assert s.flush() == []  # not whole: the writer has not finished it
    assert s.feed(b" still\n") == []
    assert s.flush() == ["6,1,10,-;no newline yet still\n"]
    assert s.feed(b"6,2,10,-;cut off") == []
    assert s.flush(eof=True) == ["6,2,10,-;cut off"]


def test_splitter_skips_blank_lines_and_decodes_bad_utf8() -> None:
    s = RecordSplitter()
    assert s.feed(b"\n\n6,1,10,-;caf\xe9\n\n6,2,10,-;x\n") == ["6,1,10,-;caf\ufffd\n"]
    assert s.flush() == ["6,2,10,-;x\n"]


def test_splitter_hands_on_an_endless_line_rather_than_grow() -> None:
    s = RecordSplitter()
    got = s.feed(b"x" * (MAX_RECORD_BYTES + 1))
    assert len(got) == 1 and s.pending == 0
    with pytest.raises(RecordError):
        parse_record(got[0])


# --- classify ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
            "(GPC 7, TPC 1, SM 0): Out Of Range Address",
            KernelXid(
                "0000:cb:00.0",
                13,
                "Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
                "(GPC 7, TPC 1, SM 0): Out Of Range Address",
                5,
            ),
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00): 31, pid=12345, name=python3, Ch 00000010, intr 10000000. MMU Fault",
            KernelXid(
                "0000:3b:00.0",
                31,
                "Xid (PCI:0000:3b:00): 31, pid=12345, name=python3, Ch 00000010, intr 10000000. MMU Fault",
                5,
            ),
        ),
        (
            "NVRM: Xid (0000:03:00): 14, Channel 00000001",
            KernelXid("0000:03:00.0", 14, "Xid (0000:03:00): 14, Channel 00000001", 5),
        ),
        (
            f"NVRM: GPU at PCI:0000:03:00: {UUID}",
            GpuNamedInLog("0000:03:00.0", UUID, 5),
        ),
        (
            "NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
            GpuFellOffBus("0000:01:00.0", 5),
        ),
        (
            "NVRM: GPU at PCI:0000:3b:00: GPU has fallen off the bus.",
            GpuFellOffBus("0000:3b:00.0", 5),
        ),
        (
            "NVRM: Xid (PCI:0000:18:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
            KernelXid(
                "0000:18:00.0",
                154,
                "Xid (PCI:0000:18:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
                5,
                recovery_action=1,
            ),
        ),
        (
            "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
            DriverLoaded("550.54.15", 5),
        ),
        (
            "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  560.35.03  Release Build  "
            "(dvs-builder@U16-I3-B03-4-3)  Fri Aug 16 21:42:42 UTC 2024",
            DriverLoaded("560.35.03", 5),
        ),
        (
            "NVRM: loading NVIDIA UNIX Open Kernel Module for aarch64  570.86.15  Release Build",
            DriverLoaded("570.86.15", 5),
        ),
        (
            "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  999.0.0-nvplug-test",
            DriverLoaded("999.0.0-nvplug-test", 5),
        ),
        (
            "nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
            SwitchXid(
                "nvidia-nvswitch3",
                "0000:c5:00.0",
                12028,
                "SXid (PCI:0000:c5:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
                5,
            ),
        ),
    ],
)
def test_classify_reads_each_driver_line(message: str, expected: Event) -> None:
    assert classify(rec(message, seq=5), replayed=False) == expected


def test_classify_takes_xid_79_as_an_xid_not_as_fallen_off_the_bus() -> None:
    event = classify(
        rec("NVRM: Xid (PCI:0000:fe:1f): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."), False
    )
    assert isinstance(event, KernelXid)
    assert (event.bus_id, event.code, event.recovery_action) == ("0000:fe:1f.0", 79, None)


def test_classify_passes_replayed_and_seq_on() -> None:
    for message in (
        "NVRM: Xid (PCI:0000:cb:00): 13, x",
        f"NVRM: GPU at PCI:0000:03:00: {UUID}",
        "NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
        "nvidia-nvswitch0: SXid (PCI:0000:c5:00.0): 12028, x",
    ):
        event = classify(rec(message, seq=42), replayed=True)
        assert event is not None
        assert event.replayed is True and event.seq == 42, message


@pytest.mark.parametrize(
    ("to", "action"),
    [
        ("0x1 (GPU Reset Required)", 1),
        ("0x2 (Node Reboot Required)", 2),
        ("0x0 (None)", 0),
        ("4 (Drain and Reset)", 4),
        ("Drain P2P", 3),
        ("(GPU Reset Required)", 1),
        ("something new", None),
    ],
)
def test_classify_reads_the_recovery_action_of_xid_154(to: str, action: int | None) -> None:
    event = classify(
        rec(f"NVRM: Xid (PCI:0000:18:00): 154, GPU recovery action changed from 0x0 (None) to {to}"), False
    )
    assert isinstance(event, KernelXid) and event.code == 154
    assert event.recovery_action == action


def test_classify_leaves_the_recovery_action_out_of_other_xids_and_unreadable_154s() -> None:
    other = classify(rec("NVRM: Xid (PCI:0000:18:00): 79, recovery action changed from 0x0 to 0x1"), False)
    assert isinstance(other, KernelXid) and other.recovery_action is None
    bare = classify(rec("NVRM: Xid (PCI:0000:18:00): 154, a wording we do not know"), False)
    assert isinstance(bare, KernelXid) and bare.recovery_action is None


@pytest.mark.parametrize(
    "message",
    [
        "nvidia: NVRM: Xid (PCI:0000:cb:00): 13, x",
        "[  123.456789] NVRM: Xid (PCI:0000:cb:00): 13, x",
        "kernel:NVRM: Xid (PCI:0000:cb:00): 13, x",
        "NVRM:Xid (PCI:0000:cb:00): 13, x",
    ],
)
def test_classify_tolerates_text_before_the_nvrm_prefix(message: str) -> None:
    event = classify(rec(message), False)
    assert isinstance(event, KernelXid)
    assert (event.bus_id, event.code, event.message) == ("0000:cb:00.0", 13, "Xid (PCI:0000:cb:00): 13, x")


@pytest.mark.parametrize(
    ("bus", "normalised"),
    [
        ("PCI:0000:CB:00", "0000:cb:00.0"),
        ("PCI:0000:cb:1f.3", "0000:cb:1f.3"),
        ("00000000:18:00", "0000:18:00.0"),
        ("PCI:10000:01:00", "10000:01:00.0"),  # a VMD domain keeps its five digits
    ],
)
def test_classify_normalises_bus_ids(bus: str, normalised: str) -> None:
    xid = classify(rec(f"NVRM: Xid ({bus}): 48, x"), False)
    assert isinstance(xid, KernelXid) and xid.bus_id == normalised
    named = classify(rec(f"NVRM: GPU at {bus}: {UUID.upper().replace('GPU-B', 'GPU-b')}"), False)
    assert isinstance(named, GpuNamedInLog) and named.bus_id == normalised and named.uuid == UUID


@pytest.mark.parametrize(
    "message",
    [
        "NVRM: Xid",
        "NVRM: Xid (PCI:zz:00:00): 13, x",
        "NVRM: Xid (PCI:0000:cb:00): abc, x",
        "NVRM: Xid (PCI:0000:cb:00) 13, x",
        "NVRM: Xid (PCI:0000:cb:00): " + "9" * 5000,
        "NVRM: GPU at PCI:0000:03:00: GPU-not-a-uuid",
        "NVRM: GPU at PCI:0000:03:00",
        "NVRM: GPU 0000:01:00.0: RmInitAdapter failed! (0x26:0xffff:1601)",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  unknown",
        "nvidia-nvswitch3: SXid (PCI:bad): 12028, x",
        "nvidia-nvswitch3: SXid",
        "NVRM: ",
        "NVRM:",
    ],
)
def test_classify_yields_none_for_malformed_driver_lines(message: str) -> None:
    assert classify(rec(message), False) is None


@pytest.mark.parametrize(
    "message",
    [
        "",
        "pci 0000:18:00.0: [10de:2330] type 00 class 0x030200",
        "nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver for UNIX platforms  550.54.15",
        "NVRM: nvidia_frontend_open: minor 255, module->open() failed, error -5",
        "xNVRM: Xid (PCI:0000:cb:00): 13, x",
        "test-nvplug-probe",
    ],
)
def test_classify_yields_none_for_other_lines(message: str) -> None:
    assert classify(rec(message), False) is None


# --- the reader, over a real FIFO --------------------------------------------------------------


class Fifo:
    """A FIFO of records with a write end held open, as the simulated node has it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self.seq = 0

    def write(self, message: str, *, seq: int | None = None) -> int:
        self.seq = self.seq if seq is None else seq
        os.write(self.fd, format_record(3, self.seq, 1000 + self.seq, message).encode())
        self.seq += 1
        return self.seq - 1

    def raw(self, data: bytes) -> None:
        os.write(self.fd, data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Fifo]:
    f = Fifo(tmp_path / "kmsg")
    yield f
    f.close()


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


XID = "NVRM: Xid (PCI:0000:cb:00): 13, pid=1, name=x, Graphics Exception"


def test_reader_reads_the_backlog_at_start_then_publishes_live_records(fifo: Fifo) -> None:
    published: list[Event] = []

    async def main() -> KernelLogSource:
        fifo.write(f"NVRM: GPU at PCI:0000:cb:00: {UUID}", seq=100)  # the log's oldest need not be seq 0
        fifo.write("something else")
        fifo.write(XID)
        source = KernelLogSource(fifo.path, published.append)
        assert source.start() is None  # type: ignore[func-returns-value]
        assert source.backlog == (
            GpuNamedInLog("0000:cb:00.0", UUID, 100, replayed=True),
            KernelXid("0000:cb:00.0", 13, XID[len("NVRM: ") :], 102, replayed=True),
            KernelLogState(None),
        )
        assert published == []  # the backlog is the caller's to apply
        fifo.write("NVRM: GPU 0000:cb:00.0: GPU has fallen off the bus.")
        await wait_for(lambda: len(published) == 1)
        # A record in two writes: the reader waits for its end.
        record = format_record(3, fifo.seq, 1, "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15 x").encode()
        fifo.raw(record[:20])
        await asyncio.sleep(0.05)
        fifo.raw(record[20:])
        await wait_for(lambda: len(published) == 2)
        await source.stop()
        return source

    source = asyncio.run(main())
    assert published == [GpuFellOffBus("0000:cb:00.0", 103), DriverLoaded("550.54.15", 104)]
    assert (source.lost, source.overruns, source.unparsed, source.records) == (0, 0, 0, 5)
    assert source.fileno() == -1


def test_reader_counts_a_seq_jump_in_the_backlog_and_live(fifo: Fifo, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    published: list[Event] = []

    async def main() -> KernelLogSource:
        fifo.write("a", seq=0)
        fifo.write("b", seq=1)
        fifo.write(XID, seq=5)
        source = KernelLogSource(fifo.path, published.append)
        source.start()
        assert source.backlog == (
            KernelLogLost(3, "seq jumped from 1 to 5"),
            KernelXid("0000:cb:00.0", 13, XID[6:], 5, replayed=True),
            KernelLogState(None),
        )
        fifo.write("c", seq=6)
        fifo.write(XID, seq=8)
        await wait_for(lambda: len(published) == 2)
        await source.stop()
        return source

    source = asyncio.run(main())
    assert published == [KernelLogLost(1, "seq jumped from 6 to 8"), KernelXid("0000:cb:00.0", 13, XID[6:], 8)]
    assert source.lost == 4 and source.overruns == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any("lost 3 kernel log record(s)" in w and "seq jumped from 1 to 5" in w for w in warnings)
    assert any("lost 1 kernel log record(s)" in w for w in warnings)


def test_reader_does_not_count_a_seq_that_goes_back_as_lost(fifo: Fifo) -> None:
    async def main() -> KernelLogSource:
        fifo.write("a", seq=7)
        fifo.write("b", seq=0)
        fifo.write("c", seq=1)
        source = KernelLogSource(fifo.path, lambda e: None)
        source.start()
        await source.stop()
        return source

    source = asyncio.run(main())
    assert source.backlog == (KernelLogState(None),)
    assert source.lost == 0 and source.records == 3


def test_reader_turns_epipe_into_a_loss_and_reads_on(fifo: Fifo, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    published: list[Event] = []

    async def main() -> tuple[KernelLogSource, bool, bool]:
        source = KernelLogSource(fifo.path, published.append)
        source.start()
        go_on = source.handle_read_error(OSError(errno.EPIPE, os.strerror(errno.EPIPE)))
        other = source.handle_read_error(OSError(errno.EIO, os.strerror(errno.EIO)))
        fifo.write(XID)
        await wait_for(lambda: len(published) == 2)
        await source.stop()
        return source, go_on, other

    source, go_on, other = asyncio.run(main())
    assert go_on is True and other is False
    assert published == [
        KernelLogLost(None, "the kernel log's ring buffer overran the reader (EPIPE)"),
        KernelXid("0000:cb:00.0", 13, XID[6:], 0),
    ]
    assert source.overruns == 1 and source.lost == 0
    assert any("EPIPE" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_reader_pauses_after_a_read_error_and_says_when_it_reads_again(
    fifo: Fifo, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernel_log, "ERROR_PAUSE_S", 0.05)
    published: list[Event] = []

    async def main() -> None:
        source = KernelLogSource(fifo.path, published.append)
        source.start()
        source._read_failed(OSError(errno.EIO, os.strerror(errno.EIO)))
        source._read_failed(OSError(errno.EIO, os.strerror(errno.EIO)))  # said once
        fifo.write(XID)
        await wait_for(lambda: len(published) == 3)
        await source.stop()

    asyncio.run(main())
    error = f"cannot read the kernel log at {fifo.path}: Input/output error (EIO)"
    assert published == [KernelLogState(error), KernelXid("0000:cb:00.0", 13, XID[6:], 0), KernelLogState(None)]


def test_reader_skips_records_that_do_not_parse(fifo: Fifo, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    published: list[Event] = []

    async def main() -> KernelLogSource:
        fifo.raw(b"garbage without a prefix\n")
        fifo.write(XID)
        source = KernelLogSource(fifo.path, published.append)
        source.start()
        fifo.raw(b"6,x,1,-;bad seq\n")
        fifo.write(XID)
        await wait_for(lambda: len(published) == 1)
        await source.stop()
        return source

    source = asyncio.run(main())
    assert source.backlog[0] == KernelXid("0000:cb:00.0", 13, XID[6:], 0, replayed=True)
    assert published == [KernelXid("0000:cb:00.0", 13, XID[6:], 1)]
    assert source.unparsed == 2
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("garbage without a prefix" in m for m in debug)


def test_reader_survives_a_publish_that_raises(fifo: Fifo, caplog: pytest.LogCaptureFixture) -> None:
    published: list[Event] = []

    def publish(event: Event) -> None:
        if not published:
            published.append(event)
            raise RuntimeError("the bus is broken")
        published.append(event)

    async def main() -> None:
        source = KernelLogSource(fifo.path, publish)
        source.start()
        fifo.raw((format_record(3, 0, 1, XID) + format_record(3, 1, 1, XID)).encode())
        await wait_for(lambda: len(published) == 2)
        await source.stop()

    asyncio.run(main())
    assert [getattr(e, "seq", None) for e in published] == [0, 1]
    errors = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].getMessage().startswith("publishing KernelXid(")
    assert errors[0].exc_info is not None and "the bus is broken" in str(errors[0].exc_info[1])


def test_reader_reports_a_fifo_whose_writers_all_closed(fifo: Fifo, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    published: list[Event] = []

    async def main() -> KernelLogSource:
        source = KernelLogSource(fifo.path, published.append)
        source.start()
        fifo.write(XID)
        await wait_for(lambda: len(published) == 1)
        fifo.close()
        await wait_for(lambda: len(published) == 2)
        await asyncio.sleep(0.05)  # nothing more comes, and nothing spins
        await source.stop()
        await source.stop()
        return source

    source = asyncio.run(main())
    closed = f"the kernel log at {fifo.path} closed"
    assert published == [KernelXid("0000:cb:00.0", 13, XID[6:], 0), KernelLogState(closed)]
    assert source.fileno() == -1
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER].count(
        f"{closed}; faults reach nvplug from NVML only"
    ) == 1


def test_reader_reports_a_fifo_with_no_writer_at_start(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    os.mkfifo(path)

    async def main() -> KernelLogSource:
        source = KernelLogSource(path, lambda e: None)
        source.start()
        await source.stop()
        return source

    source = asyncio.run(main())
    assert source.backlog == (KernelLogState(f"the kernel log at {path} closed"),)


def test_reader_of_a_path_that_cannot_be_opened_runs_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    path = tmp_path / "no-such-kmsg"
    published: list[Event] = []

    async def main() -> KernelLogSource:
        source = KernelLogSource(path, published.append)
        assert source.start() is None  # type: ignore[func-returns-value]
        await source.stop()
        await source.stop()
        return source

    source = asyncio.run(main())
    error = f"cannot read the kernel log at {path}: No such file or directory (ENOENT)"
    assert source.backlog == (KernelLogState(error),)
    assert published == []
    logged = [r for r in caplog.records if r.name == LOGGER]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert str(path) in logged[0].getMessage() and "No such file or directory" in logged[0].getMessage()


def test_reader_after_stop_reads_nothing_more(fifo: Fifo) -> None:
    published: list[Event] = []

    async def main() -> None:
        source = KernelLogSource(fifo.path, published.append)
        source.start()
        await source.stop()
        fifo.write(XID)
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert published == []


def test_source_says_what_it_is() -> None:
    source = KernelLogSource(Path("/dev/kmsg"), lambda e: None)
    assert source.name == "the kernel log"
    assert source.blocking == "loop reader"
    assert source.without == "faults reach nvplug from NVML only"
    assert logging.getLogger(LOGGER) is kernel_log.log


# --- the simulated node's stand-in -------------------------------------------------------------


def test_simulated_node_kernel_log_feeds_the_reader_and_replays_for_a_restart(short_tmp: Path) -> None:
    node = SimulatedNode(short_tmp)
    published: list[Event] = []
    fell = "NVRM: GPU 0000:cb:00.0: GPU has fallen off the bus."

    async def read(live: str | None = None) -> KernelLogSource:
        source = KernelLogSource(node.kernel_log_path, published.append)
        source.start()
        if live is not None:
            node.kernel_log(live)
            await wait_for(lambda: len(published) == 1)
        await source.stop()
        return source

    try:
        assert node.kernel_log(XID) == 0
        node.kernel_log_gap(2)
        assert node.kernel_log("something else", prio=6) == 3
        first = asyncio.run(read(live=fell))
        assert first.backlog == (
            KernelXid("0000:cb:00.0", 13, XID[6:], 0, replayed=True),
            KernelLogLost(2, "seq jumped from 0 to 3"),
            KernelLogState(None),
        )
        assert published == [GpuFellOffBus("0000:cb:00.0", 4)]
        assert [parse_record(r).seq for r in node.kernel_log_history] == [0, 3, 4]
        assert parse_record(node.kernel_log_history[1]).prio == 6

        # A restarted daemon opens the log anew and sees all of it again.
        node.replay_kernel_log()
        again = asyncio.run(read())
        assert again.backlog == (*first.backlog[:2], GpuFellOffBus("0000:cb:00.0", 4, replayed=True), first.backlog[2])
    finally:
        node.close()


def test_simulated_node_kernel_log_drops_the_oldest_when_the_pipe_is_full(short_tmp: Path) -> None:
    node = SimulatedNode(short_tmp)
    try:
        message = "x" * 200
        last = -1
        for _ in range(400):  # some 84 KiB, more than the pipe's 64 KiB, with no daemon reading
            last = node.kernel_log(message)
        history = [parse_record(r).seq for r in node.kernel_log_history]
        assert history[-1] == last and history[0] > 0
        assert history == list(range(history[0], last + 1))
        assert sum(len(r) for r in node.kernel_log_history) <= 64 * 1024

        async def read() -> KernelLogSource:
            source = KernelLogSource(node.kernel_log_path, lambda e: None)
            source.start()
            await source.stop()
            return source

        source = asyncio.run(read())
        assert (source.records, source.lost, source.unparsed) == (len(history), 0, 0)
    finally:
        node.close()
    with pytest.raises(OSError):
        node.kernel_log("after close")


# --- the machine's own /dev/kmsg ---------------------------------------------------------------

KMSG = Path("/dev/kmsg")
# Bus 0000:fe:1f is used by no scenario.
FAKE_XID = "NVRM: Xid (PCI:0000:fe:1f): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
FAKE_LOAD = "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  999.0.0-nvplug-test"


def _kmsg_unusable() -> str | None:
    if not KMSG.exists():
        return f"{KMSG} does not exist here"
    for flags, what in ((os.O_RDONLY | os.O_NONBLOCK, "read"), (os.O_WRONLY, "write")):
        try:
            os.close(os.open(KMSG, flags))
        except OSError as exc:
            return f"cannot {what} {KMSG}: {exc.strerror}"
    return None


@pytest.mark.skipif(_kmsg_unusable() is not None, reason=str(_kmsg_unusable()))
def test_reader_over_the_real_dev_kmsg() -> None:
    published: list[Event] = []

    def fake_xid(event: Event) -> bool:
        return isinstance(event, KernelXid) and event.bus_id == "0000:fe:1f.0" and not event.replayed

    def our_load(event: Event) -> bool:
        # Not an earlier run's, which may come live: a line without its newline shows once the next one comes.
        xid = next((e for e in published if fake_xid(e)), None)
        return isinstance(event, DriverLoaded) and xid is not None and event.seq > xid.seq

    async def main() -> KernelLogSource:
        source = KernelLogSource(KMSG, published.append)
        source.start()
        try:
            assert source.backlog[-1] == KernelLogState(None)
            assert source.records > 0  # the log since boot
            writer = os.open(KMSG, os.O_WRONLY)
            # Each with its newline: the kernel keeps a line without one open for a continuation,
            # and no reader sees it until the next record closes it.
            try:
                os.write(writer, f"{FAKE_XID}\n".encode())
                await wait_for(lambda: any(fake_xid(e) for e in published))
            finally:
                # Whatever happened: a later nvplug start must take the fake Xid for a previous load's.
                os.write(writer, f"{FAKE_LOAD}\n".encode())
                os.close(writer)
            await wait_for(lambda: any(our_load(e) for e in published))
        finally:
            await source.stop()
        return source

    asyncio.run(main())
    xid = next(e for e in published if fake_xid(e))
    load = next(e for e in published if our_load(e))
    assert isinstance(xid, KernelXid) and isinstance(load, DriverLoaded)
    assert (xid.code, xid.message, xid.recovery_action) == (79, FAKE_XID[len("NVRM: ") :], None)
    assert load.version == "999.0.0-nvplug-test" and not load.replayed
