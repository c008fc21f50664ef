"""Opaque handles of the simulated NVML, and the ctypes plumbing of its by-reference arguments.

Handles are instances of subclasses of pynvml's own pointer types (``c_nvmlDevice_t``,
``c_nvmlGpuInstance_t``, ``c_nvmlComputeInstance_t``), so they behave like real ones: they can be
stored in the ctypes arrays and structs that NVML fills (``nvmlDeviceGetGpuInstances``,
``c_nvmlGpuInstanceInfo_t.device``) and read back as plain pynvml pointers. The pointer value is
never dereferenced; it encodes what the handle names (kind, GPU index, GI id, CI id), so a handle
read back from an array still resolves. Encoding and decoding are pure. :func:`device`,
:func:`gpu_instance` and :func:`compute_instance` make them, typed as the opaque handle types of
:mod:`agent.nvml.api_types`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import pynvml

from agent.nvml import api_types as api
from agent.sim.mig import nvml_error

_TAG = 0x7E55  # top 16 bits of every simulated handle
KIND_GPU = 1
KIND_MIG = 2
KIND_GI = 3
KIND_CI = 4


@dataclass(frozen=True)
class Ref:
    """What a handle names."""

    kind: int
    gpu: int
    gi: int = 0
    ci: int = 0


def encode(ref: Ref) -> int:
    """The pointer value of a handle (pure)."""
    return (_TAG << 48) | (ref.kind << 40) | (ref.gpu << 24) | (ref.gi << 12) | ref.ci


def _address(obj: Any) -> int:
    return int(ctypes.cast(obj, ctypes.c_void_p).value or 0)


def decode(obj: object, pointer_type: Any) -> Ref | None:
    """The :class:`Ref` of a pynvml pointer of ``pointer_type`` made by :func:`make`, else None."""
    if not isinstance(obj, pointer_type):
        return None
    addr = _address(obj)
    if addr >> 48 != _TAG:
        return None
    return Ref(
        kind=(addr >> 40) & 0xFF,
        gpu=(addr >> 24) & 0xFFFF,
        gi=(addr >> 12) & 0xFFF,
        ci=addr & 0xFFF,
    )


class _Handle:
    """Equality, hashing and a readable repr by pointer value (real pynvml handles lack these)."""

    def __repr__(self) -> str:
        ref = decode(self, ctypes._Pointer)  # any pointer type
        if ref is None:
            return f"<{type(self).__name__} NULL>"
        parts = [f"gpu={ref.gpu}"]
        if ref.kind in (KIND_MIG, KIND_GI, KIND_CI):
            parts.append(f"gi={ref.gi}")
        if ref.kind in (KIND_MIG, KIND_CI):
            parts.append(f"ci={ref.ci}")
        return f"<{type(self).__name__} {' '.join(parts)}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ctypes._Pointer) and _address(self) == _address(other)

    def __hash__(self) -> int:
        return hash(_address(self))


class GpuHandle(_Handle, pynvml.c_nvmlDevice_t):  # type: ignore[misc]
    """A whole GPU (``nvmlDeviceGetHandleByIndex``)."""

    _type_ = pynvml.struct_c_nvmlDevice_t


class MigDeviceHandle(_Handle, pynvml.c_nvmlDevice_t):  # type: ignore[misc]
    """A MIG device (``nvmlDeviceGetMigDeviceHandleByIndex``): one compute instance."""

    _type_ = pynvml.struct_c_nvmlDevice_t


class GpuInstanceHandle(_Handle, pynvml.c_nvmlGpuInstance_t):  # type: ignore[misc]
    """A GPU instance."""

    _type_ = pynvml.struct_c_nvmlGpuInstance_t


class ComputeInstanceHandle(_Handle, pynvml.c_nvmlComputeInstance_t):  # type: ignore[misc]
    """A compute instance."""

    _type_ = pynvml.struct_c_nvmlComputeInstance_t


_CLASSES: dict[int, type[Any]] = {
    KIND_GPU: GpuHandle,
    KIND_MIG: MigDeviceHandle,
    KIND_GI: GpuInstanceHandle,
    KIND_CI: ComputeInstanceHandle,
}


def _make(ref: Ref) -> Any:
    handle = _CLASSES[ref.kind]()
    ctypes.c_void_p.from_buffer(handle).value = encode(ref)
    return handle


def device(ref: Ref) -> api.DeviceHandle:
    """A new handle for a GPU (``KIND_GPU``) or a MIG device (``KIND_MIG``)."""
    assert ref.kind in (KIND_GPU, KIND_MIG)
    return api.DeviceHandle(_make(ref))


def gpu_instance(ref: Ref) -> api.GpuInstanceHandle:
    """A new handle for a GPU instance (``KIND_GI``)."""
    assert ref.kind == KIND_GI
    return api.GpuInstanceHandle(_make(ref))


def compute_instance(ref: Ref) -> api.ComputeInstanceHandle:
    """A new handle for a compute instance (``KIND_CI``)."""
    assert ref.kind == KIND_CI
    return api.ComputeInstanceHandle(_make(ref))


# -- by-reference arguments ---------------------------------------------------------------------

_CArgObject: type[Any] = type(ctypes.byref(ctypes.c_int()))


def _target(ref: object) -> object | None:
    """What a ``byref(x)`` or ``pointer(x)`` argument points at; None for anything else."""
    if isinstance(ref, _CArgObject):
        return getattr(ref, "_obj", None)
    if isinstance(ref, ctypes._Pointer) and ref:
        contents: object = ref.contents
        return contents
    return None


def out_uint(ref: object, what: str) -> Any:
    """The ctypes integer a ``byref(c_uint())`` / ``pointer(c_uint())`` argument points at.

    Anything else would be passed by value to the C function: INVALID_ARGUMENT.
    """
    obj = _target(ref)
    if isinstance(obj, ctypes._SimpleCData) and isinstance(obj.value, int):
        return obj
    raise nvml_error(
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        f"{what} must be byref()/pointer() to a ctypes integer, got {type(ref).__name__}",
    )


def in_struct(ref: object, struct_type: Any, what: str) -> Any:
    """The struct a ``byref(struct)`` / ``pointer(struct)`` argument points at."""
    obj = _target(ref)
    if isinstance(obj, struct_type):
        return obj
    raise nvml_error(
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        f"{what} must be byref()/pointer() to a {struct_type.__name__}, got {type(ref).__name__}",
    )


class OutArray:
    """A caller-allocated output array: a ctypes array, ``byref(array)`` or a pointer."""

    def __init__(self, ref: object, elem_type: Any, what: str) -> None:
        target = _target(ref) if isinstance(ref, _CArgObject) else ref
        self._capacity: int | None
        if isinstance(target, ctypes.Array) and issubclass(target._type_, elem_type):
            self._items: Any = target
            self._capacity = len(target)
        elif (
            isinstance(target, ctypes._Pointer) and target and issubclass(target._type_, elem_type)
        ):
            self._items = target
            self._capacity = None  # unknown, as for the C function
        elif isinstance(target, elem_type) and isinstance(ref, _CArgObject):
            self._items = ctypes.pointer(target)
            self._capacity = 1
        else:
            raise nvml_error(
                pynvml.NVML_ERROR_INVALID_ARGUMENT,
                f"{what} must be a ctypes array of {elem_type.__name__}, got {type(ref).__name__}",
            )

    def fill(self, values: list[Any]) -> None:
        """Write ``values`` from index 0; INSUFFICIENT_SIZE when the array is known too small."""
        if self._capacity is not None and len(values) > self._capacity:
            raise nvml_error(
                pynvml.NVML_ERROR_INSUFFICIENT_SIZE,
                f"array of {self._capacity} cannot hold {len(values)} entries",
            )
        for i, v in enumerate(values):
            self._items[i] = v
