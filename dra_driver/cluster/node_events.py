"""Kubernetes Events about this Node, aggregated as the kubelet's event recorder aggregates them.

``NodeEventRecorder.record(type, reason, message)`` never blocks: it stamps the event and puts it
on a bounded queue (a full queue drops the event and counts it). One thread (``run``, under the
agent's supervisor) takes events off the queue, correlates them and hands them to a sink:
``KubeEventSink`` writes core/v1 Events (kube mode), ``LogEventSink`` logs each one as one
structured record (standalone mode). Nothing the API server answers is raised to the caller.

The rules are client-go's event recorder's (``tools/record/events_cache.go`` and
``tools/record/event.go``, kubernetes/client-go at 32ce75a7; the facts, in our own code):

* **Identity.** An Event is about the Node (``involvedObject``: kind ``Node``, apiVersion ``v1``,
  the Node's name and uid, no namespace) and lives in the namespace ``default``: ``makeEvent``
  gives an object without a namespace ``default``, and the API server's legacy Event validation
  accepts only that (or none) for a cluster-scoped object. Its name is
  ``<node>.<Unix time in ns, hex>`` (``util.GenerateEventName``; a UUID where that would not be a
  valid name). ``source`` is ``{component, host}``, and ``reportingComponent`` and
  ``reportingInstance`` repeat them (``generateEvent``). When the Node's uid is unknown (it could
  not be read) the uid is the node name, as in the kubelet's own Node events; ``kubectl describe
  node`` looks for both (kubectl ``pkg/describe`` ``NodeDescriber``).
* **Counting, aggregation and the spam filter** are :mod:`dra_driver.cluster.correlator`'s (its
  docstring gives client-go's rules); the Event object is :mod:`dra_driver.cluster.core_event`'s.
* The queue holds 1000 events (``maxQueuedEvents``).

Where we differ: client-go retries only lost connections (12 tries, 10 s apart, blocking its
queue); here every temporary failure (no answer, 429, 5xx) is retried after each of
``retry_delays`` (1 s, 4 s), or after the server's Retry-After when it asks for longer (client-go's
``rest/with_retry.go``: the longer of backoff and Retry-After; ``KubeError.retry_after``), unless
the agent is stopping, then counted as failed. Any other
refusal (403, 409, 422) is logged, rate-limited, and counted. At shutdown what is still queued is
written for at most ``flush_timeout`` seconds, each request bounded by the sink's timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agent.logs import Throttle, fields_
from dra_driver.cluster.core_event import NAMESPACE, NodeEvent, NodeRef, timestamp
from dra_driver.cluster.correlator import Correlator, Decision
from dra_driver.errors import KubeError

if TYPE_CHECKING:  # the kubernetes client (0.2 s to import) loads only in kube mode
    from dra_driver.cluster.kube import KubeClient

NORMAL = "Normal"
WARNING = "Warning"
EVENT_TYPES = (NORMAL, WARNING)
QUEUE_SIZE = 1000
MAX_MESSAGE_CHARS = 1024
"""Longer messages are cut (the limit the API server puts on new-style Events' notes)."""
RETRY_DELAYS = (1.0, 4.0)
FLUSH_TIMEOUT_S = 1.0
SINK_TIMEOUT = (2.0, 5.0)
"""(connect, read) seconds for one Event request: a slow API server delays events, not shutdown."""
_MAX_NAME = 253

GPU_UNHEALTHY = "GpuUnhealthy"
GPU_HEALTHY = "GpuHealthy"


def gpu_health(index: int, uuid: str, healthy: bool, cause: str) -> tuple[str, str, str]:
    """``(type, reason, message)`` of a GPU health change, for ``recorder.record(*...)``."""
    if healthy:
        return NORMAL, GPU_HEALTHY, f"GPU {index} ({uuid}) is healthy again: {cause}"
    return WARNING, GPU_UNHEALTHY, f"GPU {index} ({uuid}) is unhealthy: {cause}"


GPU_REMOVED = "GpuRemoved"
GPU_ADDED = "GpuAdded"
DEVICES_CHANGED = "DevicesChanged"
PREPARED_DEVICE_GONE = "PreparedDeviceGone"
MAX_NAMED_DEVICES = 8
"""A devices-changed message names at most this many devices of each side, then a count."""


def gpu_removed(index: int, uuid: str, bus_id: str) -> tuple[str, str, str]:
    """``(type, reason, message)``: a GPU left the node (udev remove or a re-read without it);
    its devices are withdrawn from the ResourceSlices."""
    return (
        WARNING,
        GPU_REMOVED,
        f"GPU {index} ({uuid}, PCI {bus_id}) is gone from the node: its devices are no longer"
        " advertised; claims prepared on it stay until unprepared",
    )


def gpu_added(index: int, uuid: str, bus_id: str) -> tuple[str, str, str]:
    """``(type, reason, message)``: a GPU appeared (or came back) and is advertised."""
    return NORMAL, GPU_ADDED, f"GPU {index} ({uuid}, PCI {bus_id}) is on the node and advertised"


def _named(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:MAX_NAMED_DEVICES])
    more = len(names) - MAX_NAMED_DEVICES
    return shown + (f" and {more} more" if more > 0 else "")


