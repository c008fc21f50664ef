"""A holding that comes or goes between two telemetry ticks is counted from or to the moment the
claims holding devices changed (the preparer's checkpoint commit), not from or to a tick: so a
late tick (a loaded node) or a long interval moves no GPU-second (agent/telemetry/usage_meter.py,
docs/budgets.md "When a claim starts and stops counting")."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.telemetry.usage_meter import UsageMeter
from agent.usage.counters import UsageLedger
from tests.fakeclock import FakeClock
from tests.telemetry.holders import Claim
from tests.telemetry.test_usage_meter import (
    GPUS,
    MIG,
    WEIGHT_MIG,
    WHOLE,
    meter,
    samples,
    usage,
)


def allocated(m: UsageMeter) -> dict[str, float]:
    return {k[0]: c.allocated_gpu_seconds for k, c in m.counters().items()}


def tick(
    m: UsageMeter,
    wall: FakeClock,
    mono: float,
    held: list[Claim],
    changed: dict[str, float] | None = None,
) -> None:
    wall.t = 1000.0 + mono
    m.tick(mono, samples(mono), GPUS, held, [usage(c, 0.0) for c in held], changed or {})


def test_a_claim_released_between_ticks_is_counted_to_its_release(tmp_path: Path):
    wall = FakeClock()
    m = meter(tmp_path, wall)
    tick(m, wall, 10.0, [WHOLE, MIG])
    tick(m, wall, 11.0, [WHOLE, MIG])
    # MIG's claim was unprepared at 11.3; the next tick came late, at 13.0
    tick(m, wall, 13.0, [WHOLE], changed={"uid-b": 11.3})
    got = allocated(m)
    assert got["uid-b"] == pytest.approx(WEIGHT_MIG * 1.3)  # the tick said 1.0
    assert got["uid-a"] == pytest.approx(3.0)  # a holding held throughout loses nothing
    # the file says the released one was held through 11.3, the others to the tick
    assert UsageLedger(tmp_path / "usage.json", "boot").through == pytest.approx(1013.0)


def test_a_claim_prepared_between_ticks_is_counted_from_its_prepare(tmp_path: Path):
    wall = FakeClock()
    m = meter(tmp_path, wall)
    tick(m, wall, 10.0, [WHOLE])
    tick(m, wall, 12.0, [WHOLE, MIG], changed={"uid-b": 11.75})
    got = allocated(m)
    assert got["uid-b"] == pytest.approx(WEIGHT_MIG * 0.25)  # the tick said 2.0
    assert got["uid-a"] == pytest.approx(2.0)


def test_several_claims_coming_and_going_between_two_ticks_are_each_counted_exactly(
    tmp_path: Path,
):
    wall = FakeClock()
    m = meter(tmp_path, wall)
    tick(m, wall, 10.0, [])
    # both prepared between two ticks, a second apart
    tick(m, wall, 12.0, [WHOLE, MIG], changed={"uid-a": 10.5, "uid-b": 11.5})
    assert allocated(m) == pytest.approx({"uid-a": 1.5, "uid-b": WEIGHT_MIG * 0.5})
    # one released; the other's change (it was held at both ticks) moves nothing
    tick(m, wall, 15.0, [WHOLE], changed={"uid-a": 14.0, "uid-b": 12.25})
    assert allocated(m) == pytest.approx({"uid-a": 4.5, "uid-b": WEIGHT_MIG * 0.75})
    # one released and the other prepared again, in one interval
    tick(m, wall, 16.0, [MIG], changed={"uid-a": 15.5, "uid-b": 15.25})
    assert allocated(m) == pytest.approx({"uid-a": 5.0, "uid-b": WEIGHT_MIG * 1.5})


def test_a_change_the_last_tick_already_saw_splits_nothing(tmp_path: Path):
    """A change at or before the last tick is one that tick counted (or, for a claim the meter
    did not see come, one too old to be kept): the new holders take the whole interval."""
    wall = FakeClock()
    m = meter(tmp_path, wall)
    tick(m, wall, 10.0, [WHOLE], changed={"uid-a": 9.0})
    tick(m, wall, 12.0, [WHOLE, MIG], changed={"uid-b": 10.0})
    assert allocated(m)["uid-b"] == pytest.approx(WEIGHT_MIG * 2.0)


def test_a_stop_counts_up_to_itself_and_a_release_since_the_last_tick(tmp_path: Path):
    wall = FakeClock()
    m = meter(tmp_path, wall)
    tick(m, wall, 10.0, [WHOLE, MIG])
    tick(m, wall, 11.0, [WHOLE, MIG])
    wall.t = 1011.6
    m.close(
        11.6, [WHOLE], changed={"uid-b": 11.4}
    )  # MIG's claim released at 11.4, the stop at 11.6
    stored = UsageLedger(tmp_path / "usage.json", "boot")
    got = {k[0]: c.allocated_gpu_seconds for k, c in stored.counters().items()}
    assert got["uid-b"] == pytest.approx(WEIGHT_MIG * 1.4)
    assert got["uid-a"] == pytest.approx(1.6)
    assert stored.through == pytest.approx(1011.6)  # the next start counts from the stop


def test_a_stop_without_the_holders_keeps_the_last_ticks_count(tmp_path: Path):
    wall = FakeClock()
    m = meter(tmp_path, wall)
    tick(m, wall, 10.0, [WHOLE])
    tick(m, wall, 11.0, [WHOLE])
    wall.t = 1011.6
    m.close(11.6, None)  # the holders could not be read: the next start credits the gap
    stored = UsageLedger(tmp_path / "usage.json", "boot")
    assert stored.through == pytest.approx(1011.0)
    assert [c.allocated_gpu_seconds for c in stored.counters().values()] == [pytest.approx(1.0)]


@settings(deadline=None, max_examples=150)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(1, 16).map(lambda n: n / 8),  # seconds to the next tick, in eighths
            # for each claim: None (no change) or where in the interval it came or went (0-1)
            st.tuples(*[st.one_of(st.none(), st.integers(1, 7).map(lambda n: n / 8))] * 2),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_every_claim_is_counted_for_exactly_the_time_it_was_held(steps):
    """Whatever the claims do between ticks (each coming or going at most once per interval),
    each is counted for exactly the time it held its device: the ticks never show."""
    claims = (WHOLE, MIG)
    weight = {"uid-a": 1.0, "uid-b": WEIGHT_MIG}
    with tempfile.TemporaryDirectory() as d:
        wall = FakeClock()
        m = meter(Path(d), wall)
        mono, held = 10.0, {"uid-a"}
        expected = {"uid-a": 0.0, "uid-b": 0.0}
        tick(m, wall, mono, [c for c in claims if c.uid in held])
        for seconds, toggles in steps:
            changed = {}
            for c, at in zip(claims, toggles, strict=True):
                was = c.uid in held
                until = seconds if at is None else at * seconds
                expected[c.uid] += until if was else seconds - until
                if at is not None:
                    changed[c.uid] = mono + at * seconds
                    held ^= {c.uid}
            mono += seconds
            tick(m, wall, mono, [c for c in claims if c.uid in held], changed)
        got = allocated(m)
        for uid, seconds in expected.items():
            assert got.get(uid, 0.0) == pytest.approx(weight[uid] * seconds, abs=1e-9), uid
