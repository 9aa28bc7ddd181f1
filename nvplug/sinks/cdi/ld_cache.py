"""Read glibc's ``ld.so.cache``: which library name the dynamic loader resolves to which file.

The CDI spec has to name the host's driver libraries (``libcuda.so.1`` and
friends) by the paths the host's own loader would use.  ldconfig's cache is
where the host records those, so nvplug reads it directly instead of running
``ldconfig -p``: no subprocess, no dependence on the plugin's environment
having a (glibc) ldconfig, and a driver root other than ``/`` works the same.

The layout is glibc's (``sysdeps/generic/dl-cache.h``, written by
``elf/cache.c``):

* new format (glibc >= 2.32 writes only this): a 48-byte header
  ``"glibc-ld.so.cache" "1.1"``, nlibs, len_strings, flags, extension_offset,
  then nlibs 24-byte entries, then the string table.  Entry string offsets
  count from the start of this header.
* old format: ``"ld.so-1.7.0"`` padded to 4 bytes, nlibs, 12-byte entries,
  then strings whose offsets count from the end of the entry table.  In the
  "compat" layout the new format follows the old table, 8-byte aligned, hidden
  at the start of the old string table; we then read the new one, like ld.so.

Every offset is checked against the file, so a damaged cache raises
:class:`LdCacheError` rather than ``IndexError``/``struct.error`` or a garbage
path.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CachedLibrary", "LdCacheError", "parse", "read"]

_OLD_MAGIC = b"ld.so-1.7.0"
_NEW_MAGIC = b"glibc-ld.so.cache1.1"  # CACHEMAGIC_NEW CACHE_VERSION

# ldconfig writes the cache in its host's byte order.  We read little-endian
# (x86_64, aarch64: the hosts nvplug runs on) and refuse a cache flagged
# big-endian.  Explicit "<" formats also mean no implicit C struct padding.
_OLD_HEADER = struct.Struct("<11sxI")  # struct cache_file: magic[11], 1 pad byte, nlibs -> 16 bytes
_OLD_ENTRY = struct.Struct("<iII")  # struct file_entry: flags, key, value
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")  # struct cache_file_new -> 48 bytes
_NEW_ENTRY = struct.Struct("<iIIIQ")  # struct file_entry_new: flags, key, value, osversion, hwcap
_EXT_HEADER = struct.Struct("<II")  # struct cache_extension: magic, count
_EXT_SECTION = struct.Struct("<IIII")  # struct cache_extension_section: tag, flags, offset, size
_EXT_MAGIC = 0xEAA42174  # cache_extension_magic, (uint32_t) -358342284
_NEW_ALIGN = 8  # __alignof__ (struct cache_file_new): its entries hold a uint64_t

# cache_file_new.flags & 3
_ENDIAN_UNSET, _ENDIAN_INVALID, _ENDIAN_LITTLE, _ENDIAN_BIG = 0, 1, 2, 3


class LdCacheError(ValueError):
    """The bytes are not a readable ld.so.cache; the message names the source and the fault."""


@dataclass(frozen=True)
class CachedLibrary:
    """One cache entry, as stored: ``name`` is the key (the SONAME), ``path`` the file."""

    name: str  # e.g. "libcuda.so.1"
    path: str  # e.g. "/usr/lib/x86_64-linux-gnu/libcuda.so.1", relative to the root ldconfig ran for


def read(path: Path) -> list[CachedLibrary]:
    """Parse the cache file at ``path``; ``OSError`` from reading it propagates."""
    return parse(Path(path).read_bytes(), str(path))


def parse(data: bytes, source: str = "ld.so.cache") -> list[CachedLibrary]:
    """The entries of a cache in file order (ldconfig's lookup order).

    A name may appear more than once: for another ABI (a multilib host's
    32-bit copy) or a glibc-hwcaps subdirectory.  Nothing is filtered here.
    """
    if data.startswith(_NEW_MAGIC):
        return _parse_new(data, 0, source)
    if data.startswith(_OLD_MAGIC):
        return _parse_old(data, source)
    if data.startswith(_NEW_MAGIC[:17]):
        raise LdCacheError(f"{source}: unsupported ld.so.cache version {data[17:20]!r} (want b'1.1')")
    if _NEW_MAGIC.startswith(data) or _OLD_MAGIC.startswith(data):
        raise LdCacheError(f"{source}: truncated: {len(data)} bytes end inside the magic")
    raise LdCacheError(f"{source}: not an ld.so.cache: starts with {data[:20]!r}")


def _parse_old(data: bytes, source: str) -> list[CachedLibrary]:
    if len(data) < _OLD_HEADER.size:
        raise LdCacheError(f"{source}: truncated: {len(data)} bytes, old-format header needs {_OLD_HEADER.size}")
    _, nlibs = _OLD_HEADER.unpack_from(data)
    table_end = _OLD_HEADER.size + nlibs * _OLD_ENTRY.size
    if table_end > len(data):
        raise LdCacheError(
            f"{source}: truncated: {nlibs} old-format entries end at byte {table_end}, file has {len(data)}"
        )
    # The compat layout: the new format hides at the aligned start of the old string table.
    new_at = -(-table_end // _NEW_ALIGN) * _NEW_ALIGN
    if data.startswith(_NEW_MAGIC, new_at):
        return _parse_new(data, new_at, source)
    return [
        CachedLibrary(
            _string(data, table_end, key, table_end, len(data), source),
            _string(data, table_end, value, table_end, len(data), source),
        )
        for _, key, value in _OLD_ENTRY.iter_unpack(data[_OLD_HEADER.size : table_end])
    ]


def _parse_new(data: bytes, base: int, source: str) -> list[CachedLibrary]:
    where = f"at byte {base} " if base else ""
    if len(data) - base < _NEW_HEADER.size:
        raise LdCacheError(
            f"{source}: truncated: new-format header {where}needs {_NEW_HEADER.size} bytes, {len(data) - base} left"
        )
    _, nlibs, len_strings, flags, extension_offset = _NEW_HEADER.unpack_from(data, base)
    if flags & 3 == _ENDIAN_BIG:
        raise LdCacheError(f"{source}: a big-endian cache; this reader handles little-endian only")
    if flags & 3 == _ENDIAN_INVALID:
        raise LdCacheError(f"{source}: the cache header marks itself invalid (flags {flags:#x})")
    entries_at = base + _NEW_HEADER.size
    strings_at = entries_at + nlibs * _NEW_ENTRY.size
    strings_end = strings_at + len_strings
    if strings_end > len(data):
        raise LdCacheError(
            f"{source}: truncated: {nlibs} entries and a {len_strings}-byte string table end at byte "
            f"{strings_end}, file has {len(data)}"
        )
    _check_extensions(data, extension_offset, source)
    return [
        CachedLibrary(
            _string(data, base, key, strings_at, strings_end, source),
            _string(data, base, value, strings_at, strings_end, source),
        )
        for _, key, value, _, _ in _NEW_ENTRY.iter_unpack(data[entries_at:strings_at])
    ]


def _check_extensions(data: bytes, offset: int, source: str) -> None:
    """Bounds-check the extension directory (glibc-hwcaps names, the generator string).

    We use none of it, but ldconfig writes it last, so this is what tells a cut
    after the string table from a whole file.  Unlike string offsets, these
    offsets count from the start of the file (``cache_extension_load``).
    """
    if offset == 0:  # no extensions: not an error
        return
    if offset % 4:
        raise LdCacheError(f"{source}: extension directory offset {offset} is not a multiple of 4")
    if offset + _EXT_HEADER.size > len(data):
        raise LdCacheError(f"{source}: truncated: extension directory at byte {offset}, file has {len(data)}")
    magic, count = _EXT_HEADER.unpack_from(data, offset)
    if magic != _EXT_MAGIC:
        raise LdCacheError(f"{source}: bad extension directory magic {magic:#010x} at byte {offset}")
    sections_at = offset + _EXT_HEADER.size
    if sections_at + count * _EXT_SECTION.size > len(data):
        raise LdCacheError(f"{source}: truncated: {count} extension sections from byte {sections_at}")
    for tag, _, section_at, size in _EXT_SECTION.iter_unpack(
        data[sections_at : sections_at + count * _EXT_SECTION.size]
    ):
        if section_at + size > len(data):
            raise LdCacheError(
                f"{source}: truncated: extension section {tag} ends at byte {section_at + size}, file has {len(data)}"
            )


def _string(data: bytes, base: int, offset: int, start: int, end: int, source: str) -> str:
    """The NUL-terminated string at ``base + offset``, which must lie in ``data[start:end]``."""
    at = base + offset
    if not start <= at < end:
        raise LdCacheError(f"{source}: string offset {offset} (byte {at}) is outside the string table [{start}, {end})")
    nul = data.find(b"\0", at, end)
    if nul < 0:
        raise LdCacheError(f"{source}: string at byte {at} has no terminating NUL before byte {end}")
    return os.fsdecode(data[at:nul])  # paths are bytes; keep undecodable ones round-trippable
