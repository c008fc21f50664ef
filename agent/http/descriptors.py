"""The process's file descriptors: how many are left below the soft limit (the endpoint keeps a
reserve), and raising that limit to the hard one at start."""

from __future__ import annotations

import os
import resource


def descriptors_left() -> int | None:
    """Descriptors this process may still open below its soft ``RLIMIT_NOFILE``; None when
    unlimited or unknown (no ``/proc``)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself had open
    except FileNotFoundError:
        return None
    except OSError:  # EMFILE: not even one left for listdir
        return 0
    return soft - used


def raise_descriptor_limit() -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (the agent uses epoll, never
    ``select``, so a high limit costs nothing); ``(old, new)`` when it changed, else None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return None
    return soft, hard
