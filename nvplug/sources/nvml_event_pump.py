"""The NVML event wait, in a child process of the daemon's own (run as a script, by `nvml_events`).

Why a process: the driver's last nvmlShutdown waits for an nvmlEventSetWait in progress, so a wait in
the daemon would hold up every rescan that must count GPUs again (a hot-add, a reset) for as long as the
wait, and short waits cost wake-ups all day. A process is ended at once, and its NVML with it, so its
wait can be long.

It does only the wait. Lines on stdin ask; lines on stdout answer and tell:

    stamp                                      -> (nothing: the lines marked [<ns>] carry it from now on)
    subscribe <mask hex> <wait ms> <uuid>...   -> per GPU: subscribed <uuid> <mask hex> [<ns>]
                                                  | lost <uuid> <code> | failed <uuid> <code>; then done
                                                  (error <code>: NVML or the event set did not come up)
    resume                                     -> ok | wait_error <code> (after a wait_error)
                                               <- event <uuid> <type hex> <data> <gi> <ci> [<ns>]
                                               <- wait_error <code>: the wait fails; it waits for resume

<ns>: the system's monotonic clock (every process reads the same one) when the GPU's events were
registered, and when the wait returned with the event, so that what two children both tell while one
hands over to the next is reported once (`watch_overlap`). Only where asked: a daemon from before the
stamps, still running while a package upgrade replaces this file, reads the lines it knows.

What an event means, and every read it calls for, is the daemon's. End of stdin (the daemon gone) ends
it. It calls the six functions it needs through ctypes, as nvidia-ml-py does (the same library, by the
same name, and nvml.h's nvmlEventData_t), rather than import nvidia-ml-py: that import alone took 23 ms
and 4 MB of a start of 32 ms and 17 MB. Without site (-S), and with the imports below, it is subscribed
14 ms after it was started (24 ms with signal, threading and typing) and holds 11 MiB. A hot-add waits
for it.
"""

from __future__ import annotations

# _signal and _thread, not signal and threading, and typing for the checker only: their imports (enum,
# functools, re, ...) were 12 ms of the start a hot-add waits for.
import _signal  # type: ignore[import-not-found]  # (no stub: it is signal without enum)
import _thread
import ctypes
import os
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import TextIO

# nvmlReturn_t values (nvml.h).
SUCCESS = 0
NOT_SUPPORTED = 3
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15


