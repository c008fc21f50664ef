"""The MIG calls of the simulated NVML (pynvml names, parameters and return types).

Each method resolves its handles, then reads the state or applies a pure rule from
:mod:`agent.sim.mig` under the state store's lock. Answers as real NVML gives them:

* GI profile info, possible placements: on every MIG-capable GPU, whatever its MIG mode;
* creating, listing or counting instances while MIG is disabled: NOT_SUPPORTED;
* GPUs without MIG: NOT_SUPPORTED; MIG device handles where a GPU is expected: NOT_SUPPORTED;
* a handle whose GI/CI was destroyed: INVALID_ARGUMENT.
"""

from __future__ import annotations

import ctypes
from typing import Any, Literal, cast, overload

import pynvml

from agent.nvml import api_types as api
from agent.sim import handles, mig
from agent.sim.handles import OutArray, Ref
from agent.sim.mig import nvml_error
from agent.sim.nvml_core import NvmlCore
from agent.sim.specs import GpuSpec, MigProfileSpec
from agent.sim.state import ComputeInstance, GpuInstance

MAX_MIG_DEVICES = 7


def _gi_profile_info(spec: GpuSpec, p: MigProfileSpec, version: int) -> Any:
    info = (
        pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        if version == 2
        else (pynvml.c_nvmlGpuInstanceProfileInfo_t())
    )
    info.id = p.profile_id
    info.isP2pSupported = 1 if spec.architecture >= pynvml.NVML_DEVICE_ARCH_HOPPER else 0
    info.sliceCount = p.slice_count
    info.instanceCount = p.max_instances
    info.multiprocessorCount = p.multiprocessors
    info.copyEngineCount = p.copy_engines
    info.decoderCount = p.decoders
    info.encoderCount = p.encoders
    info.jpegCount = p.jpeg_engines
    info.ofaCount = p.ofa_engines
    info.memorySizeMB = p.memory_mib
    if version == 2:
        info.name = f"MIG {p.name}"
    return info


