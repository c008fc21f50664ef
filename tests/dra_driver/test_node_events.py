"""The Node event recorder's rules with a fake clock: counting, aggregation, the spam filter, the
LRU bound, the queue, and failures that never reach the caller (client-go's recorder rules)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from typing import Any

import pytest

from dra_driver.cluster.core_event import NodeEvent, NodeRef
from dra_driver.cluster.correlator import AGGREGATE_PREFIX, Correlator, Decision
from dra_driver.cluster.node_events import (
    NORMAL,
    WARNING,
    LogEventSink,
    NodeEventRecorder,
    gpu_health,
)
from dra_driver.errors import KubeError
from tests.fakeclock import FakeClock

T0 = 1_780_000_000.0
NODE = "node-a"
UID = "8d1f2c5e-0000-4000-8000-000000000001"


def event(message: str, at: float, type: str = WARNING, reason: str = "GpuUnhealthy") -> NodeEvent:
    return NodeEvent(
        name=f"{NODE}.{int(at * 1e9):x}",
        node=NodeRef(NODE, UID),
        component="gpu.tessera.dev",
        host=NODE,
        type=type,
        reason=reason,
        message=message,
        count=1,
        first_timestamp=at,
        last_timestamp=at,
    )


def write(c: Correlator, e: NodeEvent) -> Decision | None:
    """Correlate ``e`` and, as a server that stores what it gets, record the write."""
    d = c.correlate(e)
    if d is not None:
        c.written(d, dataclasses.replace(d.event, resource_version="7"))
    return d


# -- the correlator ------------------------------------------------------------------------------


def test_a_new_event_is_created():
    d = write(Correlator(), event("GPU 1 is unhealthy", T0))
    assert d is not None and d.patch is None
    assert d.event.count == 1 and d.event.name == f"{NODE}.{int(T0 * 1e9):x}"


def test_the_same_event_again_is_a_patch_of_count_and_last_timestamp():
    c = Correlator()
    first = write(c, event("GPU 1 is unhealthy", T0))
    again = write(c, event("GPU 1 is unhealthy", T0 + 42))
    assert first is not None and again is not None
    assert again.event.name == first.event.name  # the same Event object
    assert again.event.first_timestamp == T0
    assert again.patch == {
        "count": 2,
        "lastTimestamp": "2026-05-28T20:27:22Z",
        "message": "GPU 1 is unhealthy",
    }
    third = write(c, event("GPU 1 is unhealthy", T0 + 50))
    assert third is not None and third.patch is not None and third.patch["count"] == 3


def test_a_different_message_or_type_is_another_event():
    c = Correlator()
    a = write(c, event("GPU 1 is unhealthy", T0))
    b = write(c, event("GPU 2 is unhealthy", T0 + 1))
    n = write(c, event("GPU 1 is unhealthy", T0 + 2, type=NORMAL))
    assert a and b and n and b.patch is None and n.patch is None
    assert len({a.event.name, b.event.name, n.event.name}) == 3


def test_ten_similar_events_within_ten_minutes_are_combined():
    c = Correlator()
    decisions = [write(c, event(f"GPU {i} is unhealthy", T0 + 60 * i)) for i in range(12)]
    assert all(d is not None for d in decisions)
    singles, combined = decisions[:9], [d for d in decisions[9:] if d is not None]
    assert all(d.patch is None and not d.event.message.startswith("(") for d in singles if d)
    tenth, eleventh, twelfth = combined
    assert tenth.patch is None  # the combined Event is created once ...
    assert tenth.event.message == AGGREGATE_PREFIX + "GPU 9 is unhealthy"
    assert eleventh.event.name == twelfth.event.name == tenth.event.name  # ... then counted
    assert eleventh.patch is not None and twelfth.patch is not None
    assert eleventh.patch["count"] == 2 and twelfth.patch["count"] == 3
    assert twelfth.patch["message"] == AGGREGATE_PREFIX + "GPU 11 is unhealthy"
    assert twelfth.patch["lastTimestamp"] == "2026-05-28T20:37:40Z"  # T0 + 11 minutes


def test_similar_events_further_apart_than_ten_minutes_are_not_combined():
    c = Correlator()
    for i in range(12):
        d = write(c, event(f"GPU {i} is unhealthy", T0 + 601 * i))
        assert d is not None and d.patch is None
        assert not d.event.message.startswith(AGGREGATE_PREFIX)


def test_the_spam_filter_lets_25_through_then_one_every_5_minutes_and_counts_on():
    c = Correlator()
    decisions = [write(c, event("GPU 1 is unhealthy", T0 + i)) for i in range(30)]
    assert sum(d is not None for d in decisions) == 25
    assert all(d is None for d in decisions[25:])
    # a Normal event about the same Node has its own bucket
    assert write(c, event("GPU 1 is healthy again", T0 + 30, type=NORMAL)) is not None
    assert write(c, event("GPU 1 is unhealthy", T0 + 100)) is None  # no token yet
    later = write(c, event("GPU 1 is unhealthy", T0 + 29 + 300))
    assert later is not None and later.patch is not None
    assert later.patch["count"] == 32  # every occurrence counted, the filtered ones too
    assert write(c, event("GPU 1 is unhealthy", T0 + 29 + 301)) is None


def test_the_caches_are_bounded_the_least_recently_used_is_forgotten():
    small = Correlator(entries=2)
    for m in ("a", "b", "c"):
        write(small, event(m, T0))
    forgotten = write(small, event("a", T0 + 1))
    assert forgotten is not None and forgotten.patch is None  # created anew: "a" fell out
    big = Correlator()
    for m in ("a", "b", "c"):
        write(big, event(m, T0))
    remembered = write(big, event("a", T0 + 1))
    assert remembered is not None and remembered.patch is not None


# -- the recorder --------------------------------------------------------------------------------


class FakeSink:
    """Stores Events like a server does; ``fail`` is a list of errors the next calls raise."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, int]] = []
        self.fail: list[KubeError] = []
        self.written = threading.Event()

    def _maybe_fail(self, method: str, name: str) -> None:
        if self.fail:
            raise self.fail.pop(0)

    def create(self, e: NodeEvent) -> NodeEvent:
        self._maybe_fail("POST", e.name)
        self.calls.append(("create", e.name, e.count))
        self.objects[e.name] = e.body()
        self.written.set()
        return dataclasses.replace(e, resource_version=str(len(self.calls)))

    def patch(self, e: NodeEvent, patch: Mapping[str, Any]) -> NodeEvent:
        self._maybe_fail("PATCH", e.name)
        if e.name not in self.objects:
            raise KubeError(404, "NotFound", f'events "{e.name}" not found', "PATCH", e.name)
        self.calls.append(("patch", e.name, int(patch["count"])))
        self.objects[e.name].update(patch)
        self.written.set()
        return dataclasses.replace(e, resource_version=str(len(self.calls)))


