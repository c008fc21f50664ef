"""The node's usage counters (agent/usage/counters.py): every interval counted once, across
crashes at any tick, restarts, handovers, reboots and driver reloads."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.usage.buckets import BUCKET_SECONDS, bucket_start
from agent.usage.counters import Held, Interval, UsageLedger

BOOT, OTHER_BOOT = "boot-1", "boot-2"
KEY = ("uid-1", "node-a", "gpu-0")
GPU = "GPU-0"


def iv(weight: float = 1.0, joules: float = 0.0, busy: float | None = None, key=KEY) -> Interval:
    return Interval(key, "team-a", "train", GPU, weight, "whole-gpu", joules, busy)


def test_an_interval_adds_allocated_busy_and_energy_and_is_on_disk_when_account_returns(
    tmp_path: Path,
):
    ledger = UsageLedger(tmp_path / "usage.json", BOOT, write_interval=5.0)
    ledger.account(1000.0, 0.0, [iv(0.5)], {GPU: 100.0})
    ledger.account(1010.0, 10.0, [iv(0.5, joules=1500.0, busy=0.25)], {GPU: 3100.0})
    c = ledger.counters()[KEY]
    assert (c.allocated_gpu_seconds, c.busy_gpu_seconds, c.energy_joules) == (5.0, 2.5, 1500.0)
    stored = UsageLedger(tmp_path / "usage.json", BOOT).counters()[KEY]
    assert stored == c
    assert UsageLedger(tmp_path / "usage.json", BOOT).through == 1010.0


def test_busy_time_that_was_not_measured_is_counted_as_unobserved(tmp_path: Path):
    ledger = UsageLedger(tmp_path / "usage.json", BOOT)
    ledger.account(1000.0, 4.0, [iv(1.0, busy=None)], {})
    c = ledger.counters()[KEY]
    assert (c.allocated_gpu_seconds, c.busy_gpu_seconds, c.unobserved_seconds) == (4.0, 0.0, 4.0)


def test_the_start_after_a_crash_counts_the_downtime_once(tmp_path: Path):
    path = tmp_path / "usage.json"
    ledger = UsageLedger(path, BOOT)
    ledger.account(1000.0, 0.0, [iv(0.5)], {GPU: 10_000.0})
    # kill -9: nothing more is written; the next agent starts 30 s later
    after = UsageLedger(path, BOOT)
    gap = after.credit_gap(1030.0, [KEY], {GPU: 16_000.0})
    assert (gap.reason, gap.seconds, gap.holdings) == ("credited", 30.0, 1)
    c = after.counters()[KEY]
    assert c.allocated_gpu_seconds == 15.0  # 30 s at weight 0.5
    assert c.energy_joules == 3000.0  # its half of the GPU's 6,000 J
    assert c.unobserved_seconds == 30.0
    assert after.credit_gap(1060.0, [KEY], {GPU: 20_000.0}).reason == "no-state"  # once
    assert UsageLedger(path, BOOT).counters()[KEY] == c  # the credit was written


def test_no_gap_is_credited_after_a_reboot_or_for_a_claim_no_longer_held(tmp_path: Path):
    path = tmp_path / "usage.json"
    UsageLedger(path, BOOT).account(1000.0, 0.0, [iv(1.0)], {GPU: 0.0})
    rebooted = UsageLedger(path, OTHER_BOOT)
    gap = rebooted.credit_gap(1100.0, [KEY], {GPU: 50.0})
    assert gap.reason == "rebooted"
    c = rebooted.counters()[KEY]
    assert c.allocated_gpu_seconds == 0.0 and c.released_at == 1100.0
    UsageLedger(tmp_path / "b.json", BOOT).account(1000.0, 0.0, [iv(1.0)], {})
    gone = UsageLedger(tmp_path / "b.json", BOOT)
    assert gone.credit_gap(1100.0, [], {}).holdings == 0


def test_a_driver_reload_in_the_gap_counts_the_energy_since_the_reload(tmp_path: Path):
    path = tmp_path / "usage.json"
    UsageLedger(path, BOOT).account(1000.0, 0.0, [iv(1.0)], {GPU: 900_000.0})
    after = UsageLedger(path, BOOT)
    after.credit_gap(1010.0, [KEY], {GPU: 2_000.0})  # the counter restarted at the reload
    assert after.counters()[KEY].energy_joules == 2_000.0


def test_a_clock_behind_the_file_counts_no_gap(tmp_path: Path):
    path = tmp_path / "usage.json"
    UsageLedger(path, BOOT).account(1000.0, 0.0, [iv(1.0)], {})
    assert UsageLedger(path, BOOT).credit_gap(990.0, [KEY], {}).reason == "clock-behind"


def test_a_released_claim_keeps_its_counters_for_the_retention_then_goes(tmp_path: Path):
    ledger = UsageLedger(tmp_path / "usage.json", BOOT, retention=60.0)
    ledger.account(1000.0, 10.0, [iv(1.0)], {})
    ledger.account(1001.0, 1.0, [], {})
    assert ledger.counters()[KEY].released_at == 1001.0
    assert ledger.counters()[KEY].allocated_gpu_seconds == 10.0
    ledger.account(1050.0, 49.0, [], {})
    assert KEY in ledger.counters()
    ledger.account(1062.0, 12.0, [], {})
    assert KEY not in ledger.counters()


def test_a_failed_write_keeps_counting_in_memory_and_the_next_write_catches_up(tmp_path: Path):
    path = tmp_path / "state" / "usage.json"
    ledger = UsageLedger(path, BOOT, write_interval=5.0)
    ledger.account(1000.0, 5.0, [iv(1.0)], {})
    (tmp_path / "state").rename(tmp_path / "elsewhere")
    (tmp_path / "state").write_text("a file where the directory was")  # root cannot write either
    with pytest.raises(OSError):
        ledger.account(1010.0, 10.0, [iv(1.0)], {})
    assert ledger.counters()[KEY].allocated_gpu_seconds == 15.0 and ledger.through == 1000.0
    (tmp_path / "state").unlink()
    (tmp_path / "elsewhere").rename(tmp_path / "state")
    assert ledger.account(1011.0, 1.0, [iv(1.0)], {})  # written at once: the last one failed
    assert UsageLedger(path, BOOT).counters()[KEY].allocated_gpu_seconds == 16.0


def test_the_file_is_written_when_a_holding_comes_or_goes_else_every_write_interval(
    tmp_path: Path,
):
    path = tmp_path / "usage.json"
    ledger = UsageLedger(path, BOOT, write_interval=5.0)
    assert ledger.account(1000.0, 0.0, [iv(1.0)], {})  # the first
    assert not ledger.account(1001.0, 1.0, [iv(1.0)], {})
    other = ("uid-2", "node-a", "gpu-1")
    assert ledger.account(1002.0, 1.0, [iv(1.0), iv(1.0, key=other)], {})  # one came
    assert not ledger.account(1003.0, 1.0, [iv(1.0), iv(1.0, key=other)], {})
    assert ledger.account(1004.0, 1.0, [iv(1.0)], {})  # one went
    assert not ledger.account(1008.0, 4.0, [iv(1.0)], {})
    assert ledger.account(1009.0, 1.0, [iv(1.0)], {})  # 5 s since the last write
    assert UsageLedger(path, BOOT).through == 1009.0


def test_a_corrupt_file_is_moved_aside_and_counting_starts_again(tmp_path: Path, caplog):
    path = tmp_path / "usage.json"
    path.write_text(json.dumps({"kind": "TesseraUsageLedger", "version": 1, "holdings": 3}))
    ledger = UsageLedger(path, BOOT)
    assert ledger.counters() == {} and ledger.through is None
    assert [p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert "usage ledger is corrupt" in caplog.text


# -- the arithmetic, under crashes at any tick ------------------------------------------------


def _overlap(a: float, b: float, start: int) -> float:
    return max(0.0, min(b, start + BUCKET_SECONDS) - max(a, start))


@given(
    ticks=st.lists(
        st.tuples(
            st.floats(min_value=0.05, max_value=5.0),  # seconds since the previous tick
            st.floats(min_value=0.0, max_value=700.0),  # the GPU's power in that interval
            st.floats(min_value=0.0, max_value=1.0),  # its utilization
            # after this tick the agent is killed, or the controller acknowledges every bucket
            # before now, or a report writes the file, or nothing happens
            st.sampled_from(["crash", "ack", "report", "none", "none"]),
            st.floats(min_value=0.0, max_value=2_000.0),  # a killed agent restarts this later
        ),
        min_size=1,
        max_size=40,
    ),
    weight=st.sampled_from([1.0, 0.5, (1 / 7 + 1 / 8) / 2, 0.25]),
    first=st.floats(min_value=0.0, max_value=BUCKET_SECONDS),  # where in a bucket it starts
    # the sampler's path: the same Held tuple every tick (its records found once); or a new
    # list of intervals every tick
    same_held=st.booleans(),
)
def test_allocated_time_and_energy_are_exact_across_any_crashes(ticks, weight, first, same_held):
    """A claim held throughout: whatever ticks the agent is killed after and however long it is
    down, its allocated GPU-seconds are weight x the time held and its energy weight x the GPU's,
    exactly once. Busy GPU-seconds are exact for what was written before each crash; the rest of
    the time (what was counted only in memory, and the downtime) is counted as unobserved.

    The 15-minute buckets hold the same counts split by time: each bucket's allocated
    GPU-seconds are weight x the seconds held within it (so a split at a boundary that is wrong,
    or a second counted twice, fails), a closed bucket never changes, only acknowledged closed
    buckets are dropped, and the buckets kept plus those dropped sum to the counters."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "usage.json"
        t0 = 1_800_000_000.0 - BUCKET_SECONDS + first
        now, energy = t0, 5_000.0
        ledger = UsageLedger(path, BOOT)
        ledger.account(now, 0.0, [iv(weight)], {GPU: energy})
        start_energy = energy
        busy = unobserved = 0.0  # what the counters hold in memory
        written = (now, busy, unobserved)  # what the file holds: through, busy, unobserved
        dropped: dict[int, tuple[float, float, float, float]] = {}
        closed_seen: dict[int, tuple[float, float, float, float]] = {}
        acked = 0.0
        held = (Held(KEY, "team-a", "train", GPU, weight, "whole-gpu"),)
        for seconds, watts, util, action, downtime in ticks:
            now += seconds
            energy += watts * seconds
            busy += util * weight * seconds
            joules = watts * seconds * weight
            if same_held:
                wrote = ledger.account_held(
                    now, seconds, held, [joules], [util * weight * seconds], [0.0], {GPU: energy}
                )
            else:
                wrote = ledger.account(
                    now, seconds, [iv(weight, joules, util * weight)], {GPU: energy}
                )
            if wrote:
                written = (now, busy, unobserved)
            for start, entries in ledger.buckets.items():  # a closed bucket never changes
                if ledger.buckets.closed(start):
                    (u,) = entries.values()
                    got = (u.allocated, u.busy, u.energy, u.unobserved)
                    assert closed_seen.setdefault(start, got) == pytest.approx(got, rel=1e-12)
            if action == "report":
                assert ledger.report()[0] == now
                written = (now, busy, unobserved)
            elif action == "ack":
                before = {s: next(iter(e.values())) for s, e in ledger.buckets.items() if e}
                ledger.acknowledge(now)
                acked = max(acked, now)
                for start, u in before.items():
                    if start not in dict(ledger.buckets.items()):
                        assert start < now and start + BUCKET_SECONDS <= now  # closed, acked
                        dropped[start] = (u.allocated, u.busy, u.energy, u.unobserved)
            elif action == "crash":
                now += downtime
                energy += 300.0 * downtime  # the GPU kept working while no agent watched
                through, busy, unobserved = written  # what was only in memory is gone
                unobserved += now - through  # the gap: held, not observed
                ledger = UsageLedger(path, BOOT)  # the next agent
                ledger.credit_gap(now, [KEY], {GPU: energy})
                written = (now, busy, unobserved)
                closed_seen = {}  # the file's closed buckets may be older than memory's were
        c = ledger.counters()[KEY]
        held = now - t0
        # wall-clock seconds near 1.8e9 are exact to 2.4e-7 s: a sum of 80 is exact to 1e-4
        assert c.allocated_gpu_seconds == pytest.approx(weight * held, rel=1e-9, abs=1e-4)
        assert c.energy_joules == pytest.approx(
            weight * (energy - start_energy), rel=1e-9, abs=1e-6
        )
        assert c.busy_gpu_seconds == pytest.approx(busy, rel=1e-9, abs=1e-9)
        assert c.unobserved_seconds == pytest.approx(unobserved, rel=1e-9, abs=1e-9)
        assert c.busy_gpu_seconds <= c.allocated_gpu_seconds + 1e-9

        kept = {s: next(iter(e.values())) for s, e in ledger.buckets.items()}
        totals = [0.0, 0.0, 0.0, 0.0]
        for start in range(bucket_start(t0), bucket_start(now) + 1, BUCKET_SECONDS):
            if start in kept:
                u = kept[start]
                got = (u.allocated, u.busy, u.energy, u.unobserved)
            elif start == now:  # the last second counted is its start: nothing is in it yet
                got = (0.0, 0.0, 0.0, 0.0)
            else:  # only a closed bucket the controller acknowledged is ever dropped
                assert start + BUCKET_SECONDS <= now and start < acked, start
                got = dropped[start]
            # the integral: every second held is in the bucket it was held in, once
            assert got[0] == pytest.approx(weight * _overlap(t0, now, start), rel=1e-9, abs=1e-4)
            totals = [a + b for a, b in zip(totals, got, strict=True)]
        assert set(kept) <= set(range(bucket_start(t0), bucket_start(now) + 1, BUCKET_SECONDS))
        expected = (c.allocated_gpu_seconds, c.busy_gpu_seconds, c.energy_joules)
        assert tuple(totals[:3]) == pytest.approx(expected, rel=1e-9, abs=1e-6)
        assert totals[3] == pytest.approx(c.unobserved_seconds, rel=1e-9, abs=1e-9)


