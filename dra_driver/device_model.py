"""What the node advertises to the scheduler: NodeInventory + policy -> devices and counter sets.

Pure functions of the inventory; nothing here talks to NVML or the API server.

Device names and attributes follow the reference NVIDIA DRA driver so that CEL selectors written
for it keep working: whole GPUs are ``gpu-<minor>``, MIG devices
``gpu-<minor>-mig-<profile without dots and '+'>-<profileId>-<placementStart>``.

MIG modes:

``static``
    A GPU with MIG enabled is advertised only as its existing MIG devices; every other GPU whole.
``dynamic``
    Every MIG-capable GPU advertises itself whole *and* every profile x placement (of the
    profiles ``--mig-profiles`` names; all when it names none). Exclusion is expressed with one
    counter set per GPU (``gpu-<minor>-counter-set``): each placement consumes ``memory-slice-<i>``
    = 1 for the memory slots it occupies and the engines its profile has of the counters the GPU
    needs; the whole GPU consumes every counter in full. Overlapping placements share a memory
    slice (each slice counter is 1), so they can never be allocated together. Which counters a
    GPU needs, and the proof that those left out never refuse anything:
    :mod:`dra_driver.mig_counters`.
    With ``--mig-profiles`` the counters are those the profiles offered need.

What a MIG device carries: the attributes of its GPU that tell GPUs apart (``productName``,
``architecture``, ``minor``, the PCI ones) and its own, but not what only repeats the node
(``driverVersion``, ``cudaDriverVersion``) or the GPU (``brand``, ``cudaComputeCapability``: set by
the product; ``index``: ``minor`` names the GPU), nor ``nvlinkClique`` (MIG instances have no
GPU-to-GPU peer access over NVLink); see ``MIG_LEFT_OUT``. 200 MIG devices a node make these
bytes count (docs/performance.md, "ResourceSlices").

Virtual machines (``--virtualization``): the vfio and vgpu devices come from
:mod:`dra_driver.vm_devices`; a GPU passed through gets a counter set even without dynamic MIG,
so that its whole GPU and its vfio device exclude each other. The value types are in
:mod:`dra_driver.device_types` (listed in ``__all__`` here, where the driver imports them).
"""

from __future__ import annotations

import re

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
from dra_driver.mig_counters import (
    DIMENSIONS,
    gpu_counter_set,
    memory_slots,
    placement_consumption,
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
    "mig_profile_name",
    "node_mig_profiles",
    "offered_profiles",
    "unknown_mig_profiles",
]


_PROFILE_NAME = re.compile(r"[1-9][0-9]?g\.[0-9]+gb(?:[+-][a-z]+(?:\.[a-z]+)*)*")
"""NVML's GPU instance profile names: ``<slices>g.<memory>gb``, then suffixes such as ``+me``
(``1g.10gb``, ``1g.5gb+me``; the MIG user guide's "Supported MIG Profiles")."""


def mig_profile_name(raw: str) -> str:
    """One ``--mig-profiles`` entry, lower case (``3G.40GB`` is ``3g.40gb``); ValueError with the
    phrase that follows the value when it is not a MIG profile name."""
    value = raw.strip().lower()
    if not _PROFILE_NAME.fullmatch(value):
        raise ValueError(
            "is not a MIG profile name: NVML's form is <slices>g.<memory>gb with an optional"
            " suffix, as nvidia-smi mig -lgip lists them (1g.10gb, 3g.40gb, 1g.10gb+me)"
        )
    return value


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
    """A MIG device's capacities; a zero one is left out (a 1g.5gb has no decoder: no
    ``decoders``), as a zero counter consumption is."""
    values = {cap: getattr(profile, field) for _, cap, field in DIMENSIONS} if profile else {}
    values |= {"memory": memory, "multiprocessors": multiprocessors}
    return quantities({k: v for k, v in values.items() if v != 0})


MIG_LEFT_OUT = (
    "brand",
    "cudaComputeCapability",
    "cudaDriverVersion",
    "driverVersion",
    "index",
    "nvlinkClique",
)
"""Attributes of its GPU a MIG device does not repeat (the module docstring says why). NVIDIA's
MIG user guide: MIG instances have no GPU-to-GPU P2P over PCIe or NVLink ("Deployment
Considerations"); each MIG-capable product has one compute capability ("Supported GPUs")."""


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
    attrs = {k: v for k, v in parent_attributes(gpu, system).items() if k not in MIG_LEFT_OUT}
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


def offered_profiles(device: GpuDevice, policy: DevicePolicy) -> tuple[MigProfile, ...]:
    """The GPU's MIG profiles that dynamic mode advertises: those ``--mig-profiles`` names, all
    when it names none."""
    if not policy.mig_profiles:
        return device.mig_profiles
    return tuple(p for p in device.mig_profiles if p.name in policy.mig_profiles)


def unknown_mig_profiles(inv: NodeInventory, policy: DevicePolicy) -> tuple[str, ...]:
    """The ``--mig-profiles`` no MIG-capable GPU of the node has (none outside dynamic mode,
    where the setting is refused at start)."""
    if policy.mig_mode != "dynamic":
        return ()
    known = {p.name for g in inv.gpus if g.device.mig_capable for p in g.device.mig_profiles}
    return tuple(name for name in policy.mig_profiles if name not in known)


def node_mig_profiles(inv: NodeInventory) -> tuple[str, ...]:
    """Every MIG profile name a GPU of the node has, sorted (for messages)."""
    return tuple(
        sorted({p.name for g in inv.gpus if g.device.mig_capable for p in g.device.mig_profiles})
    )


def _dynamic_devices(
    gpu: Gpu, system: SystemInfo, policy: DevicePolicy
) -> tuple[list[AdvertisedDevice], CounterSet]:
    """The whole GPU and every MIG placement of the offered profiles, as far as the GPU can
    switch: a GPU that needs a reset to enter or leave MIG mode (Ampere) offers the whole GPU
    only while MIG is off and its placements only while MIG is on; Hopper and newer offer both
    (the counters keep a whole-GPU allocation and placements apart, and prepare switches the
    mode when idle)."""
    d = gpu.device
    profiles = offered_profiles(d, policy)
    counters = gpu_counter_set(d, profiles)
    fixed = mode_switch_needs_reset(d.architecture)
    out = [_whole_gpu(gpu, system, policy, counters)] if not (fixed and d.mig_enabled) else []
    if fixed and not d.mig_enabled:
        return out, counters
    for prof in profiles:
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
                    consumes=placement_consumption(counters, prof, placement),
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
    if policy.mig_profiles and policy.mig_mode != "dynamic":
        raise ValueError(
            f"mig_profiles {', '.join(policy.mig_profiles)} with mig_mode {policy.mig_mode!r}:"
            " only dynamic MIG chooses which profiles to advertise"
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
