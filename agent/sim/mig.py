"""The MIG rules of the simulated driver, as pure functions over :class:`agent.sim.state.GpuState`.

Every function here is pure: it takes a GPU's state and its product spec and returns a new state
(and the created object), or raises the ``pynvml.NVMLError`` subclass real NVML answers with.
The rules (docs/gpu-facts.md, MIG geometry):

* 8 memory slots x 7 compute slices; a GPU instance (GI) occupies memory slots
  ``[start, start + size)``; starts only from the profile's placement table; no overlap;
* per-profile maximum instance counts; at most one ``+me`` profile per GPU; total compute
  slices <= 7;
* GI ids are handed out by the driver: the lowest free id, starting at 1 (not derived from the
  placement); compute-instance (CI) ids: the lowest free id within the GI, starting at 0;
* without an explicit placement the driver picks the highest free start of the table (this is
  what makes "create the 3g first" matter on A100, as on real hardware);
* CI profiles have ids equal to their enums (1c=0, 2c=1, 3c=2, 4c=3, 7c=4); the default CI of a
  GI uses all its compute slices; a GI that still has CIs cannot be destroyed (IN_USE);
* MIG mode: Ampere-style GPUs only change ``pending`` (current follows at a GPU reset);
  Hopper-style GPUs toggle at once when they have no GIs; disabling with GIs present is IN_USE;
  creating instances while MIG is disabled, or any MIG call on a GPU without MIG, is NOT_SUPPORTED.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pynvml

from agent.sim.specs import GpuSpec, MigProfileSpec
from agent.sim.state import ComputeInstance, GpuInstance, GpuState

MEMORY_SLOTS = 8
COMPUTE_SLICES = 7
FIRST_GI_ID = 1
FIRST_CI_ID = 0

# Compute-instance profile enum -> compute slices (NVML_COMPUTE_INSTANCE_PROFILE_*).
CI_PROFILE_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}
# GI compute slices -> {CI slices: allowed starts (compute-slice offsets inside the GI)}.
CI_PLACEMENTS: dict[int, dict[int, tuple[int, ...]]] = {
    1: {1: (0,)},
    2: {1: (0, 1), 2: (0,)},
    3: {1: (0, 1, 2), 2: (0,), 3: (0,)},
    4: {1: (0, 1, 2, 3), 2: (0, 2), 4: (0,)},
    7: {1: (0, 1, 2, 3, 4, 5, 6), 2: (0, 2, 4), 3: (0, 4), 4: (0,), 7: (0,)},
}


def nvml_error(code: int, why: str) -> Exception:
    """The real pynvml exception for ``code``, with ``why`` attached as a traceback note."""
    err: Exception = pynvml.NVMLError(code)
    err.add_note(f"simulated NVML: {why}")
    return err


@dataclass(frozen=True)
class CiProfile:
    """A compute-instance profile as offered inside one GPU instance."""

    id: int
    slice_count: int
    starts: tuple[int, ...]
    multiprocessors: int
    name: str


# -- queries ------------------------------------------------------------------------------------


def require_mig_capable(spec: GpuSpec) -> None:
    if not spec.mig_capable:
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, f"{spec.name} does not support MIG")


def require_mig_enabled(gpu: GpuState, spec: GpuSpec) -> None:
    require_mig_capable(spec)
    if not gpu.mig_current:
        raise nvml_error(
            pynvml.NVML_ERROR_NOT_SUPPORTED, f"MIG mode is disabled on GPU {gpu.index}"
        )


def gi_profile(spec: GpuSpec, profile_id: int) -> MigProfileSpec:
    """The GI profile with this id; INVALID_ARGUMENT when the GPU has none."""
    require_mig_capable(spec)
    for p in spec.mig_profiles:
        if p.profile_id == profile_id:
            return p
    raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"no GPU instance profile id {profile_id}")


def gi_profile_by_enum(spec: GpuSpec, enum: int) -> MigProfileSpec:
    """The profile for an NVML_GPU_INSTANCE_PROFILE_* value.

    Like real NVML: a value outside the enum is INVALID_ARGUMENT, a value the GPU lacks (or any
    value on a GPU without MIG) is NOT_SUPPORTED.
    """
    if not 0 <= enum < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"{enum} is not a GI profile enum")
    require_mig_capable(spec)
    for p in spec.mig_profiles:
        if p.enum == enum:
            return p
    raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, f"{spec.name} has no GI profile enum {enum}")


def _overlaps(a_start: int, a_size: int, b_start: int, b_size: int) -> bool:
    return a_start < b_start + b_size and b_start < a_start + a_size


def _why_no_room(gpu: GpuState, spec: GpuSpec, profile: MigProfileSpec) -> str | None:
    """Why no further instance of ``profile`` may exist, ignoring placement; None if it may."""
    same = sum(1 for gi in gpu.gpu_instances if gi.profile_id == profile.profile_id)
    if same >= profile.max_instances:
        return f"profile {profile.name} allows at most {profile.max_instances} instances"
    if profile.media_extensions and any(
        spec.profile(gi.profile_id).media_extensions for gi in gpu.gpu_instances
    ):
        return "only one +me GPU instance may exist at a time"
    used = sum(spec.profile(gi.profile_id).slice_count for gi in gpu.gpu_instances)
    if used + profile.slice_count > COMPUTE_SLICES:
        return f"{used} of {COMPUTE_SLICES} compute slices are in use"
    return None


def free_starts(gpu: GpuState, profile: MigProfileSpec) -> list[int]:
    """Starts of the profile's table whose memory slots are all free (pure)."""
    return [
        s
        for s in profile.placement_starts
        if not any(
            _overlaps(s, profile.memory_slots, gi.start, gi.size) for gi in gpu.gpu_instances
        )
    ]


