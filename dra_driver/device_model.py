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
"""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass

from agent.discovery.inventory import Gpu, NodeInventory
from agent.nvml.mig import mode_switch_needs_reset
from agent.nvml.types import (
    GpuDevice,
    MigInstance,
    MigProfile,
    Placement,
    PowerLimits,
    SystemInfo,
)
from agent.pcihost.vm_types import VgpuType
from dra_driver.device_attributes import (
    int_value,
    parent_attributes,
    power_attributes,
    string_value,
)

MIG_MODES = ("static", "dynamic")
SHARING_MODES = ("none", "time-slicing", "memory-shares")
GIB = 1024**3

# (counter name: a DNS label, capacity name: a C identifier, MigProfile attribute)
_DIMENSIONS: tuple[tuple[str, str, str], ...] = (
    ("multiprocessors", "multiprocessors", "multiprocessors"),
    ("copy-engines", "copyEngines", "copy_engines"),
    ("decoders", "decoders", "decoders"),
    ("encoders", "encoders", "encoders"),
    ("jpeg-engines", "jpegEngines", "jpeg_engines"),
    ("ofa-engines", "ofaEngines", "ofa_engines"),
)

Attribute = tuple[str, dict[str, object]]
Quantities = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class DevicePolicy:
    driver_name: str = "gpu.tessera.dev"
    mig_mode: str = "static"
    """``static`` or ``dynamic``."""
    sharing: str = "none"
    """How whole GPUs may be shared between claims: ``none`` (one claim per GPU),
    ``time-slicing`` (several claims, time-sliced) or ``memory-shares`` (several claims, each
    with the memory it consumed, enforced by MPS). Sharing sets ``allowMultipleAllocations``,
    which needs the DRAConsumableCapacity feature gate (alpha in 1.34/1.35)."""
    memory_share_min: int = GIB
    """memory-shares: the smallest share, in bytes (the request policy's min and default)."""
    memory_share_step: int = GIB
    """memory-shares: shares are a multiple of this many bytes (the request policy's step)."""
    virtualization: str = "none"
    """``none``, ``passthrough`` or ``vgpu``: how GPUs are handed to virtual machines."""


@dataclass(frozen=True)
class CounterSet:
    name: str
    """``gpu-<minor>-counter-set``."""
    counters: Quantities
    """(counter name, Quantity string), sorted by name."""

    def api(self) -> dict[str, object]:
        """The v1 CounterSet object."""
        return {"name": self.name, "counters": {c: {"value": q} for c, q in self.counters}}


@dataclass(frozen=True)
class RequestPolicy:
    """How a claim consumes a capacity of a shared device: ``default`` when it asks nothing,
    else at least ``min`` and rounded up to ``min + n * step`` (Quantity strings)."""

    default: str
    min: str
    step: str

    def api(self) -> dict[str, object]:
        return {"default": self.default, "validRange": {"min": self.min, "step": self.step}}


@dataclass(frozen=True)
class DeviceTaint:
    """A v1 DeviceTaint (the DRADeviceTaints feature; see dra_driver/advertise/taints.py)."""

    key: str
    value: str
    effect: str
    time_added: str
    """RFC 3339, seconds, UTC (``2026-01-02T03:04:05Z``)."""

    def api(self) -> dict[str, object]:
        return {
            "key": self.key,
            "value": self.value,
            "effect": self.effect,
            "timeAdded": self.time_added,
        }


@dataclass(frozen=True)
class AdvertisedDevice:
    name: str
    kind: str
    """``gpu`` or ``mig``."""
    gpu_index: int
    gpu_minor: int
    parent_uuid: str
    uuid: str | None
    """None for dynamic MIG placements (they do not exist yet)."""
    mig_profile_id: int | None
    mig_placement_start: int | None
    mig_placement_size: int | None
    gpu_instance_id: int | None
    """Static MIG only."""
    compute_instance_id: int | None
    attributes: tuple[Attribute, ...]
    """(qualified name, {"string"|"int"|"bool"|"version": value}), sorted by name."""
    capacity: Quantities
    """(name, Quantity string), sorted by name."""
    consumes_counters: tuple[tuple[str, Quantities], ...] = ()
    """(counter set, ((counter, Quantity), ...)); empty when the device uses no counters."""
    allow_multiple_allocations: bool = False
    """Several claims may be allocated this device at once (GPU sharing)."""
    request_policies: tuple[tuple[str, RequestPolicy], ...] = ()
    """(capacity name, how a claim consumes it) for consumable capacity."""
    taints: tuple[DeviceTaint, ...] = ()
    """Set by ``dra_driver.advertise.taints.with_health`` for devices of an unhealthy GPU."""
    power_limits: PowerLimits | None = None
    """A whole GPU's power-limit range and default in milliwatts, exactly as NVML reports them
    (the attributes round them to watts); None for MIG devices and GPUs without one."""
    bus_id: str | None = None
    """The GPU's PCI bus id (sysfs BDF): vfio and vgpu devices."""
    iommu_group: int | None = None
    """The GPU's IOMMU group: vfio devices."""
    vgpu_type: VgpuType | None = None
    """The vGPU type a vgpu device makes."""

    def api(self) -> dict[str, object]:
        """The v1 Device object as the API server stores it."""
        policies = dict(self.request_policies)
        capacity: dict[str, object] = {}
        for k, q in self.capacity:
            entry: dict[str, object] = {"value": q}
            if k in policies:
                entry["requestPolicy"] = policies[k].api()
            capacity[k] = entry
        out: dict[str, object] = {
            "name": self.name,
            "attributes": {k: dict(v) for k, v in self.attributes},
            "capacity": capacity,
        }
        if self.allow_multiple_allocations:
            out["allowMultipleAllocations"] = True
        if self.consumes_counters:
            out["consumesCounters"] = [
                {"counterSet": s, "counters": {c: {"value": q} for c, q in counters}}
                for s, counters in self.consumes_counters
            ]
        if self.taints:
            out["taints"] = [t.api() for t in self.taints]
        return out


@dataclass(frozen=True)
class DeviceModel:
    devices: tuple[AdvertisedDevice, ...]
    counter_sets: tuple[CounterSet, ...]

    def device(self, name: str) -> AdvertisedDevice:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)


