"""The sampler's feed of the usage ledger (agent/telemetry/usage_meter.py): weights, busy time
and energy per held device, from the samples and the telemetry's attribution of one tick."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.nvml.samples import GpuSample, MigSample
from agent.telemetry.gpuinfo import GpuInfo
from agent.telemetry.snapshot import ClaimUsage
from agent.telemetry.usage_meter import UsageMeter
from agent.usage.buckets import BUCKET_SECONDS, bucket_start
from agent.usage.weights import GpuCapacity
from tests.fakeclock import FakeClock
from tests.telemetry.holders import Claim, Held

GIB = 1024**3
GPU0, GPU1 = "GPU-0", "GPU-1"
# an H100-like GPU: 1g.10gb is profile 19 (1 of 7 compute slices, 1 of 8 memory slices)
MIG_GPU = GpuCapacity(GPU1, 80 * GIB, 7, 8, ((19, 1, 1), (0, 7, 8)), ((9, 19),))
GPUS = [
    GpuInfo(0, GPU0, "H100", "0000:01:00.0", 0, capacity=GpuCapacity(GPU0, 80 * GIB)),
    GpuInfo(1, GPU1, "H100", "0000:02:00.0", 1, capacity=MIG_GPU),
]
WHOLE = Claim("uid-a", "team-a", "train", (Held("node-a", "gpu-0", "gpu", GPU0, 0),))
MIG = Claim(
    "uid-b", "team-b", "infer", (Held("node-a", "gpu-1-mig-1g10gb-19-0", "mig", GPU1, 1, 9),)
)


def samples(t: float, util: float = 0.5, mig_util: float | None = 0.8) -> list[GpuSample]:
    mig = MigSample(9, 0, "MIG-1", None, None, mig_util)
    return [
        GpuSample(0, GPU0, t, utilization_gpu=util, energy_joules=1000.0 * t),
        GpuSample(1, GPU1, t, energy_joules=500.0 * t, mig=(mig,)),
    ]


def usage(claim: Claim, joules: float, share: float | None = 1.0) -> ClaimUsage:
    d = claim.devices[0]
    return ClaimUsage(
        claim.namespace, claim.name, claim.uid, d.pool, d.device, 0, "x", joules, 0, share
    )


def meter(tmp_path: Path, wall: FakeClock) -> UsageMeter:
    return UsageMeter(tmp_path / "usage.json", "boot", logging.getLogger("t"), wall=wall)


def test_busy_time_is_the_gpus_utilization_times_the_share_or_the_mig_devices_times_its_weight(
    tmp_path: Path,
):
    wall = FakeClock(1000.0)
    m = meter(tmp_path, wall)
    m.tick(10.0, samples(10.0), GPUS, [WHOLE, MIG], [usage(WHOLE, 0.0), usage(MIG, 0.0)])
    wall.advance(2.0)
    m.tick(
        12.0,
        samples(12.0, util=0.5),
        GPUS,
        [WHOLE, MIG],
        [usage(WHOLE, 700.0, share=0.5), usage(MIG, 40.0)],
    )
    c = {k[0]: v for k, v in m.counters().items()}
    weight = (1 / 7 + 1 / 8) / 2
    assert c["uid-a"].allocated_gpu_seconds == pytest.approx(2.0)
    assert c["uid-a"].busy_gpu_seconds == pytest.approx(0.5 * 0.5 * 2.0)
    assert c["uid-a"].energy_joules == pytest.approx(700.0)  # the attribution's increase
    assert c["uid-b"].allocated_gpu_seconds == pytest.approx(weight * 2.0)
    assert c["uid-b"].busy_gpu_seconds == pytest.approx(0.8 * weight * 2.0)
    assert (c["uid-a"].rule, c["uid-b"].rule) == ("whole-gpu", "mig-slices")
    assert c["uid-a"].unobserved_seconds == 0.0


def test_unmeasured_busy_time_is_unobserved_and_unknown_holders_count_nothing(tmp_path: Path):
    wall = FakeClock(1000.0)
    m = meter(tmp_path, wall)
    m.tick(10.0, samples(10.0), GPUS, [MIG], [usage(MIG, 0.0)])
    wall.advance(1.0)
    m.tick(11.0, samples(11.0), GPUS, None, [])  # holders unknown this tick: nothing
    wall.advance(1.0)
    m.tick(12.0, samples(12.0, mig_util=None), GPUS, [MIG], [usage(MIG, 0.0)])
    (c,) = m.counters().values()
    assert c.unobserved_seconds == pytest.approx(2.0)  # the unknown tick's time is covered
    assert c.busy_gpu_seconds == 0.0


def test_a_claim_prepared_later_is_weighed_and_counted_from_its_first_tick(tmp_path: Path):
    wall = FakeClock(1000.0)
    m = meter(tmp_path, wall)
    m.tick(10.0, samples(10.0), GPUS, [WHOLE], [usage(WHOLE, 0.0)])
    wall.advance(1.0)
    m.tick(11.0, samples(11.0), GPUS, [WHOLE, MIG], [usage(WHOLE, 0.0), usage(MIG, 5.0)])
    c = {k[0]: v for k, v in m.counters().items()}
    assert c["uid-b"].energy_joules == 5.0  # new since the meter started: all of it is new
    assert c["uid-b"].allocated_gpu_seconds == pytest.approx((1 / 7 + 1 / 8) / 2)
    assert m.through == 1001.0  # a holding came: written at once


WEIGHT_MIG = (1 / 7 + 1 / 8) / 2
HOLDER_SETS = [(), (WHOLE,), (MIG,), (WHOLE, MIG)]


@settings(deadline=None)
@given(
    ticks=st.lists(
        st.tuples(
            # who holds a device from this tick on (None, mostly: as before)
            st.one_of(st.none(), st.none(), st.none(), st.sampled_from(range(len(HOLDER_SETS)))),
            # seconds since the tick before, in eighths: every wall-clock second near 1.8e9 is
            # then exact, so the test's own arithmetic is exact too
            # (mostly a few seconds, as ticks are: several between two writes)
            st.one_of(st.integers(1, 40), st.integers(1, 40), st.integers(1, 960)).map(
                lambda n: n / 8
            ),
            st.floats(min_value=0.0, max_value=1.0),  # the whole GPU's utilization
            st.one_of(st.none(), st.floats(min_value=0.0, max_value=1.0)),  # the MIG device's
            st.floats(min_value=0.0, max_value=500.0),  # each holder's energy in the tick
            st.sampled_from(["none"] * 7 + ["counters", "claim", "report"]),  # then a read
        ),
        min_size=1,
        max_size=40,
    ),
    first=st.integers(min_value=0, max_value=7200).map(lambda n: n / 8),  # where in a quarter hour
)
def test_one_interval_per_write_counts_what_every_tick_would(ticks, first):
    """The meter hands the ledger one interval per write (or per change of holders, bucket
    boundary or read), not one per tick: whatever the holders, utilizations, energy, bucket
    boundaries and reads, the counters and each 15-minute bucket are what counting every tick
    on its own gives, and every read sees the last tick."""
    with tempfile.TemporaryDirectory() as d:
        wall = FakeClock(1_800_000_000.0 - 900.0 + first)
        m = meter(Path(d), wall)
        mono = 10.0
        totals = {"uid-a": 0.0, "uid-b": 0.0}
        want: dict[str, list[float]] = {}  # uid -> allocated, busy, energy, unobserved
        buckets: dict[tuple[int, str], list[float]] = {}
        ever: list[Claim] = []

        def claims() -> list[ClaimUsage]:
            return [usage(c, totals[c.uid]) for c in ever]

        m.tick(mono, samples(mono), GPUS, [], [])
        holders: tuple[Claim, ...] = (WHOLE, MIG)
        listed = list(holders)  # the same objects while the holders stay, as the driver's are
        for who, seconds, util, mig_util, joules, read in ticks:
            if who is not None and HOLDER_SETS[who] != holders:
                holders = HOLDER_SETS[who]
                listed = list(holders)
            mono += seconds
            wall.advance(seconds)
            start = wall.t - seconds
            for c in holders:
                if c not in ever:
                    ever.append(c)
                totals[c.uid] += joules
                weight = 1.0 if c is WHOLE else WEIGHT_MIG
                if c is WHOLE:
                    adds = [weight * seconds, util * seconds, joules, 0.0]
                elif mig_util is None:
                    adds = [weight * seconds, 0.0, joules, seconds]
                else:
                    adds = [weight * seconds, mig_util * weight * seconds, joules, 0.0]
                want[c.uid] = [a + b for a, b in zip(want.get(c.uid, [0.0] * 4), adds, strict=True)]
                for b in range(bucket_start(start), bucket_start(wall.t) + 1, BUCKET_SECONDS):
                    part = max(0.0, min(wall.t, b + BUCKET_SECONDS) - max(start, b)) / seconds
                    if part > 0:
                        got = buckets.setdefault((b, c.uid), [0.0] * 4)
                        buckets[(b, c.uid)] = [x + y * part for x, y in zip(got, adds, strict=True)]
            m.tick(mono, samples(mono, util=util, mig_util=mig_util), GPUS, listed, claims())
            if read == "counters":
                _check(m.counters(), want)
            elif read == "claim":
                totals_now = m.claim_totals("uid-a")
                assert totals_now is not None and totals_now[0] == wall.t
            elif read == "report":
                report = m.report(10**6)
                assert report is not None and report[0] == wall.t  # written through the last tick
        _check(m.counters(), want)
        kept = {
            (b, k[0]): [u.allocated, u.busy, u.energy, u.unobserved]
            for b, entries in m._ledger.buckets.items()  # the ledger's own view
            for k, u in entries.items()
        }
        assert set(kept) == {k for k, v in buckets.items() if v[0] > 0} | {
            k for k in kept if not any(kept[k])
        }
        for k, v in buckets.items():
            assert kept.get(k, [0.0] * 4) == pytest.approx(v, rel=1e-9, abs=1e-9), k


def _check(counters: dict, want: dict[str, list[float]]) -> None:
    got = {k[0]: c for k, c in counters.items()}
    assert set(got) == set(want)
    for uid, (allocated, busy, energy, unobserved) in want.items():
        c = got[uid]
        assert (
            c.allocated_gpu_seconds,
            c.busy_gpu_seconds,
            c.energy_joules,
            c.unobserved_seconds,
        ) == pytest.approx((allocated, busy, energy, unobserved), rel=1e-9, abs=1e-9), uid
