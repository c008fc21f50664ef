"""What the node advertises to the scheduler: NodeInventory + policy -> devices and counter sets.

Pure functions of the inventory; nothing here talks to NVML or the API server.

Device names and attributes follow the reference NVIDIA DRA driver so that CEL selectors written
for it keep working: whole GPUs are ``gpu-<minor>``, MIG devices
``gpu-<minor>-mig-<profile without dots and '+'>-<profileId>-<placementStart>``.

MIG modes:

``static``
    A GPU with MIG enabled is advertised only as its existing MIG devices; every other GPU whole.
``dynamic``
    Every MIG-capable GPU advertises itself whole *and* every profile x placement. Exclusion is
    expressed with one counter set per GPU (``gpu-<minor>-counter-set``): each placement consumes
    its profile's engines, SMs and memory plus ``memory-slice-<i>`` = 1 for every memory slot it
    occupies; the whole GPU consumes every counter in full. Overlapping placements share a memory
    slice (each slice counter is 1), so they can never be allocated together.

Counter capacity choice (dynamic mode): the inventory has no whole-GPU SM or engine totals, so
each per-dimension counter (``multiprocessors``, ``copy-engines``, ``decoders``, ``encoders``,
``jpeg-engines``, ``ofa-engines``) is the largest sum that any set of pairwise non-overlapping
placements can reach, honouring each profile's ``max_instances``. The full-GPU (7-slice)
placement is one such set, so the counter is never below the 7g profile's value, and every legal
MIG layout fits by construction; on A100/H100/H200 the maximum is exactly the 7g profile's value.
Honouring ``max_instances`` keeps ``ofa-engines`` at 1 where only one ``+me`` instance may exist,
so the counters also forbid two ``+me`` placements at once. ``memory`` is the GPU's total bytes
(or that largest sum, should it ever be greater).

Virtual machines (``--virtualization``): the vfio and vgpu devices come from
:mod:`dra_driver.vm_devices`; a GPU passed through gets a counter set even without dynamic MIG,
so that its whole GPU and its vfio device exclude each other. The value types are in
:mod:`dra_driver.device_types` (listed in ``__all__`` here, where the driver imports them).
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Mapping

from agent.discovery.inventory import Gpu, NodeInventory
from agent.nvml.mig import mode_switch_needs_reset
from agent.nvml.types import (
    GpuDevice,
    MigInstance,
    MigProfile,
    Placement,
    SystemInfo,
)
from dra_driver.device_attributes import (
    int_value,
    parent_attributes,
    power_attributes,
    string_value,
)
from dra_driver.device_types import (
    GIB,
    MIG_MODES,
    SHARING_MODES,
    VIRTUALIZATION_MODES,
    AdvertisedDevice,
    Attribute,
    CounterSet,
    DeviceModel,
    DevicePolicy,
    DeviceTaint,
    Quantities,
    RequestPolicy,
    counter_set_name,
    quantities,
    sorted_attrs,
)
from dra_driver.vm_devices import (
    memory_counter_set,
    passes_through,
    under_vgpu_manager,
    vfio_device,
    vgpu_devices,
)

__all__ = [  # the value types live in device_types; this is where the rest of the driver finds them
    "GIB",
    "MIG_MODES",
    "SHARING_MODES",
    "VIRTUALIZATION_MODES",
    "AdvertisedDevice",
    "Attribute",
    "CounterSet",
    "DeviceModel",
    "DevicePolicy",
    "DeviceTaint",
    "Quantities",
    "RequestPolicy",
    "advertised_devices",
    "counter_set_name",
    "gpu_counter_set",
    "memory_slots",
    "mig_device_name",
]

# (counter name: a DNS label, capacity name: a C identifier, MigProfile attribute)
_DIMENSIONS: tuple[tuple[str, str, str], ...] = (
    ("multiprocessors", "multiprocessors", "multiprocessors"),
    ("copy-engines", "copyEngines", "copy_engines"),
    ("decoders", "decoders", "decoders"),
    ("encoders", "encoders", "encoders"),
    ("jpeg-engines", "jpegEngines", "jpeg_engines"),
    ("ofa-engines", "ofaEngines", "ofa_engines"),
)


def mig_device_name(minor: int, profile_name: str, profile_id: int, start: int) -> str:
    """``gpu-0-mig-1g5gb-19-0``; ``1g.5gb+me`` becomes ``1g5gbme``."""
    profile = re.sub(r"[^a-z0-9]", "", profile_name.lower())
    return f"gpu-{minor}-mig-{profile}-{profile_id}-{start}"


def _whole_gpu(
    gpu: Gpu, system: SystemInfo, policy: DevicePolicy, counters: CounterSet | None = None
) -> AdvertisedDevice:
    d = gpu.device
    attrs = parent_attributes(gpu, system)
    attrs |= {
        "type": string_value("gpu"),
        "uuid": string_value(d.uuid),
        "nvlinkLinks": int_value(gpu.nvlink_links),
        # the node's --sharing: what prepare can do with the GPU, so that a class or selector
        # takes only GPUs whose node prepares what its claims ask (plan.py refuses the rest)
        "sharing": string_value(policy.sharing),
    }
    attrs |= power_attributes(d.power_limits)
    consumes = ((counters.name, counters.counters),) if counters is not None else ()
    policies: tuple[tuple[str, RequestPolicy], ...] = ()
    if policy.sharing == "memory-shares":
        step, low = str(policy.memory_share_step), str(policy.memory_share_min)
        policies = (("memory", RequestPolicy(default=low, min=low, step=step)),)
    return AdvertisedDevice(
        name=f"gpu-{d.minor}",
        kind="gpu",
        gpu_index=d.index,
        gpu_minor=d.minor,
        parent_uuid=d.uuid,
        uuid=d.uuid,
        attributes=sorted_attrs(attrs),
        capacity=quantities({"memory": d.memory.total}),
        consumes_counters=consumes,
        allow_multiple_allocations=policy.sharing != "none",
        request_policies=policies,
        power_limits=d.power_limits,
    )


def _mig_capacity(profile: MigProfile | None, memory: int, multiprocessors: int) -> Quantities:
    values = {cap: getattr(profile, field) for _, cap, field in _DIMENSIONS} if profile else {}
    return quantities(values | {"memory": memory, "multiprocessors": multiprocessors})


def _mig_device(
    gpu: Gpu,
    system: SystemInfo,
    *,
    profile_id: int,
    profile_name: str,
    placement: Placement,
    capacity: Quantities,
    instance: MigInstance | None = None,
    consumes: tuple[tuple[str, Quantities], ...] = (),
) -> AdvertisedDevice:
    d = gpu.device
    attrs = parent_attributes(gpu, system)
    attrs |= {
        "type": string_value("mig"),
        "profile": string_value(profile_name),
        "parentUUID": string_value(d.uuid),
    }
    if instance is not None:
        attrs["uuid"] = string_value(instance.uuid)
    return AdvertisedDevice(
        name=mig_device_name(d.minor, profile_name, profile_id, placement.start),
        kind="mig",
        gpu_index=d.index,
        gpu_minor=d.minor,
        parent_uuid=d.uuid,
        uuid=instance.uuid if instance is not None else None,
        mig_profile_id=profile_id,
        mig_placement_start=placement.start,
        mig_placement_size=placement.size,
        gpu_instance_id=instance.gpu_instance_id if instance is not None else None,
        compute_instance_id=instance.compute_instance_id if instance is not None else None,
        attributes=sorted_attrs(attrs),
        capacity=capacity,
        consumes_counters=consumes,
    )


def _profile_amounts(profile: MigProfile) -> dict[str, int]:
    amounts = {counter: getattr(profile, field) for counter, _, field in _DIMENSIONS}
    amounts["memory"] = profile.memory_bytes
    return amounts


def memory_slots(profiles: tuple[MigProfile, ...]) -> int:
    """Number of memory slices: the end of the furthest placement (8 on A100/H100/H200)."""
    return max((p.start + p.size for prof in profiles for p in prof.placements), default=0)


@functools.cache
def _max_layout_sums(profiles: tuple[MigProfile, ...]) -> Mapping[str, int]:
    """Per dimension, the largest sum over sets of non-overlapping placements within every
    profile's ``max_instances``. Enumerates the sets slot by slot (a few thousand per GPU)."""
    slots = memory_slots(profiles)
    starting: dict[int, list[tuple[int, MigProfile, int]]] = {s: [] for s in range(slots)}
    for i, prof in enumerate(profiles):
        for p in prof.placements:
            starting[p.start].append((i, prof, p.size))
    best = dict.fromkeys(_profile_amounts(profiles[0]) if profiles else (), 0)
    counts = [0] * len(profiles)

    def walk(slot: int, sums: dict[str, int]) -> None:
        for k, v in sums.items():
            best[k] = max(best[k], v)
        if slot >= slots:
            return
        walk(slot + 1, sums)
        for i, prof, size in starting[slot]:
            if counts[i] >= prof.max_instances:
                continue
            counts[i] += 1
            amounts = _profile_amounts(prof)
            walk(slot + size, {k: v + amounts[k] for k, v in sums.items()})
            counts[i] -= 1

    walk(0, dict.fromkeys(best, 0))
    return types.MappingProxyType(best)  # cached and shared: read-only


