"""The sampler: isolation of failing reads, XID health, latest-wins publishing, the schedule."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import replace

import pytest

from agent.nvml.samples import GpuSample, XidEvent
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.gpu_health import GpuHealth
from agent.telemetry.gpuinfo import GpuInfo
from agent.telemetry.sampler import Sampler
from tests.fakeclock import FakeClock
from tests.telemetry.holders import Claim, Held

LOG = logging.getLogger("tessera.test.sampler")


class FakeStop(threading.Event):
    """Advances the fake clock instead of sleeping; set after ``ticks`` waits."""

    def __init__(self, clock: FakeClock, ticks: int) -> None:
        super().__init__()
        self.clock = clock
        self.left = ticks
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.waits.append(timeout)
        self.clock.t += timeout
        self.left -= 1
        if self.left <= 0:
            self.set()
        return self.is_set()


def info(index: int) -> GpuInfo:
    return GpuInfo(index, f"GPU-{index}", "NVIDIA H100 80GB HBM3", f"0000:{index:02x}:00.0", index)


class Node:
    """Scripted GPUs: 300 W each, energy counter from the clock; GPUs in ``failing`` raise."""

    def __init__(self, clock: FakeClock, cost: float = 0.0) -> None:
        self.clock = clock
        self.cost = cost
        self.failing: set[int] = set()
        self.reads: list[tuple[int, float]] = []
        self.extra: dict[int, float] = {}
        """Read number (1-based) -> extra seconds that read takes."""

    def read(self, index: int, now: float) -> GpuSample:
        self.reads.append((index, now))
        self.clock.t += self.cost + self.extra.get(len(self.reads), 0.0)
        if index in self.failing:
            raise RuntimeError(f"GPU {index} read failed")
        return GpuSample(index, f"GPU-{index}", now, energy_joules=300.0 * now, power_watts=300.0)


def holders() -> tuple[Claim, ...]:
    return (Claim("uid-a", "team-a", "job-a", (Held("node-a", "gpu-0", "gpu", "GPU-0", 0),)),)


def make(tmp_path, *, gpus: int = 3, cost: float = 0.0, interval: float = 1.0, **kw):
    clock = FakeClock(100.0)
    node = Node(clock, cost)
    sampler = Sampler(
        node="node-a",
        read=node.read,
        gpus=[info(i) for i in range(gpus)],
        holders=kw.pop("holders", holders),
        accounting=EnergyAccounting(tmp_path / "energy.json", clock),
        interval=interval,
        clock=clock,
        wall=lambda: 1.7e9 + clock.t,
        log=LOG,
        **kw,
    )
    return sampler, node, clock


def test_tick_publishes_a_complete_snapshot(tmp_path):
    sampler, _, clock = make(tmp_path, cost=0.01)
    assert sampler.latest is None
    sampler.tick()
    clock.t += 1
    snap = sampler.tick()
    assert sampler.latest is snap
    assert (snap.node, snap.tick, snap.interval_seconds, snap.lag_seconds) == ("node-a", 2, 1.0, 0)
    assert snap.tick_duration_seconds == pytest.approx(0.03)
    assert snap.wall_time == pytest.approx(1.7e9 + clock.t)
    assert snap.monotonic == clock.t
    assert [g.sample.index for g in snap.gpus] == [0, 1, 2]
    g0 = snap.gpus[0]
    assert (g0.name, g0.pci_bus_id, g0.healthy, g0.xid_counts) == (
        "NVIDIA H100 80GB HBM3",
        "0000:00:00.0",
        True,
        (),
    )
    assert g0.energy_joules_total == pytest.approx(300.0 * 1.03)
    (usage,) = snap.claims
    assert (usage.uid, usage.device, usage.rule) == ("uid-a", "gpu-0", "exclusive")
    assert usage.energy_joules_total == pytest.approx(g0.energy_joules_total)
    assert [(p.device, p.claim) for p in snap.prepared] == [("gpu-0", "job-a")]


def test_a_failing_read_marks_only_that_gpu_lost(tmp_path, caplog):
    changes: list[tuple[int, bool]] = []
    sampler, node, clock = make(
        tmp_path, on_health_change=lambda h: changes.append((h.index, h.healthy)), probe_reads=1
    )
    sampler.tick()
    node.failing = {1}
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        for _ in range(3):
            clock.t += 1
            snap = sampler.tick()
    lost = snap.gpus[1]
    assert lost.sample.lost and not lost.healthy
    assert lost.sample.errors == ("read: RuntimeError: GPU 1 read failed",)
    assert lost.sample.uuid == "GPU-1" and lost.name == "NVIDIA H100 80GB HBM3"
    for other in (snap.gpus[0], snap.gpus[2]):
        assert other.healthy and not other.sample.lost
        assert other.sample.power_watts == 300.0
        assert other.energy_joules_total == pytest.approx(900.0)
    assert sum("GPU read failed" in r.message for r in caplog.records) == 1  # not every tick
    node.failing = set()
    clock.t += 1
    snap = sampler.tick()
    assert snap.gpus[1].healthy and not snap.gpus[1].sample.lost
    assert changes == [(1, False), (1, True)]


def test_xid_health_rules(tmp_path):
    pending: list[XidEvent] = []

    def xids() -> list[XidEvent]:
        out = list(pending)
        pending.clear()
        return out

    changes: list[tuple[int, bool]] = []
    sampler, _, _ = make(
        tmp_path, xids=xids, on_health_change=lambda h: changes.append((h.index, h.healthy))
    )
    pending += [XidEvent(0, 13, None, None), XidEvent(0, 43, 1, 0), XidEvent(0, 13, None, None)]
    pending += [XidEvent(1, 31, None, None), XidEvent(2, 999, None, None)]
    pending += [XidEvent(7, 79, None, None)]  # no such GPU: ignored
    snap = sampler.tick()
    assert [g.healthy for g in snap.gpus] == [True, True, True]
    assert snap.gpus[0].xid_counts == ((13, 2), (43, 1))
    assert snap.gpus[2].xid_counts == ((999, 1),)
    pending.append(XidEvent(1, 79, None, None))
    snap = sampler.tick()
    assert [g.healthy for g in snap.gpus] == [True, False, True]
    assert snap.gpus[1].xid_counts == ((31, 1), (79, 1))
    snap = sampler.tick()  # fatal XIDs are sticky
    assert not snap.gpus[1].healthy
    assert changes == [(1, False)]


@pytest.mark.parametrize("xid", [48, 63, 64, 74, 79, 92, 94, 95])
def test_every_fatal_xid_makes_the_gpu_unhealthy(tmp_path, xid):
    sampler, _, _ = make(tmp_path, gpus=1, xids=lambda: [XidEvent(0, xid, None, None)])
    assert not sampler.tick().gpus[0].healthy


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 109])
def test_application_xids_keep_the_gpu_healthy(tmp_path, xid):
    sampler, _, _ = make(tmp_path, gpus=1, xids=lambda: [XidEvent(0, xid, None, None)])
    sampler.tick()
    snap = sampler.tick()
    assert snap.gpus[0].healthy and snap.gpus[0].xid_counts == ((xid, 2),)


def test_failing_sources_and_hooks_do_not_stop_the_tick(tmp_path, caplog):
    def boom() -> list[XidEvent]:
        raise OSError("event set gone")

    def no_checkpoint() -> tuple[Claim, ...]:
        raise OSError("checkpoint unreadable")

    def bad_hook(change: GpuHealth) -> None:
        raise RuntimeError("board gone")

    sampler, node, _ = make(tmp_path, xids=boom, holders=no_checkpoint, on_health_change=bad_hook)
    node.failing = {0}
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        snap = sampler.tick()
    assert not snap.gpus[0].healthy and snap.gpus[1].healthy
    assert snap.claims == () and snap.prepared == ()
    for text in ("reading XID events failed", "reading the prepared claims failed", "hook failed"):
        assert text in caplog.text


def test_set_gpus_reads_the_new_inventory(tmp_path):
    sampler, _, _ = make(tmp_path, gpus=2)
    sampler.tick()
    sampler.set_gpus([info(0), info(1), info(2)])
    assert [g.sample.index for g in sampler.tick().gpus] == [0, 1, 2]
    assert len(sampler.gpus) == 3


# -- publishing ------------------------------------------------------------------------------------


def test_subscribe_latest_wins_and_a_slow_consumer_never_blocks(tmp_path):
    """A consumer stuck on its first snapshot never holds the sampler up: 200 ticks complete
    while it is stuck (a blocking queue would deadlock here), and afterwards it gets the
    latest snapshot, not a backlog."""
    sampler, _, clock = make(tmp_path, gpus=1)
    slow = sampler.subscribe()
    stalled = sampler.subscribe(maxsize=2)  # never read
    seen: list[int] = []
    release, got_last = threading.Event(), threading.Event()

    def consume() -> None:
        while True:
            snap = slow.get(timeout=30)
            if snap is None:
                return
            seen.append(snap.tick)
            if snap.tick == 200:
                got_last.set()
            release.wait()  # stuck until the sampler is done

    def produce() -> None:
        for _ in range(200):
            clock.t += 1
            sampler.tick()

    consumer = threading.Thread(target=consume)
    producer = threading.Thread(target=produce)
    consumer.start()
    producer.start()
    try:
        producer.join(60)
        assert not producer.is_alive(), "the sampler blocked on a stuck consumer"
    finally:
        release.set()
    assert got_last.wait(30)
    slow.close()
    consumer.join(30)
    assert not consumer.is_alive()
    assert seen[-1] == 200 and seen == sorted(seen) and len(seen) < 200
    assert slow.dropped > 0
    assert [stalled.get(0).tick, stalled.get(0).tick] == [199, 200]  # type: ignore[union-attr]
    assert stalled.get(0) is None
    assert stalled.dropped == 198


def test_subscription_close_wakes_a_blocked_get_and_stops_delivery(tmp_path):
    sampler, _, _ = make(tmp_path, gpus=1)
    sub = sampler.subscribe()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(sub.get(timeout=10)))
    t.start()
    time.sleep(0.05)
    sub.close()
    t.join(5)
    assert got == [None] and sub.closed
    sampler.tick()
    assert sub.get(0) is None
    sub.close()  # idempotent
    with pytest.raises(ValueError):
        sampler.subscribe(maxsize=0)


# -- schedule --------------------------------------------------------------------------------------


def test_run_keeps_a_fixed_schedule_without_drift(tmp_path):
    sampler, node, clock = make(tmp_path, gpus=2, cost=0.15, interval=1.0)
    start = clock.t
    ticks: list[float] = []
    sub = sampler.subscribe(maxsize=100)
    sampler.run(FakeStop(clock, ticks=50))
    while (snap := sub.get(0)) is not None:
        ticks.append(snap.lag_seconds)
    starts = [t for i, t in node.reads if i == 0]
    assert len(starts) == 50
    assert starts == pytest.approx([start + k for k in range(50)])  # no drift: 0.3 s per tick
    assert ticks == [0.0] * 50
    assert sampler.missed_ticks == 0


def test_run_records_lag_and_skips_missed_slots(tmp_path):
    sampler, node, clock = make(tmp_path, gpus=1, interval=1.0)
    node.extra = {4: 1.2, 7: 2.5}  # read 4 overruns into the next slot, read 7 past two
    start = clock.t
    sub = sampler.subscribe(maxsize=100)
    sampler.run(FakeStop(clock, ticks=10))
    lags = []
    while (snap := sub.get(0)) is not None:
        lags.append(snap.lag_seconds)
    starts = [now - start for _, now in node.reads]
    # slot 4 starts 0.2 s late; slot 7 (due at 7) is skipped, slot 8 starts 0.5 s late
    assert starts == pytest.approx([0, 1, 2, 3, 4.2, 5, 6, 8.5, 9, 10])
    assert lags == pytest.approx([0, 0, 0, 0, 0.2, 0, 0, 0.5, 0, 0])
    assert sampler.missed_ticks == 1


def test_run_returns_at_once_when_stopped(tmp_path):
    sampler, node, clock = make(tmp_path)
    stop = FakeStop(clock, ticks=1)
    stop.set()
    sampler.run(stop)
    assert node.reads == [] and sampler.latest is None


def test_run_with_a_real_event_stops_promptly(tmp_path):
    node = Node(FakeClock(100.0))
    sampler = Sampler(
        node="node-a",
        read=node.read,
        gpus=[info(0)],
        holders=holders,
        accounting=EnergyAccounting(tmp_path / "energy.json", time.time),
        interval=0.01,
        log=LOG,
    )
    stop = threading.Event()
    sub = sampler.subscribe()
    t = threading.Thread(target=sampler.run, args=(stop,))
    t.start()
    while (snap := sub.get(timeout=30)) is not None and snap.tick < 2:
        pass
    stop.set()
    t.join(5)
    assert not t.is_alive()
    assert sampler.latest is not None and sampler.latest.tick >= 2
    assert sampler.fresh()


def test_fresh(tmp_path):
    sampler, _, clock = make(tmp_path, interval=2.0)
    assert not sampler.fresh()
    sampler.tick()
    assert sampler.fresh()
    clock.t += 5.9
    assert sampler.fresh() and not sampler.fresh(max_age=5.0)
    clock.t += 0.1
    assert not sampler.fresh()
    sampler.tick()
    assert sampler.fresh()


def test_interval_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        make(tmp_path, interval=0.0)


def test_health_and_xid_counts_follow_the_gpu_by_uuid_when_indexes_shift(tmp_path):
    """GPU 1 leaves: GPU 2 becomes index 1 and keeps its own fatal XID; GPU 1's state goes."""
    events = [XidEvent(1, 31, None, None), XidEvent(2, 79, None, None)]
    sampler, _, _ = make(tmp_path, xids=lambda: [events.pop(0)] if events else [])
    sampler.tick()
    sampler.tick()
    snap = sampler.tick()
    assert [(g.sample.index, g.healthy) for g in snap.gpus] == [(0, True), (1, True), (2, False)]
    shifted = replace(info(2), index=1)
    sampler.set_gpus([info(0), shifted])
    state = {g.sample.index: g for g in sampler.tick().gpus}
    assert state[1].healthy is False and state[1].xid_counts == ((79, 1),)
    assert state[0].healthy is True and state[0].xid_counts == ()


