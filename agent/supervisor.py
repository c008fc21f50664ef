"""Named background tasks whose failure is logged, counted and shuts the agent down in order."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from agent.logs import fields_


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

    def join(self, timeout: float = 10.0) -> list[str]:
        """Wait for every task; returns the names of those still running."""
        for t in self._threads:
            t.join(timeout)
        return [t.name for t in self._threads if t.is_alive()]