def gpu_counter_set(device: GpuDevice) -> CounterSet:
    """The dynamic-MIG counter set of one MIG-capable GPU (see the module docstring)."""
    values = dict(_max_layout_sums(device.mig_profiles))
    values["memory"] = max(values.get("memory", 0), device.memory.total)
    for slot in range(memory_slots(device.mig_profiles)):
        values[f"memory-slice-{slot}"] = 1
    return CounterSet(name=counter_set_name(device.minor), counters=quantities(values))


def _placement_consumption(
    counters: CounterSet, profile: MigProfile, placement: Placement
) -> tuple[tuple[str, Quantities], ...]:
    amounts = _profile_amounts(profile)
    amounts |= {f"memory-slice-{slot}": 1 for slot in placement.slots()}
    return ((counters.name, quantities(amounts)),)


def _static_mig_devices(gpu: Gpu, system: SystemInfo) -> list[AdvertisedDevice]:
    profiles = {p.profile_id: p for p in gpu.device.mig_profiles}
    out = []
    for inst in gpu.device.mig_instances:
        profile = profiles.get(inst.profile_id)
        multiprocessors = profile.multiprocessors if profile else inst.multiprocessors
        out.append(
            _mig_device(
                gpu,
                system,
                profile_id=inst.profile_id,
                profile_name=inst.profile_name,
                placement=inst.placement,
                capacity=_mig_capacity(profile, inst.memory_bytes, multiprocessors),
                instance=inst,
            )
        )
    return out


