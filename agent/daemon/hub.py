"""An event passed between objects built in either order, without patching either one: the
composition root makes the :class:`Relay` first and hands it to both, the one that emits it (as
a plain callable, at its construction) and the one that handles it (which subscribes at its
own construction)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Relay(Generic[T]):
    """Calls every subscribed handler with each event, in subscription order (an exception
    goes to the emitter, which handles it as it would its own callback's)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._handlers: tuple[Callable[[T], None], ...] = ()
        self._lock = threading.Lock()

    def subscribe(self, handler: Callable[[T], None]) -> None:
        with self._lock:
            self._handlers = (*self._handlers, handler)

    def __call__(self, event: T) -> None:
        for handler in self._handlers:
            handler(event)
