"""The NVML surface Tessera uses, as a ``typing.Protocol``: :class:`NvmlApi`.

This is the boundary between Tessera and NVML. :class:`NvmlApi` names exactly the pynvml
functions the agent calls (``agent/`` and ``dra_driver/``; the simulator's own internals do not
count), with pynvml's names, parameter names, kinds and defaults, and typed parameters and
returns; plus the constants, ctypes struct types and the error class the agent uses. Two things
satisfy it:

* the real ``pynvml`` module. It is untyped (mypy sees ``Any``), so its conformance is proven at
  test time: ``tests/sim/test_signatures.py`` checks every :class:`NvmlApi` function against the
  installed pynvml (same parameters) and every struct shape below against pynvml's ctypes
  ``_fields_``;
* the simulator, :class:`agent.sim.nvml.FakeNvml`, which mypy checks structurally where the
  simulated node builds the facade (``agent.sim.node``).

``tests/nvml/test_api.py`` scans ``agent/`` and ``dra_driver/`` and fails when the code calls an
NVML function this Protocol does not declare, or the Protocol declares one nothing calls. Adding a
call is one method here (pynvml's signature, typed) plus the simulator's method.

Nothing NVML hands out is ``Any``: the handle types and struct shapes it takes and returns are
:mod:`agent.nvml.api_types`.

Calls through the facade raise ``agent.nvml.errors`` errors: use ``Nvml.api(device)``
(:mod:`agent.nvml.facade`), which returns this same API with error translation. Nothing here
calls NVML.
"""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, overload

from agent.nvml.api_types import (
    CArray,
    ComputeInstanceHandle,
    ComputeInstanceInfo,
    ComputeInstanceProfileInfo,
    DeviceHandle,
    EventData,
    EventSet,
    FieldValue,
    GpmMetricsGet,
    GpmSample,
    GpmSupport,
    GpuInstanceHandle,
    GpuInstanceInfo,
    GpuInstancePlacement,
    GpuInstanceProfileInfo,
    Memory,
    MemoryInfoVersion,
    MemoryV2,
    PciInfo,
    ProcessInfo,
    ProcessUtilizationSample,
    StructType,
    Utilization,
)

if TYPE_CHECKING:
    from ctypes import _CArgObject

    UIntRef: TypeAlias = _CArgObject | ctypes._Pointer[ctypes.c_uint]
    """``ctypes.byref(c_uint())`` or ``ctypes.pointer(c_uint())``: an ``unsigned int *``."""
    GpuInstancePlacementRef: TypeAlias = _CArgObject
    """``ctypes.byref(c_nvmlGpuInstancePlacement_t())``."""