def _dynamic_devices(
    gpu: Gpu, system: SystemInfo, policy: DevicePolicy
) -> tuple[list[AdvertisedDevice], CounterSet]:
    """The whole GPU and every MIG placement, as far as the GPU can switch: a GPU that needs a
    reset to enter or leave MIG mode (Ampere) offers the whole GPU only while MIG is off and
    its placements only while MIG is on; Hopper and newer offer both (the counters keep a
    whole-GPU allocation and placements apart, and prepare switches the mode when idle)."""
    counters = gpu_counter_set(gpu.device)
    d = gpu.device
    fixed = mode_switch_needs_reset(d.architecture)
    out = [_whole_gpu(gpu, system, policy, counters)] if not (fixed and d.mig_enabled) else []
    if fixed and not d.mig_enabled:
        return out, counters
    for prof in gpu.device.mig_profiles:
        capacity = _mig_capacity(prof, prof.memory_bytes, prof.multiprocessors)
        for placement in prof.placements:
            out.append(
                _mig_device(
                    gpu,
                    system,
                    profile_id=prof.profile_id,
                    profile_name=prof.name,
                    placement=placement,
                    capacity=capacity,
                    consumes=_placement_consumption(counters, prof, placement),
                )
            )
    return out, counters


def _slice_count(gpu: GpuDevice, profile_id: int | None, profile_name: str) -> int:
    for p in gpu.mig_profiles:
        if p.profile_id == profile_id:
            return p.slice_count
    m = re.match(r"(\d+)g", profile_name)
    return int(m.group(1)) if m else 0


