"""MIG configuration through the facade: GPU and compute instances created and destroyed.

Dynamic MIG creates a partition when a claim is prepared (at exactly the placement the scheduler
allocated) and destroys it when the claim is unprepared; at start, instances no claim owns are
destroyed. The NVML facts this relies on (docs/gpu-facts.md, "NVML from Python"):

- MIG mode: ``nvmlDeviceSetMigMode`` applies at once on an idle Hopper or newer GPU; on Ampere it
  only becomes pending until a GPU reset (activation status NVML_ERROR_RESET_REQUIRED), and a GPU
  with GPU instances cannot leave MIG mode (NVML_ERROR_IN_USE).
- A GPU instance is created with ``nvmlDeviceCreateGpuInstanceWithPlacement`` (profile *id* and
  a placement), its default compute instance with ``nvmlGpuInstanceCreateComputeInstance`` and the
  compute-instance profile whose slice count is the GPU instance's (the whole instance).
- Compute instances are destroyed before their GPU instance; GPU instance ids are handed out by
  the driver, so an instance is found again by its placement.
- The MIG device (its UUID) is the pair (GPU instance, compute instance), found through
  ``nvmlDeviceGetMigDeviceHandleByIndex``.

Every call goes through ``Nvml.api(device)``, so failures are ``agent.nvml.errors`` naming the
call and the GPU. Not thread-safe per GPU: the caller serializes the changes to one GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import cast

from agent.nvml.api import NvmlApi
from agent.nvml.api_types import GpuInstanceHandle
from agent.nvml.errors import NvmlInvalidArgument, NvmlNotFound, NvmlNotSupported
from agent.nvml.facade import Nvml
from agent.nvml.types import MigInstance, MigMode, Placement

MIG_DISABLE, MIG_ENABLE = 0, 1
RESET_REQUIRED = 16
"""NVML_ERROR_RESET_REQUIRED: the change applies after a GPU reset."""
MAX_GPU_INSTANCES = 8


@dataclass(frozen=True)
class GpuInstanceInfo:
    """One GPU instance of a GPU (whether or not it has a compute instance)."""

    gpu_instance_id: int
    profile_id: int
    placement: Placement


def mode_switch_needs_reset(architecture: str) -> bool:
    """Whether turning MIG mode on or off takes a GPU reset on this architecture (Ampere does;
    Hopper and newer switch at once when no GPU instance exists)."""
    return architecture in ("Ampere",)


class MigControl:
    """Creates, finds and destroys MIG instances of the node's GPUs (see the module docstring)."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml

    def _api(self, index: int) -> NvmlApi:
        return self._nvml.api(str(index))

    def mode(self, index: int) -> MigMode | None:
        """GPU ``index``'s MIG mode (None without MIG)."""
        return self._nvml.mig_mode(index)

    def set_mode(self, index: int, enabled: bool) -> bool:
        """Turn MIG mode on or off; True when it applied now, False when it is only pending (it
        applies after a GPU reset). Raises NvmlInUse while GPU instances exist."""
        api = self._api(index)
        status = api.nvmlDeviceSetMigMode(
            self._nvml.handle(index), MIG_ENABLE if enabled else MIG_DISABLE
        )
        return int(status) != RESET_REQUIRED

    def gpu_instances(self, index: int) -> tuple[GpuInstanceInfo, ...]:
        """Every GPU instance of GPU ``index``, by placement (empty when MIG is off)."""
        api = self._api(index)
        h = self._nvml.handle(index)
        out: list[GpuInstanceInfo] = []
        for profile in range(int(api.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            try:
                info = api.nvmlDeviceGetGpuInstanceProfileInfo(h, profile)
            except (NvmlNotSupported, NvmlInvalidArgument, NvmlNotFound):
                continue
            for gi in self._instances_of(api, index, int(info.id)):
                gi_info = api.nvmlGpuInstanceGetInfo(gi)
                out.append(
                    GpuInstanceInfo(
                        gpu_instance_id=int(gi_info.id),
                        profile_id=int(gi_info.profileId),
                        placement=Placement(
                            int(gi_info.placement.start), int(gi_info.placement.size)
                        ),
                    )
                )
        return tuple(sorted(out, key=lambda g: (g.placement.start, g.gpu_instance_id)))

    def _instances_of(self, api: NvmlApi, index: int, profile_id: int) -> list[GpuInstanceHandle]:
        array = (api.c_nvmlGpuInstance_t * MAX_GPU_INSTANCES)()
        count = ctypes.c_uint(MAX_GPU_INSTANCES)
        try:
            api.nvmlDeviceGetGpuInstances(
                self._nvml.handle(index), profile_id, array, ctypes.byref(count)
            )
        except (NvmlNotSupported, NvmlNotFound):
            return []
        return [array[i] for i in range(count.value)]

    def find(self, index: int, profile_id: int, start: int) -> GpuInstanceInfo | None:
        """The GPU instance of ``profile_id`` at placement ``start``, if there is one: the
        instances of that profile alone are read (``nvmlDeviceGetGpuInstances`` takes the
        profile id), not every profile's as :meth:`gpu_instances` does; a prepare and an
        unprepare of a dynamic MIG device each look once."""
        api = self._api(index)
        try:
            instances = self._instances_of(api, index, profile_id)
        except NvmlInvalidArgument:  # no such profile on this GPU
            return None
        for gi in instances:
            info = api.nvmlGpuInstanceGetInfo(gi)
            if int(info.profileId) == profile_id and int(info.placement.start) == start:
                return GpuInstanceInfo(
                    gpu_instance_id=int(info.id),
                    profile_id=profile_id,
                    placement=Placement(start, int(info.placement.size)),
                )
        return None

    def create(self, index: int, profile_id: int, start: int, size: int) -> MigInstance:
        """Create the GPU instance of ``profile_id`` at placement ``start`` (``size`` memory
        slices) and its default compute instance; the MIG device with its UUID. Raises
        agent.nvml.errors errors (NvmlInsufficientResources when the placement is taken)."""
        gi_id = self.create_gpu_instance(index, profile_id, start, size)
        ci_id = self.create_compute_instance(index, gi_id)
        return self.mig_device(index, gi_id, ci_id)

    def create_gpu_instance(self, index: int, profile_id: int, start: int, size: int) -> int:
        """The GPU instance alone (no compute instance yet); its id."""
        api = self._api(index)
        placement = api.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        struct = cast(ctypes.Structure, placement)  # pynvml's ctypes struct behind the shape
        gi = api.nvmlDeviceCreateGpuInstanceWithPlacement(
            self._nvml.handle(index), profile_id, ctypes.byref(struct)
        )
        return int(api.nvmlGpuInstanceGetInfo(gi).id)

    def create_compute_instance(self, index: int, gpu_instance_id: int) -> int:
        """The default compute instance of a GPU instance (all its compute slices); its id."""
        api = self._api(index)
        gi = api.nvmlDeviceGetGpuInstanceById(self._nvml.handle(index), gpu_instance_id)
        best: tuple[int, int] | None = None  # (slices, CI profile id)
        for profile in range(int(api.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
            try:
                info = api.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, profile, api.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except (NvmlNotSupported, NvmlInvalidArgument, NvmlNotFound):
                continue
            if best is None or int(info.sliceCount) > best[0]:
                best = (int(info.sliceCount), int(info.id))
        if best is None:
            raise NvmlNotSupported(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                3,
                f"GPU instance {gpu_instance_id} offers no compute-instance profile",
                str(index),
            )
        ci = api.nvmlGpuInstanceCreateComputeInstance(gi, best[1])
        return int(api.nvmlComputeInstanceGetInfo(ci).id)

    def compute_instances(self, index: int, gpu_instance_id: int) -> tuple[MigInstance, ...]:
        """The MIG devices (compute instances) of one GPU instance."""
        return tuple(
            i for i in self._nvml.mig_instances(index) if i.gpu_instance_id == gpu_instance_id
        )

    def _compute_instance_ids(self, api: NvmlApi, index: int, gpu_instance_id: int) -> list[int]:
        """The compute instance ids of one GPU instance, from the GPU's MIG device handles
        (each names its GI and CI id), without reading what :meth:`compute_instances` reads of
        each device (its profile, UUID and memory): all a destroy needs."""
        h = self._nvml.handle(index)
        ids: list[int] = []
        for i in range(api.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                mh = api.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except NvmlNotFound:
                continue
            if api.nvmlDeviceGetGpuInstanceId(mh) == gpu_instance_id:
                ids.append(int(api.nvmlDeviceGetComputeInstanceId(mh)))
        return ids

    def mig_device(self, index: int, gpu_instance_id: int, compute_instance_id: int) -> MigInstance:
        """The MIG device of (GPU instance, compute instance); NvmlNotFound when there is none."""
        for inst in self._nvml.mig_instances(index):
            if (inst.gpu_instance_id, inst.compute_instance_id) == (
                gpu_instance_id,
                compute_instance_id,
            ):
                return inst
        raise NvmlNotFound(
            "nvmlDeviceGetMigDeviceHandleByIndex",
            6,
            f"no MIG device for GPU instance {gpu_instance_id}, compute instance"
            f" {compute_instance_id}",
            str(index),
        )

    def destroy(self, index: int, gpu_instance_id: int) -> None:
        """Destroy the GPU instance and its compute instances first. A GPU instance that is
        already gone is no error (destroying is idempotent)."""
        api = self._api(index)
        try:
            gi = api.nvmlDeviceGetGpuInstanceById(self._nvml.handle(index), gpu_instance_id)
        except (NvmlNotFound, NvmlInvalidArgument):
            return
        for ci_id in self._compute_instance_ids(api, index, gpu_instance_id):
            try:
                ci = api.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
                api.nvmlComputeInstanceDestroy(ci)
            except (NvmlNotFound, NvmlInvalidArgument):
                continue
        try:
            api.nvmlGpuInstanceDestroy(gi)
        except (NvmlNotFound, NvmlInvalidArgument):
            return

    def destroy_all(self, index: int) -> list[GpuInstanceInfo]:
        """Destroy every GPU instance of GPU ``index``; the ones destroyed."""
        gone = list(self.gpu_instances(index))
        for gi in gone:
            self.destroy(index, gi.gpu_instance_id)
        return gone