def remaining_capacity(gpu: GpuState, spec: GpuSpec, profile_id: int) -> int:
    """How many more GIs of the profile could be created now (pure)."""
    require_mig_enabled(gpu, spec)
    profile = gi_profile(spec, profile_id)
    count = 0
    while _why_no_room(gpu, spec, profile) is None:
        starts = free_starts(gpu, profile)
        if not starts:
            break
        gpu, _ = _add_gi(gpu, profile, starts[0])
        count += 1
    return count


def _lowest_free(used: set[int], first: int) -> int:
    n = first
    while n in used:
        n += 1
    return n


def _add_gi(gpu: GpuState, profile: MigProfileSpec, start: int) -> tuple[GpuState, GpuInstance]:
    gi = GpuInstance(
        id=_lowest_free({g.id for g in gpu.gpu_instances}, FIRST_GI_ID),
        profile_id=profile.profile_id,
        start=start,
        size=profile.memory_slots,
    )
    return replace(gpu, gpu_instances=(*gpu.gpu_instances, gi)), gi


# -- GPU instances ------------------------------------------------------------------------------


def create_gpu_instance(
    gpu: GpuState,
    spec: GpuSpec,
    profile_id: int,
    placement: tuple[int, int] | None = None,
) -> tuple[GpuState, GpuInstance]:
    """Create a GI of ``profile_id``, at ``placement`` ``(start, size)`` or where the driver picks.

    INVALID_ARGUMENT for an unknown profile or a placement not in its table;
    INSUFFICIENT_RESOURCES when it does not fit (overlap, instance limits, +me, compute slices).
    """
    require_mig_enabled(gpu, spec)
    profile = gi_profile(spec, profile_id)
    if placement is not None:
        start, size = placement
        if start not in profile.placement_starts or size != profile.memory_slots:
            raise nvml_error(
                pynvml.NVML_ERROR_INVALID_ARGUMENT,
                f"placement {start}:{size} is not in profile {profile.name}'s table "
                f"{profile.placement_starts}:{profile.memory_slots}",
            )
    why = _why_no_room(gpu, spec, profile)
    if why is not None:
        raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, why)
    free = free_starts(gpu, profile)
    if placement is None:
        if not free:
            raise nvml_error(
                pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, f"no free placement for {profile.name}"
            )
        return _add_gi(gpu, profile, max(free))
    if placement[0] not in free:
        raise nvml_error(
            pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
            f"placement {placement[0]}:{placement[1]} overlaps an existing GPU instance",
        )
    return _add_gi(gpu, profile, placement[0])


