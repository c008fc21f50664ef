"""The devices a GPU offers virtual machines (``--virtualization``), pure functions of inventory.

``passthrough``
    Each chosen GPU with an IOMMU group is also ``gpu-<minor>-vfio`` (type ``vfio``): the whole
    GPU handed to a VM through vfio-pci. Its VM view and its container views are kept apart by
    the scheduler itself: the GPU has one counter set, ``gpu-<minor>-counter-set`` (dynamic MIG's,
    else :func:`memory_counter_set`'s one ``memory`` counter), that the whole GPU, every MIG
    placement and the vfio device consume from, and the vfio device consumes every counter in
    full, so it is never allocated beside any other device of its GPU (KEP-4815, partitionable
    devices: the allocator checks the sum of what the allocated devices consume against each
    counter). Static MIG devices that exist consume no counters, so a GPU in MIG mode under
    ``--mig-mode static`` offers no vfio device.
``vgpu``
    Each chosen GPU under NVIDIA's vGPU host driver offers, per vGPU type T it supports,
    ``gpu-<minor>-vgpu-<T.type_id>-<k>`` for k < T.max_instances (type ``vgpu``), each consuming
    its framebuffer from the counter ``framebuffer`` = max over T of T.max_instances x
    framebuffer: the scheduler allocates no more vGPUs of a type than fit. A GPU whose types may
    not be mixed (not heterogeneous) that already hosts a vGPU offers only that vGPU's type.
    Counters cannot say "one type at a time" before the first vGPU exists (a sum of two types
    can fit where the driver takes only one), so prepare refuses a second type
    (``vgpu_type_conflict``) and the slices drop the other types once the first one exists. A
    GPU under the vGPU host driver runs no CUDA on the host: it is not advertised for
    containers.

Facts (the sysfs ABI, vGPU type names, the host driver's interfaces): docs/gpu-facts.md, "GPUs for
virtual machines (VFIO and vGPU)".
"""

from __future__ import annotations

import re

from agent.discovery.inventory import Gpu
from agent.nvml.types import GpuDevice, SystemInfo
from agent.pcihost.vm_types import GpuVirtualization, VgpuType
from dra_driver.device_attributes import (
    STANDARD_DOMAIN,
    int_value,
    parent_attributes,
    string_value,
)
from dra_driver.device_types import (
    AdvertisedDevice,
    CounterSet,
    DevicePolicy,
    counter_set_name,
    quantities,
    sorted_attrs,
)

PCI_BUS_ID = f"{STANDARD_DOMAIN}/pciBusID"
_HOST_ONLY = ("cudaDriverVersion",)
"""Parent attributes a VM device does not carry: the host's CUDA is not what the guest runs."""
_VGPU_DROPPED = (*_HOST_ONLY, PCI_BUS_ID, "nvlinkClique")
"""A vGPU's PCI address is its own (a VF's, known at prepare, given in the KEP-5304 metadata),
not its GPU's, which it carries as ``parentPciBusID``; a time-sliced vGPU has no NVLink."""
_NAME_PREFIXES = ("NVIDIA ", "GRID ")

_MINOR = re.compile(r"[0-9]{1,3}")
_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I)
_BDF = re.compile(r"(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([01][0-9a-f])\.([0-7])", re.I)


def bus_id_key(bus_id: str) -> str | None:
    """A PCI address in sysfs form (``0000:1b:00.0``) from sysfs's, NVML's
    (``00000000:1B:00.0``) or a short one (``1b:00.0``, domain 0); None when it is none."""
    m = _BDF.fullmatch(bus_id.strip())
    if m is None:
        return None
    domain = int(m[1], 16) if m[1] else 0
    return f"{domain:04x}:{int(m[2], 16):02x}:{int(m[3], 16):02x}.{m[4]}"


def gpu_selector(raw: str) -> str:
    """One ``--virtualization-gpus`` entry, canonical: a minor (``3``), a UUID (lower case) or a
    PCI address (sysfs form). ValueError with the phrase that follows the value otherwise."""
    value = raw.strip()
    if _MINOR.fullmatch(value):
        return str(int(value))
    if _UUID.fullmatch(value):
        return value.lower()
    key = bus_id_key(value)
    if key is not None:
        return key
    raise ValueError(
        "is not a GPU: give its minor (3, as in /dev/nvidia3), its UUID (GPU-…) or its PCI"
        " address (0000:1b:00.0)"
    )


def chosen(gpu: Gpu, policy: DevicePolicy) -> bool:
    """Whether ``--virtualization-gpus`` names the GPU (every GPU when it names none)."""
    if not policy.virtualization_gpus:
        return True
    d = gpu.device
    names = {str(d.minor), d.uuid.lower(), bus_id_key(gpu.pcie.bus_id)}
    if gpu.virtualization is not None:
        names.add(bus_id_key(gpu.virtualization.bus_id))
    return any(gpu_selector(s) in names for s in policy.virtualization_gpus)


def passes_through(gpu: Gpu, policy: DevicePolicy) -> bool:
    """``--virtualization passthrough`` and the GPU is chosen and in an IOMMU group (without
    one, VFIO cannot take it)."""
    v = gpu.virtualization
    return (
        policy.virtualization == "passthrough"
        and v is not None
        and v.iommu_group is not None
        and chosen(gpu, policy)
    )


