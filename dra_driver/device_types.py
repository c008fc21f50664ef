"""The values the device model hands on: what the node advertises, as plain frozen data.

:mod:`dra_driver.device_model` builds them from the inventory (containers' devices) and
:mod:`dra_driver.vm_devices` (virtual machines' devices); the slices, the kubelet plugin and the
scheduler model read them. No logic beyond turning them into API objects."""

from __future__ import annotations

from dataclasses import dataclass

from agent.nvml.types import PowerLimits
from agent.pcihost.vm_types import VgpuType

MIG_MODES = ("static", "dynamic")
SHARING_MODES = ("none", "time-slicing", "memory-shares")
VIRTUALIZATION_MODES = ("none", "passthrough", "vgpu")
GIB = 1024**3

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
    """What the GPUs also offer virtual machines: ``none``, ``passthrough`` (a ``vfio`` device
    per GPU) or ``vgpu`` (``vgpu`` devices per vGPU type); see :mod:`dra_driver.vm_devices`."""
    virtualization_gpus: tuple[str, ...] = ()
    """Which GPUs get VM devices: minors, UUIDs or PCI addresses; empty: every GPU."""
    mig_profiles: tuple[str, ...] = ()
    """``dynamic`` MIG: the profiles (``1g.10gb``) whose placements are advertised; empty: all."""


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


@dataclass(frozen=True, kw_only=True)
class AdvertisedDevice:
    name: str
    kind: str
    """``gpu``, ``mig``, ``vfio`` (the GPU passed through to a VM) or ``vgpu``."""
    gpu_index: int
    gpu_minor: int
    parent_uuid: str
    uuid: str | None
    """None for dynamic MIG placements and vGPUs (they do not exist yet)."""
    mig_profile_id: int | None = None
    """MIG devices only (the MIG fields are None for every other kind)."""
    mig_placement_start: int | None = None
    mig_placement_size: int | None = None
    gpu_instance_id: int | None = None
    """Static MIG only."""
    compute_instance_id: int | None = None
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
    """The GPU's PCI address (sysfs form, ``0000:1b:00.0``): ``vfio`` and ``vgpu`` devices."""
    iommu_group: int | None = None
    """The GPU's IOMMU group: ``vfio`` devices."""
    vgpu_type: VgpuType | None = None
    """The vGPU type a ``vgpu`` device is an instance of."""

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


def counter_set_name(minor: int) -> str:
    """``gpu-<minor>-counter-set``: the one counter set of a GPU."""
    return f"gpu-{minor}-counter-set"


def sorted_attrs(attrs: dict[str, dict[str, object]]) -> tuple[Attribute, ...]:
    return tuple(sorted(attrs.items()))


def quantities(values: dict[str, int]) -> Quantities:
    return tuple(sorted((k, str(v)) for k, v in values.items()))