def devices_changed(added: tuple[str, ...], removed: tuple[str, ...]) -> tuple[str, str, str]:
    """``(type, reason, message)``: the advertised devices changed (an admin's MIG change, or
    the devices of GPUs that came or went)."""
    parts = []
    if added:
        parts.append(f"{len(added)} added ({_named(added)})")
    if removed:
        parts.append(f"{len(removed)} removed ({_named(removed)})")
    return NORMAL, DEVICES_CHANGED, "advertised devices changed: " + "; ".join(parts or ["none"])


def prepared_device_gone(described: str) -> tuple[str, str, str]:
    """``(type, reason, message)``: a prepared claim holds a device the node no longer has
    (``described``: ``GoneDevice.describe()``, naming the claim, device, GPU UUID and why)."""
    return (
        WARNING,
        PREPARED_DEVICE_GONE,
        f"prepared claim {described}; it stays prepared until the kubelet unprepares it, and"
        " no GPU's usage or energy is attributed to it",
    )


class EventSink(Protocol):
    """Where events go. Both return the Event as stored; failures raise ``KubeError``."""

    def create(self, event: NodeEvent) -> NodeEvent: ...

    def patch(self, event: NodeEvent, patch: Mapping[str, Any]) -> NodeEvent: ...


class KubeEventSink:
    """core/v1 Events in the namespace ``default``: POST to create, a strategic merge PATCH to
    count (the patch type client-go's ``EventSinkImpl`` sends)."""

    def __init__(self, kube: KubeClient, timeout: tuple[float, float] = SINK_TIMEOUT) -> None:
        self._kube = kube
        self._timeout = timeout
        self._path = f"/api/v1/namespaces/{NAMESPACE}/events"

    def create(self, event: NodeEvent) -> NodeEvent:
        answer = self._kube.request("POST", self._path, body=event.body(), timeout=self._timeout)
        return _stored(event, answer)

    def patch(self, event: NodeEvent, patch: Mapping[str, Any]) -> NodeEvent:
        from dra_driver.cluster.kube import (
            STRATEGIC_MERGE_PATCH,  # loaded already: self._kube is one
        )

        answer = self._kube.request(
            "PATCH",
            f"{self._path}/{event.name}",
            body=dict(patch),
            timeout=self._timeout,
            content_type=STRATEGIC_MERGE_PATCH,
        )
        return _stored(event, answer)


def _stored(event: NodeEvent, answer: Mapping[str, Any]) -> NodeEvent:
    """``event`` with the name, count and resourceVersion the server answered (ours where the
    answer lacks them: it is untrusted input)."""
    meta = answer.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    name, rv, count = meta.get("name"), meta.get("resourceVersion"), answer.get("count")
    return dataclasses.replace(
        event,
        name=name if isinstance(name, str) and name else event.name,
        resource_version=rv if isinstance(rv, str) else "",
        count=count if isinstance(count, int) and not isinstance(count, bool) else event.count,
    )


