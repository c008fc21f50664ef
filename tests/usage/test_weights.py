"""How much of a physical GPU a prepared device holds (agent/usage/weights.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.nvml.facade import Nvml
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from agent.usage.weights import (
    MEMORY_SHARE,
    MIG_SLICES,
    TIME_SLICED,
    WHOLE_GPU,
    GpuCapacity,
    Holding,
    capacity_of,
    weights,
)
from tests.telemetry.holders import Held

GIB = 1024**3


def Dev(
    device: str,
    gpu_uuid: str = "GPU-0",
    kind: str = "gpu",
    *,
    gpu_instance_id: int | None = None,
    sharing: str | None = None,
    memory_bytes: int | None = None,
) -> Held:
    """A held device as the checkpoint records it."""
    return Held("node-a", device, kind, gpu_uuid, 0, gpu_instance_id, sharing, memory_bytes)


@functools.cache
def capacity(model: str, index: int = 0) -> GpuCapacity:
    """The capacity of a simulated model's GPU as discovery reads it (the simulator's NVML)."""
    import tempfile

    with tempfile.TemporaryDirectory() as state:
        nv = Nvml(FakeNvml(load_model(model), Path(state)))
        nv.init()
        try:
            return capacity_of(nv.devices()[index])
        finally:
            nv.shutdown()


def one(dev: Dev, gpus: list[GpuCapacity], uid: str = "c1") -> tuple[float, str]:
    found, unknown = weights([Holding(uid, dev)], gpus)
    assert unknown == ()
    (w,) = found
    return w.weight, w.rule


def test_a_whole_gpu_weighs_one_shared_with_its_own_mps_daemon_too():
    gpu = GpuCapacity("GPU-0", 80 * GIB)
    assert one(Dev("gpu-0"), [gpu]) == (1.0, WHOLE_GPU)
    assert one(Dev("gpu-0", sharing="MPS"), [gpu]) == (1.0, WHOLE_GPU)


def test_the_a100_and_h100_mig_profiles_weigh_their_mean_slice_fractions():
    a100 = capacity("dgx-a100")
    assert (a100.compute_slices, a100.memory_slices) == (7, 8)
    uuid = a100.uuid
    w, rule = one(Dev("gpu-0-mig-1g5gb-19-0", uuid, "mig"), [a100])
    assert rule == MIG_SLICES and w == pytest.approx((1 / 7 + 1 / 8) / 2)
    w, _ = one(Dev("gpu-0-mig-3g20gb-9-4", uuid, "mig"), [a100])
    assert w == pytest.approx((3 / 7 + 4 / 8) / 2)
    w, _ = one(Dev("gpu-0-mig-7g40gb-0-0", uuid, "mig"), [a100])
    assert w == pytest.approx(1.0)
    assert a100.mig_profile_name("gpu-0-mig-3g20gb-9-4", None) == "3g.20gb"  # for prices


def test_mig_devices_side_by_side_never_weigh_more_than_their_gpu():
    h100 = capacity("dgx-h100")
    pair = [
        Holding("a", Dev("gpu-0-mig-3g40gb-9-0", h100.uuid, "mig")),
        Holding("b", Dev("gpu-0-mig-4g40gb-5-4", h100.uuid, "mig")),
    ]
    found, _ = weights(pair, [h100])
    assert sum(w.weight for w in found) <= 1.0
    assert [w.rule for w in found] == [MIG_SLICES, MIG_SLICES]


def test_a_mig_device_of_an_unknown_profile_weighs_nothing_and_is_named():
    a100 = capacity("dgx-a100")
    h = Holding("c1", Dev("gpu-0-mig-9g99gb-99-0", a100.uuid, "mig"))
    found, unknown = weights([h], [a100])
    assert found == () and unknown == (h,)
    elsewhere = Holding("c2", Dev("gpu-3", "GPU-not-here"))
    assert weights([elsewhere], [a100]) == ((), (elsewhere,))


def test_a_memory_share_weighs_its_memory_and_time_slicers_split_the_gpu():
    gpu = GpuCapacity("GPU-0", 80 * GIB)
    assert one(Dev("gpu-0", sharing="MemoryShare", memory_bytes=20 * GIB), [gpu]) == (
        0.25,
        MEMORY_SHARE,
    )
    three = [Holding(f"c{i}", Dev("gpu-0", sharing="TimeSlicing")) for i in range(3)]
    found, _ = weights(three, [gpu])
    assert [(w.weight, w.rule) for w in found] == [(pytest.approx(1 / 3), TIME_SLICED)] * 3


def test_a_malformed_checkpoint_cannot_make_a_gpu_weigh_more_than_one():
    gpu = GpuCapacity("GPU-0", 80 * GIB)
    twice = [Holding("a", Dev("gpu-0")), Holding("b", Dev("gpu-0"))]
    found, _ = weights(twice, [gpu])
    assert [w.weight for w in found] == [0.5, 0.5]


@given(
    shares=st.lists(st.integers(min_value=1, max_value=80), min_size=1, max_size=8),
    slicers=st.integers(min_value=0, max_value=5),
)
def test_the_weights_on_one_gpu_sum_to_at_most_one(shares, slicers):
    gpu = GpuCapacity("GPU-0", 80 * GIB)
    held = [
        Holding(f"m{i}", Dev("gpu-0", sharing="MemoryShare", memory_bytes=g * GIB))
        for i, g in enumerate(shares)
    ] + [Holding(f"t{i}", Dev("gpu-0", sharing="TimeSlicing")) for i in range(slicers)]
    found, unknown = weights(held, [gpu])
    assert unknown == () and len(found) == len(held)
    assert sum(w.weight for w in found) <= 1.0 + 1e-9
    assert all(0 < w.weight <= 1 for w in found)