def under_vgpu_manager(gpu: Gpu, policy: DevicePolicy) -> bool:
    """``--virtualization vgpu`` and the GPU is under NVIDIA's vGPU host driver: it offers
    vGPUs (when chosen) and nothing for containers."""
    v = gpu.virtualization
    return policy.virtualization == "vgpu" and v is not None and v.vgpu_interface is not None


def memory_counter_set(device: GpuDevice) -> CounterSet:
    """The counter set of a GPU without MIG placements: one ``memory`` counter, all of it."""
    return CounterSet(
        name=counter_set_name(device.minor), counters=quantities({"memory": device.memory.total})
    )


def _hex4(value: int) -> str:
    return f"{value:04x}"


def vfio_device(gpu: Gpu, system: SystemInfo, counters: CounterSet) -> AdvertisedDevice:
    """``gpu-<minor>-vfio``: the GPU for a VM, consuming all of ``counters`` (its GPU's set).
    Only for a GPU that :func:`passes_through`."""
    d, v = gpu.device, gpu.virtualization
    if v is None or v.iommu_group is None:
        raise ValueError(f"gpu-{d.minor} has no IOMMU group: it cannot be passed through")
    attrs = {k: a for k, a in parent_attributes(gpu, system).items() if k not in _HOST_ONLY}
    attrs |= {
        "type": string_value("vfio"),
        "uuid": string_value(d.uuid),
        "pciVendorID": string_value(_hex4(v.vendor_id)),
        "pciDeviceID": string_value(_hex4(v.device_id)),
        "iommuGroup": int_value(v.iommu_group),
    }
    return AdvertisedDevice(
        name=f"gpu-{d.minor}-vfio",
        kind="vfio",
        gpu_index=d.index,
        gpu_minor=d.minor,
        parent_uuid=d.uuid,
        uuid=d.uuid,
        attributes=sorted_attrs(attrs),
        capacity=quantities({"memory": d.memory.total}),
        consumes_counters=((counters.name, counters.counters),),
        bus_id=bus_id_key(v.bus_id) or v.bus_id,
        iommu_group=v.iommu_group,
    )


def vgpu_type_name(vgpu_type: VgpuType) -> str:
    """The type's name without the driver's ``NVIDIA ``/``GRID `` prefix: ``H200X-35C``."""
    for prefix in _NAME_PREFIXES:
        if vgpu_type.name.startswith(prefix):
            return vgpu_type.name[len(prefix) :]
    return vgpu_type.name


def offered_types(v: GpuVirtualization) -> tuple[VgpuType, ...]:
    """The vGPU types the GPU can take now, smallest framebuffer first: all it supports, or
    on a GPU whose types may not be mixed that hosts vGPUs, only theirs."""
    types = v.vgpu_types
    if not v.heterogeneous and v.vgpus:
        hosted = {g.type_id for g in v.vgpus}
        types = tuple(t for t in types if t.type_id in hosted)
    return tuple(sorted(types, key=lambda t: (t.framebuffer_bytes, t.type_id)))


def vgpu_devices(
    gpu: Gpu, system: SystemInfo, policy: DevicePolicy
) -> tuple[list[AdvertisedDevice], CounterSet | None]:
    """The vGPU devices of a GPU :func:`under_vgpu_manager` and their counter set (none when
    the GPU is not chosen or offers no type)."""
    d, v = gpu.device, gpu.virtualization
    if v is None or not chosen(gpu, policy):
        return [], None
    types = offered_types(v)
    if not types:
        return [], None
    framebuffer = max(t.max_instances * t.framebuffer_bytes for t in types)
    counters = CounterSet(
        name=counter_set_name(d.minor), counters=quantities({"framebuffer": framebuffer})
    )
    parent = {k: a for k, a in parent_attributes(gpu, system).items() if k not in _VGPU_DROPPED}
    parent |= {
        "type": string_value("vgpu"),
        "parentUUID": string_value(d.uuid),
        "parentPciBusID": string_value(bus_id_key(v.bus_id) or v.bus_id),
    }
    out = []
    for t in types:
        attrs = parent | {
            "vgpuType": string_value(vgpu_type_name(t)),
            "vgpuTypeID": int_value(t.type_id),
            "maxInstances": int_value(t.max_instances),
        }
        consumes = ((counters.name, quantities({"framebuffer": t.framebuffer_bytes})),)
        out += [
            AdvertisedDevice(
                name=f"gpu-{d.minor}-vgpu-{t.type_id}-{k}",
                kind="vgpu",
                gpu_index=d.index,
                gpu_minor=d.minor,
                parent_uuid=d.uuid,
                uuid=None,
                attributes=sorted_attrs(attrs),
                capacity=quantities({"memory": t.framebuffer_bytes}),
                consumes_counters=consumes,
                bus_id=bus_id_key(v.bus_id) or v.bus_id,
                vgpu_type=t,
            )
            for k in range(t.max_instances)
        ]
    return out, counters
