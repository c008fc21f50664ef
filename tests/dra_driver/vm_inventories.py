"""Inventories of nodes whose GPUs offer virtual machines, built by hand from a simulated node's
discovered inventory: ``Gpu.virtualization`` filled as discovery fills it on a VFIO-capable
node (every GPU in an IOMMU group of its own, bound to nvidia) or on a node under NVIDIA's vGPU
host driver (types as NVML lists them). Stand-ins until the simulator models ``vgpu-h200`` and
``vgpu-t4`` and discovery's ``read_gpu_functions`` exist (design24 sections 6 and 10)."""

from __future__ import annotations

import dataclasses

from agent.discovery.inventory import Gpu, NodeInventory
from agent.pcihost.vm_types import NVIDIA, VGPU_MDEV, VGPU_VF, GpuVirtualization, Vgpu, VgpuType

GIB = 1024**3
NVIDIA_VENDOR = 0x10DE
DEVICE_IDS = {"NVIDIA H100 80GB HBM3": 0x2330, "NVIDIA H200": 0x2335, "NVIDIA L40S": 0x26B9}
"""PCI device ids of the simulated products (pci-ids: 10de 2330, 2335, 26b9); others 0x20b0."""

H200_TYPES = (
    VgpuType(1428, "NVIDIA H200X-141C", 141 * GIB, 1),
    VgpuType(1429, "NVIDIA H200X-70C", 70 * GIB, 2),
    VgpuType(1430, "NVIDIA H200X-35C", 35 * GIB, 4),
    VgpuType(1431, "NVIDIA H200X-17C", 17 * GIB, 8),
)
"""Time-sliced H200 types (per-VF ``current_vgpu_type``, vGPU 17+); 15 instances in all."""

L40S_TYPES = tuple(
    VgpuType(900 + gb, f"GRID L40S-{gb}Q", gb * GIB, count)
    for gb, count in ((1, 32), (2, 24), (3, 16), (4, 12), (6, 8), (8, 6), (12, 4), (16, 3),
                      (24, 2), (48, 1))
)  # fmt: skip
"""Q-series L40S types, mediated devices (at most 32 vGPUs per GPU): 108 instances per GPU, more
than a 1.35 slice of counter-consuming devices holds (64)."""


def _virtualization(gpu: Gpu, **fields: object) -> GpuVirtualization:
    bus = gpu.pcie.bus_id
    base = GpuVirtualization(
        bus_id=bus,
        vendor_id=NVIDIA_VENDOR,
        device_id=DEVICE_IDS.get(gpu.device.name, 0x20B0),
        driver=NVIDIA,
        iommu_group=40 + gpu.device.minor,
        group_members=(bus,),
    )
    return dataclasses.replace(base, **fields)  # type: ignore[arg-type]


def _with(inv: NodeInventory, each: dict[int, GpuVirtualization]) -> NodeInventory:
    gpus = tuple(dataclasses.replace(g, virtualization=each.get(g.device.minor)) for g in inv.gpus)
    return dataclasses.replace(inv, gpus=gpus)


def passthrough(inv: NodeInventory, *, no_iommu: tuple[int, ...] = ()) -> NodeInventory:
    """Every GPU bound to nvidia in an IOMMU group of its own (group 40 + minor); the GPUs of
    ``no_iommu`` (minors) without a group (IOMMU off for them)."""
    each = {
        g.device.minor: _virtualization(
            g, iommu_group=None if g.device.minor in no_iommu else 40 + g.device.minor
        )
        for g in inv.gpus
    }
    return _with(inv, each)


def vgpu(
    inv: NodeInventory,
    types: tuple[VgpuType, ...],
    *,
    interface: str = VGPU_VF,
    heterogeneous: bool = False,
    hosted: dict[int, int] | None = None,
) -> NodeInventory:
    """Every GPU under the vGPU host driver offering ``types``; ``hosted``: minor -> the type id
    of a vGPU that exists on it now."""
    each = {}
    for g in inv.gpus:
        vgpus: tuple[Vgpu, ...] = ()
        type_id = (hosted or {}).get(g.device.minor)
        if type_id is not None:
            uuid = "5b7e8f2c-0000-4000-8000-00000000000" + str(g.device.minor)
            mdev = uuid if interface == VGPU_MDEV else None
            vgpus = (Vgpu(type_id, g.pcie.bus_id, mdev),)
        each[g.device.minor] = _virtualization(
            g, vgpu_interface=interface, vgpu_types=types, heterogeneous=heterogeneous,
            vgpus=vgpus,
        )  # fmt: skip
    return _with(inv, each)
