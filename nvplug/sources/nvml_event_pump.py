"""The NVML event wait, in a child process of the daemon's own (run as a script, by `nvml_events`).

Why a process: the driver's last nvmlShutdown waits for an nvmlEventSetWait in progress, so a wait in
the daemon would hold up every rescan that must count GPUs again (a hot-add, a reset) for as long as the
wait, and short waits cost wake-ups all day. A process is ended at once, and its NVML with it, so its
wait can be long.

It does only the wait. Lines on stdin ask; lines on stdout answer and tell:

    subscribe <mask hex> <wait ms> <uuid>...   -> per GPU: subscribed <uuid> <mask hex>
                                                  | lost <uuid> <code> | failed <uuid> <code>; then done
                                                  (error <code>: NVML or the event set did not come up)
    resume                                     -> ok | wait_error <code> (after a wait_error)
                                               <- event <uuid> <type hex> <data> <gi> <ci>
                                               <- wait_error <code>: the wait fails; it waits for resume

What an event means, and every read it calls for, is the daemon's. End of stdin (the daemon gone) ends
it. Imports nothing of nvplug's, so that it starts in tens of milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any

import pynvml  # type: ignore[import-untyped]


def _address(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


class Pump:
    def __init__(self) -> None:
        self._say_lock = threading.Lock()
        self._event_set: Any = None
        self._wait_ms = 0
        # Replaced whole by each subscribe, so that the waiting thread reads one map or the other.
        self._uuids: dict[int, str] = {}
        self._resume = threading.Event()

    def serve(self, commands: Any) -> None:
        for line in commands:
            words = line.split()
            if words[:1] == ["subscribe"] and len(words) >= 3:
                self._subscribe(int(words[1], 16), int(words[2]), words[3:])
            elif words == ["resume"]:
                self._resume.set()
            else:
                print(f"nvml_event_pump: unknown command {line.strip()!r}", file=sys.stderr, flush=True)

    def _say(self, line: str) -> None:
        data = (line + "\n").encode()
        with self._say_lock:
            os.write(1, data)

    def _subscribe(self, wanted: int, wait_ms: int, uuids: list[str]) -> None:
        if self._event_set is None:
            try:
                pynvml.nvmlInit()
                self._event_set = pynvml.nvmlEventSetCreate()
            except pynvml.NVMLError as err:
                self._say(f"error {err.value}")
                return
            self._wait_ms = wait_ms
        added: dict[int, str] = {}
        for uuid in uuids:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                mask = _supported(handle) & wanted
                if mask:
                    pynvml.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
            except pynvml.NVMLError as err:
                kind = "lost" if err.value == pynvml.NVML_ERROR_GPU_IS_LOST else "failed"
                self._say(f"{kind} {uuid} {err.value}")
                continue
            added[_address(handle)] = uuid
            self._say(f"subscribed {uuid} {mask:x}")
        first = not self._uuids and bool(added)
        self._uuids = {**self._uuids, **added}
        self._say("done")
        if first:
            threading.Thread(target=self._wait, name="nvml-event-wait", daemon=True).start()

    def _wait(self) -> None:
        while True:
            try:
                data = pynvml.nvmlEventSetWait_v2(self._event_set, self._wait_ms)
            except pynvml.NVMLError as err:
                if err.value != pynvml.NVML_ERROR_TIMEOUT:
                    self._recover(err.value)
                continue
            self._tell(data)

    def _recover(self, code: int) -> None:
        """Say so, and at each resume try a wait that returns at once, until one works."""
        while True:
            self._say(f"wait_error {code}")
            self._resume.wait()
            self._resume.clear()
            try:
                data = pynvml.nvmlEventSetWait_v2(self._event_set, 0)
            except pynvml.NVMLError as err:
                if err.value == pynvml.NVML_ERROR_TIMEOUT:
                    self._say("ok")
                    return
                code = err.value
                continue
            self._say("ok")
            self._tell(data)
            return

    def _tell(self, data: Any) -> None:
        uuid = self._uuids.get(_address(data.device), "-")
        self._say(
            f"event {uuid} {int(data.eventType):x} {int(data.eventData)} "
            f"{int(data.gpuInstanceId)} {int(data.computeInstanceId)}"
        )


def _supported(handle: Any) -> int:
    try:
        return int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
    except pynvml.NVMLError as err:
        if err.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            return 0
        raise


def main() -> None:
    # A terminal's ^C, and systemd's SIGTERM to the whole unit at a stop, are the daemon's to act on: it
    # kills this process, or its exit closes our stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Pump().serve(sys.stdin)
    # The daemon has gone: a wait in progress must not keep the process.
    os._exit(0)


if __name__ == "__main__":
    main()
