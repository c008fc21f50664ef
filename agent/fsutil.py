"""Crash-safe file writes: temp file in the same directory, fsync, rename, fsync the directory;
whether a directory's file system can take a write at all (``disk_trouble``); and reading a file
from a directory others can write without following links or reading without bound
(``read_regular_file``)."""

from __future__ import annotations

import errno
import os
import socket
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


def ensure_dir(path: Path, mode: int = 0o750) -> None:
    """Create ``path`` and its missing parents with exactly ``mode`` (set explicitly, so a
    umask of 000 cannot make them world-writable); existing directories are left as they are."""
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:
            continue
        os.chmod(d, mode)


def temp_name_prefix(path: Path) -> str:
    """How ``atomic_write`` names the temporary file of ``path``: ``.<name>.<random>.tmp``."""
    return f".{path.name}."


def _create_temp(path: Path) -> tuple[int, str]:
    """A new temporary file beside ``path`` (``.<name>.<random>.tmp``, mode 0600, opened for
    writing), made as ``tempfile.mkstemp`` makes one (``O_CREAT | O_EXCL``, another name when
    one exists) but with its random part from ``os.urandom``: mkstemp draws each of its eight
    characters in Python, a third of a CDI spec's write on the prepare path (``python -m bench
    prepare``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    prefix = os.path.join(path.parent, temp_name_prefix(path))
    for _ in range(tempfile.TMP_MAX):
        name = f"{prefix}{os.urandom(6).hex()}.tmp"
        try:
            return os.open(name, flags, 0o600), name
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", prefix)


def remove_temp_files(directory: Path, name_glob: str = "*") -> list[Path]:
    """Remove the temporary files ``atomic_write`` left in ``directory`` when a process died
    mid-write (``.<name>.<random>.tmp`` for names matching ``name_glob``); returns them."""
    removed: list[Path] = []
    try:
        candidates = list(directory.glob(f".{name_glob}.*.tmp"))
    except OSError:
        return removed
    for p in candidates:
        try:
            if p.is_file() and not p.is_symlink():
                p.unlink()
                removed.append(p)
        except OSError:
            continue
    return removed


def atomic_write(
    path: Path,
    data: bytes,
    mode: int = 0o640,
    dir_mode: int = 0o750,
    *,
    sync: bool = True,
    sync_dir: bool = True,
) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file
    (plus, at worst, a temporary file that ``remove_temp_files`` sweeps); a missing directory is
    created with ``dir_mode``.

    ``sync=False`` skips the two fsyncs (the file's and the directory's): the replacement is
    still atomic for every reader and survives the process being killed (the page cache is the
    kernel's), but a power loss may bring back an earlier file. For a file rewritten every
    second whose caller syncs it every so often.

    ``sync_dir=False`` (with ``sync``) fsyncs the file but not the directory: the new name is
    durable only once the caller fsyncs the directory (``fsync_dir``), once for several files
    written there (a batch of CDI specs)."""
    try:
        fd, tmp = _create_temp(path)
    except FileNotFoundError:  # the directory is missing: made then, not stat-ed before each write
        ensure_dir(path.parent, dir_mode)
        fd, tmp = _create_temp(path)
    try:
        try:
            _write_all(fd, data)
            if sync:
                os.fsync(fd)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync and sync_dir:
        fsync_dir(path.parent)


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may write less). Straight to the
    descriptor: ``os.fdopen``'s buffered file costs two more system calls (an fstat and an
    isatty ioctl) and an object, a fifth of a CDI spec's write on the prepare path (``python -m
    bench prepare``, py-spy)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


DISK_HEADROOM_BYTES = 64 * 1024
"""The room ``disk_trouble`` asks for beyond the caller's own need: a CDI spec or a small state
file, with their temporary copies."""


def disk_trouble(directory: Path, need: int = 0) -> str | None:
    """Why a file of ``need`` bytes (plus ``DISK_HEADROOM_BYTES``) cannot be written atomically
    in ``directory`` now, or None when it can: the file system is read-only, or has too little
    space or no inode left (what a write would fail with, ``EROFS`` or ``ENOSPC``). A directory
    that does not exist is judged by the nearest one above it (where it would be created).
    Space counts what this process may use: root may use the blocks a file system reserves."""
    path = directory
    while True:
        try:
            st = os.statvfs(path)
            break
        except FileNotFoundError:
            if path == path.parent:
                return f"cannot check {directory}: no such directory"
            path = path.parent
        except OSError as exc:
            return f"cannot check {directory}: {exc.strerror or exc}"
    if st.f_flag & os.ST_RDONLY:
        return f"{directory}: {os.strerror(errno.EROFS)}"
    free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    wanted = need + DISK_HEADROOM_BYTES
    if free < wanted:
        return (
            f"{directory}: {os.strerror(errno.ENOSPC)} ({free} bytes free, a write needs {wanted})"
        )
    if st.f_files and not (st.f_ffree if os.geteuid() == 0 else st.f_favail):
        return f"{directory}: {os.strerror(errno.ENOSPC)} (no free inode)"
    return None


class FileRefused(OSError):
    """A file that ``read_regular_file`` will not read: a symbolic link, not a regular file, or
    larger than allowed. The message says which, with the size where it is too big."""


def holds(path: Path, data: bytes) -> bool:
    """Whether the regular file ``path`` holds exactly ``data`` (read no further than that, never
    through a link): a caller that would write ``data`` there need not, and a start on a full
    disk then writes nothing it already has. False when it cannot be read."""
    try:
        return read_regular_file(path, len(data)) == data
    except OSError:
        return False


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


def accepts_connections(path: Path, timeout: float = 1.0) -> bool:
    """Whether a process accepts connections on the unix socket ``path`` right now (a stale
    socket file that a crash left answers no)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a plain file")


def read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The whole content of ``path``, a regular file of at most ``max_bytes``, for a file in a
    directory others can write (the CDI root, a claim's MPS pipe directory, a claim-file
    directory).

    Opened without following a symbolic link (``O_NOFOLLOW``: a link to ``/dev/zero`` would be
    read without end, one to any other file would read what it names) and without blocking
    (``O_NONBLOCK``: opening a FIFO with no writer blocks, and would stall the caller, at start
    the whole agent); then checked on the open descriptor (``fstat``, so the file cannot be
    swapped between the check and the read) to be a regular file no larger than ``max_bytes``,
    and read at most ``max_bytes + 1`` bytes (a file still growing is refused too).

    Raises FileRefused (an OSError), ``strerror`` saying what was wrong and ``filename`` the
    path: ``ELOOP`` for a symbolic link, ``EINVAL`` for anything but a regular file, ``EFBIG``
    for a file that is too large; FileNotFoundError and the like as ``open`` does."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise FileRefused(errno.ELOOP, "a symbolic link, not followed", str(path)) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _kind(st.st_mode)
            raise FileRefused(errno.EINVAL, f"not a regular file ({kind})", str(path))
        if st.st_size > max_bytes:
            raise FileRefused(
                errno.EFBIG, f"{st.st_size} bytes, more than the {max_bytes} allowed", str(path)
            )
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FileRefused(errno.EFBIG, f"grew past the {max_bytes} bytes allowed", str(path))
    return data
