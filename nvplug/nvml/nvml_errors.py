"""What NVML's callers catch: NVML unusable, or a call that has not returned."""

from __future__ import annotations


class NvmlUnavailable(Exception):
    """NVML cannot be loaded or initialised; the message carries the library's text."""


class NvmlHung(NvmlUnavailable):
    """A call did not return by its deadline, or was refused because an earlier one on its GPU has not."""
