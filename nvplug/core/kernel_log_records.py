"""The kernel log's records and what the NVIDIA drivers print in them. Pure: no I/O.

A record is what one read of /dev/kmsg returns (Documentation/ABI/testing/dev-kmsg):
`<prio>,<seq>,<usec>,<flags>[,...];<message>\n`, then optional continuation lines that
start with a space (` SUBSYSTEM=pci`). The kernel writes bytes below 0x20, from 0x7f and the
backslash as `\\xNN`; `parse_record` turns them back.

`classify` turns the driver's lines into events (`KernelXid`, `GpuFellOffBus`, `GpuNamedInLog`,
`DriverLoaded`, `SwitchXid`); any other line, and any driver line it cannot read, is None.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from nvplug.core.events import DriverLoaded, GpuFellOffBus, GpuNamedInLog, KernelXid, SwitchXid
from nvplug.core.gpu import normalize_bus_id

KernelLogEvent = KernelXid | GpuFellOffBus | DriverLoaded | GpuNamedInLog | SwitchXid
"""What `classify` makes of a record."""

# A tail with no record boundary past this is handed on as it is (it will not parse): a stream
# of garbage must not grow the buffer without end. The kernel's records stay under 8 KiB.
MAX_RECORD_BYTES = 64 * 1024

_ESCAPED = re.compile(r"\\x([0-9a-fA-F]{2})")


class RecordError(ValueError):
    """A kernel log record that does not follow the format; the message says what is wrong."""


@dataclass(frozen=True)
class Record:
    """One kernel log record: `prio` is facility * 8 + level, `usec` the time since boot."""

    prio: int
    seq: int
    usec: int
    message: str
    fields: Mapping[str, str] = field(default_factory=dict)  # SUBSYSTEM, DEVICE, ...

    @property
    def level(self) -> int:
        return self.prio & 7

    @property
    def facility(self) -> int:
        return self.prio >> 3


def _unescape(text: str) -> str:
    if "\\x" not in text:
        return text
    out = bytearray()
    pos = 0
    for m in _ESCAPED.finditer(text):
        out += text[pos : m.start()].encode()
        out.append(int(m[1], 16))
        pos = m.end()
    out += text[pos:].encode()
    return out.decode("utf-8", "replace")


def _escape(text: str) -> str:
    """The kernel's escaping, so that a message stays on one line."""
    data = text.encode()
    if all(0x20 <= b < 0x7F and b != 0x5C for b in data):
        return text
    return "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in data)


def _number(name: str, value: str, text: str) -> int:
    # isdigit() also takes non-ASCII digits; the limit keeps int() within Python's digit cap.
    if not (value.isascii() and value.isdigit() and len(value) <= 20):
        raise RecordError(f"kernel log record {text[:80]!r}: {name} {value[:40]!r} is not a number")
    return int(value)


def parse_record(text: str) -> Record:
    """One record, with or without its final newline; RecordError where it is not one."""
    text = text.rstrip("\n")
    first, *continuation = text.split("\n")
    header, sep, message = first.partition(";")
    if not sep:
        raise RecordError(f"kernel log record {text[:80]!r}: no ';' between the prefix and the message")
    parts = header.split(",")
    if len(parts) < 4:
        raise RecordError(
            f"kernel log record {text[:80]!r}: the prefix {header[:80]!r} is not <prio>,<seq>,<usec>,<flags>"
        )
    prio = _number("prio", parts[0], text)
    seq = _number("seq", parts[1], text)
    usec = _number("usec", parts[2], text)
    fields: dict[str, str] = {}
    for line in continuation:
        if not line.startswith(" "):
            raise RecordError(f"kernel log record {text[:80]!r}: continuation line {line[:80]!r} lacks its space")
        key, eq, value = line[1:].partition("=")
        if not eq or not key:
            raise RecordError(f"kernel log record {text[:80]!r}: continuation line {line[:80]!r} is not KEY=value")
        fields[key] = _unescape(value)
    return Record(prio, seq, usec, _unescape(message), fields)


def format_record(prio: int, seq: int, usec: int, message: str, fields: Mapping[str, str] | None = None) -> str:
    """A record as /dev/kmsg gives it, with its final newline: for stand-ins and tests."""
    lines = [f"{prio},{seq},{usec},-;{_escape(message)}"]
    lines += [f" {key}={_escape(value)}" for key, value in (fields or {}).items()]
    return "\n".join(lines) + "\n"


