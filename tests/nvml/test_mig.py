"""MIG configuration through the facade (agent.nvml.mig) against the simulated MIG rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.nvml.errors import NvmlInsufficientResources, NvmlInUse
from agent.nvml.facade import Nvml
from agent.nvml.mig import MigControl, mode_switch_needs_reset
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml


def control(tmp_path, model: str, layout: str | None = None) -> tuple[Nvml, MigControl]:
    nvml = Nvml(FakeNvml(load_model(model), tmp_path, mig_layout=layout))
    nvml.init()
    return nvml, MigControl(nvml)


@pytest.mark.parametrize("model", ["dgx-a100", "dgx-h100", "hgx-h200"])
def test_every_profile_at_every_placement_is_created_found_and_destroyed(tmp_path, model):
    nvml, mig = control(tmp_path, model, layout="balanced")
    mig.destroy_all(0)
    assert mig.gpu_instances(0) == () and nvml.mig_instances(0) == ()
    for profile in nvml.device(0).mig_profiles:
        for placement in profile.placements:
            inst = mig.create(0, profile.profile_id, placement.start, placement.size)
            assert inst.profile_id == profile.profile_id and inst.placement == placement
            assert inst.uuid.startswith("MIG-") and inst in nvml.mig_instances(0)
            found = mig.find(0, profile.profile_id, placement.start)
            assert found is not None and found.gpu_instance_id == inst.gpu_instance_id
            mig.destroy(0, inst.gpu_instance_id)  # the compute instance goes first
            assert mig.gpu_instances(0) == ()


def test_an_overlapping_placement_is_refused(tmp_path):
    _, mig = control(tmp_path, "dgx-h100", layout="balanced")
    mig.destroy_all(1)
    mig.create(1, 9, 0, 4)  # a 3g at slices 0-3
    with pytest.raises(NvmlInsufficientResources):
        mig.create(1, 19, 2, 1)  # a 1g inside it
    assert [g.placement.start for g in mig.gpu_instances(1)] == [0]


def test_a_gpu_instance_without_compute_instance_is_found_and_destroyed(tmp_path):
    """What a crash between the two creates leaves: found by placement, destroyed cleanly."""
    nvml, mig = control(tmp_path, "dgx-a100", layout="balanced")
    mig.destroy_all(2)
    api = nvml.api("2")
    placement = api.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = 4, 2
    import ctypes

    api.nvmlDeviceCreateGpuInstanceWithPlacement(nvml.handle(2), 14, ctypes.byref(placement))
    (gi,) = mig.gpu_instances(2)
    assert (gi.profile_id, gi.placement.start) == (14, 4) and nvml.mig_instances(2) == ()
    mig.destroy(2, gi.gpu_instance_id)
    mig.destroy(2, gi.gpu_instance_id)  # idempotent
    assert mig.gpu_instances(2) == ()


def test_mig_mode_switches_at_once_on_hopper_and_is_pending_on_ampere(tmp_path):
    nvml, mig = control(tmp_path / "h", "dgx-h100", layout="balanced")
    with pytest.raises(NvmlInUse):
        mig.set_mode(0, False)  # GPU instances still exist
    mig.destroy_all(0)
    assert mig.set_mode(0, False) is True
    mode = nvml.mig_mode(0)
    assert mode is not None and not mode.current
    nvml, mig = control(tmp_path / "a", "dgx-a100", layout="none")
    assert mig.set_mode(0, True) is False  # Ampere: only after a GPU reset
    mode = nvml.mig_mode(0)
    assert mode is not None and not mode.current and mode.pending
    assert mode_switch_needs_reset("Ampere") and not mode_switch_needs_reset("Hopper")


def test_find_answers_what_the_instance_list_says(tmp_path: Path) -> None:
    """``find`` reads one profile's instances: the same answer as looking through every
    instance, for a placement another profile holds, a profile the GPU lacks, MIG off."""
    _, mig = control(tmp_path, "dgx-h100", layout="balanced")
    for gi in mig.gpu_instances(3):
        listed = mig.find(3, gi.profile_id, gi.placement.start)
        assert listed == gi
    mig.destroy_all(4)
    mig.create(4, 9, 0, 4)  # a 3g.40gb at slices 0-3
    assert mig.find(4, 9, 0) == mig.gpu_instances(4)[0]
    assert mig.find(4, 19, 0) is None  # a 1g at the same start: not the 3g
    assert mig.find(4, 9, 4) is None
    assert mig.find(4, 999, 0) is None  # no such profile on this GPU
    mig.destroy_all(5)
    assert mig.set_mode(5, False)
    assert mig.find(5, 9, 0) is None  # MIG off