def recorder(sink: Any, clock: FakeClock | None = None, **kw: Any) -> NodeEventRecorder:
    return NodeEventRecorder(
        sink,
        NODE,
        "gpu.tessera.dev",
        logging.getLogger("test.node-events"),
        node_uid=lambda: UID,
        clock=clock or FakeClock(T0),
        **{"retry_delays": (0.0,), **kw},
    )


def flap(rec: NodeEventRecorder, clock: FakeClock, cycles: int, gpu: int = 1) -> None:
    for _ in range(cycles):
        rec.record(*gpu_health(gpu, "GPU-1111", False, "xid-79"))
        clock.now += 1
        rec.record(*gpu_health(gpu, "GPU-1111", True, "it answers again"))
        clock.now += 1


def test_a_flapping_gpu_is_a_bounded_number_of_writes_mostly_patches_of_one_event():
    sink, clock = FakeSink(), FakeClock(T0)
    rec = recorder(sink, clock)
    flap(rec, clock, 50)
    rec.drain()
    creates = [c for c in sink.calls if c[0] == "create"]
    patches = [c for c in sink.calls if c[0] == "patch"]
    assert len(creates) == 2  # one Warning, one Normal Event
    assert len(patches) == 48 and len(sink.calls) == 50  # 25 of each type, then the filter
    assert rec.stats.recorded == 50 and rec.stats.filtered == 50 and rec.stats.failed == 0
    warning = next(o for o in sink.objects.values() if o["type"] == WARNING)
    assert warning["count"] == 25 and warning["reason"] == "GpuUnhealthy"
    assert "GPU 1 (GPU-1111)" in warning["message"] and "xid-79" in warning["message"]
    clock.now += 300  # a token again: the next write carries the true count
    flap(rec, clock, 1)
    rec.drain()
    assert warning["count"] == 51


