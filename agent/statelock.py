"""One agent per state directory: an exclusive ``fcntl`` lock on ``<state-dir>/agent.lock``.

The lock is taken before the agent touches anything in the directory and held until it exits;
the kernel releases it when the process dies, however it dies, so a crashed agent never blocks
its successor. The holder writes its PID into the file so that a second agent can say who holds
it. (A rolling upgrade hands the directory over through this lock: the new agent waits for it.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from agent.errors import ConfigError, StateDirInUse

LOCK_FILE = "agent.lock"


class StateLock:
    """The lock of one state directory (see the module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock now or raise StateDirInUse naming the holder's PID; ConfigError when
        the lock file cannot be opened (the message names it)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(
                f"--state-dir: cannot open the lock file {self.path}: {exc.strerror or exc}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid_in(fd)
            os.close(fd)
            raise StateDirInUse(str(self.path), holder) from None
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"cannot lock {self.path}: {exc.strerror or exc}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def intact(self) -> bool:
        """Whether the lock file we hold is still the one at its path: a state directory that
        was deleted or replaced while we run no longer protects anything (a restart repairs)."""
        if self._fd is None:
            return False
        try:
            held, there = os.fstat(self._fd), os.stat(self.path)
        except OSError:
            return False
        return (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino)

    def release(self) -> None:
        """Give the lock up (idempotent). The file stays: removing it would race a successor."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
