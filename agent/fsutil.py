"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory."""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

SocketIdentity = tuple[int, int]
"""(st_dev, st_ino) of a bound unix socket file."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o640) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def socket_identity(path: Path) -> SocketIdentity | None:
    """The identity of the unix socket at ``path``; None when there is no socket there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def move_aside(path: Path, now: float, reason: str = "corrupt") -> Path:
    """Rename ``path`` to ``<name>.<reason>-<UTC timestamp>[.N]`` beside it, never replacing an
    existing file (a file that could not be read is kept for a person to look at). Returns the
    new path; raises OSError when it cannot be moved."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    base = f"{path.name}.{reason}-{stamp}"
    for n in range(1000):
        target = path.with_name(base if n == 0 else f"{base}.{n}")
        try:
            os.link(path, target)  # fails, unlike rename, when the target exists
        except FileExistsError:
            continue
        path.unlink()
        fsync_dir(path.parent)
        return target
    raise OSError(f"{path}: too many earlier copies set aside")
