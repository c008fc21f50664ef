"""One agent per state directory: an exclusive ``fcntl`` lock on ``<state-dir>/agent.lock``.

The lock is taken before the agent touches anything in the directory and held until it is done
writing there; the kernel releases it when the process dies, however it dies, so a crashed agent
never blocks its successor. The holder writes its PID (and, in a rolling update, its pod's UID)
into the file so that another agent can say who holds it.

A rolling update hands the directory over through this lock: the new agent waits for it
(:meth:`StateLock.acquire` with ``wait=True``, ended early by a stop event) while the old one
finishes its calls and then releases it. Every write that must never come from two processes at
once runs inside :meth:`StateLock.guard`, which refuses when the lock is not held (or the
directory was deleted or replaced since it was taken) and keeps :meth:`StateLock.release`
waiting until the write is done: such a file is only ever written by the one process the kernel
lets hold the lock, at the lock file's path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agent.errors import ConfigError, StateDirInUse, StateDirLost, StateDirNotHeld

LOCK_FILE = "agent.lock"
POLL_S = 0.05
"""How often a waiting :meth:`StateLock.acquire` tries again (flock has no timeout)."""


@dataclass(frozen=True)
class Holder:
    """Who the lock file says holds the lock: the PID as the holder's PID namespace sees it
    (another pod's agent is often PID 1 there) and, in a rolling update, its pod's UID."""

    pid: int | None
    pod_uid: str | None = None

    def __str__(self) -> str:
        who = f"PID {self.pid}" if self.pid is not None else "a process whose PID is not recorded"
        return f"{who} of pod {self.pod_uid}" if self.pod_uid else who


class StateLock:
    """The lock of one state directory (see the module docstring). ``pod_uid`` is written into
    the lock file with the PID while we hold it."""

    def __init__(self, state_dir: Path, pod_uid: str | None = None) -> None:
        self.path = state_dir / LOCK_FILE
        self.pod_uid = pod_uid
        self._fd: int | None = None
        self._writing = threading.Lock()
        """Held by :meth:`guard` for the length of a write, and by :meth:`release`."""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(
        self,
        *,
        wait: bool = False,
        stop: threading.Event | None = None,
        timeout: float | None = None,
        poll: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> bool:
        """Take the lock. Without ``wait``: now, or raise StateDirInUse naming the holder. With
        ``wait``: try every ``poll`` seconds until it is ours (True), or until ``stop`` is set or
        ``timeout`` seconds have passed (False). ConfigError when the lock file cannot be opened
        or locked (the message names it)."""
        deadline = None if timeout is None else clock() + timeout
        stop = stop or threading.Event()
        while True:
            if self._try():
                return True
            if not wait:
                raise StateDirInUse(str(self.path), self.holder().pid)
            left = poll if deadline is None else min(poll, deadline - clock())
            if left <= 0 or stop.wait(left):
                return False

    def _try(self) -> bool:
        """One attempt: True when the lock is now ours, False when another holds it."""
        if self._fd is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(
                f"--state-dir: cannot open the lock file {self.path}: {exc.strerror or exc}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"cannot lock {self.path}: {exc.strerror or exc}") from exc
        os.ftruncate(fd, 0)
        owner = f"pod {self.pod_uid}\n" if self.pod_uid else ""
        os.pwrite(fd, f"{os.getpid()}\n{owner}".encode(), 0)
        self._fd = fd
        return True

    def holder(self) -> Holder:
        """Who the lock file names (the last holder's record while nobody holds it)."""
        try:
            text = self.path.read_bytes()[:256].decode(errors="replace")
        except OSError:
            return Holder(None)
        return _parse(text)

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

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Hold off :meth:`release` for the length of a write to the state directory; raise
        StateDirNotHeld when the lock is not ours (never taken, or handed over already), and
        StateDirLost when the directory was deleted or replaced since we took it (the lock file
        at its path is not ours: another agent could take that one, and a write would recreate
        the directory behind the lock's back)."""
        with self._writing:
            if self._fd is None:
                raise StateDirNotHeld(str(self.path))
            if not self.intact():
                raise StateDirLost(str(self.path))
            yield

    def release(self) -> None:
        """Give the lock up (idempotent), once no write under :meth:`guard` is running. The
        file stays: removing it would race a successor."""
        with self._writing:
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _parse(text: str) -> Holder:
    lines = [line.strip() for line in text.splitlines()]
    pid = int(lines[0]) if lines and lines[0].isdigit() else None
    pod = next((line[4:].strip() for line in lines[1:] if line.startswith("pod ")), None)
    return Holder(pid, pod or None)
