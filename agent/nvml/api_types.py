"""The types NVML takes and hands out, as :class:`agent.nvml.api.NvmlApi` declares them.

Nothing NVML hands out is ``Any``:

* handles are opaque nominal types (:data:`DeviceHandle` for GPUs and MIG devices alike, as in
  NVML; :data:`GpuInstanceHandle`, :data:`ComputeInstanceHandle`, :data:`EventSet`,
  :data:`GpmSample`). They are ctypes pointers that are never dereferenced: pass them back to
  NVML, or compare their addresses;
* returned structs are Protocol shapes naming the fields Tessera reads (each names the pynvml
  type it describes). Text fields of structs are ``str | bytes``: pynvml decodes them, older
  versions did not.

``tests/sim/test_signatures.py`` checks every struct shape here against pynvml's ctypes
``_fields_``. Nothing here calls NVML.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, NewType, Protocol, TypeAlias, TypeVar

if TYPE_CHECKING:
    _Opaque: TypeAlias = ctypes._Pointer[ctypes.Structure]
else:
    _Opaque = ctypes._Pointer  # not subscriptable at run time (Python 3.11)

# -- handles: opaque NVML pointers ---------------------------------------------------------------
DeviceHandle = NewType("DeviceHandle", _Opaque)
"""``nvmlDevice_t``: a GPU or a MIG device (pynvml ``c_nvmlDevice_t``)."""
GpuInstanceHandle = NewType("GpuInstanceHandle", _Opaque)
"""``nvmlGpuInstance_t`` (pynvml ``c_nvmlGpuInstance_t``)."""
ComputeInstanceHandle = NewType("ComputeInstanceHandle", _Opaque)
"""``nvmlComputeInstance_t`` (pynvml ``c_nvmlComputeInstance_t``)."""
EventSet = NewType("EventSet", _Opaque)
"""``nvmlEventSet_t`` (pynvml ``c_nvmlEventSet_t``)."""
GpmSample = NewType("GpmSample", _Opaque)
"""``nvmlGpmSample_t``: a GPM sample buffer (pynvml ``c_nvmlGpmSample_t``)."""
MemoryInfoVersion = NewType("MemoryInfoVersion", int)
"""``nvmlMemory_v2``: the version that makes ``nvmlDeviceGetMemoryInfo`` return v2."""

S = TypeVar("S", covariant=True)


# -- ctypes arrays and struct types --------------------------------------------------------------
class CArray(Protocol[S]):
    """A ctypes array NVML filled: index it (``len`` is its capacity)."""

    def __getitem__(self, index: int, /) -> S: ...

    def __len__(self) -> int: ...


class StructType(Protocol[S]):
    """A pynvml ctypes struct type: call it for a zeroed struct, multiply it for an array type."""

    def __call__(self) -> S: ...

    def __mul__(self, length: int, /) -> Callable[[], CArray[S]]: ...


# -- struct shapes: the fields Tessera reads (or writes) -----------------------------------------
class PciInfo(Protocol):
    """pynvml ``nvmlPciInfo_t``."""

    busId: str | bytes
    """``00000000:1B:00.0``."""
    pciDeviceId: int


class Memory(Protocol):
    """pynvml ``c_nvmlMemory_t``: bytes."""

    total: int
    free: int
    used: int


class MemoryV2(Memory, Protocol):
    """pynvml ``c_nvmlMemory_v2_t``: bytes; ``used`` excludes ``reserved``."""

    reserved: int


class GpuInstanceProfileInfo(Protocol):
    """pynvml ``c_nvmlGpuInstanceProfileInfo_v2_t``; ``memorySizeMB`` is MiB."""

    id: int
    name: str | bytes
    sliceCount: int
    instanceCount: int
    multiprocessorCount: int
    copyEngineCount: int
    decoderCount: int
    encoderCount: int
    jpegCount: int
    ofaCount: int
    memorySizeMB: int


class GpuInstancePlacement(Protocol):
    """pynvml ``c_nvmlGpuInstancePlacement_t``: memory slices ``[start, start + size)``."""

    start: int
    size: int


class GpuInstanceInfo(Protocol):
    """pynvml ``c_nvmlGpuInstanceInfo_t``."""

    id: int
    profileId: int
    placement: GpuInstancePlacement


class ComputeInstanceProfileInfo(Protocol):
    """pynvml ``c_nvmlComputeInstanceProfileInfo_t`` (v2 adds a name)."""

    id: int
    sliceCount: int


class ComputeInstanceInfo(Protocol):
    """pynvml ``c_nvmlComputeInstanceInfo_t``."""

    id: int
    profileId: int


class Utilization(Protocol):
    """pynvml ``c_nvmlUtilization_t``: percent."""

    gpu: int
    memory: int


class ProcessInfo(Protocol):
    """What ``nvmlDeviceGetComputeRunningProcesses`` lists (pynvml makes it from
    ``c_nvmlProcessInfo_v3_t``): ``usedGpuMemory`` in bytes, None where NVML cannot tell; the
    instance ids are 0xFFFFFFFF outside MIG."""

    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int
    computeInstanceId: int


class ProcessUtilizationSample(Protocol):
    """pynvml ``c_nvmlProcessUtilizationSample_t``: ``timeStamp`` in microseconds, percent."""

    pid: int
    timeStamp: int
    smUtil: int


class FieldValueUnion(Protocol):
    """pynvml ``c_nvmlValue_t``: read the member ``FieldValue.valueType`` names."""

    dVal: float
    uiVal: int
    ulVal: int
    ullVal: int
    sllVal: int
    siVal: int
    usVal: int


class FieldValue(Protocol):
    """pynvml ``c_nvmlFieldValue_t``: one answer of ``nvmlDeviceGetFieldValues``."""

    fieldId: int
    scopeId: int
    nvmlReturn: int
    valueType: int
    value: FieldValueUnion


class EventData(Protocol):
    """pynvml ``c_nvmlEventData_t``; the instance ids are 0xFFFFFFFF outside MIG."""

    device: DeviceHandle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


class GpmSupport(Protocol):
    """pynvml ``c_nvmlGpmSupport_t``."""

    isSupportedDevice: int


class GpmMetric(Protocol):
    """pynvml ``c_nvmlGpmMetric_t``: the caller sets ``metricId``, NVML the rest."""

    metricId: int
    nvmlReturn: int
    value: float


class GpmMetricsGet(Protocol):
    """pynvml ``c_nvmlGpmMetricsGet_t``: a request the caller fills and NVML answers in place."""

    version: int
    numMetrics: int
    sample1: GpmSample
    sample2: GpmSample
    metrics: CArray[GpmMetric]
