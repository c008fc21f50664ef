"""Thread pools of a fixed size: every worker started together, at the pool's first task.

``concurrent.futures.ThreadPoolExecutor`` starts a worker only when a task finds none idle, up
to its bound, and keeps it for the pool's life: a daemon's thread count then follows the most
concurrent calls it has seen so far, and a busier minute hours into a run adds threads (each of
which may take a malloc arena of its own; :mod:`agent.daemon.allocator`). A :class:`FixedPool`
starts all its workers at its first task instead, so once the daemon has answered its first
calls its thread count is known and never changes (docs/performance.md, "Memory, descriptors
and threads under churn"). Not at construction: a pool built and never used (a test's, a server
the agent stops before serving) has no threads, and building the agent starts none on the way
to the kubelet's first call.

Still the standard executor (gRPC servers take it as it is); the workers are started through
its own ``submit``, one task per worker that waits at a barrier until every worker holds one, so
that each of those submissions finds no idle worker and starts another."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

FILL_TIMEOUT_S = 30.0
"""The longest starting the pool's workers may take (a thread that cannot start fails it)."""


class FixedPool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``<name>_<n>``, all started at the
    first :meth:`submit`."""

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, not {workers}")
        super().__init__(max_workers=workers, thread_name_prefix=name)
        self.workers = workers
        self._fill_lock = threading.Lock()
        self._filled = threading.Event()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        if not self._filled.is_set():
            self._fill()
        return super().submit(fn, *args, **kwargs)

    def _fill(self) -> None:
        with self._fill_lock:
            if self._filled.is_set():
                return
            all_in = threading.Barrier(self.workers + 1, timeout=FILL_TIMEOUT_S)
            for _ in range(self.workers):
                super().submit(all_in.wait)
            all_in.wait()
            self._filled.set()
