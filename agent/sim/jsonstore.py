"""A frozen state value kept in one JSON file and shared between processes.

Every simulator process (the agent, `tessera sim fault`, a test) works on the same files: a
mutation takes an ``fcntl`` lock, reloads the freshest state, applies a pure change and writes
the file atomically (temp file, fsync, rename, fsync of the directory); reads reload only when
the file changed (inode, mtime, size).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

from agent.fsutil import atomic_write

S = TypeVar("S")
T = TypeVar("T")

log = logging.getLogger("tessera.sim")


class SharedJsonStore(Generic[S]):
    def __init__(
        self,
        directory: Path,
        file_name: str,
        lock_name: str,
        *,
        encode: Callable[[S], dict[str, Any]],
        decode: Callable[[object], S],
        belongs: Callable[[S], bool],
        empty: S,
        format_error: type[Exception],
    ) -> None:
        """``decode`` raises ``format_error`` for unusable content; ``belongs`` says whether a
        stored state is this node's (another model's state is ignored)."""
        self.dir = Path(directory)
        self.path = self.dir / file_name
        self._lock_path = self.dir / lock_name
        self._encode = encode
        self._decode = decode
        self._belongs = belongs
        self._format_error = format_error
        self._thread_lock = threading.RLock()
        self._state = empty
        self._seen: tuple[int, int, int] | None = None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    def _stat_key(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _decode_file(self) -> S:
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._format_error(f"cannot read {self.path}: {exc}") from exc
        return self._decode(raw)

    def _save(self, state: S) -> None:
        data = json.dumps(self._encode(state), indent=1, sort_keys=True) + "\n"
        atomic_write(self.path, data.encode(), mode=0o644)
        self._state = state
        self._seen = self._stat_key()

    def _refresh(self) -> None:
        """Reload when the file changed since it was last seen; keep the cache otherwise."""
        key = self._stat_key()
        if key is None or key == self._seen:
            return
        self._seen = key
        try:
            state = self._decode_file()
        except self._format_error as exc:
            log.error("ignoring unreadable simulator state %s: %s", self.path, exc)
            return
        if not self._belongs(state):
            log.error("ignoring simulator state %s of another node model", self.path)
            return
        self._state = state

    def open(self, init: Callable[[S | None], S]) -> S:
        """Load the stored state and pass it (None when absent, unusable or another model's)
        through ``init``; a changed result is saved. A corrupt file is moved aside to
        ``<file>.corrupt``."""
        with self._locked():
            stored: S | None = None
            if self.path.exists():
                try:
                    stored = self._decode_file()
                except self._format_error as exc:
                    aside = self.path.with_name(self.path.name + ".corrupt")
                    log.warning(
                        "simulator state %s is unusable (%s); moved to %s", self.path, exc, aside
                    )
                    os.replace(self.path, aside)
                if stored is not None and not self._belongs(stored):
                    log.warning(
                        "simulator state %s belongs to another model; starting fresh", self.path
                    )
                    stored = None
            state = init(stored)
            if stored is None or state != stored:
                self._save(state)
            else:
                self._state = state
                self._seen = self._stat_key()
            return self._state

    def read(self) -> S:
        """The current state, reloaded from disk when another writer changed it."""
        with self._thread_lock:
            self._refresh()
            return self._state

    def update(self, change: Callable[[S], tuple[S, T]]) -> T:
        """Apply ``change`` under the lock to the freshest state; save when it changed.

        ``change`` returns ``(new_state, result)``; an exception leaves the stored state as it
        was. Returns ``result``."""
        with self._locked():
            self._refresh()
            new_state, result = change(self._state)
            if new_state != self._state:
                self._save(new_state)
            return result
