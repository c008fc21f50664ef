"""One watch of the API-server emulator: what it streams, and when it ends.

The HTTP handler (:mod:`~agent.sim.apiserver_http`) parses the query, frames the chunked
response and counts the open watches; a :class:`Watch` decides what goes in it: the initial
``ADDED`` events (or the ``ERROR`` of a 410), the bookmarks (with the
``k8s.io/initial-events-end`` one after the initial events when asked), each change as a watcher
with its selection sees it, and the end: the deadline (``timeoutSeconds``), a 410 from the
history, a cut (:meth:`FaultInjector.cut_watches`), the client going away, or the store closing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.sim.apiserver_errors import ApiError
from agent.sim.apiserver_faults import FaultInjector
from agent.sim.apiserver_history import ADDED, DELETED, MODIFIED, WatchEvent
from agent.sim.apiserver_select import Selection
from agent.sim.apiserver_store import Obj, Store
from agent.sim.apiserver_types import ResourceType

POLL = 0.25  # how often an idle watch checks whether its client went away


class Cut(Exception):
    """The test cut the open watches (``FaultInjector.cut_watches``)."""


def event_for(event: WatchEvent, selection: Selection) -> tuple[str, Obj] | None:
    """What a watcher with ``selection`` sees of ``event`` (an object leaving it is DELETED)."""
    now = selection.matches(event.obj)
    before = event.old is not None and selection.matches(event.old)
    if event.type == ADDED:
        return (ADDED, event.obj) if now else None
    if event.type == DELETED:
        return (DELETED, event.obj) if now or before else None
    if now:
        return (MODIFIED if before else ADDED, event.obj)
    return (DELETED, event.obj) if before else None


@dataclass(frozen=True)
class Watch:
    """A watch of ``rt`` objects in ``selection``, opened at ``cursor``; built by :meth:`open`."""

    store: Store
    faults: FaultInjector
    rt: ResourceType
    selection: Selection
    cursor: int
    initial: tuple[WatchEvent, ...]
    error: ApiError | None
    """The 410 to send instead of events (the asked resourceVersion left the history)."""
    cuts: int
    """The faults' cut count when the watch opened (a cut since ends it)."""
    deadline: float
    monotonic: Callable[[], float]
    """Times the watch; the real waits between checks are at most ``POLL``."""
    bookmark_interval: float
    bookmarks: bool
    """``allowWatchBookmarks``."""
    initial_events_end: bool
    """``sendInitialEvents``: a bookmark marks the end of the initial events (with bookmarks)."""
    stalled: bool = False
    """The ``stall`` fault: nothing is sent until a cut or the client going away."""

    @classmethod
    def open(
        cls,
        store: Store,
        faults: FaultInjector,
        rt: ResourceType,
        selection: Selection,
        resource_version: str,
        *,
        deadline: float,
        monotonic: Callable[[], float],
        bookmark_interval: float,
        bookmarks: bool,
        initial_events_end: bool,
        stalled: bool = False,
    ) -> Watch:
        """Start at ``resource_version``; a 410 becomes the stream's ERROR event (as the real
        server sends it), any other error is raised for the handler to answer."""
        error: ApiError | None = None
        try:
            cursor, initial = store.watch_start(rt, selection, resource_version)
        except ApiError as exc:
            if exc.code != 410:
                raise
            cursor, initial, error = 0, [], exc
        return cls(
            store,
            faults,
            rt,
            selection,
            cursor,
            tuple(initial),
            error,
            faults.cuts,  # before the watch is seen as open: a cut after that reaches it
            deadline,
            monotonic,
            bookmark_interval,
            bookmarks,
            initial_events_end,
            stalled,
        )

    def _stall(self, peer_closed: Callable[[], bool]) -> bool:
        """The ``stall`` fault: send nothing (no event, no bookmark, no end at the deadline)
        until the test cuts the watches, the client goes away or the store closes."""
        while not self.store.closed:
            if self.faults.cuts != self.cuts:
                raise Cut
            if peer_closed():
                return True
            time.sleep(POLL)
        return False

    def stream(self, send: Callable[[str, Obj], None], peer_closed: Callable[[], bool]) -> bool:
        """Send the watch's events (``send(type, object)``) until it ends; True when it ended
        because the client went away. Raises :class:`Cut` when the test cut the watches."""
        rt, store, cuts = self.rt, self.store, self.cuts

        def bookmark(rv: int, annotations: dict[str, str] | None = None) -> None:
            meta: Obj = {"resourceVersion": str(rv)}
            if annotations:
                meta["annotations"] = annotations
            send("BOOKMARK", {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta})

        if self.stalled:
            return self._stall(peer_closed)
        if self.error is not None:
            send("ERROR", self.error.status())
            return False
        for event in self.initial:
            send(ADDED, event.obj)
        cursor = self.cursor
        if self.bookmarks and self.initial_events_end:
            bookmark(cursor, {"k8s.io/initial-events-end": "true"})
        next_bookmark = self.monotonic() + self.bookmark_interval
        while not store.closed:
            if self.faults.cuts != cuts:
                raise Cut
            now = self.monotonic()
            if now >= self.deadline:
                return False
            wait = min(
                self.deadline - now, POLL, max(0.0, next_bookmark - now) if self.bookmarks else POLL
            )
            try:
                events, current = store.wait_events(rt, cursor, wait)
            except ApiError as exc:
                if self.faults.cuts != cuts:
                    raise Cut from None
                send("ERROR", exc.status())
                return False
            if self.faults.cuts != cuts:  # nothing that happened after the cut reaches the client
                raise Cut
            for event in events:
                seen = event_for(event, self.selection)
                if seen is not None:
                    send(*seen)
                cursor = event.rv
            if self.bookmarks and self.monotonic() >= next_bookmark:
                cursor = max(cursor, current)
                bookmark(cursor)
                next_bookmark = self.monotonic() + self.bookmark_interval
            if not events and peer_closed():
                return True
        return False