def test_a_full_queue_drops_and_counts_and_never_blocks():
    rec = recorder(FakeSink(), queue_size=2)
    assert rec.record(WARNING, "GpuUnhealthy", "a") and rec.record(WARNING, "GpuUnhealthy", "b")
    assert rec.record(WARNING, "GpuUnhealthy", "c") is False
    assert rec.stats.dropped == 1
    assert rec.drain() == 2


def test_a_type_other_than_normal_or_warning_is_a_bug_of_the_caller():
    with pytest.raises(ValueError, match="Normal, Warning"):
        recorder(FakeSink()).record("Error", "GpuUnhealthy", "x")


def test_a_patch_of_an_expired_event_creates_it_again_under_its_name():
    sink = FakeSink()
    rec = recorder(sink)
    rec.record(WARNING, "GpuUnhealthy", "GPU 1 is unhealthy")
    rec.drain()
    sink.objects.clear()  # the API server's --event-ttl passed
    rec.record(WARNING, "GpuUnhealthy", "GPU 1 is unhealthy")
    rec.drain()
    (first, again) = sink.calls
    assert again == ("create", first[1], 2)
    assert rec.stats.recorded == 2 and rec.stats.failed == 0


@pytest.mark.parametrize(
    ("status", "reason"),
    [(403, "Forbidden"), (409, "AlreadyExists"), (422, "Invalid"), (503, "ServiceUnavailable")],
)
def test_api_errors_are_logged_rate_limited_counted_and_never_raised(status, reason, caplog):
    sink = FakeSink()
    rec = recorder(sink)
    sink.fail = [KubeError(status, reason, "no", "POST", "/events")] * 10
    with caplog.at_level(logging.WARNING, "test.node-events"):
        for i in range(4):
            rec.record(WARNING, "GpuUnhealthy", f"GPU {i} is unhealthy")
        rec.drain()
    assert rec.stats.failed == 4 and sink.calls == []
    logged = [r for r in caplog.records if r.getMessage() == "could not write a node event"]
    assert len(logged) == 1  # one line per kind of failure a minute, not one per event
    assert logged[0].fields["status"] == status  # type: ignore[attr-defined]
    if status == 403:
        assert "create and patch on events" in logged[0].fields["hint"]  # type: ignore[attr-defined]


def test_a_temporary_failure_is_retried():
    sink = FakeSink()
    rec = recorder(sink)
    sink.fail = [KubeError(503, "ServiceUnavailable", "busy", "POST", "/events")]
    rec.record(WARNING, "GpuUnhealthy", "GPU 1 is unhealthy")
    rec.drain()
    assert [c[0] for c in sink.calls] == ["create"] and rec.stats.failed == 0


