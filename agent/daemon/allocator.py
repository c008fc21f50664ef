"""glibc's malloc arenas for the daemon (``--malloc-arenas``).

glibc gives a thread that finds the arenas in use by others an arena of its own, up to eight per
CPU core (``mallopt(3)``, ``M_ARENA_MAX``), and an arena keeps the memory its busiest moment
needed: freed chunks stay in it for that arena's next requests, however few. The daemon runs
about 80 threads (the gRPC servers' and the prepare pools' workers, the HTTP workers, the loops),
each call's work landing on whichever worker is free, so over a long run each arena's
high-water mark creeps up: this was the RSS growth under prepare/unprepare churn
(docs/performance.md, "Memory, descriptors and threads under churn"). Few arenas share their free
chunks between all threads; the daemon's threads mostly wait (on sockets, the kubelet, fsync),
and CPython's small objects do not use malloc's arenas at all (pymalloc), so the locking this
costs is not seen.

Applied with ``mallopt`` through ctypes first thing in ``tessera run``, before any thread
starts (an arena made before keeps serving its thread). Only glibc has these arenas: elsewhere
(musl) nothing is done, and the caller logs why. The variable ``MALLOC_ARENA_MAX`` sets the same
before the process starts; the setting, when not 0, takes precedence over it."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

M_ARENA_MAX = -8
"""``mallopt``'s parameter number for the arena limit (glibc's ``malloc.h``)."""


@dataclass(frozen=True)
class ArenaLimit:
    """What became of ``--malloc-arenas``: ``applied`` (the limit now in force, None when not
    changed) and, when nothing was done, why."""

    applied: int | None
    why_not: str | None = None


def glibc_version() -> str | None:
    """``glibc 2.36`` and the like, or None when the C library is not glibc."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):  # the name is unknown outside glibc
        return None
    return version if version and version.startswith("glibc") else None


def limit_arenas(arenas: int) -> ArenaLimit:
    """Allow at most ``arenas`` malloc arenas from now on (0: leave glibc's own limit, which
    ``MALLOC_ARENA_MAX`` may have set). Call before threads start."""
    if arenas == 0:
        return ArenaLimit(None, "--malloc-arenas 0 leaves glibc's own limit")
    if glibc_version() is None:
        return ArenaLimit(None, "the C library is not glibc (no malloc arenas to limit)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(arenas)) != 1:
        return ArenaLimit(None, f"glibc refused mallopt(M_ARENA_MAX, {arenas})")
    return ArenaLimit(arenas)
