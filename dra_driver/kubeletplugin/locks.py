"""Locks by key, for the claims and GPUs that concurrent kubelet calls touch.

The same claim from several callers is serialized by a lock on its UID; side effects on one GPU
by a lock on its UUID (``transaction``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager


class ClaimLocks:
    """One lock per key (a claim UID, a GPU UUID), kept only while some call uses it: the same
    claim from several callers is serialized, and a claim that is gone leaves nothing behind."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def hold(self, uid: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(uid) or (threading.Lock(), 0)
            self._locks[uid] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[uid]
                if users == 1:
                    del self._locks[uid]
                else:
                    self._locks[uid] = (lock, users - 1)

    @contextmanager
    def hold_all(self, keys: Iterable[str]) -> Iterator[None]:
        """Hold the locks of every key, taken in sorted order (so two callers never wait on
        each other the other way round)."""
        with ExitStack() as stack:
            for key in sorted(set(keys)):
                stack.enter_context(self.hold(key))
            yield

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)