class EventData(ctypes.Structure):
    """nvmlEventData_t."""

    _fields_ = [
        ("device", ctypes.c_void_p),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class NvmlCallFailed(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class EventCalls:
    """The NVML calls of an event wait, on libnvidia-ml.so.1 as the loader finds it."""

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as err:
            raise NvmlCallFailed(LIBRARY_NOT_FOUND) from err

    def _call(self, name: str, *args: object) -> None:
        try:
            function = getattr(self._lib, name)
        except AttributeError as err:  # an older driver
            raise NvmlCallFailed(FUNCTION_NOT_FOUND) from err
        code = function(*args)
        if code != SUCCESS:
            raise NvmlCallFailed(code)

    def init(self) -> None:
        self._call("nvmlInit_v2")

    def event_set(self) -> ctypes.c_void_p:
        event_set = ctypes.c_void_p()
        self._call("nvmlEventSetCreate", ctypes.byref(event_set))
        return event_set

    def handle(self, uuid: str) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByUUID", uuid.encode(), ctypes.byref(handle))
        return handle

    def supported(self, handle: ctypes.c_void_p) -> int:
        """0 where the driver tells no events of the GPU."""
        types = ctypes.c_ulonglong()
        try:
            self._call("nvmlDeviceGetSupportedEventTypes", handle, ctypes.byref(types))
        except NvmlCallFailed as err:
            if err.code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                return 0
            raise
        return types.value

    def register(self, handle: ctypes.c_void_p, mask: int, event_set: ctypes.c_void_p) -> None:
        self._call("nvmlDeviceRegisterEvents", handle, ctypes.c_ulonglong(mask), event_set)

    def wait(self, event_set: ctypes.c_void_p, timeout_ms: int) -> EventData:
        data = EventData()
        self._call("nvmlEventSetWait_v2", event_set, ctypes.byref(data), ctypes.c_uint(timeout_ms))
        return data


class Pump:
    def __init__(self) -> None:
        self._say_lock = _thread.allocate_lock()
        self._nvml: EventCalls | None = None
        self._event_set = ctypes.c_void_p()
        self._wait_ms = 0
        # Replaced whole by each subscribe, so that the waiting thread reads one map or the other.
        self._uuids: dict[int, str] = {}
        self._stamped = False
        # Held while no resume is owed: a resume releases it, and the waiting thread takes it back.
        self._resume = _thread.allocate_lock()
        self._resume.acquire()

    def serve(self, commands: TextIO) -> None:
        for line in commands:
            words = line.split()
            if words[:1] == ["subscribe"] and len(words) >= 3:
                self._subscribe(int(words[1], 16), int(words[2]), words[3:])
            elif words == ["stamp"]:
                self._stamped = True
            elif words == ["resume"]:
                if self._resume.locked():  # one owed resume, however many are sent
                    self._resume.release()
            else:
                print(f"nvml_event_pump: unknown command {line.strip()!r}", file=sys.stderr, flush=True)

    def _say(self, line: str) -> None:
        data = (line + "\n").encode()
        with self._say_lock:
            os.write(1, data)

    def _subscribe(self, wanted: int, wait_ms: int, uuids: list[str]) -> None:
        if self._nvml is None:
            try:
                nvml = EventCalls()
                nvml.init()
                self._event_set = nvml.event_set()
            except NvmlCallFailed as err:
                self._say(f"error {err.code}")
                return
            self._nvml, self._wait_ms = nvml, wait_ms
        added: dict[int, str] = {}
        for uuid in uuids:
            try:
                handle = self._nvml.handle(uuid)
                mask = self._nvml.supported(handle) & wanted
                if mask:
                    self._nvml.register(handle, mask, self._event_set)
            except NvmlCallFailed as err:
                kind = "lost" if err.code == GPU_IS_LOST else "failed"
                self._say(f"{kind} {uuid} {err.code}")
                continue
            added[handle.value or 0] = uuid
            self._say(f"subscribed {uuid} {mask:x}{self._stamp(time.monotonic_ns())}")
        first = not self._uuids and bool(added)
        self._uuids = {**self._uuids, **added}
        self._say("done")
        if first:
            _thread.start_new_thread(self._wait, ())

    def _wait(self) -> None:
        assert self._nvml is not None
        while True:
            try:
                data = self._nvml.wait(self._event_set, self._wait_ms)
            except NvmlCallFailed as err:
                if err.code != TIMEOUT:
                    self._recover(self._nvml, err.code)
                continue
            self._tell(data, time.monotonic_ns())

    def _recover(self, nvml: EventCalls, code: int) -> None:
        """Say so, and at each resume try a wait that returns at once, until one works."""
        while True:
            self._say(f"wait_error {code}")
            self._resume.acquire()
            try:
                data = nvml.wait(self._event_set, 0)
                at = time.monotonic_ns()
            except NvmlCallFailed as err:
                if err.code == TIMEOUT:
                    self._say("ok")
                    return
                code = err.code
                continue
            self._say("ok")
            self._tell(data, at)
            return

    def _tell(self, data: EventData, at: int) -> None:
        uuid = self._uuids.get(data.device or 0, "-")
        self._say(
            f"event {uuid} {data.eventType:x} {data.eventData} {data.gpuInstanceId} {data.computeInstanceId}"
            + self._stamp(at)
        )

    def _stamp(self, at: int) -> str:
        return f" {at}" if self._stamped else ""


def main() -> None:
    # A terminal's ^C, and systemd's SIGTERM to the whole unit at a stop, are the daemon's to act on: it
    # kills this process, or its exit closes our stdin.
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)
    Pump().serve(sys.stdin)
    # The daemon has gone: a wait in progress must not keep the process.
    os._exit(0)


if __name__ == "__main__":
    main()