KEYS = [("uid-1", "node-a", "gpu-0"), ("uid-2", "node-a", "gpu-1"), ("uid-3", "node-a", "gpu-0")]


def _state(ledger: UsageLedger) -> tuple[object, object]:
    buckets = {
        s: {k: (u.namespace, u.claim, u.allocated, u.busy, u.energy, u.unobserved)
            for k, u in e.items()}
        for s, e in ledger.buckets.items()
    }  # fmt: skip
    return ledger.counters(), buckets


@given(
    ticks=st.lists(
        st.tuples(
            st.frozensets(st.sampled_from(range(len(KEYS)))),  # who holds a device now
            st.floats(min_value=0.5, max_value=400.0),  # seconds since the previous tick
            st.floats(min_value=-5.0, max_value=50.0),  # each one's joules (negative: a reset)
            st.one_of(st.none(), st.floats(min_value=0.0, max_value=1.5)),  # busy GPUs
            st.sampled_from([0.25, 0.5, 1.0]),  # the weight, when the holders change
        ),
        min_size=1,
        max_size=30,
    )
)
def test_the_sampler_path_counts_as_the_general_one_while_holders_come_and_go(ticks):
    """``account_held`` finds the records and bucket entries once per ``Held`` tuple (the
    sampler hands the same one every tick while nobody comes or goes): whatever comes, goes,
    changes weight, expires past the retention or crosses a bucket boundary, its counters,
    buckets and writes are those of ``account`` given new intervals every tick."""
    with tempfile.TemporaryDirectory() as d:
        general = UsageLedger(Path(d) / "a.json", BOOT, retention=600.0)
        sampler = UsageLedger(Path(d) / "b.json", BOOT, retention=600.0)
        now = 1_800_000_000.0 - 100.0
        held: tuple[Held, ...] = ()
        holders: frozenset[int] | None = None
        for who, seconds, joules, busy, weight in ticks:
            now += seconds
            if who != holders:  # a new tuple only when the holders change, as the sampler does
                holders = who
                held = tuple(
                    Held(KEYS[i], "team-a", f"claim-{i}", GPU, weight, "r", "A100", None, "gpu")
                    for i in sorted(who)
                )
            intervals = [
                Interval(h.key, h.namespace, h.claim, h.gpu_uuid, h.weight, h.rule, joules,
                         busy, h.product, h.mig_profile, h.device_class)
                for h in held
            ]  # fmt: skip
            energy = {GPU: 1000.0 + now}
            busy_s = 0.0 if busy is None else min(busy, 1.0) * seconds
            idle = seconds if busy is None else 0.0
            n = len(held)
            wrote = sampler.account_held(
                now, seconds, held, [joules] * n, [busy_s] * n, [idle] * n, energy
            )
            assert general.account(now, seconds, intervals, energy) == wrote
            assert _state(sampler) == _state(general)
        assert json.loads((Path(d) / "a.json").read_bytes()) == json.loads(
            (Path(d) / "b.json").read_bytes()
        )
