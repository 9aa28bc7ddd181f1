"""Build and drive the fake ``libnvidia-ml.so.1`` (``fakenvml.c``).

The fake is loaded by the real ``pynvml`` through ``LD_LIBRARY_PATH`` in a
child process started with :func:`environ`; the test (or demo) then injects
faults through :class:`Control`, a client of the library's unix datagram
control socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal, TypeAlias

from nvplug.testing import c_build
from nvplug.testing.c_build import CBuildError
from nvplug.testing.net_namespace import NetNamespace

__all__ = [
    "ANY_GPU",
    "DEFAULT_SCENARIO",
    "LIB_NAME",
    "MIG_PROFILES",
    "SOURCE",
    "STATE_FILE",
    "ComputeMode",
    "Control",
    "ControlError",
    "FakeNvmlBuildError",
    "GpuProcess",
    "MigProfile",
    "ProcessKind",
    "build",
    "environ",
    "mig_minor",
    "mig_uuid",
    "persisted_compute_modes",
    "state_file",
    "write_mig_minors",
]

_HERE = Path(__file__).resolve().parent
SOURCE: Path = _HERE / "fakenvml.c"
DEFAULT_SCENARIO: Path = _HERE / "default.scenario"
LIB_NAME = "libnvidia-ml.so.1"
_CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-pthread")

# A GPU as the control socket names it: an index in the current enumeration or a UUID.
GpuRef: TypeAlias = "int | str"
# The GPU of a block that matches every GPU, and the only one for calls that take no device.
ANY_GPU = "*"

MigProfile: TypeAlias = Literal["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
# The H100 80GB MIG profiles the fake knows, in its table order.
MIG_PROFILES: tuple[MigProfile, ...] = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")

# Which running-process query lists a process: nvmlDeviceGet{Compute,Graphics,MPSCompute}RunningProcesses.
ProcessKind: TypeAlias = Literal["compute", "graphics", "mps"]
_PROCESS_KINDS: tuple[ProcessKind, ...] = ("compute", "graphics", "mps")
_PROCS_MAX = 64  # PROCS_MAX in the C: processes per GPU
_MIG_MAX_GI = 14
_MIG_MAX_CI = 7

# The driver state file (compute modes by GPU UUID) in FAKE_NVML_STATE_DIR: STATE_FILE in the C.
STATE_FILE = "fakenvml.state"


class ComputeMode(enum.IntEnum):
    """nvmlComputeMode_t (pynvml's NVML_COMPUTEMODE_*)."""

    DEFAULT = 0
    EXCLUSIVE_THREAD = 1  # "Support Removed": nvmlDeviceSetComputeMode refuses it, the driver may still hold it
    PROHIBITED = 2
    EXCLUSIVE_PROCESS = 3


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    """A process the fake reports as running on a GPU (``procs=`` / the ``procs`` command).

    ``used_mib`` None makes NVML report ``usedGpuMemory`` as NVML_VALUE_NOT_AVAILABLE
    (pynvml: None).  ``kinds`` picks the queries that list it (``("compute", "graphics")``
    is nvidia-smi's "C+G").  ``mig`` (gi, ci) puts it on the GPU's MIG device with
    those ids, which must exist when the command runs.
    """

    pid: int
    used_mib: int | None = None
    kinds: tuple[ProcessKind, ...] = ("compute",)
    mig: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.pid <= 0xFFFFFFFF:
            raise ValueError(f"pid out of range: {self.pid}")
        if self.used_mib is not None and not 0 <= self.used_mib <= 1 << 30:
            raise ValueError(f"used_mib out of range: {self.used_mib}")
        if not self.kinds or len(set(self.kinds)) != len(self.kinds) or set(self.kinds) - set(_PROCESS_KINDS):
            raise ValueError(f"bad process kinds: {self.kinds!r}")
        if self.mig is not None and not (0 <= self.mig[0] <= _MIG_MAX_GI and 0 <= self.mig[1] <= _MIG_MAX_CI):
            raise ValueError(f"no such MIG device ids (gi 0-{_MIG_MAX_GI}, ci 0-{_MIG_MAX_CI}): {self.mig}")

    def spec(self) -> str:
        """The ``PID[:MIB][:KIND][@GI/CI]`` text the C side parses (and its ``state`` reply shows)."""
        text = str(self.pid)
        if self.used_mib is not None:
            text += f":{self.used_mib}"
        if self.kinds != ("compute",):
            text += ":" + "+".join(k for k in _PROCESS_KINDS if k in self.kinds)
        if self.mig is not None:
            text += f"@{self.mig[0]}/{self.mig[1]}"
        return text


_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def _fnv1a(text: str, h: int) -> int:
    for byte in text.encode():
        h = ((h ^ byte) * _FNV_PRIME) & _MASK64
    return h


def mig_uuid(parent_uuid: str, gi: int, ci: int) -> str:
    """The UUID the fake gives a MIG device without a ``uuid=`` (mirrors ``mig_default_uuid`` in the C)."""
    key = f"{parent_uuid}/{gi}/{ci}"
    a = _fnv1a(key, 0xCBF29CE484222325)
    b = _fnv1a(key, 0x84222325CBF29CE4)
    return f"MIG-{a >> 32:08x}-{(a >> 16) & 0xFFFF:04x}-{a & 0xFFFF:04x}-{b >> 48:04x}-{b & 0xFFFFFFFFFFFF:012x}"


# nvidia-caps numbering (/proc/driver/nvidia-caps/mig-minors): "config 1", "monitor 2", then for
# each GPU minor 0..31 and GPU instance 0..14 the GI's access minor followed by its compute
# instances 0..7: 9 minors per GI, 135 per GPU.
_MIG_GIS = 15
_MIG_CIS = 8
_MIG_PER_GI = 1 + _MIG_CIS
_MIG_PER_GPU = _MIG_GIS * _MIG_PER_GI


def mig_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The nvidia-cap minor of ``gpu<gpu_minor>/gi<gi>/access`` or, with ``ci``, ``.../ci<ci>/access``.

    ``3 + gpu_minor*135 + gi*9`` for the GPU instance, plus ``1 + ci`` for a compute
    instance: the order in which the driver lists every possible capability (so
    ``gpu0/gi1/access 12``, ``gpu0/gi1/ci0/access 13``, ``gpu1/gi0/access 138``).
    """
    if not 0 <= gpu_minor <= 255 or not 0 <= gi < _MIG_GIS or (ci is not None and not 0 <= ci < _MIG_CIS):
        raise ValueError(f"no nvidia-caps minor for gpu{gpu_minor}/gi{gi}/ci{ci}")
    base = 3 + gpu_minor * _MIG_PER_GPU + gi * _MIG_PER_GI
    return base if ci is None else base + 1 + ci


def write_mig_minors(path: Path, layout: Mapping[int, Sequence[tuple[int, int]]]) -> None:
    """Write a ``mig-minors`` file like the driver's ``/proc/driver/nvidia-caps/mig-minors``.

    ``layout`` maps GPU minor numbers to (gi, ci) pairs.  The file has the
    ``config``/``monitor`` lines and, per GPU and GI in ascending order, the GI
    access line then its CI lines, numbered by :func:`mig_minor`.  (The real
    file lists every possible GPU/GI/CI; listing only the given ones keeps the
    same numbers.)
    """
    lines = ["config 1", "monitor 2"]
    for gpu in sorted(layout):
        gis: dict[int, set[int]] = {}
        for gi, ci in layout[gpu]:
            mig_minor(gpu, gi, ci)  # validates
            gis.setdefault(gi, set()).add(ci)
        for gi in sorted(gis):
            lines.append(f"gpu{gpu}/gi{gi}/access {mig_minor(gpu, gi)}")
            lines.extend(f"gpu{gpu}/gi{gi}/ci{ci}/access {mig_minor(gpu, gi, ci)}" for ci in sorted(gis[gi]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


class FakeNvmlBuildError(CBuildError):
    """The C compiler could not build the fake library."""


class ControlError(RuntimeError):
    """The fake library rejected a control command (its reply began with ``error``)."""


def build(dest_dir: Path, cc: str = "cc") -> Path:
    """Compile :data:`SOURCE` to ``dest_dir/libnvidia-ml.so.1`` unless an up-to-date build exists.

    Safe to call from concurrent processes: the library is written under a
    temporary name and renamed into place, and the source hash beside it is
    written only after the library.
    """
    return c_build.build(SOURCE, Path(dest_dir) / LIB_NAME, _CFLAGS, cc, FakeNvmlBuildError)


def environ(
    lib_dir: Path,
    scenario: Path,
    control: Path,
    base: Mapping[str, str] | None = None,
    state_dir: Path | None = None,
) -> dict[str, str]:
    """The environment for a child process that should load the fake instead of a real NVML.

    ``state_dir`` (``FAKE_NVML_STATE_DIR``) holds the driver state that outlives the
    processes, the GPUs' compute modes (:data:`STATE_FILE`); by default the control
    socket's directory, which is one per simulated node: its processes (a daemon, its
    restarts, a CLI with a control socket of its own beside it) share the state, other
    nodes do not.
    """
    env = dict(os.environ if base is None else base)
    previous = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = str(lib_dir) + (os.pathsep + previous if previous else "")
    env["FAKE_NVML_SCENARIO"] = str(scenario)
    env["FAKE_NVML_CONTROL"] = str(control)
    env["FAKE_NVML_STATE_DIR"] = str(Path(control).parent if state_dir is None else state_dir)
    return env


def state_file(env: Mapping[str, str]) -> Path | None:
    """The driver state file the library uses in ``env``, as the C resolves it; None: it keeps none.

    ``FAKE_NVML_STATE_DIR``/:data:`STATE_FILE` (an empty value: none), else :data:`STATE_FILE`
    beside ``FAKE_NVML_CONTROL``, else none (the state then lives in the process).
    """
    state_dir = env.get("FAKE_NVML_STATE_DIR")
    if state_dir is not None:
        return Path(state_dir) / STATE_FILE if state_dir else None
    control = env.get("FAKE_NVML_CONTROL")
    return Path(control).parent / STATE_FILE if control else None


def persisted_compute_modes(where: Mapping[str, str] | Path) -> dict[str, int]:
    """The compute modes in the driver state file, by GPU UUID, read without loading the library.

    ``where`` is an environment (see :func:`state_file`), the state directory or the
    file itself.  Only GPUs whose mode was set since the file was made are there (the
    others have their gpu line's ``compute_mode=``); no file is no entries.
    """
    if isinstance(where, Path):
        path: Path | None = where / STATE_FILE if where.is_dir() else where
    else:
        path = state_file(where)
    text = c_build.read_text(path) if path is not None else None
    modes: dict[str, int] = {}
    for line in (text or "").splitlines():
        words = line.split("#", 1)[0].split()
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if sep and key == "compute_mode" and value.isdigit() and int(value) < len(ComputeMode):
                modes[words[0]] = int(value)
    return modes


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

    def ecc(self, gpu: GpuRef, kind: Literal["sbe", "dbe"]) -> str:
        """Queue a single (0x1) or double (0x2) bit ECC error event."""
        return self.send(f"ecc {gpu} {kind}")

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
        UUIDs are :func:`mig_uuid` of those.  An empty sequence clears the
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
        if len(procs) > _PROCS_MAX:
            raise ValueError(f"at most {_PROCS_MAX} processes per GPU")
        items = [p if isinstance(p, GpuProcess) else GpuProcess(p) for p in procs]
        return self.send(f"procs {gpu} {','.join(p.spec() for p in items) or '-'}")

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