def find_gpu_instance(gpu: GpuState, gi_id: int) -> GpuInstance:
    gi = gpu.gpu_instance(gi_id)
    if gi is None:
        raise nvml_error(
            pynvml.NVML_ERROR_NOT_FOUND, f"GPU {gpu.index} has no GPU instance {gi_id}"
        )
    return gi


def destroy_gpu_instance(gpu: GpuState, gi_id: int) -> GpuState:
    """Destroy a GI; IN_USE while it still has compute instances."""
    gi = find_gpu_instance(gpu, gi_id)
    if gi.compute_instances:
        raise nvml_error(
            pynvml.NVML_ERROR_IN_USE, f"GPU instance {gi_id} still has compute instances"
        )
    return replace(gpu, gpu_instances=tuple(g for g in gpu.gpu_instances if g.id != gi_id))


def destroy_all(gpu: GpuState) -> GpuState:
    """Every compute and GPU instance gone, as an administrator clearing the GPU does (pure)."""
    return replace(gpu, gpu_instances=())


# -- compute instances --------------------------------------------------------------------------


def ci_profiles(spec: GpuSpec, gi: GpuInstance) -> dict[int, CiProfile]:
    """The CI profiles a GI offers, by id (pure)."""
    profile = spec.profile(gi.profile_id)
    g = profile.slice_count
    one_slice = next((p for p in spec.mig_profiles if p.profile_id == 19), None)
    per_slice = one_slice.multiprocessors if one_slice else profile.multiprocessors // g
    out: dict[int, CiProfile] = {}
    for ci_id, c in CI_PROFILE_SLICES.items():
        starts = CI_PLACEMENTS.get(g, {}).get(c)
        if starts is None:
            continue
        full = c == g
        out[ci_id] = CiProfile(
            id=ci_id,
            slice_count=c,
            starts=starts,
            multiprocessors=profile.multiprocessors
            if full
            else min(c * per_slice, profile.multiprocessors),
            name=profile.name if full else f"{c}c.{profile.name}",
        )
    return out


def ci_profile(spec: GpuSpec, gi: GpuInstance, ci_profile_id: int) -> CiProfile:
    """INVALID_ARGUMENT outside the enum, NOT_SUPPORTED when this GI does not offer it."""
    if not 0 <= ci_profile_id < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
        raise nvml_error(
            pynvml.NVML_ERROR_INVALID_ARGUMENT, f"{ci_profile_id} is not a CI profile enum"
        )
    found = ci_profiles(spec, gi).get(ci_profile_id)
    if found is None:
        raise nvml_error(
            pynvml.NVML_ERROR_NOT_SUPPORTED,
            f"GPU instance {gi.id} ({spec.profile(gi.profile_id).name}) has no CI profile "
            f"{ci_profile_id}",
        )
    return found


def default_ci_profile_id(spec: GpuSpec, gi: GpuInstance) -> int:
    """The CI profile that uses all of the GI's compute slices (pure)."""
    g = spec.profile(gi.profile_id).slice_count
    return next(i for i, c in CI_PROFILE_SLICES.items() if c == g)


def _replace_gi(gpu: GpuState, gi: GpuInstance) -> GpuState:
    return replace(gpu, gpu_instances=tuple(gi if g.id == gi.id else g for g in gpu.gpu_instances))


