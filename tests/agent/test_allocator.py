"""``--malloc-arenas``: glibc's arena limit, applied in a fresh interpreter (the limit holds for
the process, so each case runs in its own), read back from glibc's own ``malloc_info``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent.daemon.allocator import glibc_version, limit_arenas

PROGRAM = """
import ctypes, json, sys, threading
from agent.daemon.allocator import limit_arenas

limit = limit_arenas(int(sys.argv[1]))
libc = ctypes.CDLL(None)
libc.open_memstream.restype = ctypes.c_void_p
THREADS = 8
ready, done = threading.Barrier(THREADS + 1), threading.Event()
held = []

def work():
    # malloc'd blocks (not pymalloc's: above 512 bytes, below the mmap threshold), held while
    # every thread holds its own: each thread that finds the arenas busy may get one of its own
    held.append([bytearray(20_000) for _ in range(50)])
    ready.wait()
    done.wait()

threads = [threading.Thread(target=work) for _ in range(THREADS)]
for t in threads:
    t.start()
ready.wait()
buf, size = ctypes.c_char_p(), ctypes.c_size_t()
stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
libc.malloc_info(0, ctypes.c_void_p(stream))
libc.fclose(ctypes.c_void_p(stream))
done.set()
for t in threads:
    t.join()
print(json.dumps({"applied": limit.applied, "why_not": limit.why_not,
                  "heaps": buf.value.decode().count("<heap nr=")}))
"""

needs_glibc = pytest.mark.skipif(glibc_version() is None, reason="malloc arenas are glibc's")


def arenas_after(limit: int) -> dict[str, object]:
    """Run the threads under ``limit``; what ``limit_arenas`` said and the arenas glibc has."""
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(limit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    result: dict[str, object] = json.loads(out)
    return result


@needs_glibc
@pytest.mark.parametrize("limit", [1, 2])
def test_threads_share_at_most_the_arenas_allowed(limit: int) -> None:
    result = arenas_after(limit)
    assert result["applied"] == limit and result["why_not"] is None
    assert 1 <= result["heaps"] <= limit  # type: ignore[operator]


@needs_glibc
def test_zero_leaves_glibc_its_own_limit_and_threads_get_arenas_of_their_own() -> None:
    result = arenas_after(0)
    assert result["applied"] is None
    assert result["why_not"] == "--malloc-arenas 0 leaves glibc's own limit"
    assert result["heaps"] > 2  # type: ignore[operator]  # the case the setting is for


def test_nothing_is_done_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_glibc(name: str) -> str:
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr("agent.daemon.allocator.os.confstr", not_glibc)
    limit = limit_arenas(2)
    assert limit.applied is None
    assert limit.why_not == "the C library is not glibc (no malloc arenas to limit)"
