"""glibc's malloc told to keep the memory a scrape frees, for the next scrape.

A scrape of a busy node builds its text, and copies of it, half a megabyte each (8 GPUs with 64 processes
each). glibc gives such blocks back to the kernel as they are freed (mmap'd blocks, and a heap top past its
trim threshold), so the next scrape takes them again, page fault by page fault: 450 a scrape, 0.6 ms of
its time. Kept in the heap instead, the memory the daemon holds is the largest scrape's, a few megabytes.
"""

from __future__ import annotations

import ctypes

# mallopt(3)'s parameters.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap, not a mapping of their own (glibc allows up to 32 MiB).
MMAP_THRESHOLD = 16 << 20
# Free memory at the heap's top up to this much stays the process's.
TRIM_THRESHOLD = 32 << 20


def keep_freed_memory() -> bool:
    """False where the C library has no mallopt (not glibc): its malloc is left as it is."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