def _check(policy: DevicePolicy) -> None:
    for name, value, allowed in (
        ("mig_mode", policy.mig_mode, MIG_MODES),
        ("sharing", policy.sharing, SHARING_MODES),
        ("virtualization", policy.virtualization, VIRTUALIZATION_MODES),
    ):
        if value not in allowed:
            raise ValueError(f"{name} {value!r}: expected one of {', '.join(allowed)}")
    if policy.virtualization != "none" and policy.sharing != "none":
        raise ValueError(
            f"virtualization {policy.virtualization!r} with sharing {policy.sharing!r}: a GPU"
            " for VMs is never shared between containers' claims"
        )
    if policy.virtualization == "vgpu" and policy.mig_mode == "dynamic":
        raise ValueError("virtualization 'vgpu' with mig_mode 'dynamic': vGPU GPUs have no MIG")


def _gpu_devices(
    gpu: Gpu, system: SystemInfo, policy: DevicePolicy
) -> tuple[list[AdvertisedDevice], CounterSet | None]:
    """One GPU's devices and its counter set (None: its devices consume no counters)."""
    d = gpu.device
    if under_vgpu_manager(gpu, policy):
        return vgpu_devices(gpu, system, policy)
    vfio = passes_through(gpu, policy)
    if policy.mig_mode == "dynamic" and d.mig_capable and d.mig_profiles:
        found, counters = _dynamic_devices(gpu, system, policy)
        return [*found, vfio_device(gpu, system, counters)] if vfio else found, counters
    if policy.mig_mode == "static" and d.mig_enabled:
        return _static_mig_devices(gpu, system), None
    if not vfio:
        return [_whole_gpu(gpu, system, policy)], None
    counters = memory_counter_set(d)
    return [_whole_gpu(gpu, system, policy, counters), vfio_device(gpu, system, counters)], counters


_KIND_ORDER = {"gpu": 0, "mig": 1, "vfio": 2, "vgpu": 3}


def advertised_devices(inv: NodeInventory, policy: DevicePolicy) -> DeviceModel:
    """Every device the node advertises under ``policy``, in a deterministic order: by GPU minor,
    the whole GPU first, then MIG devices by (slice count, profile id, placement start), then
    the GPU's VM devices (its vfio device; its vGPUs by type, smallest first, then instance)."""
    _check(policy)
    devices: list[AdvertisedDevice] = []
    counter_sets: list[CounterSet] = []
    for gpu in sorted(inv.gpus, key=lambda g: g.device.minor):
        found, counters = _gpu_devices(gpu, inv.system, policy)
        devices += found
        if counters is not None:
            counter_sets.append(counters)

    def order(dev: AdvertisedDevice) -> tuple[int, int, int, int, int]:
        if dev.kind != "mig":  # vGPUs keep the order vm_devices made them in (a stable sort)
            return (dev.gpu_minor, _KIND_ORDER[dev.kind], 0, 0, 0)
        gpu = next(g.device for g in inv.gpus if g.device.minor == dev.gpu_minor)
        profile = dict(dev.attributes)["profile"]["string"]
        return (
            dev.gpu_minor,
            1,
            _slice_count(gpu, dev.mig_profile_id, str(profile)),
            dev.mig_profile_id or 0,
            dev.mig_placement_start or 0,
        )

    return DeviceModel(devices=tuple(sorted(devices, key=order)), counter_sets=tuple(counter_sets))
