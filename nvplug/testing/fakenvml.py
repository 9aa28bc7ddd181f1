"""Build and drive the fake ``libnvidia-ml.so.1`` (``fakenvml.c``).

The fake is loaded by the real ``pynvml`` through ``LD_LIBRARY_PATH`` in a
child process started with :func:`environ`; the test (or demo) then injects
faults through :class:`Control`, a client of the library's unix datagram
control socket.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal, TypeAlias

__all__ = [
    "DEFAULT_SCENARIO",
    "LIB_NAME",
    "SOURCE",
    "Control",
    "ControlError",
    "FakeNvmlBuildError",
    "build",
    "environ",
]

_HERE = Path(__file__).resolve().parent
SOURCE: Path = _HERE / "fakenvml.c"
DEFAULT_SCENARIO: Path = _HERE / "default.scenario"
LIB_NAME = "libnvidia-ml.so.1"
_CFLAGS = ("-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-pthread")

# A GPU as the control socket names it: an index in the current enumeration or a UUID.
GpuRef: TypeAlias = "int | str"


class FakeNvmlBuildError(RuntimeError):
    """The C compiler could not build the fake library."""

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(f"{message}\n{stderr}".rstrip())
        self.stderr = stderr


class ControlError(RuntimeError):
    """The fake library rejected a control command (its reply began with ``error``)."""


def build(dest_dir: Path, cc: str = "cc") -> Path:
    """Compile :data:`SOURCE` to ``dest_dir/libnvidia-ml.so.1`` unless an up-to-date build exists.

    Safe to call from concurrent processes: the library is written under a
    temporary name and renamed into place, and the source hash beside it is
    written only after the library.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    lib = dest_dir / LIB_NAME
    stamp = dest_dir / f"{LIB_NAME}.sha256"
    digest = hashlib.sha256(SOURCE.read_bytes() + repr((cc, _CFLAGS)).encode()).hexdigest()
    if lib.is_file() and _read_text(stamp) == digest:
        return lib

    with _temp_in(dest_dir, ".tmp") as tmp:
        try:
            proc = subprocess.run(
                [cc, *_CFLAGS, "-o", str(tmp), str(SOURCE)],
                capture_output=True,
                text=True,
                check=False,
            )
        except OSError as exc:
            raise FakeNvmlBuildError(f"cannot run C compiler {cc!r}: {exc}") from exc
        if proc.returncode != 0:
            raise FakeNvmlBuildError(f"{cc} failed to build {SOURCE} (exit {proc.returncode})", proc.stderr)
        tmp.chmod(0o755)
        tmp.replace(lib)
    with _temp_in(dest_dir, ".sha256.tmp") as tmp:
        tmp.write_text(digest)
        tmp.replace(stamp)
    return lib


def environ(
    lib_dir: Path,
    scenario: Path,
    control: Path,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment for a child process that should load the fake instead of a real NVML."""
    env = dict(os.environ if base is None else base)
    previous = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = str(lib_dir) + (os.pathsep + previous if previous else "")
    env["FAKE_NVML_SCENARIO"] = str(scenario)
    env["FAKE_NVML_CONTROL"] = str(control)
    return env


class Control:
    """Client for the fake library's control socket (``FAKE_NVML_CONTROL``).

    The socket only exists once the process under test has called nvmlInit,
    so :meth:`send` keeps retrying until its timeout.  Every method returns the
    reply text (``ok ...``) and raises :class:`ControlError` for ``error: ...``
    replies and :class:`TimeoutError` when no reply comes in time.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def send(self, command: str, timeout: float = 5.0) -> str:
        """Send one command line and return the reply."""
        if "\n" in command.rstrip("\n"):
            raise ValueError("one command per call")
        deadline = time.monotonic() + timeout
        payload = command.encode()
        with _client_socket() as sock:
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


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


@contextlib.contextmanager
def _temp_in(directory: Path, suffix: str) -> Iterator[Path]:
    """A fresh file name in ``directory``, removed afterwards unless it was renamed away."""
    fd, name = tempfile.mkstemp(prefix=f".{LIB_NAME}.", suffix=suffix, dir=directory)
    os.close(fd)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _client_socket() -> Iterator[socket.socket]:
    """A datagram socket bound to an address, so that the library can reply to it.

    Linux autobind gives a unique abstract address: no file to clean up, and a
    library in another mount namespace (a container sharing our network
    namespace) can still reach it.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("")
        yield sock
