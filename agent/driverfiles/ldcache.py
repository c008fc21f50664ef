"""The dynamic loader's cache (``/etc/ld.so.cache``): which file a SONAME resolves to.

No maintained Python library reads this file, so this module does, for the two layouts glibc's
``ldconfig`` writes (``ldconfig -c``): ``new`` (magic ``glibc-ld.so.cache``, version ``1.1``;
glibc's default since 2.32) and ``compat`` (an old ``ld.so-1.7.0`` table followed by the new one,
the default before 2.32). Only the new table is read; a cache with only the old table (``-c
old``, libc5-era) is rejected. The layout (glibc ``sysdeps/generic/dl-cache.h``, and NVIDIA
Container Toolkit's own reader, ``internal/ldcache/ldcache.go``)::

    old header   "ld.so-1.7.0\\0", uint32 nlibs, nlibs x {int32 flags, uint32 key, value}
                 then padding to 8 bytes                                 (compat only)
    new header   "glibc-ld.so.cache" "1.1", uint32 nlibs, uint32 len_strings,
                 uint8 flags, 3 bytes, uint32 extension_offset, 3 x uint32   (48 bytes)
    entries      nlibs x {int32 flags, uint32 key, uint32 value, uint32 osversion,
                 uint64 hwcap}                                           (24 bytes each)
    strings      NUL-terminated; key (the SONAME) and value (the path) are offsets from the
                 start of the new header

Everything is little-endian (the machines Tessera runs on). ``flags``' low byte is the type
(``0x03``: ELF for glibc), its high byte the architecture (``0x0300`` x86-64, ``0x0a00``
AArch64). :func:`parse` is pure; :func:`build` writes the new layout (the simulator's driver
roots and the tests use it).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from agent.errors import DecodeError

OLD_MAGIC = b"ld.so-1.7.0\x00"
NEW_MAGIC = b"glibc-ld.so.cache1.1"
_OLD_HEADER = struct.Struct("<12sI")
_OLD_ENTRY = struct.Struct("<iII")
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")
_NEW_ENTRY = struct.Struct("<iIIIQ")
MAX_CACHE_BYTES = 64 * 1024 * 1024
"""A real cache is tens to hundreds of KiB."""

FLAG_TYPE_MASK = 0x00FF
FLAG_ELF = 0x0001
FLAG_ELF_LIBC6 = 0x0003
FLAG_ARCH_MASK = 0xFF00
FLAG_X8664_LIB64 = 0x0300
FLAG_AARCH64_LIB64 = 0x0A00
ARCH_64 = {FLAG_X8664_LIB64: "x86_64", FLAG_AARCH64_LIB64: "aarch64"}
"""The 64-bit architectures Tessera runs on, by their cache flag."""


@dataclass(frozen=True)
class CacheEntry:
    """One library the loader knows: ``soname`` resolves to ``path`` (a path on the machine whose
    cache it is, usually the SONAME link itself)."""

    soname: str
    path: str
    flags: int = FLAG_ELF_LIBC6 | FLAG_X8664_LIB64

    @property
    def arch(self) -> str | None:
        """``x86_64`` or ``aarch64`` for a 64-bit glibc ELF library of those; None otherwise
        (32-bit, x32, other architectures)."""
        if not self.flags & FLAG_TYPE_MASK & FLAG_ELF:
            return None
        return ARCH_64.get(self.flags & FLAG_ARCH_MASK)


def _string(data: bytes, base: int, offset: int, what: str) -> str:
    start = base + offset
    end = data.find(b"\x00", start)
    if offset < 0 or start >= len(data) or end < 0:
        raise DecodeError(f"{what}: string offset {offset} is outside the cache")
    return data[start:end].decode("utf-8", "surrogateescape")


def parse(data: bytes, what: str = "ld.so.cache") -> list[CacheEntry]:
    """The entries of a cache file's bytes, in the file's order (the loader's order: the first
    entry for a SONAME and architecture wins). Raises DecodeError naming ``what`` for a file that
    is not a cache of the new or compat layout, or whose tables run past its end."""
    if len(data) > MAX_CACHE_BYTES:
        raise DecodeError(f"{what}: {len(data)} bytes, more than any ld.so.cache")
    base = 0
    if data.startswith(OLD_MAGIC):
        if len(data) < _OLD_HEADER.size:
            raise DecodeError(f"{what}: truncated old-format header")
        _, old_n = _OLD_HEADER.unpack_from(data)
        base = _OLD_HEADER.size + old_n * _OLD_ENTRY.size
        base += -base % 8  # the new table is aligned like its 8-byte fields
        if not data.startswith(NEW_MAGIC, base):
            raise DecodeError(
                f"{what}: only the old ld.so-1.7.0 table (ldconfig -c old); expected the"
                " glibc-ld.so.cache1.1 table (ldconfig -c new or compat)"
            )
    elif not data.startswith(NEW_MAGIC):
        raise DecodeError(f"{what}: not an ld.so.cache (no glibc-ld.so.cache1.1 magic)")
    if len(data) < base + _NEW_HEADER.size:
        raise DecodeError(f"{what}: truncated header")
    _, n, _strings_len, _flags, _ext = _NEW_HEADER.unpack_from(data, base)
    first = base + _NEW_HEADER.size
    if first + n * _NEW_ENTRY.size > len(data):
        raise DecodeError(f"{what}: {n} entries do not fit in {len(data)} bytes")
    entries: list[CacheEntry] = []
    for i in range(n):
        flags, key, value, _os, _hwcap = _NEW_ENTRY.unpack_from(data, first + i * _NEW_ENTRY.size)
        entries.append(
            CacheEntry(
                soname=_string(data, base, key, what),
                path=_string(data, base, value, what),
                flags=flags,
            )
        )
    return entries


def build(entries: Iterable[CacheEntry]) -> bytes:
    """A cache file (new layout) holding ``entries`` in the order given (``ldconfig`` sorts
    them; the loader takes the first match). Pure."""
    items = list(entries)
    strings = bytearray()
    offsets: dict[str, int] = {}
    table_end = _NEW_HEADER.size + len(items) * _NEW_ENTRY.size

    def offset(s: str) -> int:
        if s not in offsets:
            offsets[s] = table_end + len(strings)
            strings.extend(s.encode("utf-8", "surrogateescape") + b"\x00")
        return offsets[s]

    table = b"".join(
        _NEW_ENTRY.pack(e.flags, offset(e.soname), offset(e.path), 0, 0) for e in items
    )
    header = _NEW_HEADER.pack(NEW_MAGIC, len(items), len(strings), 0, 0)
    return header + table + bytes(strings)
