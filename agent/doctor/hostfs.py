"""Looking at the host's files from wherever ``tessera doctor`` runs, and probing directories.

In the agent's pod the host's ``/`` is mounted somewhere (``--host-root``); a host path such as
``/var/run/cdi`` is then ``<host-root>/var/run/cdi`` here, and its symbolic links name host paths
(``/var/run`` -> ``/run``), so they are followed inside the host root (:func:`resolve`), as the
host would, and never into the pod's own tree.

A directory is writable when a file can be created in it (:func:`probe_write`): a read-only mount
refuses even root, which ``access(2)`` alone would not show for every file system.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path, PurePosixPath

MAX_LINKS = 40
"""Symbolic links followed while resolving one path, as the kernel's limit (ELOOP)."""
PROBE_PREFIX = ".tessera-doctor."
PROBE_SUFFIX = ".tmp"
"""A probe file is ``.tessera-doctor.<random>.tmp``, removed at once; one a killed doctor left in
the state directory is swept by the agent at start (``agent.fsutil.remove_temp_files``)."""


def on_host(host_root: Path, path: PurePosixPath | str) -> Path:
    """Where the host's absolute ``path`` is seen here (no links followed)."""
    return host_root / str(path).lstrip("/")


def resolve(host_root: Path, path: PurePosixPath | str) -> PurePosixPath:
    """The host path ``path`` names once the host's symbolic links are followed (inside the host
    root; absolute link targets are host paths). Components that do not exist are kept as they
    are; a loop stops after :data:`MAX_LINKS` links and keeps what was reached. Pure apart from
    reading links."""
    parts = list(PurePosixPath("/", str(path)).parts[1:])
    done = PurePosixPath("/")
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            done = done.parent
            continue
        candidate = done / part
        try:
            target = os.readlink(on_host(host_root, candidate))
        except OSError:  # not a link, or missing: keep the name
            done = candidate
            continue
        hops += 1
        if hops > MAX_LINKS:
            return PurePosixPath(candidate, *parts)
        link = PurePosixPath(target)
        if link.is_absolute():
            done = PurePosixPath("/")
            parts = [*link.parts[1:], *parts]
        else:
            parts = [*link.parts, *parts]
    return done


def probe_write(directory: Path) -> str | None:
    """Create and remove a file in ``directory``; None when that worked, else why not."""
    try:
        fd, name = tempfile.mkstemp(prefix=PROBE_PREFIX, suffix=PROBE_SUFFIX, dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    try:
        os.unlink(name)
    except OSError as exc:
        return f"created a file but cannot remove it: {exc.strerror or exc}"
    return None


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (``/`` at worst)."""
    p = path
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def node_problem(path: Path, *, major: int | None, minor: int | None, stand_in: bool) -> str | None:
    """What is wrong with the device node ``path`` (None: nothing): missing, not a character
    device, or another device number than ``major:minor`` (None: any). ``stand_in``: a regular
    file stands in for the device (the simulator's ``/dev``)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return exc.strerror or str(exc)
    if stand_in and stat.S_ISREG(st.st_mode):
        return None
    if not stat.S_ISCHR(st.st_mode):
        return f"not a character device ({_kind(st.st_mode)})"
    got = (os.major(st.st_rdev), os.minor(st.st_rdev))
    want = (got[0] if major is None else major, got[1] if minor is None else minor)
    if got != want:
        return f"is device {got[0]}:{got[1]}, expected {want[0]}:{want[1]}"
    return None


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "another kind of file"


def is_executable(path: Path) -> bool:
    """A regular file (after links) with an execute bit."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)


def lock_holder(lock_file: Path, proc_locks: Path = Path("/proc/locks")) -> int | None:
    """The PID (in this PID namespace) holding a ``flock`` on ``lock_file``, from
    ``/proc/locks`` (``N: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF``, device
    numbers in hex); None when none is listed or it cannot be told."""
    try:
        st = os.stat(lock_file)
        text = proc_locks.read_text()
    except OSError:
        return None
    return holder_in(text, os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)


def holder_in(proc_locks: str, major: int, minor: int, inode: int) -> int | None:
    """The PID of the first FLOCK on device ``major:minor`` inode ``inode`` in the text of
    ``/proc/locks`` (pure; ``->`` lines are waiters, skipped)."""
    for line in proc_locks.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        pid, where = fields[4], fields[5].split(":")
        if len(where) != 3 or not pid.isdigit():
            continue
        try:
            found = (int(where[0], 16), int(where[1], 16), int(where[2]))
        except ValueError:
            continue
        if found == (major, minor, inode) and int(pid) > 0:
            return int(pid)
    return None


def command_line(pid: int, proc_root: Path = Path("/proc")) -> list[str] | None:
    """The argv of process ``pid``; None when it cannot be read (gone, or not visible here)."""
    try:
        raw = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a] or None
