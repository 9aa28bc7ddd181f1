"""Act as udevd: broadcast libudev-format uevents on netlink group 2, for tests.

No udevd runs on the test machines, so this is how tests get udev traffic that a
`pyudev.Monitor.from_netlink(ctx, source="udev")` accepts. Receivers drop
messages from senders whose uid is not 0, so sending needs root.

A sender always sends in a simulated node's own network namespace, never in the
machine's: there, a real nvplug serving real GPUs would hear it too.
"""

from __future__ import annotations

import itertools
import socket
import struct
from collections.abc import Mapping
from types import TracebackType

from nvplug.testing.net_namespace import NetNamespace

NETLINK_KOBJECT_UEVENT = 15
UDEV_GROUP = 2  # udevd re-broadcasts here; group 1 is the kernel's own

_PREFIX = b"libudev\0"
_MAGIC = 0xFEEDCAFE
# systemd's struct monitor_netlink_header: the magic, hashes and tag bloom are in
# network byte order, but header size, properties offset and length are in host
# order (receivers drop the message when these do not add up).
_PREFIX_MAGIC = struct.Struct("!8sI")
_SIZES = struct.Struct("=III")  # header size, properties offset, properties length
_FILTERS = struct.Struct("!IIII")  # subsystem hash, devtype hash, tag bloom hi, lo
_HEADER_SIZE = _PREFIX_MAGIC.size + _SIZES.size + _FILTERS.size
assert _HEADER_SIZE == 40

_M32 = 0xFFFFFFFF


def murmur_hash2(data: bytes, seed: int = 0) -> int:
    """MurmurHash2 (32-bit) as systemd's string_hash32 computes it.

    systemd reads 4-byte blocks in host order; on the little-endian hosts we run on
    that is little-endian, which is what receivers' BPF filters compare against.
    """
    m = 0x5BD1E995
    length = len(data)
    h = (seed ^ length) & _M32
    full = length - length % 4
    for i in range(0, full, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & _M32
        k ^= k >> 24
        k = (k * m) & _M32
        h = (h * m) & _M32
        h ^= k
    tail = data[full:]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if tail:
        h ^= tail[0]
        h = (h * m) & _M32
    h ^= h >> 13
    h = (h * m) & _M32
    h ^= h >> 15
    return h


def encode_uevent(properties: Mapping[str, str | bytes], subsystem: str = "pci", devtype: str | None = None) -> bytes:
    """The whole datagram: a 40-byte header, then `KEY=VALUE\\0` for each property.

    Values may be bytes, so tests can send text that is not valid UTF-8.
    `subsystem` and `devtype` only feed the hashes the in-kernel filters match on;
    the SUBSYSTEM property itself must be in `properties`.
    """
    body = bytearray()
    for key, value in properties.items():
        raw = value if isinstance(value, bytes) else value.encode()
        if b"\0" in raw or "\0" in key or "=" in key:
            raise ValueError(f"uevent property {key!r}={value!r}: keys cannot hold '=' or NUL, values no NUL")
        body += key.encode() + b"=" + raw + b"\0"
    return (
        _PREFIX_MAGIC.pack(_PREFIX, _MAGIC)
        + _SIZES.pack(_HEADER_SIZE, _HEADER_SIZE, len(body))
        + _FILTERS.pack(murmur_hash2(subsystem.encode()), murmur_hash2(devtype.encode()) if devtype else 0, 0, 0)
        + bytes(body)
    )


class UdevSender:
    """One netlink socket, made in `netns`, that broadcasts uevents there as udevd would. Needs root.

    SEQNUM, which every receiver requires, is filled in from this sender's own
    counter (starting at 1) when the properties lack it.
    """

    def __init__(self, netns: NetNamespace) -> None:
        try:
            self._sock = netns.run(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_KOBJECT_UEVENT))
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open a NETLINK_KOBJECT_UEVENT socket: {exc.strerror}") from exc
        self._seqnum = itertools.count(1)

    def send(self, properties: Mapping[str, str | bytes], subsystem: str = "pci", devtype: str | None = None) -> None:
        props = dict(properties)
        if "SEQNUM" not in props:
            props["SEQNUM"] = str(next(self._seqnum))
        message = encode_uevent(props, subsystem, devtype)
        try:
            self._sock.sendto(message, (0, UDEV_GROUP))
        except OSError as exc:
            # EPERM here means not root (sending to a uevent group needs CAP_NET_ADMIN).
            raise OSError(
                exc.errno, f"cannot broadcast a uevent ({props.get('ACTION')!r}) on netlink group 2: {exc.strerror}"
            ) from exc

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> UdevSender:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def send_uevent(
    netns: NetNamespace, properties: Mapping[str, str | bytes], subsystem: str = "pci", devtype: str | None = None
) -> None:
    """Send one uevent in `netns` on a throwaway socket. SEQNUM defaults to 1: use a UdevSender for sequences."""
    with UdevSender(netns) as sender:
        sender.send(properties, subsystem, devtype)


def _modalias(pci_id: str, subsys_id: str, pci_class: str) -> str | None:
    try:
        vendor, device = (int(part, 16) for part in pci_id.split(":"))
        sub_vendor, sub_device = (int(part, 16) for part in subsys_id.split(":"))
        klass = int(pci_class, 16)
    except ValueError:
        return None
    return (
        f"pci:v{vendor:08X}d{device:08X}sv{sub_vendor:08X}sd{sub_device:08X}"
        f"bc{klass >> 16 & 0xFF:02X}sc{klass >> 8 & 0xFF:02X}i{klass & 0xFF:02X}"
    )


def pci_event(
    action: str,
    bus_id: str,
    *,
    pci_id: str = "10DE:2330",
    driver: str | None = "nvidia",
    pci_class: str = "30200",
    subsys_id: str = "10DE:16C1",
    seqnum: int | None = None,
) -> dict[str, str]:
    """The properties a PCI uevent carries, as the kernel's pci_uevent writes them.

    The kernel adds DRIVER only while a driver is bound: `bind` and `change` of a
    bound device carry it; `add` (sent before probing), `unbind` and `remove` (sent
    after the driver let go) do not, whatever `driver` says. `bus_id` goes into
    PCI_SLOT_NAME as given, so tests can send odd spellings; DEVPATH uses it
    lower-cased, under a made-up root port. MODALIAS is left out when the ids are
    not hex. SEQNUM is left for the sender to fill in unless `seqnum` is given.
    """
    slot = bus_id.lower()
    domain = slot.partition(":")[0]
    # In the kernel's order: the driver core's keys, then pci_uevent's, SEQNUM last.
    props = {
        "ACTION": action,
        "DEVPATH": f"/devices/pci{domain}:00/{domain}:00:01.0/{slot}",
        "SUBSYSTEM": "pci",
    }
    if driver is not None and action in ("bind", "change"):
        props["DRIVER"] = driver
    props |= {"PCI_CLASS": pci_class, "PCI_ID": pci_id, "PCI_SUBSYS_ID": subsys_id, "PCI_SLOT_NAME": bus_id}
    modalias = _modalias(pci_id, subsys_id, pci_class)
    if modalias is not None:
        props["MODALIAS"] = modalias
    if seqnum is not None:
        props["SEQNUM"] = str(seqnum)
    return props
