"""The ld.so.cache reader against glibc's own ldconfig: both layouts it writes, and bad files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from agent.driverfiles.ldcache import (
    FLAG_AARCH64_LIB64,
    FLAG_ELF_LIBC6,
    NEW_MAGIC,
    OLD_MAGIC,
    CacheEntry,
    build,
    parse,
)
from agent.errors import DecodeError

LDCONFIG = shutil.which("ldconfig") or shutil.which("ldconfig", path="/sbin:/usr/sbin")


def ldconfig_p(cache: Path) -> list[tuple[str, str]]:
    """``ldconfig -p -C cache``: (SONAME, path) per entry, in the file's order."""
    assert LDCONFIG is not None
    out = subprocess.run(
        [LDCONFIG, "-p", "-C", str(cache)], capture_output=True, text=True, check=True
    ).stdout
    return [
        (line.split(" (", 1)[0].strip(), line.split(" => ", 1)[1])
        for line in out.splitlines()[1:]
        if " => " in line
    ]


@pytest.mark.skipif(LDCONFIG is None, reason="no ldconfig on this machine")
@pytest.mark.parametrize("fmt", ["new", "compat"])
def test_reads_what_ldconfig_writes(tmp_path: Path, fmt: str) -> None:
    """ldconfig writes a cache of this machine's libraries (-X: no links touched) in each
    layout; ours reads the same entries as ldconfig's own -p."""
    assert LDCONFIG is not None
    cache = tmp_path / "ld.so.cache"
    conf = tmp_path / "ld.so.conf"
    conf.write_text("include /etc/ld.so.conf.d/*.conf\n")
    subprocess.run([LDCONFIG, "-X", "-c", fmt, "-C", str(cache), "-f", str(conf)], check=True)
    data = cache.read_bytes()
    assert data.startswith(NEW_MAGIC if fmt == "new" else OLD_MAGIC)
    entries = parse(data)
    assert entries and [(e.soname, e.path) for e in entries] == ldconfig_p(cache)
    assert any(e.soname == "libc.so.6" and e.arch is not None for e in entries)


@pytest.mark.skipif(LDCONFIG is None, reason="no ldconfig on this machine")
def test_ldconfig_reads_what_we_build(tmp_path: Path) -> None:
    entries = [
        CacheEntry("libcuda.so.1", "/lib/x86_64-linux-gnu/libcuda.so.1"),
        CacheEntry("libcuda.so.1", "/usr/lib/libcuda.so.1", flags=FLAG_ELF_LIBC6),  # i386
        CacheEntry("libnvidia-ml.so.1", "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
                   flags=FLAG_ELF_LIBC6 | FLAG_AARCH64_LIB64),
    ]  # fmt: skip
    cache = tmp_path / "ld.so.cache"
    cache.write_bytes(build(entries))
    assert ldconfig_p(cache) == [(e.soname, e.path) for e in entries]
    assert parse(cache.read_bytes()) == entries
    assert [e.arch for e in entries] == ["x86_64", None, "aarch64"]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        pytest.param(b"", "no glibc-ld.so.cache1.1 magic", id="empty"),
        pytest.param(b"\x7fELF" + bytes(60), "not an ld.so.cache", id="elf"),
        pytest.param(OLD_MAGIC + (0).to_bytes(4, "little") + bytes(8), "only the old", id="old"),
        pytest.param(NEW_MAGIC + bytes(10), "truncated header", id="short-header"),
        pytest.param(build([CacheEntry("a", "/a")])[:60], "do not fit", id="entries-past-the-end"),
        pytest.param(
            build([CacheEntry("a", "/a")]).replace(b"/a\x00", b"/a!"), "outside", id="no-nul"
        ),
    ],
)
def test_rejects(data: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        parse(data, "etc/ld.so.cache")