class BrokenUsage:
    """A usage meter with a bug."""

    def tick(self, *args: object) -> None:
        raise KeyError("a bug in usage accounting")


def test_a_failing_usage_meter_does_not_stop_the_tick(tmp_path, caplog):
    sampler, _, _ = make(tmp_path, usage=BrokenUsage())
    with caplog.at_level(logging.ERROR):
        snap = sampler.tick()
    assert sampler.latest is snap and snap.tick == 1 and len(snap.gpus) == 3
    assert any(r.getMessage() == "usage accounting failed this tick" for r in caplog.records)


def test_the_usage_meter_is_fed_every_tick_with_the_holders(tmp_path):
    from agent.telemetry.usage_meter import UsageMeter
    from agent.usage.weights import GpuCapacity

    meter = UsageMeter(tmp_path / "usage.json", "boot", LOG, wall=lambda: 1.7e9)
    sampler, _, clock = make(tmp_path, usage=meter)
    sampler.set_gpus(
        [dataclasses.replace(info(i), capacity=GpuCapacity(f"GPU-{i}", 80 << 30)) for i in range(3)]
    )
    sampler.tick()
    clock.t += 1
    sampler.tick()
    ((key, c),) = meter.counters().items()
    assert key[0] == "uid-a" and c.allocated_gpu_seconds == pytest.approx(1.0)
