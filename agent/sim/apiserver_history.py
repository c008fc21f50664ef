"""The bounded watch history of the API-server emulator, one per resource (like a watch cache).

Not thread-safe on its own: the store's lock guards it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agent.sim import apiserver_errors as err

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"


@dataclass(frozen=True)
class WatchEvent:
    """A change: ``obj`` is the state after it (the last state for DELETED), ``old`` before."""

    rv: int
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


class History:
    """The last ``size`` events of each resource; older resourceVersions are 410 Expired."""

    def __init__(self, resources: Iterable[str], size: int) -> None:
        self._size = max(1, size)
        self._events: dict[str, deque[WatchEvent]] = {r: deque() for r in resources}
        self._compacted: dict[str, int] = dict.fromkeys(self._events, 0)

    def add(self, resource: str) -> None:
        """Keep a history for ``resource`` too (a custom resource served from now on)."""
        self._events.setdefault(resource, deque())
        self._compacted.setdefault(resource, 0)

    def record(self, resource: str, event: WatchEvent) -> None:
        events = self._events[resource]
        events.append(event)
        while len(events) > self._size:
            self._compacted[resource] = events.popleft().rv

    def check(self, resource: str, cursor: int) -> None:
        """Raise 410 when events after ``cursor`` already left the history."""
        if cursor < self._compacted[resource]:
            oldest = self._compacted[resource] + 1
            raise err.gone(f"too old resource version: {cursor} ({oldest})")

    def has_after(self, resource: str, cursor: int) -> bool:
        events = self._events[resource]
        return bool(events) and events[-1].rv > cursor

    def after(self, resource: str, cursor: int) -> list[WatchEvent]:
        """The events with a resourceVersion above ``cursor``, oldest first."""
        found: list[WatchEvent] = []
        for event in reversed(self._events[resource]):
            if event.rv <= cursor:
                break
            found.append(event)
        found.reverse()
        return found

    def compact(self, rv: int) -> None:
        """Forget everything up to ``rv``."""
        for resource, events in self._events.items():
            events.clear()
            self._compacted[resource] = rv
