"""ld.so.cache reading, against caches the real ldconfig writes for a fake driver root, and hand-built ones."""

from __future__ import annotations

import os
import re
import shutil
import stat
import struct
import subprocess
from pathlib import Path

import pytest

from nvplug.sinks.cdi import ld_cache as ldcache
from nvplug.sinks.cdi.ld_cache import CachedLibrary, LdCacheError
from nvplug.testing import fake_driver_root as driverroot
from nvplug.testing.fake_driver_root import FakeDriverRoot

LIB = "/" + driverroot.LIB_DIR
HOST_CACHE = Path("/etc/ld.so.cache")


def _ldconfig() -> str:
    found = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None
    )
    assert found, "driverroot.build needs ldconfig, so the tests do too"
    return found


@pytest.fixture(scope="module")
def drv(tmp_path_factory: pytest.TempPathFactory) -> FakeDriverRoot:
    return driverroot.build(tmp_path_factory.mktemp("ldcache") / "drv")


@pytest.fixture(scope="module")
def caches(drv: FakeDriverRoot) -> dict[str, Path]:
    """The fake root's cache in each format ldconfig writes (new is its default, the one build() made)."""
    out = {"new": drv.root / "etc" / "ld.so.cache"}
    for fmt in ("compat", "old"):
        # -C is taken relative to -r; -X leaves the links build() made alone.
        subprocess.run(
            [_ldconfig(), "-r", str(drv.root), "-X", "-c", fmt, "-C", f"/etc/ld.so.cache.{fmt}"],
            check=True,
            capture_output=True,
        )
        out[fmt] = drv.root / "etc" / f"ld.so.cache.{fmt}"
    return out


def _ldconfig_p(cache: Path) -> list[CachedLibrary]:
    """What glibc's own reader (ldconfig -p) lists for a cache file."""
    text = subprocess.run([_ldconfig(), "-p", "-C", str(cache)], check=True, capture_output=True, text=True).stdout
    return [CachedLibrary(m[1], m[2]) for m in re.finditer(r"^\t(\S+) \(.*\) => (.*)$", text, re.MULTILINE)]


# ---- hand-built caches ----------------------------------------------------------------

NEW_HEADER = struct.Struct("<20sIIB3xI12x")
NEW_ENTRY = struct.Struct("<iIIIQ")
OLD_HEADER = struct.Struct("<11sxI")
OLD_ENTRY = struct.Struct("<iII")
ELF_X86_64 = 0x0303  # FLAG_X8664_LIB64 | FLAG_ELF_LIBC6


def _strings(pairs: list[tuple[str, str]]) -> tuple[bytes, list[tuple[int, int]]]:
    table = bytearray()
    offsets = []
    for name, path in pairs:
        key = len(table)
        table += name.encode() + b"\0"
        value = len(table)
        table += path.encode() + b"\0"
        offsets.append((key, value))
    return bytes(table), offsets


def new_cache(pairs: list[tuple[str, str]], *, flags: int = 2, table: bytes | None = None) -> bytes:
    """A new-format cache; ``table`` replaces the string table (offsets still computed from ``pairs``)."""
    strings, offsets = _strings(pairs)
    strings = strings if table is None else table
    base = NEW_HEADER.size + NEW_ENTRY.size * len(pairs)
    header = NEW_HEADER.pack(b"glibc-ld.so.cache1.1", len(pairs), len(strings), flags, 0)
    entries = b"".join(NEW_ENTRY.pack(ELF_X86_64, base + k, base + v, 0, 0) for k, v in offsets)
    return header + entries + strings


def old_cache(pairs: list[tuple[str, str]], *, hidden: bytes = b"") -> bytes:
    """An old-format cache; ``hidden`` (a new-format cache) goes 8-aligned at the start of its string table."""
    table_end = OLD_HEADER.size + OLD_ENTRY.size * len(pairs)
    pad = -table_end % 8 if hidden else 0
    strings, offsets = _strings(pairs)
    skip = pad + len(hidden)  # old string offsets count from the end of the old table
    header = OLD_HEADER.pack(b"ld.so-1.7.0", len(pairs))
    entries = b"".join(OLD_ENTRY.pack(ELF_X86_64, skip + k, skip + v) for k, v in offsets)
    return header + entries + b"\0" * pad + hidden + strings


