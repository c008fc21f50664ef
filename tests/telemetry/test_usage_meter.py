"""The sampler's feed of the usage ledger (agent/telemetry/usage_meter.py): weights, busy time
and energy per held device, from the samples and the telemetry's attribution of one tick."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.nvml.samples import GpuSample, MigSample
from agent.telemetry.gpuinfo import GpuInfo
from agent.telemetry.snapshot import ClaimUsage
from agent.telemetry.usage_meter import UsageMeter
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
