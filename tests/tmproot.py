"""Where the tests write their temporary files: a RAM-backed directory when the machine has one.

The suite writes many small files and directories (each simulated node's sysfs tree and driver
root, state directories, sockets, CDI specs). On the ext4 disks of the 2-core CI machines a
``mkdir`` costs about 0.33 ms and a small file 0.5 ms, against 0.007 ms and 0.05 ms on tmpfs
(measured with 1,000 of each, docs/performance.md "Test suite"); about a third of the suite's CPU
time was the kernel's. So, unless the person running the tests chose a ``TMPDIR``, the session
puts its temporary files (pytest's ``tmp_path``, ``tempfile``, and the daemons and tools the tests
start, which inherit ``TMPDIR``) in a directory of its own under ``/dev/shm`` when that is a
writable tmpfs with room (bytes and inodes), and removes it when the session ends.

``TESTS_TMPDIR=disk`` keeps the default (the disk's ``/tmp``), e.g. to run the suite on the
filesystem a node's state directory lives on.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import string
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
MIN_FREE = 2 << 30
"""The bytes a session needs free: a run of ``make test`` held at most 271 MB at once (passing
tests' ``tmp_path`` are removed as they end: ``tmp_path_retention_policy`` in pyproject.toml)."""
MIN_INODES = 500_000
"""The inodes a session needs free: a run held at most 128,000 at once. A tmpfs has a number of
inodes of its own (``nr_inodes``, by default half the machine's pages of RAM), which a machine
with little RAM reaches before its bytes; ``No space left on device`` says either."""
CHOICE = "TESTS_TMPDIR"
OWNER = "TESTS_TMPDIR_OWNER"
"""Set to the pid of the process that made the directory (the xdist controller or the single
pytest process); its workers inherit the directory and leave it alone."""


def _is_tmpfs(path: Path) -> bool:
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    fields = [line.split() for line in mounts]
    return any(f[1] == str(path) and f[2] == "tmpfs" for f in fields if len(f) > 2)


def short_dir(parent: Path, prefix: str) -> Path:
    """A new private directory ``<parent>/<prefix><5 random characters>``: no longer than
    ``/tmp/ts-XXXXXXXX`` (``mkdtemp``'s) when ``parent`` is ``/dev/shm``, since a unix socket path
    may be 107 bytes at most and some tests' sockets lie deep below."""
    alphabet = string.ascii_lowercase + string.digits
    while True:
        path = parent / (prefix + "".join(secrets.choice(alphabet) for _ in range(5)))
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        return path


def choose(config: pytest.Config) -> Path | None:
    """Make and select the session's RAM-backed temporary directory (``TMPDIR``, and pytest's
    ``--basetemp`` unless given); None where the environment chose one (``TMPDIR``, or
    ``TESTS_TMPDIR=disk``) or there is no usable tmpfs. Workers of ``pytest-xdist`` inherit the
    controller's directory through ``TMPDIR`` and their base from its ``--basetemp``."""
    if os.environ.get("TMPDIR") or os.environ.get(CHOICE) == "disk":
        return None
    if not _is_tmpfs(SHM) or not os.access(SHM, os.W_OK | os.X_OK):
        return None
    stats = os.statvfs(SHM)
    if stats.f_bavail * stats.f_frsize < MIN_FREE or stats.f_favail < MIN_INODES:
        return None
    root = short_dir(SHM, "t")
    if config.option.basetemp is None:  # shorter than /tmp/pytest-of-<user>/pytest-<n>
        config.option.basetemp = str(root / "pytest")
    os.environ["TMPDIR"] = str(root)
    os.environ[OWNER] = str(os.getpid())
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    return root


def short_base() -> Path:
    """Where a directory whose path must stay short (unix sockets: 107 bytes) is made: beside the
    session's directory on the tmpfs it chose (its own name is part of no such path), else
    ``/tmp``."""
    return SHM if os.environ.get(OWNER) else Path("/tmp")


@contextlib.contextmanager
def short_tmp_dir() -> Iterator[Path]:
    """A temporary directory with a short path, removed afterwards: unix socket paths are limited
    to 107 bytes and pytest's ``tmp_path`` is long. On the session's tmpfs when it chose one."""
    base = short_base()
    path = short_dir(base, "s") if base == SHM else Path(tempfile.mkdtemp(prefix="ts-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def release() -> None:
    """Remove the session's directory, in the process that made it."""
    if os.environ.get(OWNER) != str(os.getpid()):
        return
    root = os.environ.pop("TMPDIR", None)
    os.environ.pop(OWNER, None)
    tempfile.tempdir = None
    if root:
        shutil.rmtree(root, ignore_errors=True)
