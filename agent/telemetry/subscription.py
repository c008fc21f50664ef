"""A bounded, latest-wins queue of telemetry snapshots: what ``Sampler.subscribe`` hands a
consumer (the gRPC stream, the watchers' notifier), so a slow one misses intermediate snapshots
and publishing never waits for it."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from agent.telemetry.snapshot import Snapshot


class Subscription:
    """A bounded, latest-wins queue of snapshots (``Sampler.subscribe``)."""

    def __init__(self, maxsize: int, on_close: Callable[[Subscription], None]) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self._queue: collections.deque[Snapshot] = collections.deque(maxlen=maxsize)
        self._cond = threading.Condition()
        self._closed = False
        self._on_close = on_close
        self.dropped = 0
        """Snapshots replaced by newer ones before the consumer got them."""

    def put(self, snap: Snapshot) -> None:
        """Add ``snap``, dropping the oldest queued one when full. Never blocks for long."""
        with self._cond:
            if self._closed:
                return
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(snap)
            self._cond.notify()

    def get(self, timeout: float | None = None) -> Snapshot | None:
        """The oldest queued snapshot; None after ``timeout`` seconds or once closed."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._queue) or self._closed, timeout)
            if self._closed or not self._queue:
                return None
            return self._queue.popleft()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop receiving; a blocked ``get`` returns None."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._on_close(self)