class RecordSplitter:
    """Cuts a stream (a FIFO's arbitrary chunks, or /dev/kmsg's one record per read) into records.

    A record ends at a newline followed by anything but a space (a space starts a continuation
    line). A newline at the very end of what has come so far may still be followed by one, so
    that record waits: `flush()` hands it on once the stream has nothing more for now, as a
    writer writes each record whole; `flush(eof=True)` hands on whatever is left.
    """

    def __init__(self) -> None:
        self._buf = b""

    @property
    def pending(self) -> int:
        """Bytes held back, waiting for the rest of their record."""
        return len(self._buf)

    def feed(self, chunk: bytes | str) -> list[str]:
        data = chunk.encode() if isinstance(chunk, str) else chunk
        buf = self._buf + data
        out: list[str] = []
        start = 0
        i = buf.find(b"\n")
        while i != -1 and i + 1 < len(buf):
            if buf[i + 1] != 0x20:
                out.append(buf[start : i + 1].decode("utf-8", "replace"))
                start = i + 1
            i = buf.find(b"\n", i + 1)
        self._buf = buf[start:]
        if len(self._buf) > MAX_RECORD_BYTES and not self._buf.endswith(b"\n"):
            out.append(self._buf.decode("utf-8", "replace"))
            self._buf = b""
        return [r for r in out if r.strip()]

    def flush(self, *, eof: bool = False) -> list[str]:
        if not self._buf or not (eof or self._buf.endswith(b"\n")):
            return []
        tail, self._buf = self._buf.decode("utf-8", "replace"), b""
        return [tail] if tail.strip() else []


# Bus ids as the driver prints them: domain:bus:device, the function mostly left out.
_BUS = r"(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)"
_CODE = r"(?P<code>\d{1,9})"
# Some kernels put the module's name (or more) before the driver's own prefix.
_NVRM = re.compile(r"(?:^|[\s:\]])NVRM:\s*")
_XID = re.compile(rf"Xid\s*\(\s*(?:PCI:)?{_BUS}\s*\)\s*:\s*{_CODE}\b")
_NAMED = re.compile(
    rf"GPU at (?:PCI:)?{_BUS}\s*:\s*(?P<uuid>GPU-[0-9a-fA-F]{{8}}(?:-[0-9a-fA-F]{{4}}){{3}}-[0-9a-fA-F]{{12}})\b"
)
_FELL_OFF = re.compile(rf"GPU (?:at )?(?:PCI:)?{_BUS}\s*:.*\bfallen off the bus", re.IGNORECASE)
_LOADING = re.compile(r"loading NVIDIA UNIX\b.*?\bKernel Module(?:\s+for\s+\S+)?\s+(?P<version>\d[\w.+~-]*)")
_SXID = re.compile(rf"(?P<switch>nvidia-nvswitch\d+):\s*(?P<text>SXid\s*\(\s*(?:PCI:)?{_BUS}\s*\)\s*:\s*{_CODE}\b.*)")
# Xid 154: `GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)`.
_RECOVERY = re.compile(r"recovery action changed from .*?\bto\s+(?P<to>.+)", re.IGNORECASE)
_ACTION_NUMBER = re.compile(r"(?:0x(?P<hex>[0-9a-fA-F]{1,8})|(?P<dec>\d{1,9}))\b")
# NVML's nvmlDeviceGpuRecoveryAction_t, for a wording that gives only the name.
_ACTION_NAMES = {
    "none": 0,
    "gpu reset required": 1,
    "node reboot required": 2,
    "drain p2p": 3,
    "drain and reset": 4,
}


def _bus_id(text: str) -> str:
    return normalize_bus_id(text if "." in text else f"{text}.0")


def _recovery_action(body: str) -> int | None:
    m = _RECOVERY.search(body)
    if m is None:
        return None
    to = m["to"].strip()
    number = _ACTION_NUMBER.match(to)
    if number is not None:
        return int(number["hex"], 16) if number["hex"] is not None else int(number["dec"])
    return _ACTION_NAMES.get(to.strip("() .").lower())


def classify(record: Record, replayed: bool) -> KernelLogEvent | None:
    """The event a record means, or None: not the driver's, or a driver line it cannot read."""
    message = record.message
    seq = record.seq
    if "SXid" in message:
        sxid = _SXID.search(message)
        if sxid is not None:
            text = sxid["text"].rstrip()
            return SwitchXid(sxid["switch"], _bus_id(sxid["bus"]), int(sxid["code"]), text, seq, replayed)
        return None
    nvrm = _NVRM.search(message)
    if nvrm is None:
        return None
    body = message[nvrm.end() :].rstrip()
    if body.startswith("Xid"):
        xid = _XID.match(body)
        if xid is None:
            return None
        code = int(xid["code"])
        action = _recovery_action(body) if code == 154 else None
        return KernelXid(_bus_id(xid["bus"]), code, body, seq, replayed, action)
    if body.startswith("GPU"):
        named = _NAMED.match(body)
        if named is not None:
            return GpuNamedInLog(_bus_id(named["bus"]), "GPU-" + named["uuid"][4:].lower(), seq, replayed)
        fell = _FELL_OFF.match(body)
        if fell is not None:
            return GpuFellOffBus(_bus_id(fell["bus"]), seq, replayed)
        return None
    if body.startswith("loading"):
        loading = _LOADING.match(body)
        if loading is not None:
            return DriverLoaded(loading["version"], seq, replayed)
    return None
