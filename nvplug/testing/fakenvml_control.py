"""Drive the fake NVML library through its control socket (``FAKE_NVML_CONTROL``).

The test (or demo) injects faults through :class:`Control`, a client of the
library's unix datagram control socket, once a child process started with
``fakenvml_library.environ`` has loaded the fake.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, TypeAlias

from nvplug.testing.fakenvml_devices import PROCS_MAX, ComputeMode, GpuProcess
from nvplug.testing.net_namespace import NetNamespace

__all__ = ["ANY_GPU", "Control", "ControlError", "GpuRef"]

# A GPU as the control socket names it: an index in the current enumeration or a UUID.
GpuRef: TypeAlias = "int | str"
# The GPU of a block that matches every GPU, and the only one for calls that take no device.
ANY_GPU = "*"


class ControlError(RuntimeError):
    """The fake library rejected a control command (its reply began with ``error``)."""


class Control:
    """Client for the fake library's control socket (``FAKE_NVML_CONTROL``).

    The socket only exists once the process under test has called nvmlInit,
    so :meth:`send` keeps retrying until its timeout.  Every method returns the
    reply text (``ok ...``) and raises :class:`ControlError` for ``error: ...``
    replies and :class:`TimeoutError` when no reply comes in time.
    """

    def __init__(self, path: Path, netns: NetNamespace | None = None) -> None:
        self.path = Path(path)
        # Where the library runs: the reply comes to an abstract address, which lives in a network namespace.
        self._netns = netns

    def send(self, command: str, timeout: float = 5.0) -> str:
        """Send one command line and return the reply."""
        if "\n" in command.rstrip("\n"):
            raise ValueError("one command per call")
        deadline = time.monotonic() + timeout
        payload = command.encode()
        with _client_socket(self._netns) as sock:
            while True:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                try:
                    sock.sendto(payload, str(self.path))
                    break
                # Not created yet, or a stale file nobody is bound to: the host may still be starting.
                except (FileNotFoundError, ConnectionRefusedError) as exc:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"fake NVML control socket {self.path} is not being served") from exc
                    time.sleep(0.02)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                reply = sock.recv(65536).decode(errors="replace")
            except TimeoutError as exc:
                raise TimeoutError(f"no reply to {command!r} from {self.path}") from exc
        if reply.startswith("error"):
            raise ControlError(reply)
        return reply

    def ping(self, timeout: float = 5.0) -> str:
        return self.send("ping", timeout)

    def state(self) -> str:
        return self.send("state")

    def xid(self, gpu: GpuRef, code: int, gi: int | None = None, ci: int | None = None) -> str:
        """Queue an Xid critical error event (type 0x8, eventData = code)."""
        if gi is None and ci is None:
            return self.send(f"xid {gpu} {code}")
        any_id = 0xFFFFFFFF  # NVML_GPU_INSTANCE_ID_ANY / NVML_COMPUTE_INSTANCE_ID_ANY
        return self.send(f"xid {gpu} {code} {any_id if gi is None else gi} {any_id if ci is None else ci}")

    def ecc(self, gpu: GpuRef, kind: Literal["sbe", "dbe"], count: int = 1) -> str:
        """Count `count` single- or double-bit ECC errors (volatile and aggregate) and queue one event (0x1 / 0x2)."""
        return self.send(f"ecc {gpu} {kind}" + (f" {count}" if count != 1 else ""))

    def retire(self, gpu: GpuRef, cause: Literal["sbe", "dbe"], count: int = 1) -> str:
        """Retire `count` pages for multiple single-bit (sbe) or a double-bit (dbe) ECC error, stamped now.

        What nvmlDeviceGetRetiredPages(_v2) list for that cause from then on; ``restore`` keeps them.
        Reply ``ok pages=N``, N the cause's retired pages now. A GPU without page retirement (cc 8.0
        and later, which remap rows instead, or unsupported=retired_pages) is a :class:`ControlError`.
        """
        return self.send(f"retire {_word(gpu)} {_word(cause)}" + (f" {count}" if count != 1 else ""))

    def gpm(self, gpu: GpuRef, **levels: float) -> str:
        """Set GPM activity levels from now on: graphics, sm, sm_occupancy, integer, tensor, dfma, hmma, imma,
        dram, fp64, fp32, fp16 (percent) and pcie_tx, pcie_rx (MiB/s); the others keep theirs.

        nvmlGpmMetricsGet gives each metric's time-weighted mean level between two samples. ``restore``
        sets every level to 0. A GPU without GPM (cc before 9.0, or unsupported=gpm) is a :class:`ControlError`.
        """
        if not levels:
            raise ValueError("gpm needs at least one level")
        return self.send(f"gpm {_word(gpu)} " + " ".join(f"{_word(k)}={float(v)!r}" for k, v in levels.items()))

    def event(self, gpu: GpuRef, event_type: int, data: int = 0) -> str:
        return self.send(f"event {gpu} {event_type:#x} {data}")

    def lose(self, gpu: GpuRef) -> str:
        """Make the GPU fall off the bus: its calls return GPU_IS_LOST."""
        return self.send(f"lose {gpu}")

    def restore(self, gpu: GpuRef) -> str:
        """Undo lose/remove and clear the health probes."""
        return self.send(f"restore {gpu}")

    def remove(self, gpu: GpuRef) -> str:
        """Lost at once; no longer enumerated from the next real nvmlInit."""
        return self.send(f"remove {gpu}")

    def add(self, spec: str) -> str:
        """Add a GPU (``gpu`` line syntax without the keyword), enumerated from the next real nvmlInit."""
        return self.send(f"add {spec}")

    def pending_pages(self, gpu: GpuRef, pending: bool) -> str:
        return self.send(f"pending_pages {gpu} {int(pending)}")

    def remap(self, gpu: GpuRef, pending: bool, failure: bool) -> str:
        return self.send(f"remap {gpu} {int(pending)} {int(failure)}")

    def recovery_action(self, gpu: GpuRef, action: int) -> str:
        return self.send(f"recovery_action {gpu} {action}")

    def mig_mode(self, gpu: GpuRef, enabled: bool) -> str:
        """Set the GPU's MIG mode at once (current = pending); off also drops its MIG devices.

        Queues a MigConfigChange (0x100) event.
        """
        return self.send(f"mig {gpu} mode {int(enabled)}")

    def mig_layout(self, gpu: GpuRef, profiles: Sequence[str]) -> str:
        """Replace the GPU's MIG devices (MIG mode must be on) with one per profile, in order.

        GPU instance ids are 1, 2, ... in that order, compute instance ids 0;
        UUIDs are ``fakenvml_devices.mig_uuid`` of those.  An empty sequence clears the
        layout.  Takes effect at once and queues a MigConfigChange (0x100) event.
        """
        if isinstance(profiles, str):
            raise TypeError("profiles must be a sequence of profile names, not one string")
        if any(not p or "," in p or p.split() != [p] for p in profiles):
            raise ValueError(f"bad MIG profile names: {list(profiles)!r}")
        return self.send(f"mig {gpu} layout {','.join(profiles) or '-'}")

    def compute_mode(self, gpu: GpuRef) -> int:
        """The GPU's compute mode (a :class:`ComputeMode` value), as nvmlDeviceGetComputeMode reads it."""
        reply = self.send(f"compute_mode {_word(gpu)}").split()
        if len(reply) != 2 or not reply[1].isdigit():
            raise ControlError(f"unexpected reply to 'compute_mode': {' '.join(reply)!r}")
        return int(reply[1])

    def set_compute_mode(self, gpu: GpuRef, mode: int) -> str:
        """Set the GPU's compute mode as an operator's ``nvidia-smi -c`` does (no root check).

        The mode is driver state: written to the state file, later processes read it.
        EXCLUSIVE_THREAD is accepted here (a driver can still hold it) though
        nvmlDeviceSetComputeMode refuses it.  A lost GPU or one in MIG mode is a
        :class:`ControlError`, as for nvidia-smi; running processes do not matter.
        """
        return self.send(f"compute_mode {_word(gpu)} {ComputeMode(mode).value}")

    def procs(self, gpu: GpuRef, procs: Sequence[GpuProcess | int]) -> str:
        """Replace the processes running on the GPU (an int is a compute process of unknown memory use).

        Takes effect at once, without an event; an empty sequence clears them.
        ``restore`` keeps them; a MIG layout change or MIG mode off ends those
        on MIG devices.  The GPU's compute mode limits them (outside MIG mode):
        EXCLUSIVE_PROCESS allows one of kind compute (an MPS server, its clients
        being kind mps), PROHIBITED none of kind compute or mps; more is a
        :class:`ControlError` naming the rule.
        """
        if isinstance(procs, (str, bytes)):
            raise TypeError("procs must be a sequence of GpuProcess or pids, not one string")
        if len(procs) > PROCS_MAX:
            raise ValueError(f"at most {PROCS_MAX} processes per GPU")
        items = [p if isinstance(p, GpuProcess) else GpuProcess(p) for p in procs]
        return self.send(f"procs {gpu} {','.join(p.spec() for p in items) or '-'}")

    def telemetry(self, gpu: GpuRef, **figures: int) -> str:
        """Set what the GPU's figures answer: util, mem_util, enc_util, dec_util (percent), temp, mem_temp
        (C), power_mw, energy_mj, sm_clock, mem_clock (MHz), throttle (nvmlClocksEventReasons bits),
        pcie_replays, reserved_mib (framebuffer used before any process), nvlink_tx, nvlink_rx (MiB/s). Energy
        grows at power_mw from then on, the NVLink counts (fields 138 to 141) at their rates, and the violation
        times (fields 74 to 80) of the policies whose reasons throttle holds."""
        if not figures:
            raise ValueError("telemetry needs at least one figure")
        return self.send(f"telemetry {gpu} " + " ".join(f"{k}={v}" for k, v in figures.items()))

    def samples(self, gpu: GpuRef, samples: Sequence[tuple[int, int, int]]) -> int:
        """Record one process utilization sample (pid, sm %, memory %) per item, stamped now; an empty
        sequence forgets them all. Returns the last sample's timestamp (microseconds)."""
        items = ",".join(f"{pid}:{sm}:{mem}" for pid, sm, mem in samples) or "-"
        reply = self.send(f"samples {gpu} {items}")
        return int(reply.rpartition("last=")[2]) if "last=" in reply else 0

    def init_error(self, code: int) -> str:
        """Make later nvmlInit calls fail with ``code`` (0 clears it)."""
        return self.send(f"init_error {code}")

    def wait_error(self, code: int, count: int) -> None:
        """Fail the next ``count`` event waits with ``code`` (-1: until ``wait_error(0, 0)``).

        A waiter blocked now wakes up and fails at once; queued events stay queued.
        """
        self.send(f"wait_error {code} {count}")

    def calls(self) -> dict[str, int]:
        """NVML calls per exported function since the start or :meth:`reset_calls` (only non-zero ones)."""
        reply = self.send("calls").split()
        if reply[:1] != ["ok"] or not reply[1:2] or not reply[1].startswith("total="):
            raise ControlError(f"unexpected reply to 'calls': {' '.join(reply)!r}")
        counts = {name: int(n) for name, _, n in (word.partition("=") for word in reply[2:])}
        if sum(counts.values()) != int(reply[1].removeprefix("total=")):
            raise ControlError(f"'calls' reply does not add up: {' '.join(reply)!r}")
        return counts

    def reset_calls(self) -> None:
        self.send("calls reset")

    def block(self, gpu: GpuRef, function: str) -> str:
        """Make calls of ``function`` on ``gpu`` hang until released, like a GPU wedged in the driver.

        ``function`` is the exported entry point's exact name (``nvmlDeviceGetPciInfo_v3``,
        not pynvml's ``nvmlDeviceGetPciInfo``; :meth:`calls` shows which ones a client
        uses); one the fake lacks is a :class:`ControlError`.  ``gpu`` is an index, a UUID
        or :data:`ANY_GPU` (every GPU; the only choice for calls without a device, such as
        ``nvmlInit_v2`` or ``nvmlShutdown``).  A handle lookup blocks for the GPU it finds,
        so ``block(3, "nvmlDeviceGetHandleByIndex_v2")`` hangs the lookup of index 3.

        A blocked call holds none of the fake's locks: the control socket, other GPUs and
        other functions keep answering.  :meth:`release` lets it go on as a call entering
        then would: its normal result, or NVML_ERROR_UNINITIALIZED after an nvmlShutdown
        (which itself returns at once).  Release every block before the process under test
        exits, or a thread stuck in one may keep it from exiting; :meth:`blocked` does that.
        """
        return self.send(f"block {_word(gpu)} {_word(function)}")

    def release(self, gpu: GpuRef, function: str) -> str:
        """Undo :meth:`block` for the same ``gpu`` and ``function``; not blocked is a :class:`ControlError`.

        Callers it held return; those another block still matches (an :data:`ANY_GPU`
        one, say) keep waiting.
        """
        return self.send(f"release {_word(gpu)} {_word(function)}")

    def latency(self, gpu: GpuRef, microseconds: int) -> str:
        """Make each call about ``gpu`` (or every GPU without its own, :data:`ANY_GPU`) take ``microseconds``
        longer, spent holding none of the fake's locks, as a real driver's call spends time in the kernel
        while other GPUs answer. 0 takes it off (a GPU's own: back to the :data:`ANY_GPU` figure)."""
        return self.send(f"latency {_word(gpu)} {int(microseconds)}")

    def release_all(self) -> str:
        """Clear every block (reply ``ok released=N``, N the blocks cleared); all blocked callers go on."""
        return self.send("release all")

    @contextlib.contextmanager
    def blocked(self, gpu: GpuRef, function: str) -> Iterator[None]:
        """:meth:`block` for the ``with`` body, released on the way out (even if the body failed).

        A block the body released itself is fine; a failure to release after a body that
        raised is dropped in favour of the body's exception.
        """
        self.block(gpu, function)
        failed = True
        try:
            yield
            failed = False
        finally:
            try:
                self.release(gpu, function)
            except ControlError as exc:
                if not failed and not str(exc).endswith("is not blocked"):
                    raise
            except TimeoutError:
                if not failed:
                    raise

    def blocked_waiting(self) -> int:
        """How many callers are asleep in a block right now (``blocked_waiting=`` of ``state``)."""
        return int(self._state_field("blocked_waiting"))

    def wait_blocked(self, count: int = 1, timeout: float = 5.0) -> None:
        """Wait until at least ``count`` callers are asleep in blocks; :class:`TimeoutError` if they never are."""
        deadline = time.monotonic() + timeout
        while (waiting := self.blocked_waiting()) < count:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{waiting} caller(s) blocked after {timeout}s, wanted {count}")
            time.sleep(0.01)

    def _state_field(self, key: str) -> str:
        """One ``key=value`` of the ``state`` reply's header (before the first GPU)."""
        header = self.state().partition(" | ")[0].split()
        for word in header[1:]:
            name, sep, value = word.partition("=")
            if sep and name == key:
                return value
        raise ControlError(f"no {key}= in the state reply: {' '.join(header)!r}")


def _word(value: object) -> str:
    """One token of a control command: the C side splits on whitespace and groups on quotes."""
    text = str(value)
    if not text or text.split() != [text] or '"' in text or text.startswith("#"):
        raise ValueError(f"not a single control-command word: {value!r}")
    return text


@contextlib.contextmanager
def _client_socket(netns: NetNamespace | None) -> Iterator[socket.socket]:
    """A datagram socket bound to an address, so that the library can reply to it.

    Linux autobind gives a unique abstract address: no file to clean up, and a
    library in another mount namespace (a container) can still reach it. An
    abstract address belongs to a network namespace: the socket is made in the
    library's (`netns`, or ours).
    """

    def bound() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind("")
        except OSError:
            sock.close()
            raise
        return sock

    with netns.run(bound) if netns is not None else bound() as sock:
        yield sock