class LogEventSink:
    """Standalone mode: each event written is one structured record (``node event``), at
    warning level for ``Warning`` events."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log

    def create(self, event: NodeEvent) -> NodeEvent:
        self._emit(event)
        return event

    def patch(self, event: NodeEvent, patch: Mapping[str, Any]) -> NodeEvent:
        self._emit(event)
        return event

    def _emit(self, e: NodeEvent) -> None:
        self._log.log(
            logging.WARNING if e.type == WARNING else logging.INFO,
            "node event",
            extra=fields_(
                type=e.type,
                reason=e.reason,
                message=e.message,
                count=e.count,
                node=e.node.name,
                event=e.name,
                first_timestamp=timestamp(e.first_timestamp),
                last_timestamp=timestamp(e.last_timestamp),
            ),
        )


@dataclass(frozen=True)
class EventStats:
    recorded: int = 0
    """Written (created or counted), or logged in standalone mode."""
    filtered: int = 0
    """Held back by the spam filter (their count moves on)."""
    dropped: int = 0
    """Not queued: the queue was full."""
    failed: int = 0
    """Refused by the API server or not answered (after the retries)."""

    def outcomes(self) -> tuple[tuple[str, int], ...]:
        """``(outcome, count)`` pairs (the ``outcome`` label of ``tessera_node_events_total``)."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))


@dataclass(frozen=True)
class _Occurrence:
    type: str
    reason: str
    message: str
    at: float


