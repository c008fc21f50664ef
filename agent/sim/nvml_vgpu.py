"""The simulated NVML's vGPU host calls (NVML "vGPU Management" and "vGPU" queries).

A model whose ``vgpu`` interface is set runs NVIDIA's vGPU host driver: every GPU reports
``NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU``, its host vGPU mode (SR-IOV for ``vf``, non-SR-IOV
for ``mdev``), the vGPU types of its product (``agent/sim/gpus.yaml``) and homogeneous mode (0).
Elsewhere (the ordinary driver) the mode is NONE and the vGPU queries answer NOT_SUPPORTED, as
NVML documents for GPUs without vGPU support (NVML API reference, group nvmlVgpu). A type id
unknown to the driver is INVALID_ARGUMENT.
"""

from __future__ import annotations

import pynvml

from agent.nvml import api_types as api
from agent.sim.mig import nvml_error
from agent.sim.model import GpuSlot
from agent.sim.nvml_core import NvmlCore
from agent.sim.specs import MIB, VgpuTypeSpec


class VgpuCalls(NvmlCore):
    """nvmlDeviceGetVirtualizationMode, nvmlDeviceGetHostVgpuMode, nvmlDeviceGetSupportedVgpus,
    nvmlVgpuTypeGet{Name,FramebufferSize,MaxInstances}, nvmlDeviceGetVgpuHeterogeneousMode."""

    def _vgpu_gpu(self, handle: api.DeviceHandle) -> GpuSlot:
        slot = self._gpu(handle)
        if self.model.vgpu_interface is None:
            raise nvml_error(
                pynvml.NVML_ERROR_NOT_SUPPORTED, "the driver is not a vGPU host driver"
            )
        return slot

    def _vgpu_type(self, vgpuTypeId: int) -> VgpuTypeSpec:
        self._require_init()
        if self.model.vgpu_interface is not None:
            for g in self.model.gpus:
                for t in g.spec.vgpu_types:
                    if t.type_id == vgpuTypeId:
                        return t
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"no vGPU type {vgpuTypeId!r}")

    def nvmlDeviceGetVirtualizationMode(self, handle: api.DeviceHandle) -> int:
        self._gpu(handle)
        if self.model.vgpu_interface is None:
            return int(pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE)
        return int(pynvml.NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU)

    def nvmlDeviceGetHostVgpuMode(self, handle: api.DeviceHandle) -> int:
        self._vgpu_gpu(handle)
        if self.model.vgpu_interface == "vf":
            return int(pynvml.NVML_HOST_VGPU_MODE_SRIOV)
        return int(pynvml.NVML_HOST_VGPU_MODE_NON_SRIOV)

    def nvmlDeviceGetSupportedVgpus(self, handle: api.DeviceHandle) -> list[int]:
        return [t.type_id for t in self._vgpu_gpu(handle).spec.vgpu_types]

    def nvmlVgpuTypeGetName(self, vgpuTypeId: int) -> str:
        return self._vgpu_type(vgpuTypeId).name

    def nvmlVgpuTypeGetFramebufferSize(self, vgpuTypeId: int) -> int:
        """Bytes."""
        return self._vgpu_type(vgpuTypeId).framebuffer_mib * MIB

    def nvmlVgpuTypeGetMaxInstances(self, handle: api.DeviceHandle, vgpuTypeId: int) -> int:
        slot = self._vgpu_gpu(handle)
        for t in slot.spec.vgpu_types:
            if t.type_id == vgpuTypeId:
                return t.max_instances
        raise nvml_error(
            pynvml.NVML_ERROR_INVALID_ARGUMENT, f"GPU {slot.index} has no vGPU type {vgpuTypeId}"
        )

    def nvmlDeviceGetVgpuHeterogeneousMode(self, handle: api.DeviceHandle) -> int:
        """0: homogeneous (every vGPU of the GPU has one type), the simulated drivers' mode."""
        self._vgpu_gpu(handle)
        return 0