# -- the API -------------------------------------------------------------------------------------
class NvmlApi(Protocol):
    """The pynvml functions, constants and types Tessera uses (see the module docstring).

    Functions raise ``NVMLError`` (subclasses carry the NVML return code in ``value``); the
    facade's ``Nvml.api()`` translates them. Parameter names are pynvml's, so a keyword call
    works on both implementations.
    """

    NVMLError: type[Exception]
    NVML_GPU_INSTANCE_PROFILE_COUNT: int
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT: int
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED: int
    NVML_NVLINK_MAX_LINKS: int
    nvmlMemory_v2: MemoryInfoVersion
    c_nvmlGpuInstancePlacement_t: StructType[GpuInstancePlacement]
    c_nvmlGpuInstance_t: StructType[GpuInstanceHandle]
    c_nvmlGpmMetricsGet_t: StructType[GpmMetricsGet]

    # -- lifecycle, system -----------------------------------------------------------------------
    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlSystemGetDriverVersion(self) -> str: ...

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        """e.g. 12040 for CUDA 12.4."""
        ...

    def nvmlSystemGetNVMLVersion(self) -> str: ...

    # -- devices: identity -----------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int: ...

    def nvmlDeviceGetHandleByIndex(self, index: int) -> DeviceHandle: ...

    def nvmlDeviceGetIndex(self, handle: DeviceHandle) -> int: ...

    def nvmlDeviceGetMinorNumber(self, handle: DeviceHandle) -> int: ...

    def nvmlDeviceGetUUID(self, handle: DeviceHandle) -> str: ...

    def nvmlDeviceGetName(self, handle: DeviceHandle) -> str: ...

    def nvmlDeviceGetBrand(self, handle: DeviceHandle) -> int: ...

    def nvmlDeviceGetSerial(self, handle: DeviceHandle) -> str: ...

    def nvmlDeviceGetArchitecture(self, device: DeviceHandle) -> int: ...

    def nvmlDeviceGetCudaComputeCapability(self, handle: DeviceHandle) -> tuple[int, int]: ...

    def nvmlDeviceGetPciInfo(self, handle: DeviceHandle) -> PciInfo: ...

    # -- memory ------------------------------------------------------------------------------------
    @overload
    def nvmlDeviceGetMemoryInfo(self, handle: DeviceHandle, version: None = None) -> Memory: ...

    @overload
    def nvmlDeviceGetMemoryInfo(
        self, handle: DeviceHandle, version: MemoryInfoVersion
    ) -> MemoryV2: ...

    def nvmlDeviceGetMemoryInfo(
        self, handle: DeviceHandle, version: MemoryInfoVersion | None = None
    ) -> Memory | MemoryV2:
        """v1 without ``version``; v2 (with ``reserved``) for ``nvmlMemory_v2``."""
        ...

    # -- MIG ---------------------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, device: DeviceHandle) -> list[int]:
        """``[current, pending]``, 1 for enabled."""
        ...

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: DeviceHandle, profile: int, version: Literal[2] = 2
    ) -> GpuInstanceProfileInfo:
        """``profile`` is an NVML_GPU_INSTANCE_PROFILE_* value (below the profile count)."""
        ...

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self,
        device: DeviceHandle,
        profileId: int,
        placementsRef: CArray[GpuInstancePlacement] | None,
        countRef: UIntRef,
    ) -> int:
        """Fills ``placementsRef`` (capacity in ``countRef``) and sets ``countRef`` to the
        number of placements; returns NVML_SUCCESS."""
        ...

    def nvmlDeviceGetMaxMigDeviceCount(self, device: DeviceHandle) -> int: ...

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: DeviceHandle, index: int) -> DeviceHandle:
        """A MIG device of GPU ``device``."""
        ...

    def nvmlDeviceGetGpuInstanceId(self, device: DeviceHandle) -> int:
        """Of a MIG device handle."""
        ...

    def nvmlDeviceGetComputeInstanceId(self, device: DeviceHandle) -> int:
        """Of a MIG device handle."""
        ...

    def nvmlDeviceGetGpuInstanceById(
        self, device: DeviceHandle, gpuInstanceId: int
    ) -> GpuInstanceHandle: ...

    def nvmlGpuInstanceGetInfo(self, gpuInstance: GpuInstanceHandle) -> GpuInstanceInfo: ...

    # -- MIG configuration (dynamic MIG: prepare creates, unprepare destroys) ---------------------
    def nvmlDeviceSetMigMode(self, device: DeviceHandle, mode: int) -> int:
        """``mode`` NVML_DEVICE_MIG_ENABLE (1) or _DISABLE (0); returns the activation status
        (NVML_SUCCESS, or NVML_ERROR_RESET_REQUIRED where only a GPU reset applies it)."""
        ...

    def nvmlDeviceGetGpuInstances(
        self,
        device: DeviceHandle,
        profileId: int,
        gpuInstancesRef: CArray[GpuInstanceHandle],
        countRef: UIntRef,
    ) -> int:
        """Fills ``gpuInstancesRef`` with the GPU instances of profile ``profileId`` and sets
        ``countRef`` to their number."""
        ...

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: DeviceHandle, profileId: int, placement: GpuInstancePlacementRef
    ) -> GpuInstanceHandle:
        """``placement``: ``ctypes.byref`` of a c_nvmlGpuInstancePlacement_t."""
        ...

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: GpuInstanceHandle, profile: int, engProfile: int, version: int = 2
    ) -> ComputeInstanceProfileInfo:
        """``profile`` an NVML_COMPUTE_INSTANCE_PROFILE_* value; ``engProfile`` 0 (shared)."""
        ...

    def nvmlGpuInstanceCreateComputeInstance(
        self, gpuInstance: GpuInstanceHandle, profileId: int
    ) -> ComputeInstanceHandle: ...

    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: GpuInstanceHandle, computeInstanceId: int
    ) -> ComputeInstanceHandle: ...

    def nvmlComputeInstanceGetInfo(
        self, computeInstance: ComputeInstanceHandle
    ) -> ComputeInstanceInfo: ...

    def nvmlComputeInstanceDestroy(self, computeInstance: ComputeInstanceHandle) -> int: ...

    def nvmlGpuInstanceDestroy(self, gpuInstance: GpuInstanceHandle) -> int: ...

    # -- NVLink ------------------------------------------------------------------------------------
    def nvmlDeviceGetNvLinkState(self, device: DeviceHandle, link: int) -> int:
        """1 (NVML_FEATURE_ENABLED) for an active link."""
        ...

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: DeviceHandle, link: int) -> PciInfo: ...

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: DeviceHandle, link: int) -> int:
        """NVML_NVLINK_DEVICE_TYPE_GPU (0), _IBMNPU (1), _SWITCH (2)."""
        ...

    # -- vGPU host (NVIDIA's vGPU host driver; NOT_SUPPORTED elsewhere) ----------------------------
    def nvmlDeviceGetVirtualizationMode(self, handle: DeviceHandle) -> int:
        """An ``NVML_GPU_VIRTUALIZATION_MODE_*`` value (3: HOST_VGPU)."""
        ...

    def nvmlDeviceGetHostVgpuMode(self, handle: DeviceHandle) -> int:
        """``NVML_HOST_VGPU_MODE_NON_SRIOV`` (0) or ``NVML_HOST_VGPU_MODE_SRIOV`` (1)."""
        ...

    def nvmlDeviceGetSupportedVgpus(self, handle: DeviceHandle) -> list[int]:
        """vGPU type ids."""
        ...

    def nvmlVgpuTypeGetName(self, vgpuTypeId: int) -> str: ...

    def nvmlVgpuTypeGetFramebufferSize(self, vgpuTypeId: int) -> int:
        """Bytes."""
        ...

    def nvmlVgpuTypeGetMaxInstances(self, handle: DeviceHandle, vgpuTypeId: int) -> int: ...

    def nvmlDeviceGetVgpuHeterogeneousMode(self, handle: DeviceHandle) -> int:
        """1: vGPUs of different types may share the GPU; 0: homogeneous."""
        ...

    # -- telemetry ---------------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: DeviceHandle) -> Utilization: ...

    def nvmlDeviceGetPowerUsage(self, handle: DeviceHandle) -> int:
        """Milliwatts."""
        ...

    # -- power limits (a whole GPU's; docs/gpu-facts.md, "Power limits") ------------------------
    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: DeviceHandle) -> list[int]:
        """``[minimum, maximum]`` power limit in milliwatts."""
        ...

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: DeviceHandle) -> int:
        """Milliwatts: the limit the GPU boots with."""
        ...

    def nvmlDeviceGetPowerManagementLimit(self, handle: DeviceHandle) -> int:
        """Milliwatts: the limit set now."""
        ...

    def nvmlDeviceSetPowerManagementLimit(self, handle: DeviceHandle, limit: int) -> None:
        """Milliwatts; root only; kept until the driver unloads (reboot, driver reload)."""
        ...

    def nvmlDeviceSetPersistenceMode(self, handle: DeviceHandle, mode: int) -> None:
        """NVML_FEATURE_DISABLED (0) or NVML_FEATURE_ENABLED (1); root only, Linux only
        (NOT_SUPPORTED elsewhere)."""
        ...

    def nvmlDeviceGetTemperature(self, handle: DeviceHandle, sensor: int) -> int:
        """Degrees C."""
        ...

    def nvmlDeviceGetClockInfo(self, handle: DeviceHandle, type: int) -> int:
        """MHz."""
        ...

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: DeviceHandle) -> int:
        """Bitmask; absent from older pynvml (check with ``hasattr``)."""
        ...

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: DeviceHandle) -> int:
        """The deprecated name of ``nvmlDeviceGetCurrentClocksEventReasons``."""
        ...

    def nvmlDeviceGetPcieThroughput(self, device: DeviceHandle, counter: int) -> int:
        """KB/s."""
        ...

    def nvmlDeviceGetFieldValues(
        self, handle: DeviceHandle, fieldIds: Sequence[int | tuple[int, int]]
    ) -> CArray[FieldValue]:
        """One answer per field id (or ``(fieldId, scopeId)``), each with its own return code."""
        ...

    def nvmlDeviceGetComputeRunningProcesses(self, handle: DeviceHandle) -> list[ProcessInfo]: ...

    def nvmlDeviceGetProcessUtilization(
        self, handle: DeviceHandle, timeStamp: int
    ) -> list[ProcessUtilizationSample]:
        """Samples newer than ``timeStamp`` (microseconds); NOT_FOUND when there are none."""
        ...

    # -- events ------------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> EventSet: ...

    def nvmlDeviceRegisterEvents(
        self, handle: DeviceHandle, eventTypes: int, eventSet: EventSet
    ) -> None: ...

    def nvmlEventSetWait(self, eventSet: EventSet, timeoutms: int) -> EventData:
        """The next event; NVML_ERROR_TIMEOUT when none came in ``timeoutms``."""
        ...

    def nvmlEventSetFree(self, eventSet: EventSet) -> None: ...

    # -- GPM (Hopper and newer; absent from older pynvml) ------------------------------------------
    def nvmlGpmQueryDeviceSupport(self, device: DeviceHandle) -> GpmSupport: ...

    def nvmlGpmSampleAlloc(self) -> GpmSample: ...

    def nvmlGpmSampleFree(self, gpmSample: GpmSample) -> None: ...

    def nvmlGpmMigSampleGet(
        self, device: DeviceHandle, gpuInstanceId: int, gpmSample: GpmSample
    ) -> GpmSample:
        """Takes a sample of GPU instance ``gpuInstanceId`` of GPU ``device`` into
        ``gpmSample`` and returns it."""
        ...

    def nvmlGpmMetricsGet(self, metricsGet: GpmMetricsGet) -> GpmMetricsGet:
        """Answers ``metricsGet.metrics`` in place and returns it."""
        ...


def api_functions() -> tuple[str, ...]:
    """The names of the functions :class:`NvmlApi` declares (what the tests compare with
    pynvml, the simulator and the agent's code)."""
    return tuple(
        sorted(
            name
            for name, value in vars(NvmlApi).items()
            if name.startswith("nvml") and inspect.isfunction(value)
        )
    )


def api_attributes() -> tuple[str, ...]:
    """The names of the constants and types :class:`NvmlApi` declares."""
    return tuple(sorted(NvmlApi.__annotations__))
