"""vGPU facts of a GPU, read through NVML (the facade's :meth:`Nvml.vgpu_types`,
:meth:`Nvml.vgpu_heterogeneous`, :meth:`Nvml.vgpu_sriov` use these).

NVML's vGPU host calls (NVML API reference, "vGPU Management"; docs/gpu-facts.md, "NVIDIA vGPU
host driver"): a GPU under the vGPU host driver reports virtualization mode HOST_VGPU, the type
ids it supports, each type's name, framebuffer and most instances per GPU, its host vGPU mode
(SR-IOV or not) and whether vGPUs of different types may share it (heterogeneous mode). On the
ordinary driver the calls answer NOT_SUPPORTED: no types.
"""

from __future__ import annotations

from agent.nvml.api import NvmlApi
from agent.nvml.api_types import DeviceHandle
from agent.nvml.errors import NvmlNotSupported
from agent.pcihost.vm_types import VgpuType

VIRTUALIZATION_MODE_HOST_VGPU = 3
"""``NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU`` (nvml.h)."""
HOST_VGPU_MODE_SRIOV = 1
"""``NVML_HOST_VGPU_MODE_SRIOV`` (nvml.h)."""


def vgpu_types(api: NvmlApi, handle: DeviceHandle) -> tuple[VgpuType, ...]:
    """The vGPU types the GPU supports, in NVML's order; empty when it is not in vGPU host mode
    or NVML answers NOT_SUPPORTED."""
    try:
        if api.nvmlDeviceGetVirtualizationMode(handle) != VIRTUALIZATION_MODE_HOST_VGPU:
            return ()
        ids = api.nvmlDeviceGetSupportedVgpus(handle)
    except NvmlNotSupported:
        return ()
    return tuple(
        VgpuType(
            type_id=int(type_id),
            name=str(api.nvmlVgpuTypeGetName(type_id)),
            framebuffer_bytes=api.nvmlVgpuTypeGetFramebufferSize(type_id),
            max_instances=api.nvmlVgpuTypeGetMaxInstances(handle, type_id),
        )
        for type_id in ids
    )


def heterogeneous(api: NvmlApi, handle: DeviceHandle) -> bool:
    """Whether vGPUs of different types may share the GPU (False where NVML does not say)."""
    try:
        return bool(api.nvmlDeviceGetVgpuHeterogeneousMode(handle))
    except NvmlNotSupported:
        return False


def sriov(api: NvmlApi, handle: DeviceHandle) -> bool | None:
    """True: vGPUs are SR-IOV VFs; False: mediated devices on the GPU; None: no vGPU host."""
    try:
        return api.nvmlDeviceGetHostVgpuMode(handle) == HOST_VGPU_MODE_SRIOV
    except NvmlNotSupported:
        return None
