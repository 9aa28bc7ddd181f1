"""NVML's field values (`nvmlDeviceGetFieldValues`), several in one call, read straight from pynvml's own
structure. Every call blocks.

pynvml's wrapper builds the array afresh each call, sets each id through the structure's hooks (raising and
catching a TypeError for each id given without a scope), and each value read goes through a formatting hook.
A request here is made once: each read copies it, and each answer is unpacked from its bytes at the offsets
pynvml's structure gives, as the type the driver says it has.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import pynvml  # type: ignore[import-untyped]

from nvplug.sources.nvml_process_arrays import unpacker

_ENTRY = pynvml.c_nvmlFieldValue_t
# nvmlValue_t's member for each nvmlValueType_t, as a native struct format.
_VALUE_FORMATS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "@d",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "@I",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "@L",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "@Q",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "@q",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "@i",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "@H",
}
# Each entry's head and its value's 8 bytes as one unsigned integer, which is the value itself where the
# driver gives an unsigned 64-bit type (most fields); another type is unpacked from the same bytes.
_ENTRY_FIELDS = unpacker(_ENTRY, ("timestamp", "valueType", "nvmlReturn", "value"))
_RAW = struct.Struct("=Q")
_WHOLE = frozenset(kind for kind, form in _VALUE_FORMATS.items() if form in ("@Q", "@L") and struct.calcsize(form) == 8)


class FieldValue(NamedTuple):
    value: float | None  # None: the driver does not give it (`returned`), or in a type unknown here
    returned: int  # the field's own nvmlReturn_t
    timestamp: int  # when NVML read it (µs)


class FieldRequest:
    """The fields (fieldId, scopeId) one call asks for."""

    def __init__(self, fields: Sequence[tuple[int, int]]) -> None:
        self._array = _ENTRY * len(fields)
        template = self._array()
        for entry, (field, scope) in zip(template, fields, strict=True):
            entry.fieldId, entry.scopeId = field, scope
        self._template = bytes(template)
        self._count = ctypes.c_int(len(fields))

    def read(self, handle: Any) -> list[FieldValue]:
        """Each field's answer, in the request's order. Raises pynvml.NVMLError where the call itself fails."""
        values = self._array.from_buffer_copy(self._template)
        ret = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")(handle, self._count, ctypes.byref(values))
        if ret != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(ret)
        return decode(bytes(values))

    def one(self, handle: Any) -> float:
        """The first field's value; NVMLError where the driver does not give it (the call worked, the field's
        own return did not)."""
        got = self.read(handle)[0]
        if got.value is None:
            raise pynvml.NVMLError(got.returned if got.returned != pynvml.NVML_SUCCESS else pynvml.NVML_ERROR_UNKNOWN)
        return got.value


def decode(data: bytes) -> list[FieldValue]:
    """The answers in an array of nvmlFieldValue_t's bytes."""
    out = []
    for stamp, kind, returned, raw in _ENTRY_FIELDS.iter_unpack(data):
        if returned != pynvml.NVML_SUCCESS:
            value = None
        elif kind in _WHOLE:
            value = raw
        else:
            known = _VALUE_FORMATS.get(kind)
            value = struct.unpack_from(known, _RAW.pack(raw))[0] if known else None
        out.append(FieldValue(value, returned, stamp))
    return out
