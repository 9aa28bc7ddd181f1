"""NVML's per-process arrays, read straight from pynvml's own structures: the running processes of a GPU and
its process utilization samples. Every call blocks.

pynvml's wrappers of these calls build a friendly object per process, or hand out structures whose every
field read goes through a formatting hook: 10 µs a process, more than the rest of a GPU's read with 64 on
it. Here the same functions fill the same ctypes arrays, and the fields wanted are unpacked from their
bytes at the offsets pynvml's structures give, so the layouts stay pynvml's.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Iterator
from typing import Any

import pynvml  # type: ignore[import-untyped]

# Either array is read into room for FIRST_ROOM elements, with no call first to ask how many there are (on
# a real H200 one nvmlDeviceGetProcessUtilization takes 1.3 ms). Where that is short, or processes start
# between the answer and the read, it is grown and asked again, this many times more.
FIRST_ROOM = 128
TRIES = 3


def unpacker(structure: Any, fields: tuple[str, ...]) -> struct.Struct:
    """Reads `fields`, in their order, from one element of an array of `structure`."""
    types = dict(structure._fields_)
    layout, at = "=", 0
    for name in fields:
        offset = getattr(structure, name).offset
        layout += f"{offset - at}x" if offset > at else ""
        layout += "d" if types[name] is ctypes.c_double else {4: "I", 8: "Q"}[ctypes.sizeof(types[name])]
        at = offset + ctypes.sizeof(types[name])
    size = ctypes.sizeof(structure)
    return struct.Struct(layout + (f"{size - at}x" if size > at else ""))


_PROCESS = pynvml.c_nvmlProcessInfo_v3_t
_PROCESS_FIELDS = unpacker(_PROCESS, ("pid", "usedGpuMemory"))
_SAMPLE = pynvml.c_nvmlProcessUtilizationSample_t
_SAMPLE_FIELDS = unpacker(_SAMPLE, ("pid", "timeStamp", "smUtil", "memUtil"))
NOT_AVAILABLE = ctypes.c_ulonglong(-1).value  # usedGpuMemory NVML does not know


def running_processes(function: str, handle: Any) -> list[tuple[int, int | None]]:
    """Each process of a list (`nvmlDeviceGet{Compute,Graphics,MPSCompute}RunningProcesses_v3`), with the
    memory it uses in bytes (None: NVML does not know). Raises pynvml.NVMLError as pynvml would."""
    call = pynvml._nvmlGetFunctionPointer(function)
    count = ctypes.c_uint(0)

    def fill(array: Any) -> int:
        return int(call(handle, ctypes.byref(count), array))

    return [
        (pid, None if used == NOT_AVAILABLE else used)
        for pid, used in _PROCESS_FIELDS.iter_unpack(_filled(_PROCESS, count, fill))
    ]


def utilization_samples(handle: Any, last_seen: int) -> Iterator[tuple[int, int, int, int]]:
    """`nvmlDeviceGetProcessUtilization`'s samples newer than `last_seen`: pid, time stamp (µs), SM and
    memory utilization in percent. Raises pynvml.NVMLError as pynvml would (NOT_FOUND: none newer)."""
    call = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
    count = ctypes.c_uint(0)
    since = ctypes.c_ulonglong(last_seen)

    def fill(array: Any) -> int:
        return int(call(handle, array, ctypes.byref(count), since))

    yield from _SAMPLE_FIELDS.iter_unpack(_filled(_SAMPLE, count, fill))


def _filled(structure: Any, count: ctypes.c_uint, fill: Callable[[Any], int]) -> bytes:
    """The bytes of the elements NVML wrote into an array with room (`count`: the room in, the elements out)."""
    count.value = FIRST_ROOM
    for _ in range(1 + TRIES):
        array = (structure * count.value)()
        ret = fill(array)
        if ret == pynvml.NVML_SUCCESS:
            return ctypes.string_at(array, count.value * ctypes.sizeof(structure))
        if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            break
        count.value = count.value * 2 + 5  # room for those that start meanwhile, as pynvml leaves
    raise pynvml.NVMLError(ret)