class NodeEventRecorder:
    """Records Events about the Node ``node`` from ``component``; see the module docstring.

    ``node_uid`` answers the Node's uid when an event is written (read at start in kube mode;
    until then, or when it is None, the node name stands in for it, as the kubelet does).

    ``clock`` is Unix time (names, timestamps, intervals and token buckets); ``monotonic``
    bounds the shutdown flush. Thread-safe ``record``; ``run``/``drain`` on one thread."""

    def __init__(
        self,
        sink: EventSink,
        node: str,
        component: str,
        log: logging.Logger,
        *,
        node_uid: Callable[[], str | None] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        correlator: Correlator | None = None,
        queue_size: int = QUEUE_SIZE,
        retry_delays: Sequence[float] = RETRY_DELAYS,
        flush_timeout: float = FLUSH_TIMEOUT_S,
        poll: float = 0.25,
    ) -> None:
        self._sink = sink
        self._node_name = node
        self._node_uid = node_uid or (lambda: None)
        self._component = component
        self._log = log
        self._throttle = Throttle(log, interval=60.0, clock=monotonic)
        self._clock = clock
        self._monotonic = monotonic
        self._correlator = correlator or Correlator()
        self._queue: queue.Queue[_Occurrence] = queue.Queue(maxsize=queue_size)
        self._queue_size = queue_size
        self._retry_delays = tuple(retry_delays)
        self._flush_timeout = flush_timeout
        self._poll = poll
        self._last_ns = 0
        self._stats = EventStats()
        self._lock = threading.Lock()

    # -- any thread --------------------------------------------------------------------------

    def record(self, type: str, reason: str, message: str) -> bool:
        """Queue an event; False when the queue was full (dropped, counted). Never blocks.

        Raises ValueError for a ``type`` other than Normal or Warning, or an empty reason (a
        bug in the caller, as client-go refuses them)."""
        if type not in EVENT_TYPES:
            raise ValueError(f"event type {type!r}: must be one of {', '.join(EVENT_TYPES)}")
        if not reason:
            raise ValueError("an event needs a reason (a CamelCase word such as GpuUnhealthy)")
        occurrence = _Occurrence(type, reason, message[:MAX_MESSAGE_CHARS], self._clock())
        try:
            self._queue.put_nowait(occurrence)
        except queue.Full:
            self._count(dropped=1)
            self._throttle(
                logging.WARNING,
                "dropped",
                "node event queue full; event dropped",
                reason=reason,
                queue_size=self._queue_size,
            )
            return False
        return True

    @property
    def stats(self) -> EventStats:
        with self._lock:
            return self._stats

    # -- the recorder's thread ---------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Write events as they come until ``stop``; then flush what is queued for at most
        ``flush_timeout`` seconds (no retries then)."""
        while not stop.is_set():
            try:
                occurrence = self._queue.get(timeout=self._poll)
            except queue.Empty:
                continue
            self._handle(occurrence, stop)
        end = self._monotonic() + self._flush_timeout
        while self._monotonic() < end and self._take(stop):
            pass

    def drain(self, stop: threading.Event | None = None) -> int:
        """Write everything queued now, without waiting for more; how many were taken."""
        stop = stop or threading.Event()
        taken = 0
        while self._take(stop):
            taken += 1
        return taken

    def close(self) -> int:
        """After ``run`` returned: log what was left unwritten; how many."""
        left = self._queue.qsize()
        if left:
            self._log.warning("node events not written before shutdown", extra=fields_(events=left))
        return left

    def _take(self, stop: threading.Event) -> bool:
        try:
            occurrence = self._queue.get_nowait()
        except queue.Empty:
            return False
        self._handle(occurrence, stop)
        return True

    def _handle(self, occurrence: _Occurrence, stop: threading.Event) -> None:
        try:
            decision = self._correlator.correlate(self._event(occurrence))
            if decision is None:
                self._count(filtered=1)
                return
            stored = self._write(decision, stop)
        except Exception as exc:  # an events bug must never take the agent (and GPUs) down
            self._count(failed=1)
            self._throttle(
                logging.ERROR,
                "bug",
                "recording a node event failed",
                exc_info=exc,
                reason=occurrence.reason,
            )
            return
        if stored is None:
            self._count(failed=1)
            return
        self._correlator.written(decision, stored)
        self._count(recorded=1)

    def _event(self, o: _Occurrence) -> NodeEvent:
        ns = max(int(o.at * 1e9), self._last_ns + 1)  # unique names, even within one ns
        self._last_ns = ns
        name = f"{self._node_name}.{ns:x}"
        if len(name) > _MAX_NAME:
            name = str(uuid.uuid4())
        return NodeEvent(
            name=name,
            node=NodeRef(self._node_name, self._node_uid() or self._node_name),
            component=self._component,
            host=self._node_name,
            type=o.type,
            reason=o.reason,
            message=o.message,
            count=1,
            first_timestamp=o.at,
            last_timestamp=o.at,
        )

    def _write(self, decision: Decision, stop: threading.Event) -> NodeEvent | None:
        for attempt in range(len(self._retry_delays) + 1):
            try:
                return self._send(decision)
            except KubeError as exc:
                if exc.temporary and attempt < len(self._retry_delays) and not stop.is_set():
                    stop.wait(exc.retry_delay(self._retry_delays[attempt]))
                    continue
                self._throttle(
                    logging.WARNING,
                    f"failed:{exc.status}",
                    "could not write a node event",
                    error=str(exc),
                    status=exc.status,
                    reason=decision.event.reason,
                    hint=_hint(exc),
                )
                return None
        return None  # not reached: the last attempt returns or logs

    def _send(self, decision: Decision) -> NodeEvent:
        if decision.patch is None:
            return self._sink.create(decision.event)
        try:
            return self._sink.patch(decision.event, decision.patch)
        except KubeError as exc:
            if exc.status != 404:
                raise
            # the Event is gone (expired after the API server's --event-ttl, or deleted)
            return self._sink.create(dataclasses.replace(decision.event, resource_version=""))

    def _count(self, **delta: int) -> None:
        with self._lock:
            s = self._stats
            self._stats = dataclasses.replace(s, **{k: getattr(s, k) + v for k, v in delta.items()})


def _hint(exc: KubeError) -> str:
    if exc.status == 403:
        return (
            f"grant create and patch on events in the namespace {NAMESPACE}"
            " (deploy/daemonset/rbac.yaml, Role tessera-events)"
        )
    if exc.temporary:
        return "the API server did not answer in time or is overloaded; later events still go"
    return "the API server refused the Event; later events still go"
