"""Aggregation, counting and the spam filter of Events about the Node, as client-go's event
recorder correlates them (``tools/record/events_cache.go``, kubernetes/client-go at 32ce75a7; the
facts, in our own code):

* **Counting** (``eventLogger``): the same event again (same source, object, type, reason and
  message) is a strategic merge PATCH of the first Event's ``count``, ``lastTimestamp`` and
  ``message``, not a new Event. A PATCH answered 404 (the Event expired: the API server keeps
  Events for ``--event-ttl``, one hour by default) creates it again under its name.
* **Aggregation** (``EventAggregator``): events that differ only in their message are similar;
  the 10th different message within 10 minutes of the previous similar event (a rolling
  interval) and every new one after it become one Event ``(combined from similar events):
  <message>``, counted like any other.
* **Spam filter** (``EventSourceObjectSpamFilter``): a token bucket per source, object and type
  (not reason) with a burst of 25, refilled by one every 5 minutes. An event without a token is
  not written, but its count moves on, so the next write carries the true count.
* Each cache is an LRU of 4096 entries (``maxLruCacheEntries``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dra_driver.cluster.core_event import NodeEvent

LRU_ENTRIES = 4096
AGGREGATE_MAX_EVENTS = 10
AGGREGATE_INTERVAL_S = 600.0
AGGREGATE_PREFIX = "(combined from similar events): "
SPAM_BURST = 25
SPAM_QPS = 1.0 / 300.0


Key = tuple[str, ...]


def _object_key(e: NodeEvent) -> Key:
    return (e.component, e.host, "Node", "", e.node.name, e.node.uid, "v1")


def event_key(e: NodeEvent) -> Key:
    """What makes two events the same one (counted): source, object, type, reason, message."""
    return (*_object_key(e), e.type, e.reason, e.message)


def aggregate_key(e: NodeEvent) -> Key:
    """What makes two events similar (aggregated): all but the message."""
    return (*_object_key(e), e.type, e.reason, e.component, e.host)


def spam_key(e: NodeEvent) -> Key:
    """Whose token bucket an event takes from: source, object and type."""
    return (*_object_key(e), e.type)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Lru(Generic[K, V]):
    """A bounded map that forgets the least recently used entry."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"an LRU needs at least one entry, got {size}")
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self._size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class _Similar:
    messages: dict[str, None]
    """The different messages seen (insertion-ordered), at most max_events - 1 kept."""
    last: float


@dataclass(frozen=True)
class _Seen:
    count: int
    first_timestamp: float
    name: str
    resource_version: str


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass(frozen=True)
class Decision:
    """What to write for one event."""

    event: NodeEvent
    key: Key
    """Its counting key (``Correlator.written`` records the server's answer under it)."""
    patch: dict[str, Any] | None
    """None: create the Event; else PATCH the existing one (``event.name``) with this."""


class Correlator:
    """Aggregation, counting and the spam filter; one thread's (the recorder's), not locked.

    The time of an event is its ``last_timestamp`` (when it was recorded), so a test drives the
    intervals and the token buckets through the events it makes."""

    def __init__(
        self,
        *,
        entries: int = LRU_ENTRIES,
        max_events: int = AGGREGATE_MAX_EVENTS,
        interval: float = AGGREGATE_INTERVAL_S,
        burst: int = SPAM_BURST,
        qps: float = SPAM_QPS,
    ) -> None:
        self.max_events = max_events
        self.interval = interval
        self.burst = burst
        self.qps = qps
        self._similar: Lru[Key, _Similar] = Lru(entries)
        self._seen: Lru[Key, _Seen] = Lru(entries)
        self._buckets: Lru[Key, _Bucket] = Lru(entries)

    def correlate(self, event: NodeEvent) -> Decision | None:
        """The write ``event`` comes to, or None when the spam filter holds it back."""
        now = event.last_timestamp
        event, key = self._aggregate(event, now)
        decision = self._observe(event, key)
        if not self._take_token(spam_key(decision.event), now):
            return None
        return decision

    def written(self, decision: Decision, stored: NodeEvent) -> None:
        """The server stored ``stored`` for ``decision``: count on from its answer."""
        self._seen.put(
            decision.key,
            _Seen(stored.count, stored.first_timestamp, stored.name, stored.resource_version),
        )

    def _aggregate(self, event: NodeEvent, now: float) -> tuple[NodeEvent, Key]:
        akey = aggregate_key(event)
        similar = self._similar.get(akey)
        if similar is None or now - similar.last > self.interval:
            similar = _Similar({}, now)
        similar.messages[event.message] = None
        similar.last = now
        self._similar.put(akey, similar)
        if len(similar.messages) < self.max_events:
            return event, ("event", *event_key(event))
        del similar.messages[next(iter(similar.messages))]  # keep the set below the threshold
        combined = dataclasses.replace(
            event,
            message=AGGREGATE_PREFIX + event.message,
            count=1,
            first_timestamp=now,
            last_timestamp=now,
        )
        return combined, ("aggregate", *akey)

    def _observe(self, event: NodeEvent, key: Key) -> Decision:
        seen = self._seen.get(key)
        patch = None
        if seen is not None and seen.count > 0:
            event = dataclasses.replace(
                event,
                name=seen.name,
                resource_version=seen.resource_version,
                first_timestamp=seen.first_timestamp,
                count=seen.count + 1,
            )
            patch = event.patch()
        self._seen.put(
            key, _Seen(event.count, event.first_timestamp, event.name, event.resource_version)
        )
        return Decision(event, key, patch)

    def _take_token(self, key: Key, now: float) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = _Bucket(float(self.burst), now)
        if now > bucket.at:
            bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.qps)
            bucket.at = now
        allowed = bucket.tokens >= 1.0
        if allowed:
            bucket.tokens -= 1.0
        self._buckets.put(key, bucket)
        return allowed
