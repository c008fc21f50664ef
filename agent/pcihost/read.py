"""What one GPU offers virtual machines, read from sysfs alone (NVML adds the vGPU types).

Sources: sysfs-bus-pci (``driver``, ``iommu_group``, ``sriov_totalvfs``, ``virtfn<N>``),
vfio.rst (IOMMU group members), sysfs-bus-vfio-mdev (``mdev_supported_types``) and NVIDIA's
per-VF ``nvidia/current_vgpu_type`` (docs/gpu-facts.md, "GPUs for virtual machines")."""

from __future__ import annotations

from pathlib import Path

from agent.pcihost import attrs
from agent.pcihost.vgpu_host import (
    current_vgpu_type_path,
    mdev_types_dir,
    read_vgpus,
)
from agent.pcihost.vm_types import VGPU_MDEV, VGPU_VF, GpuVirtualization


def vgpu_layout(sys_root: Path, bus_id: str) -> tuple[str | None, tuple[str, ...]]:
    """The GPU's vGPU interface and the functions vGPUs are made on (sorted):

    - ``vf``: the PF has ``sriov_totalvfs`` and an enabled VF has ``nvidia/current_vgpu_type``;
      the functions are those VFs;
    - ``mdev``: its VFs (Ampere) or, failing that, the GPU itself have
      ``mdev_supported_types``; the functions are those;
    - else ``(None, ())``: no vGPU host driver, or its VFs are not enabled yet."""
    vfs = attrs.virtual_functions(sys_root, bus_id)
    has_total = (attrs.function_dir(sys_root, bus_id) / "sriov_totalvfs").exists()
    typed = tuple(vf for vf in vfs if current_vgpu_type_path(sys_root, vf).exists())
    if has_total and typed:
        return VGPU_VF, typed
    parents = tuple(vf for vf in vfs if mdev_types_dir(sys_root, vf).is_dir())
    if parents:
        return VGPU_MDEV, parents
    if mdev_types_dir(sys_root, bus_id).is_dir():
        return VGPU_MDEV, (bus_id,)
    return None, ()


def read_gpu_functions(sys_root: Path, bus_id: str) -> GpuVirtualization:
    """The GPU at ``bus_id`` as sysfs shows it now: IDs, bound driver, IOMMU group and its
    members, vGPU interface, the functions vGPUs are made on and the vGPUs that exist.
    ``vgpu_types`` is empty and ``heterogeneous`` False: NVML knows those (discovery fills them).
    PciHostError naming the path when the function is not there or cannot be read."""
    fn = attrs.function_dir(sys_root, bus_id)
    group = attrs.iommu_group(sys_root, bus_id)
    interface, functions = vgpu_layout(sys_root, bus_id)
    return GpuVirtualization(
        bus_id=bus_id,
        vendor_id=attrs.read_hex(fn / "vendor"),
        device_id=attrs.read_hex(fn / "device"),
        driver=attrs.bound_driver(sys_root, bus_id),
        iommu_group=group,
        group_members=() if group is None else attrs.group_devices(sys_root, group),
        vgpu_interface=interface,
        vgpu_functions=functions,
        vgpus=read_vgpus(sys_root, bus_id) if interface else (),
    )