def with_extension(cache: bytes, directory: bytes) -> bytes:
    """Append an extension directory to a new-format cache (at file offset 0) and point the header at it."""
    cache += b"\0" * (-len(cache) % 4)
    return cache[:32] + struct.pack("<I", len(cache)) + cache[36:] + directory


PAIRS = [("libcuda.so.1", f"{LIB}/libcuda.so.1"), ("libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6")]


# ---- reading real caches --------------------------------------------------------------


def test_fake_root_cache_lists_driver_libraries(drv: FakeDriverRoot) -> None:
    entries = ldcache.read(drv.root / "etc" / "ld.so.cache")
    by_name = {e.name: e.path for e in entries}
    assert by_name["libcuda.so.1"] == f"{LIB}/libcuda.so.1"
    for _stem, soname in driverroot.DRIVER_LIBRARIES:
        assert by_name[soname] == f"{LIB}/{soname}"
    assert by_name["libz-fake.so.1"] == f"{LIB}/libz-fake.so.1"
    assert len(entries) == len(driverroot.DRIVER_LIBRARIES) + 1


@pytest.mark.parametrize("fmt", ["new", "compat", "old"])
def test_every_format_ldconfig_writes_reads_as_ldconfig_p_lists_it(caches: dict[str, Path], fmt: str) -> None:
    data = caches[fmt].read_bytes()
    assert data.startswith(b"glibc-ld.so.cache1.1" if fmt == "new" else b"ld.so-1.7.0")
    entries = ldcache.parse(data)
    assert entries == _ldconfig_p(caches[fmt])
    assert CachedLibrary("libcuda.so.1", f"{LIB}/libcuda.so.1") in entries


def test_host_cache_parses_like_ldconfig_p() -> None:
    if not HOST_CACHE.exists():
        pytest.skip("this host has no /etc/ld.so.cache")
    entries = ldcache.read(HOST_CACHE)
    assert "libc.so.6" in {e.name for e in entries}
    assert all(e.path.startswith("/") for e in entries)
    assert entries == _ldconfig_p(HOST_CACHE)


def test_read_lets_oserror_through(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ldcache.read(tmp_path / "missing")


# ---- damaged caches -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["new", "compat", "old"])
def test_every_truncation_of_a_real_cache_is_an_ldcache_error(caches: dict[str, Path], fmt: str) -> None:
    data = caches[fmt].read_bytes()
    for cut in range(len(data)):
        with pytest.raises(LdCacheError):
            ldcache.parse(data[:cut], f"cut-{cut}")


def test_host_cache_cut_short_is_an_ldcache_error() -> None:
    if not HOST_CACHE.exists():
        pytest.skip("this host has no /etc/ld.so.cache")
    data = HOST_CACHE.read_bytes()
    for cut in (0, 5, 19, 20, 47, 48, 49, 100, len(data) // 3, len(data) // 2, len(data) - 9, len(data) - 1):
        with pytest.raises(LdCacheError, match=r"cut: "):
            ldcache.parse(data[:cut], "cut")


def test_truncated_message_names_source_and_sizes() -> None:
    data = new_cache(PAIRS)
    with pytest.raises(LdCacheError, match=r"^some/ld.so.cache: truncated: .*file has 100"):
        ldcache.parse(data[:100], "some/ld.so.cache")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated"),
        (b"glibc-ld.so", "truncated"),
        (b"ld.so-1.7", "truncated"),
        (b"\x7fELF" + b"\0" * 60, "not an ld.so.cache"),
        (b"GLIBC-LD.SO.CACHE1.1" + b"\0" * 60, "not an ld.so.cache"),
        (b"glibc-ld.so.cache2.0" + b"\0" * 60, "unsupported ld.so.cache version"),
    ],
)
def test_wrong_magic_is_an_ldcache_error(data: bytes, message: str) -> None:
    with pytest.raises(LdCacheError, match=message):
        ldcache.parse(data, "x")


