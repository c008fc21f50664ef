"""What the node's PCI functions offer virtual machines: domain types, no I/O.

Built by :mod:`agent.pcihost` (sysfs) and :mod:`agent.nvml` (vGPU type facts) and read by the
device model, prepare, telemetry and doctor. Facts: docs/gpu-facts.md, "GPUs for virtual
machines (VFIO and vGPU)"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KernelWrite = Callable[[Path, str], None]
"""Write ``value`` to the sysfs attribute at ``path``, as ``echo -n value > path`` does (one
``write(2)``; raises OSError as the kernel answers). The real one is
:func:`agent.pcihost.kernel.write_attribute`; the simulator's acts on the write as Linux does."""

VFIO_PCI = "vfio-pci"
NVIDIA = "nvidia"

VGPU_MDEV = "mdev"
"""vGPUs are mediated devices: on the GPU itself (before Ampere) or on its SR-IOV virtual
functions (Ampere): ``mdev_supported_types/<nvidia-ID>/create``."""
VGPU_VF = "vf"
"""vGPUs are SR-IOV virtual functions given a type through ``nvidia/current_vgpu_type`` (Ada,
Hopper and newer, vGPU 17+; no mdev)."""


@dataclass(frozen=True)
class VgpuType:
    """One vGPU type a GPU supports, as NVML gives it (``nvmlDeviceGetSupportedVgpus``,
    ``nvmlVgpuTypeGetName``, ``nvmlVgpuTypeGetFramebufferSize``,
    ``nvmlVgpuTypeGetMaxInstances``)."""

    type_id: int
    """NVML's vGPU type id; the mdev type directory is ``nvidia-<type_id>``, the per-VF
    ``current_vgpu_type`` value is ``<type_id>``."""
    name: str
    """As the driver names it: ``NVIDIA H200X-35C``, ``GRID T4-4Q``."""
    framebuffer_bytes: int
    max_instances: int
    """On one GPU, when every vGPU of that GPU has this type."""


@dataclass(frozen=True)
class Vgpu:
    """A vGPU that exists now on a GPU (found in sysfs)."""

    type_id: int
    function: str
    """The VF's BDF (``vf``) or the mdev's parent BDF (``mdev``)."""
    mdev_uuid: str | None
    """The mediated device's UUID (``mdev``); None for a VF vGPU."""


@dataclass(frozen=True)
class GpuVirtualization:
    """What one GPU offers virtual machines, and its state now."""

    bus_id: str
    """The GPU's (physical function's) sysfs BDF: ``0000:1b:00.0``."""
    vendor_id: int
    device_id: int
    driver: str | None
    """The driver bound now (``nvidia``, ``vfio-pci``), None when unbound."""
    iommu_group: int | None
    """None: no IOMMU (VFIO cannot be used)."""
    group_members: tuple[str, ...]
    """Every function of the IOMMU group (the GPU included), sorted."""
    vgpu_interface: str | None = None
    """``mdev``, ``vf``, or None where the vGPU host driver does not offer vGPUs."""
    vgpu_types: tuple[VgpuType, ...] = ()
    heterogeneous: bool = False
    """The GPU may host vGPUs of different types at once (NVML's vGPU heterogeneous mode)."""
    vgpu_functions: tuple[str, ...] = ()
    """Where vGPUs are made: the enabled VFs (``vf``, or Ampere's ``mdev``), else the GPU itself
    (``mdev`` before Ampere); sorted."""
    vgpus: tuple[Vgpu, ...] = ()
    """The vGPUs that exist now."""