def create_compute_instance(
    gpu: GpuState,
    spec: GpuSpec,
    gi_id: int,
    ci_profile_id: int,
    placement: tuple[int, int] | None = None,
) -> tuple[GpuState, ComputeInstance]:
    """Create a CI in GI ``gi_id`` (lowest free start unless ``placement`` is given)."""
    gi = find_gpu_instance(gpu, gi_id)
    profile = ci_profile(spec, gi, ci_profile_id)
    g = spec.profile(gi.profile_id).slice_count
    used = sum(c.size for c in gi.compute_instances)
    if used + profile.slice_count > g:
        raise nvml_error(
            pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
            f"GPU instance {gi_id} has {g - used} free compute slices, {profile.name} needs "
            f"{profile.slice_count}",
        )
    free = [
        s
        for s in profile.starts
        if not any(_overlaps(s, profile.slice_count, c.start, c.size) for c in gi.compute_instances)
    ]
    if placement is not None:
        start, size = placement
        if start not in profile.starts or size != profile.slice_count:
            raise nvml_error(
                pynvml.NVML_ERROR_INVALID_ARGUMENT,
                f"CI placement {start}:{size} is not allowed for {profile.name}",
            )
        if start not in free:
            raise nvml_error(
                pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, f"CI placement {start}:{size} is taken"
            )
    elif not free:
        raise nvml_error(
            pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, f"no free placement for {profile.name}"
        )
    ci = ComputeInstance(
        id=_lowest_free({c.id for c in gi.compute_instances}, FIRST_CI_ID),
        profile_id=ci_profile_id,
        start=placement[0] if placement is not None else min(free),
        size=profile.slice_count,
    )
    new_gi = replace(gi, compute_instances=(*gi.compute_instances, ci))
    return _replace_gi(gpu, new_gi), ci


def ci_remaining_capacity(gpu: GpuState, spec: GpuSpec, gi_id: int, ci_profile_id: int) -> int:
    """How many more CIs of the profile fit in the GI now (pure)."""
    count = 0
    while True:
        try:
            gpu, _ = create_compute_instance(gpu, spec, gi_id, ci_profile_id)
        except pynvml.NVMLError_InsufficientResources:
            return count
        count += 1


def destroy_compute_instance(gpu: GpuState, gi_id: int, ci_id: int) -> GpuState:
    gi = find_gpu_instance(gpu, gi_id)
    if gi.compute_instance(ci_id) is None:
        raise nvml_error(
            pynvml.NVML_ERROR_NOT_FOUND, f"GPU instance {gi_id} has no compute instance {ci_id}"
        )
    new_gi = replace(gi, compute_instances=tuple(c for c in gi.compute_instances if c.id != ci_id))
    return _replace_gi(gpu, new_gi)


# -- MIG mode -----------------------------------------------------------------------------------


def set_mig_mode(gpu: GpuState, spec: GpuSpec, mode: int) -> tuple[GpuState, int]:
    """nvmlDeviceSetMigMode: returns the new state and the activation status (an NVML code).

    Hopper-style: toggles now when there are no GIs (status SUCCESS). Ampere-style: only
    ``pending`` changes; status RESET_REQUIRED until :func:`reset` when pending differs from
    current. Disabling with GIs present is IN_USE on both.
    """
    require_mig_capable(spec)
    if mode not in (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE):
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"MIG mode {mode} is not 0 or 1")
    enable = mode == pynvml.NVML_DEVICE_MIG_ENABLE
    if enable != gpu.mig_current and gpu.gpu_instances:
        raise nvml_error(pynvml.NVML_ERROR_IN_USE, f"GPU {gpu.index} still has MIG GPU instances")
    if spec.mig_hopper_style:
        return replace(gpu, mig_current=enable, mig_pending=enable), pynvml.NVML_SUCCESS
    new = replace(gpu, mig_pending=enable)
    status = pynvml.NVML_SUCCESS if enable == gpu.mig_current else pynvml.NVML_ERROR_RESET_REQUIRED
    return new, status


def reset(gpu: GpuState) -> GpuState:
    """A GPU reset: the pending MIG mode becomes current and every MIG instance is gone (pure)."""
    return replace(gpu, mig_current=gpu.mig_pending, gpu_instances=())