def mig_device_name(minor: int, profile_name: str, profile_id: int, start: int) -> str:
    """``gpu-0-mig-1g5gb-19-0``; ``1g.5gb+me`` becomes ``1g5gbme``."""
    profile = re.sub(r"[^a-z0-9]", "", profile_name.lower())
    return f"gpu-{minor}-mig-{profile}-{profile_id}-{start}"


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counter-set"


def _sorted_attrs(attrs: dict[str, dict[str, object]]) -> tuple[Attribute, ...]:
    return tuple(sorted(attrs.items()))


def _quantities(values: dict[str, int]) -> Quantities:
    return tuple(sorted((k, str(v)) for k, v in values.items()))


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
        mig_profile_id=None,
        mig_placement_start=None,
        mig_placement_size=None,
        gpu_instance_id=None,
        compute_instance_id=None,
        attributes=_sorted_attrs(attrs),
        capacity=_quantities({"memory": d.memory.total}),
        consumes_counters=consumes,
        allow_multiple_allocations=policy.sharing != "none",
        request_policies=policies,
        power_limits=d.power_limits,
    )


def _mig_capacity(profile: MigProfile | None, memory: int, multiprocessors: int) -> Quantities:
    values = {cap: getattr(profile, field) for _, cap, field in _DIMENSIONS} if profile else {}
    return _quantities(values | {"memory": memory, "multiprocessors": multiprocessors})


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
        attributes=_sorted_attrs(attrs),
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
    return CounterSet(name=counter_set_name(device.minor), counters=_quantities(values))


def _placement_consumption(
    counters: CounterSet, profile: MigProfile, placement: Placement
) -> tuple[tuple[str, Quantities], ...]:
    amounts = _profile_amounts(profile)
    amounts |= {f"memory-slice-{slot}": 1 for slot in placement.slots()}
    return ((counters.name, _quantities(amounts)),)


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


def advertised_devices(inv: NodeInventory, policy: DevicePolicy) -> DeviceModel:
    """Every device the node advertises under ``policy``, in a deterministic order: by GPU minor,
    the whole GPU first, then MIG devices by (slice count, profile id, placement start)."""
    if policy.mig_mode not in MIG_MODES:
        raise ValueError(f"mig_mode {policy.mig_mode!r}: expected one of {', '.join(MIG_MODES)}")
    if policy.sharing not in SHARING_MODES:
        raise ValueError(f"sharing {policy.sharing!r}: expected one of {', '.join(SHARING_MODES)}")
    devices: list[AdvertisedDevice] = []
    counter_sets: list[CounterSet] = []
    for gpu in sorted(inv.gpus, key=lambda g: g.device.minor):
        d = gpu.device
        if policy.mig_mode == "dynamic" and d.mig_capable and d.mig_profiles:
            found, counters = _dynamic_devices(gpu, inv.system, policy)
            devices += found
            counter_sets.append(counters)
        elif policy.mig_mode == "static" and d.mig_enabled:
            devices += _static_mig_devices(gpu, inv.system)
        else:
            devices.append(_whole_gpu(gpu, inv.system, policy))

    def order(dev: AdvertisedDevice) -> tuple[int, int, int, int, int]:
        if dev.kind == "gpu":
            return (dev.gpu_minor, 0, 0, 0, 0)
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
