"""Named background tasks whose failure is logged, counted and shuts the agent down in order,
and the one deadline a shutdown runs under."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agent.logs import fields_


class Deadline:
    """A point in time that several steps share: each asks how long is left."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._end = clock() + max(0.0, seconds)

    def remaining(self, cap: float | None = None) -> float:
        """Seconds left (never negative), at most ``cap``."""
        left = max(0.0, self._end - self._clock())
        return left if cap is None else min(left, cap)


class Supervisor:
    def __init__(self, log: logging.Logger, on_failure: Callable[[], None]) -> None:
        self.log = log
        self.on_failure = on_failure
        self.failures: dict[str, str] = {}
        self._threads: list[threading.Thread] = []

    def spawn(self, name: str, target: Callable[[], None]) -> None:
        def body() -> None:
            try:
                target()
            except BaseException as exc:  # a dead loop must never go unnoticed
                self.failures[name] = repr(exc)
                self.log.exception("task failed; shutting down", extra=fields_(task=name))
                self.on_failure()

        thread = threading.Thread(target=body, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self, deadline: Deadline) -> list[str]:
        """Wait for every task until ``deadline``; returns the names of those still running."""
        for t in self._threads:
            t.join(deadline.remaining())
        return [t.name for t in self._threads if t.is_alive()]