class MigCalls(NvmlCore):
    """nvmlDevice*Mig*, nvmlDevice*GpuInstance*, nvmlGpuInstance*, nvmlComputeInstance*."""

    # -- helpers -------------------------------------------------------------------------------
    def _gi_handle(self, gpu: int, gi: GpuInstance) -> api.GpuInstanceHandle:
        return handles.gpu_instance(Ref(handles.KIND_GI, gpu, gi.id))

    def _ci_handle(
        self, gpu: int, gi: GpuInstance, ci: ComputeInstance
    ) -> api.ComputeInstanceHandle:
        return handles.compute_instance(Ref(handles.KIND_CI, gpu, gi.id, ci.id))

    # -- MIG mode --------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, device: api.DeviceHandle) -> list[int]:
        slot = self._gpu(device)
        mig.require_mig_capable(slot.spec)
        g = self._gpu_state(slot.index)
        return [int(g.mig_current), int(g.mig_pending)]

    def nvmlDeviceSetMigMode(self, device: api.DeviceHandle, mode: int) -> int:
        slot = self._gpu(device)
        return self._update_gpu(slot.index, lambda g: mig.set_mig_mode(g, slot.spec, mode))

    # -- GPU instance profiles ---------------------------------------------------------------------
    @overload
    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: api.DeviceHandle, profile: int, version: Literal[2] = 2
    ) -> api.GpuInstanceProfileInfo: ...

    @overload
    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: api.DeviceHandle, profile: int, version: int
    ) -> Any: ...

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: api.DeviceHandle, profile: int, version: int = 2
    ) -> Any:
        """Version 2 (``c_nvmlGpuInstanceProfileInfo_v2_t``, with the name) by default; 1
        (``c_nvmlGpuInstanceProfileInfo_t``) on request."""
        if version not in (1, 2):
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, f"no version {version}")
        slot = self._gpu(device)
        return _gi_profile_info(slot.spec, mig.gi_profile_by_enum(slot.spec, profile), version)

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstanceProfileInfoById(
        self, device: api.DeviceHandle, profileId: int
    ) -> api.GpuInstanceProfileInfo:
        slot = self._gpu(device)
        info = _gi_profile_info(slot.spec, mig.gi_profile(slot.spec, profileId), 2)
        return cast(api.GpuInstanceProfileInfo, info)

    nvmlDeviceGetGpuInstanceProfileInfoByIdV = nvmlDeviceGetGpuInstanceProfileInfoById

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: api.DeviceHandle, profileId: int, placementsRef: object, countRef: object
    ) -> int:
        """Every placement of the profile's table, MIG enabled or not; NULL array: count only."""
        slot = self._gpu(device)
        p = mig.gi_profile(slot.spec, profileId)
        count = handles.out_uint(countRef, "countRef")
        if placementsRef is not None:
            out = OutArray(placementsRef, pynvml.c_nvmlGpuInstancePlacement_t, "placementsRef")
            out.fill(
                [pynvml.c_nvmlGpuInstancePlacement_t(s, p.memory_slots) for s in p.placement_starts]
            )
        count.value = len(p.placement_starts)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(
        self, device: api.DeviceHandle, profileId: int
    ) -> int:
        slot = self._gpu(device)
        return mig.remaining_capacity(self._gpu_state(slot.index), slot.spec, profileId)

    # -- GPU instances ----------------------------------------------------------------------------
    def nvmlDeviceCreateGpuInstance(
        self, device: api.DeviceHandle, profileId: int
    ) -> api.GpuInstanceHandle:
        slot = self._gpu(device)
        gi = self._update_gpu(
            slot.index, lambda g: mig.create_gpu_instance(g, slot.spec, profileId)
        )
        return self._gi_handle(slot.index, gi)

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: api.DeviceHandle, profileId: int, placement: object
    ) -> api.GpuInstanceHandle:
        """``placement`` is ``byref(c_nvmlGpuInstancePlacement_t(start, size))``."""
        slot = self._gpu(device)
        pl = handles.in_struct(placement, pynvml.c_nvmlGpuInstancePlacement_t, "placement")
        where = (int(pl.start), int(pl.size))
        gi = self._update_gpu(
            slot.index, lambda g: mig.create_gpu_instance(g, slot.spec, profileId, where)
        )
        return self._gi_handle(slot.index, gi)

    def nvmlDeviceGetGpuInstances(
        self, device: api.DeviceHandle, profileId: int, gpuInstancesRef: object, countRef: object
    ) -> int:
        slot = self._gpu(device)
        g = self._gpu_state(slot.index)
        mig.require_mig_enabled(g, slot.spec)
        mig.gi_profile(slot.spec, profileId)
        count = handles.out_uint(countRef, "countRef")
        out = OutArray(gpuInstancesRef, pynvml.c_nvmlGpuInstance_t, "gpuInstancesRef")
        found = sorted(
            (gi for gi in g.gpu_instances if gi.profile_id == profileId), key=lambda gi: gi.id
        )
        out.fill([self._gi_handle(slot.index, gi) for gi in found])
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuInstanceById(
        self, device: api.DeviceHandle, gpuInstanceId: int
    ) -> api.GpuInstanceHandle:
        slot = self._gpu(device)
        g = self._gpu_state(slot.index)
        mig.require_mig_enabled(g, slot.spec)
        return self._gi_handle(slot.index, mig.find_gpu_instance(g, gpuInstanceId))

    def nvmlGpuInstanceGetInfo(self, gpuInstance: api.GpuInstanceHandle) -> api.GpuInstanceInfo:
        slot, gi = self._gpu_instance(gpuInstance)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = handles.device(Ref(handles.KIND_GPU, slot.index))
        info.id = gi.id
        info.profileId = gi.profile_id
        info.placement = pynvml.c_nvmlGpuInstancePlacement_t(gi.start, gi.size)
        return cast(api.GpuInstanceInfo, info)

    def nvmlGpuInstanceDestroy(self, gpuInstance: api.GpuInstanceHandle) -> int:
        slot, gi = self._gpu_instance(gpuInstance)
        self._update_gpu(slot.index, lambda g: (mig.destroy_gpu_instance(g, gi.id), None))
        return int(pynvml.NVML_SUCCESS)

    # -- compute instances ------------------------------------------------------------------------
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: api.GpuInstanceHandle, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        """``device`` is a GPU-instance handle (pynvml's parameter name)."""
        if version not in (1, 2):
            raise nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, f"no version {version}")
        slot, gi = self._gpu_instance(device)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"engine profile {engProfile}")
        p = mig.ci_profile(slot.spec, gi, profile)
        gp = slot.spec.profile(gi.profile_id)
        info = (
            pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            if version == 2
            else (pynvml.c_nvmlComputeInstanceProfileInfo_t())
        )
        info.id = p.id
        info.sliceCount = p.slice_count
        info.instanceCount = len(p.starts)
        info.multiprocessorCount = p.multiprocessors
        info.sharedCopyEngineCount = gp.copy_engines
        info.sharedDecoderCount = gp.decoders
        info.sharedEncoderCount = gp.encoders
        info.sharedJpegCount = gp.jpeg_engines
        info.sharedOfaCount = gp.ofa_engines
        if version == 2:
            info.name = f"MIG {p.name}"
        return info

    nvmlGpuInstanceGetComputeInstanceProfileInfoV = nvmlGpuInstanceGetComputeInstanceProfileInfo

    def nvmlGpuInstanceCreateComputeInstance(
        self, gpuInstance: api.GpuInstanceHandle, profileId: int
    ) -> api.ComputeInstanceHandle:
        slot, gi = self._gpu_instance(gpuInstance)
        ci = self._update_gpu(
            slot.index, lambda g: mig.create_compute_instance(g, slot.spec, gi.id, profileId)
        )
        return self._ci_handle(slot.index, gi, ci)

    def nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        self, gpuInstance: api.GpuInstanceHandle, profileId: int, placement: object
    ) -> api.ComputeInstanceHandle:
        """``placement`` is ``byref(c_nvmlComputeInstancePlacement_t(start, size))``."""
        slot, gi = self._gpu_instance(gpuInstance)
        pl = handles.in_struct(placement, pynvml.c_nvmlComputeInstancePlacement_t, "placement")
        where = (int(pl.start), int(pl.size))
        ci = self._update_gpu(
            slot.index,
            lambda g: mig.create_compute_instance(g, slot.spec, gi.id, profileId, where),
        )
        return self._ci_handle(slot.index, gi, ci)

    def nvmlGpuInstanceGetComputeInstances(
        self,
        gpuInstance: api.GpuInstanceHandle,
        profileId: int,
        computeInstancesRef: object,
        countRef: object,
    ) -> int:
        slot, gi = self._gpu_instance(gpuInstance)
        mig.ci_profile(slot.spec, gi, profileId)
        count = handles.out_uint(countRef, "countRef")
        out = OutArray(computeInstancesRef, pynvml.c_nvmlComputeInstance_t, "computeInstancesRef")
        found = sorted(
            (c for c in gi.compute_instances if c.profile_id == profileId), key=lambda c: c.id
        )
        out.fill([self._ci_handle(slot.index, gi, c) for c in found])
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: api.GpuInstanceHandle, computeInstanceId: int
    ) -> api.ComputeInstanceHandle:
        slot, gi = self._gpu_instance(gpuInstance)
        ci = gi.compute_instance(computeInstanceId)
        if ci is None:
            raise nvml_error(
                pynvml.NVML_ERROR_NOT_FOUND, f"no compute instance {computeInstanceId}"
            )
        return self._ci_handle(slot.index, gi, ci)

    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(
        self, gpuInstance: api.GpuInstanceHandle, profileId: int
    ) -> int:
        slot, gi = self._gpu_instance(gpuInstance)
        g = self._gpu_state(slot.index)
        return mig.ci_remaining_capacity(g, slot.spec, gi.id, profileId)

    def nvmlComputeInstanceGetInfo(self, computeInstance: api.ComputeInstanceHandle) -> Any:
        slot, gi, ci = self._compute_instance(computeInstance)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = handles.device(Ref(handles.KIND_GPU, slot.index))
        info.gpuInstance = self._gi_handle(slot.index, gi)
        info.id = ci.id
        info.profileId = ci.profile_id
        info.placement = pynvml.c_nvmlComputeInstancePlacement_t(ci.start, ci.size)
        return info

    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: api.ComputeInstanceHandle) -> Any:
        return self.nvmlComputeInstanceGetInfo(computeInstance)

    def nvmlComputeInstanceDestroy(self, computeInstance: api.ComputeInstanceHandle) -> int:
        slot, gi, ci = self._compute_instance(computeInstance)
        self._update_gpu(
            slot.index, lambda g: (mig.destroy_compute_instance(g, gi.id, ci.id), None)
        )
        return int(pynvml.NVML_SUCCESS)

    # -- MIG devices ------------------------------------------------------------------------------
    def nvmlDeviceGetMaxMigDeviceCount(self, device: api.DeviceHandle) -> int:
        """7 on a MIG-enabled GPU, 0 when MIG is unsupported or disabled."""
        slot = self._gpu(device)
        enabled = slot.spec.mig_capable and self._gpu_state(slot.index).mig_current
        return MAX_MIG_DEVICES if enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(
        self, device: api.DeviceHandle, index: int
    ) -> api.DeviceHandle:
        """MIG devices in (GI id, CI id) order; NOT_FOUND for an empty index below the maximum."""
        slot = self._gpu(device)
        g = self._gpu_state(slot.index)
        mig.require_mig_enabled(g, slot.spec)
        if not 0 <= index < MAX_MIG_DEVICES:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"MIG device index {index}")
        pairs = g.mig_devices()
        if index >= len(pairs):
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND, f"no MIG device at index {index}")
        gi, ci = pairs[index]
        return handles.device(Ref(handles.KIND_MIG, slot.index, gi.id, ci.id))

    def nvmlDeviceIsMigDeviceHandle(self, device: api.DeviceHandle) -> ctypes.c_uint:
        """A ``ctypes.c_uint`` (use ``.value``), as pynvml returns it."""
        _, instance = self._device(device)
        return ctypes.c_uint(1 if instance is not None else 0)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
        self, migDevice: api.DeviceHandle
    ) -> api.DeviceHandle:
        ref = self._ref(migDevice, pynvml.c_nvmlDevice_t, (handles.KIND_MIG,))
        self._live(ref, migDevice)
        return handles.device(Ref(handles.KIND_GPU, ref.gpu))

    def _mig_instance(self, device: api.DeviceHandle) -> tuple[GpuInstance, ComputeInstance]:
        _, instance = self._device(device)
        if instance is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, "not a MIG device handle")
        return instance

    def nvmlDeviceGetGpuInstanceId(self, device: api.DeviceHandle) -> int:
        return self._mig_instance(device)[0].id

    def nvmlDeviceGetComputeInstanceId(self, device: api.DeviceHandle) -> int:
        return self._mig_instance(device)[1].id
