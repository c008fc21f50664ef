"""Named MIG layouts an administrator (or the simulator at start) applies to every MIG GPU.

All functions here are pure. A layout is a list of GPU-instance profile ids in creation order;
applying it to a MIG-capable GPU destroys what exists, enables MIG (as ``nvidia-smi -mig 1`` plus a
reset would), searches placements that fit by backtracking in creation order, and creates each GPU
instance with its default compute instance. GPUs without MIG are left alone.

===========  ===========================================================
``none``     MIG disabled, no instances
``balanced`` 1x3g, 1x2g, 2x1g (profile ids 9, 14, 19, 19), e.g. 3g.20gb,
             2g.10gb, 2x1g.5gb on A100-40GB (the 3g lands at start 4)
``all-1g``   7x1g (profile 19)
``all-7g``   one 7g (profile 0)
===========  ===========================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pynvml

from agent.errors import ConfigError
from agent.sim import mig
from agent.sim.errors import MigError
from agent.sim.model import NodeModel
from agent.sim.specs import GpuSpec
from agent.sim.state import GpuState, SimState

LAYOUTS: dict[str, tuple[int, ...]] = {
    "none": (),
    "balanced": (9, 14, 19, 19),
    "all-1g": (19,) * 7,
    "all-7g": (0,),
}


def layout_names() -> list[str]:
    """The known layout names, in a stable order."""
    return list(LAYOUTS)


def layout_profiles(name: str) -> tuple[int, ...]:
    """The profile ids of a layout; ConfigError naming the value and the allowed names."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ConfigError(
            f"unknown MIG layout {name!r}; allowed: {', '.join(layout_names())}"
        ) from None


def plan_placements(gpu: GpuState, spec: GpuSpec, profile_ids: Sequence[int]) -> list[int] | None:
    """Placement starts, in creation order, that let every profile fit; None when none do.

    Backtracking: each profile tries the starts of its table in ascending order, on top of the
    GPU's existing instances and the ones placed before it.
    """
    if not profile_ids:
        return []
    profile = spec.profile(profile_ids[0])
    for start in profile.placement_starts:
        try:
            placed, _ = mig.create_gpu_instance(
                gpu, spec, profile.profile_id, (start, profile.memory_slots)
            )
        except pynvml.NVMLError:  # this start does not fit: try the next
            continue
        rest = plan_placements(placed, spec, profile_ids[1:])
        if rest is not None:
            return [start, *rest]
    return None


def apply_to_gpu(gpu: GpuState, spec: GpuSpec, name: str) -> GpuState:
    """The GPU after applying layout ``name`` (unchanged when the GPU has no MIG)."""
    profile_ids = layout_profiles(name)
    if not spec.mig_capable:
        return gpu
    enabled = name != "none"
    gpu = replace(mig.destroy_all(gpu), mig_current=enabled, mig_pending=enabled)
    starts = plan_placements(gpu, spec, profile_ids)
    if starts is None:
        raise MigError(f"MIG layout {name!r} does not fit on {spec.name} (GPU {gpu.index})")
    for profile_id, start in zip(profile_ids, starts, strict=True):
        size = spec.profile(profile_id).memory_slots
        gpu, gi = mig.create_gpu_instance(gpu, spec, profile_id, (start, size))
        gpu, _ = mig.create_compute_instance(gpu, spec, gi.id, mig.default_ci_profile_id(spec, gi))
    return gpu


def apply_layout(state: SimState, model: NodeModel, name: str) -> SimState:
    """The node state after applying layout ``name`` to every MIG-capable GPU."""
    layout_profiles(name)
    specs = {g.index: g.spec for g in model.gpus}
    return replace(state, gpus=tuple(apply_to_gpu(g, specs[g.index], name) for g in state.gpus))