def test_entry_offset_past_the_end_is_an_ldcache_error(caches: dict[str, Path]) -> None:
    data = caches["new"].read_bytes()
    key_at = NEW_HEADER.size + 4  # the first entry's key
    for bad in (len(data), len(data) + 100, 0xFFFFFFFF, 0):  # 0: the header, not the string table
        broken = data[:key_at] + struct.pack("<I", bad) + data[key_at + 4 :]
        with pytest.raises(LdCacheError, match="outside the string table"):
            ldcache.parse(broken)


def test_old_entry_offset_past_the_end_is_an_ldcache_error() -> None:
    data = old_cache(PAIRS)
    value_at = OLD_HEADER.size + 8  # the first entry's value
    broken = data[:value_at] + struct.pack("<I", len(data)) + data[value_at + 4 :]
    with pytest.raises(LdCacheError, match="outside the string table"):
        ldcache.parse(broken)


def test_entry_count_past_the_end_is_an_ldcache_error(caches: dict[str, Path]) -> None:
    data = caches["new"].read_bytes()
    broken = data[:20] + struct.pack("<I", 0xFFFFFFFF) + data[24:]
    with pytest.raises(LdCacheError, match="truncated: 4294967295 entries"):
        ldcache.parse(broken)


def test_string_without_nul_is_an_ldcache_error() -> None:
    strings, _ = _strings(PAIRS)
    with pytest.raises(LdCacheError, match="no terminating NUL"):
        ldcache.parse(new_cache(PAIRS, table=strings[:-1] + b"x"))
    # A NUL after the string table does not count.
    with pytest.raises(LdCacheError, match="no terminating NUL"):
        ldcache.parse(new_cache(PAIRS, table=strings[:-1]) + b"\0")


def test_string_without_nul_in_old_format_is_an_ldcache_error() -> None:
    with pytest.raises(LdCacheError, match="no terminating NUL"):
        ldcache.parse(old_cache(PAIRS)[:-1] + b"x")


@pytest.mark.parametrize(("flags", "message"), [(3, "big-endian"), (1, "invalid")])
def test_foreign_or_invalid_endianness_is_an_ldcache_error(flags: int, message: str) -> None:
    with pytest.raises(LdCacheError, match=message):
        ldcache.parse(new_cache(PAIRS, flags=flags))


def test_unknown_endianness_from_old_ldconfig_is_read() -> None:
    assert ldcache.parse(new_cache(PAIRS, flags=0)) == [CachedLibrary(*p) for p in PAIRS]


def test_bad_extension_directory_is_an_ldcache_error() -> None:
    good = with_extension(new_cache(PAIRS), struct.pack("<II", 0xEAA42174, 0))
    assert ldcache.parse(good) == [CachedLibrary(*p) for p in PAIRS]
    with pytest.raises(LdCacheError, match="bad extension directory magic"):
        ldcache.parse(with_extension(new_cache(PAIRS), struct.pack("<II", 0x12345678, 0)))
    with pytest.raises(LdCacheError, match="extension section 0 ends at byte"):
        ldcache.parse(with_extension(new_cache(PAIRS), struct.pack("<IIIIII", 0xEAA42174, 1, 0, 0, 8, 1 << 20)))


# ---- hand-built layouts ---------------------------------------------------------------


def test_hand_built_new_format() -> None:
    assert ldcache.parse(new_cache(PAIRS)) == [CachedLibrary(*p) for p in PAIRS]


def test_hand_built_old_format() -> None:
    assert ldcache.parse(old_cache(PAIRS)) == [CachedLibrary(*p) for p in PAIRS]


@pytest.mark.parametrize("old_count", [1, 2, 3])
def test_compat_layout_reads_the_new_table(old_count: int) -> None:
    # Odd counts put the old table's end off 8-byte alignment: the new header
    # then starts after 4 pad bytes.  (ldconfig avoids this by duplicating the
    # last old entry; the reader must align anyway, as ld.so does.)
    old = [(f"libold{i}.so.1", f"/old/libold{i}.so.1") for i in range(old_count)]
    data = old_cache(old, hidden=new_cache(PAIRS))
    assert (OLD_HEADER.size + OLD_ENTRY.size * old_count) % 8 == (4 if old_count % 2 else 0)
    assert ldcache.parse(data) == [CachedLibrary(*p) for p in PAIRS]
    # Without the hidden new table, the same old entries are what is read.
    assert ldcache.parse(old_cache(old)) == [CachedLibrary(*p) for p in old]