class Waits(threading.Event):
    """A stop event that is never set and whose waits return at once, recording each timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0.0))
        return False


@pytest.mark.parametrize(
    ("retry_after", "waits"), [(None, [1.0, 4.0]), (2.0, [2.0, 4.0]), (10.0, [10.0, 10.0])]
)
def test_a_retry_waits_the_longer_of_its_delay_and_the_servers_retry_after(
    retry_after: float | None, waits: list[float]
) -> None:
    sink = FakeSink()
    rec = recorder(sink, retry_delays=(1.0, 4.0))
    busy = KubeError(429, "TooManyRequests", "busy", "POST", "/events", retry_after=retry_after)
    sink.fail = [busy, busy]
    rec.record(WARNING, "GpuUnhealthy", "GPU 1 is unhealthy")
    stop = Waits()
    rec.drain(stop)
    assert stop.waits == waits
    assert [c[0] for c in sink.calls] == ["create"] and rec.stats.recorded == 1


def test_the_loop_writes_as_events_come_and_stops_when_asked():
    sink = FakeSink()
    rec = recorder(sink, poll=0.01)
    stop = threading.Event()
    thread = threading.Thread(target=rec.run, args=(stop,))
    thread.start()
    try:
        rec.record(WARNING, "GpuUnhealthy", "GPU 1 is unhealthy")
        assert sink.written.wait(10)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive() and len(sink.calls) == 1


class SlowSink(FakeSink):
    """Each write takes 0.6 s of the fake monotonic clock."""

    def __init__(self, monotonic: FakeClock) -> None:
        super().__init__()
        self.monotonic = monotonic

    def create(self, e: NodeEvent) -> NodeEvent:
        self.monotonic.now += 0.6
        return super().create(e)


def test_shutdown_flushes_what_is_queued_within_its_bound_and_reports_the_rest(caplog):
    monotonic = FakeClock(0.0)
    sink = SlowSink(monotonic)
    rec = recorder(sink, monotonic=monotonic, flush_timeout=1.0)
    for i in range(3):
        rec.record(WARNING, "GpuUnhealthy", f"GPU {i} is unhealthy")
    stop = threading.Event()
    stop.set()
    with caplog.at_level(logging.WARNING, "test.node-events"):
        rec.run(stop)  # returns: stopping, two writes fit in the bound
        assert rec.close() == 1
    assert len(sink.calls) == 2
    assert any(r.getMessage() == "node events not written before shutdown" for r in caplog.records)


def test_standalone_mode_logs_each_event_as_one_structured_record(caplog):
    rec = recorder(LogEventSink(logging.getLogger("test.node-events.log")))
    with caplog.at_level(logging.INFO, "test.node-events.log"):
        rec.record(*gpu_health(3, "GPU-3333", False, "xid-79"))
        rec.record(*gpu_health(3, "GPU-3333", False, "xid-79"))
        rec.drain()
    records = [r for r in caplog.records if r.getMessage() == "node event"]
    assert [r.levelno for r in records] == [logging.WARNING] * 2
    fields = [r.fields for r in records]  # type: ignore[attr-defined]
    assert [f["count"] for f in fields] == [1, 2]
    assert fields[0]["reason"] == "GpuUnhealthy" and fields[0]["node"] == NODE
    assert fields[0]["message"] == "GPU 3 (GPU-3333) is unhealthy: xid-79"


def test_without_the_nodes_uid_the_node_name_stands_in_as_the_kubelet_does():
    sink = FakeSink()
    read: list[str | None] = [None]
    rec = NodeEventRecorder(
        sink,
        NODE,
        "gpu.tessera.dev",
        logging.getLogger("t"),
        node_uid=lambda: read[0],
        clock=FakeClock(T0),
    )
    rec.record(WARNING, "GpuUnhealthy", "x")
    rec.drain()
    read[0] = UID  # the agent's start has read the Node
    rec.record(NORMAL, "GpuHealthy", "y")
    rec.drain()
    uids = [o["involvedObject"]["uid"] for o in sink.objects.values()]
    assert uids == [NODE, UID]


def test_events_recorded_in_the_same_instant_get_different_names():
    sink = FakeSink()
    rec = recorder(sink)  # the clock stands still
    for i in range(3):
        rec.record(WARNING, "GpuUnhealthy", f"GPU {i} is unhealthy")
    rec.drain()
    assert len({name for _, name, _ in sink.calls}) == 3


def test_hotplug_events_name_the_gpu_its_uuid_and_bus_and_bound_the_devices_they_list():
    from dra_driver.cluster.node_events import devices_changed, gpu_added, gpu_removed

    kind, reason, msg = gpu_removed(3, "GPU-abc", "0000:1b:00.0")
    assert (kind, reason) == ("Warning", "GpuRemoved")
    assert "GPU 3 (GPU-abc, PCI 0000:1b:00.0)" in msg and "no longer advertised" in msg
    assert gpu_added(3, "GPU-abc", "0000:1b:00.0")[:2] == ("Normal", "GpuAdded")
    many = tuple(f"gpu-0-mig-1g10gb-19-{i}" for i in range(10))
    kind, reason, msg = devices_changed(many, ("gpu-0",))
    assert (kind, reason) == ("Normal", "DevicesChanged")
    assert msg.startswith("advertised devices changed: 10 added (gpu-0-mig-1g10gb-19-0, ")
    assert "and 2 more); 1 removed (gpu-0)" in msg and "gpu-0-mig-1g10gb-19-9" not in msg