def test_compat_layout_with_truncated_new_header_is_an_ldcache_error() -> None:
    data = old_cache(PAIRS, hidden=new_cache(PAIRS))
    new_at = OLD_HEADER.size + OLD_ENTRY.size * len(PAIRS)
    with pytest.raises(LdCacheError, match="new-format header at byte 40 needs 48 bytes"):
        ldcache.parse(data[: new_at + 30])


# ---- the fake driver root -------------------------------------------------------------


def test_fake_root_libraries_are_elf_with_soname_links(drv: FakeDriverRoot) -> None:
    lib_dir = drv.root / driverroot.LIB_DIR
    for stem, soname in driverroot.DRIVER_LIBRARIES:
        real = drv.library(stem)
        assert real == lib_dir / f"{stem}.so.{drv.version}"
        data = real.read_bytes()
        assert data.startswith(b"\x7fELF")
        assert f"nvplug fake {stem} {drv.version}".encode() in data
        assert soname.encode() in data  # the DT_SONAME string
        link = lib_dir / soname
        assert link.is_symlink()
        assert str(link.readlink()) == real.name
    zlib, zsoname = driverroot.UNRELATED_LIBRARY
    assert str((lib_dir / zsoname).readlink()) == zlib
    assert drv.version not in zlib
    assert (drv.root / "etc" / "ld.so.conf").read_text() == f"{LIB}\n"


def test_fake_root_binaries_firmware_and_socket(drv: FakeDriverRoot) -> None:
    for name in driverroot.BINARIES:
        path = drv.root / "usr" / "bin" / name
        assert os.access(path, os.X_OK)
        assert subprocess.run([str(path)], check=True, capture_output=True, text=True).stdout == f"{name}\n"
    for name in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        firmware = drv.root / "lib" / "firmware" / "nvidia" / drv.version / name
        assert firmware.stat().st_size > 0
    assert stat.S_ISSOCK((drv.root / "run" / "nvidia-persistenced" / "socket").stat().st_mode)


def test_fake_root_without_socket_and_other_version(tmp_path: Path) -> None:
    drv = driverroot.build(tmp_path / "drv", "535.104.05", persistenced_socket=False)
    assert not (drv.root / "run").exists()
    assert str((drv.root / driverroot.LIB_DIR / "libcuda.so.1").readlink()) == "libcuda.so.535.104.05"
    assert (drv.root / "lib" / "firmware" / "nvidia" / "535.104.05" / "gsp_ga10x.bin").is_file()


def test_fake_root_socket_beyond_sun_path_length(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100) / "drv"
    assert len(str(deep / driverroot.PERSISTENCED_SOCKET)) > 108
    drv = driverroot.build(deep)
    assert stat.S_ISSOCK((drv.root / driverroot.PERSISTENCED_SOCKET).stat().st_mode)
    # Rebuilding over an existing root replaces the socket instead of failing on it.
    driverroot.build(deep)
    assert stat.S_ISSOCK((drv.root / driverroot.PERSISTENCED_SOCKET).stat().st_mode)


def test_fake_root_rejects_unknown_stem_and_bad_version(drv: FakeDriverRoot, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="libz-fake"):
        drv.library("libz-fake")
    with pytest.raises(ValueError, match="version"):
        driverroot.build(tmp_path / "x", "../550")


def test_compiler_failure_is_a_build_error_with_its_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cc = bin_dir / "cc"
    cc.write_text("#!/bin/sh\necho 'fake cc: no such luck' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(driverroot.DriverRootBuildError, match="no such luck"):
        driverroot.build(tmp_path / "drv")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    with pytest.raises(driverroot.DriverRootBuildError, match="cannot run the C compiler"):
        driverroot.build(tmp_path / "drv")
