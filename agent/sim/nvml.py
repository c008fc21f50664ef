"""``FakeNvml``: pynvml's function surface over a simulated node model.

Use it exactly like the ``pynvml`` module::

    nvml = FakeNvml(load_model("dgx-a100"), state_dir)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlDeviceGetUUID(h)                     # 'GPU-…' (str, as pynvml returns it)
    nvml.nvmlDeviceGetMemoryInfo(h, nvml.nvmlMemory_v2).reserved

Every ``nvml*`` method has pynvml's name, parameter names, order and defaults (a test checks this
against the installed pynvml), returns what pynvml returns (its ctypes structs, str where pynvml
decodes, ``c_uint`` from ``nvmlDeviceIsMigDeviceHandle``) and raises pynvml's own
``NVMLError_*`` classes. pynvml's constants, error classes and ctypes types are attributes of the
class too (``FakeNvml.NVML_ERROR_NOT_FOUND``, ``FakeNvml.NVMLError``, ``FakeNvml.nvmlMemory_v2``).
Units are NVML's: bytes for memory, MiB for MIG profile ``memorySizeMB``.

``FakeNvml`` satisfies :class:`agent.nvml.api.NvmlApi`, the NVML surface the agent uses; mypy
checks it where the simulated node builds the facade (:mod:`agent.sim.node`). Its methods are
typed with that module's opaque handle types (made by :mod:`agent.sim.handles`) and struct
shapes; the pynvml structs it fills are untyped and cast to those shapes, which
``tests/sim/test_signatures.py`` checks against pynvml's fields. A call the agent starts to make
is a method here with pynvml's signature (that test compares them) plus its line in ``NvmlApi``.

Simulator controls (not pynvml functions): ``reset_gpu(index)``, ``apply_mig_layout(name)``,
``state``, ``state_dir``, ``vm_state``, ``update_vm`` (see
:class:`agent.sim.nvml_core.NvmlCore`); compute modes, time-slices and MPS daemons
(``sharing_state``, ``set_timeslice``, ``record_mps_daemon``, …, see
:class:`agent.sim.nvml_sharing.SharingCalls`); the load and faults
(``set_load``, ``add_process``, ``inject_xid``, ``lose_gpu``, ``reload_driver``, …, see
:class:`agent.sim.telemetry_base.TelemetryBase`), driven by the ``clock`` keyword (default
``time.monotonic``). MIG calls are in :mod:`agent.sim.nvml_mig`; vGPU host calls in
:mod:`agent.sim.nvml_vgpu`; telemetry calls in
:mod:`agent.sim.telemetry_calls`; events and GPM in :mod:`agent.sim.telemetry_events`. The MIG
state lives in ``<state_dir>/nvml-state.json``, the load, counters and faults in
``<state_dir>/telemetry-state.json``, the sharing settings in ``<state_dir>/sharing-state.json``,
all shared with other processes.
"""

from __future__ import annotations

import re
import uuid as uuidlib
from typing import Any, cast, overload

import pynvml

from agent.nvml import api_types as api
from agent.sim import handles, layouts
from agent.sim.errors import MigError
from agent.sim.handles import Ref
from agent.sim.mig import nvml_error
from agent.sim.nvlink import LinkEnd, nvlink_table
from agent.sim.nvml_core import pci_info, pynvml_constants
from agent.sim.nvml_mig import MigCalls
from agent.sim.nvml_sharing import SharingCalls
from agent.sim.nvml_vgpu import VgpuCalls
from agent.sim.specs import MIB
from agent.sim.state import SimState
from agent.sim.telemetry_calls import TelemetryCalls
from agent.sim.telemetry_events import EventCalls, GpmCalls

RESERVED_MIB = 512
"""Memory the simulated driver reserves on a whole GPU (v2 ``reserved``; part of v1 ``used``)."""

_BUS_ID_FORMS = (
    re.compile(r"^(?P<d>[0-9a-f]+):(?P<b>[0-9a-f]+):(?P<s>[0-9a-f]+)\.(?P<f>[0-9a-f]+)$"),
    re.compile(r"^(?P<d>[0-9a-f]+):(?P<b>[0-9a-f]+):(?P<s>[0-9a-f]+)$"),
    re.compile(r"^(?P<b>[0-9a-f]+):(?P<s>[0-9a-f]+)\.(?P<f>[0-9a-f]+)$"),
)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def mig_uuid(parent_uuid: str, gi_id: int, ci_id: int) -> str:
    """The deterministic UUID of a MIG device (pure)."""
    return "MIG-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{parent_uuid}/gi{gi_id}/ci{ci_id}"))


class FakeNvml(TelemetryCalls, EventCalls, GpmCalls, MigCalls, SharingCalls, VgpuCalls):
    """The simulated pynvml module for one node model (see the module docstring)."""

    # pynvml's constants and types that agent.nvml.api.NvmlApi names, declared so that mypy
    # checks the simulator against it; the other ones are copied at the end of the module.
    NVMLError: type[Exception] = pynvml.NVMLError
    NVML_GPU_INSTANCE_PROFILE_COUNT: int = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT: int = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED: int = (
        pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    NVML_NVLINK_MAX_LINKS: int = pynvml.NVML_NVLINK_MAX_LINKS
    nvmlMemory_v2: api.MemoryInfoVersion = pynvml.nvmlMemory_v2
    c_nvmlGpuInstancePlacement_t: api.StructType[api.GpuInstancePlacement] = (
        pynvml.c_nvmlGpuInstancePlacement_t
    )
    c_nvmlGpmMetricsGet_t: api.StructType[api.GpmMetricsGet] = pynvml.c_nvmlGpmMetricsGet_t
    c_nvmlGpuInstance_t: api.StructType[api.GpuInstanceHandle] = pynvml.c_nvmlGpuInstance_t

    _link_table: dict[int, tuple[LinkEnd | None, ...]] | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def nvmlInitWithFlags(self, flags: int) -> None:
        self._init_count += 1

    def nvmlInit(self) -> None:
        self.nvmlInitWithFlags(0)

    def nvmlShutdown(self) -> None:
        """Reference counted like NVML: one shutdown per init; UNINITIALIZED when none is left."""
        self._require_init()
        self._init_count -= 1

    # -- system ----------------------------------------------------------------------------------
    def nvmlSystemGetDriverVersion(self) -> str:
        self._require_init()
        return self.model.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._require_init()
        return self.model.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._require_init()
        return self.model.cuda_driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        """``<CUDA major>.<driver version>``, e.g. ``12.550.90.07``."""
        self._require_init()
        return f"{self.model.cuda_driver_version // 1000}.{self.model.driver_version}"

    # -- simulator control: an administrator's MIG change ---------------------------------------
    def apply_gpu_mig_layout(self, index: int, name: str) -> None:
        """``nvidia-smi mig`` on GPU ``index`` (the model's): destroy its compute and GPU
        instances and create layout ``name``'s. MigError where nvidia-smi refuses: the GPU is
        not on the bus, cannot do MIG, has MIG mode off (``nvidia-smi -i N -mig 1`` and a reset
        come first), or runs processes (instances in use cannot be destroyed)."""
        self._check_index(index)
        slot = self._slots[index]
        if not slot.spec.mig_capable:
            raise MigError(f"GPU {index} ({slot.spec.name}) does not support MIG")
        busy = [p.pid for p in self.telemetry_state.gpus[index].processes]

        def change(state: SimState) -> tuple[SimState, None]:
            gpu = state.gpus[index]
            if gpu.removed:
                raise MigError(f"GPU {index} is not on the PCI bus (removed)")
            if not gpu.mig_current:
                raise MigError(
                    f"MIG mode is disabled on GPU {index}; enable it first"
                    f" (nvidia-smi -i {index} -mig 1, then reset the GPU)"
                )
            if busy:
                raise MigError(
                    f"GPU {index}'s MIG instances are in use by processes"
                    f" {', '.join(map(str, busy))}; stop them first"
                )
            return state.with_gpu(layouts.apply_to_gpu(gpu, slot.spec, name)), None

        self._store.update(change)

    # -- device enumeration ----------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        """The GPUs on the bus (a hot-removed one is not counted)."""
        self._require_init()
        return len(self.present())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> api.DeviceHandle:
        """By NVML index: the ``index``-th GPU on the bus (see ``present``)."""
        self._require_init()
        present = self.present()
        if not isinstance(index, int) or not 0 <= index < len(present):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"no GPU index {index!r}")
        return handles.device(Ref(handles.KIND_GPU, present[index].index))

    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str | bytes) -> api.DeviceHandle:
        """Accepts NVML's forms: ``domain:bus:device.function``, ``domain:bus:device``,
        ``bus:device.function`` (hex, any case)."""
        self._require_init()
        text = _text(pciBusId).strip().lower()
        m = next((m for r in _BUS_ID_FORMS if (m := r.match(text))), None)
        if m is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"bad PCI bus id {text!r}")
        parts = m.groupdict()
        want = (int(parts.get("d") or "0", 16), int(parts["b"], 16), int(parts["s"], 16))
        for g in self.present():
            d, b, rest = g.bus.split(":")
            if (int(d, 16), int(b, 16), int(rest.split(".")[0], 16)) == want:
                return handles.device(Ref(handles.KIND_GPU, g.index))
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND, f"no GPU at {text!r}")

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> api.DeviceHandle:
        """GPU UUIDs (``GPU-…``) and MIG device UUIDs (``MIG-…``)."""
        self._require_init()
        text = _text(uuid)
        if not text.startswith(("GPU-", "MIG-")):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"malformed UUID {text!r}")
        state = self.state
        for g in self.present():
            if g.uuid == text:
                return handles.device(Ref(handles.KIND_GPU, g.index))
            for gi, ci in state.gpus[g.index].mig_devices():
                if mig_uuid(g.uuid, gi.id, ci.id) == text:
                    return handles.device(Ref(handles.KIND_MIG, g.index, gi.id, ci.id))
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND, f"no device with UUID {text!r}")

    # -- identity --------------------------------------------------------------------------------
    def nvmlDeviceGetIndex(self, handle: api.DeviceHandle) -> int:
        """The GPU's place among the GPUs on the bus (shifts when one before it leaves)."""
        slot = self._gpu(handle)
        return [g.index for g in self.present()].index(slot.index)

    def nvmlDeviceGetMinorNumber(self, handle: api.DeviceHandle) -> int:
        """``/dev/nvidia<minor>``: the model's GPU index (the NVML index with every GPU on the
        bus); stable when other GPUs leave or return, as the kernel's minor numbers are."""
        return self._gpu(handle).index

    def nvmlDeviceGetUUID(self, handle: api.DeviceHandle) -> str:
        slot, instance = self._device(handle)
        if instance is None:
            return slot.uuid
        return mig_uuid(slot.uuid, instance[0].id, instance[1].id)

    def nvmlDeviceGetName(self, handle: api.DeviceHandle) -> str:
        """The product name; for a MIG device ``<product> MIG <profile>``."""
        slot, instance = self._device(handle)
        if instance is None:
            return slot.spec.name
        return f"{slot.spec.name} MIG {slot.spec.profile(instance[0].profile_id).name}"

    def nvmlDeviceGetBrand(self, handle: api.DeviceHandle) -> int:
        return self._device(handle)[0].spec.brand

    def nvmlDeviceGetSerial(self, handle: api.DeviceHandle) -> str:
        return self._gpu(handle).serial

    def nvmlDeviceGetArchitecture(self, device: api.DeviceHandle) -> int:
        return self._device(device)[0].spec.architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: api.DeviceHandle) -> tuple[int, int]:
        return self._device(handle)[0].spec.compute_capability

    def nvmlDeviceGetPciInfo_v3(self, handle: api.DeviceHandle) -> api.PciInfo:
        """The GPU's PCI info (a MIG device reports its parent's)."""
        slot = self._device(handle)[0]
        subsystem = (slot.spec.pci_device_id & 0xFFFF0000) | 0x10DE
        return pci_info(slot.bus, slot.spec.pci_device_id, subsystem)

    def nvmlDeviceGetPciInfo(self, handle: api.DeviceHandle) -> api.PciInfo:
        return self.nvmlDeviceGetPciInfo_v3(handle)

    def nvmlDeviceGetNumaNodeId(self, handle: api.DeviceHandle) -> int:
        """Only GPUs that are NUMA nodes themselves (Grace) answer; none of these models do."""
        self._gpu(handle)
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, "the GPU is not a NUMA node (x86)")

    # -- memory ----------------------------------------------------------------------------------
    @overload
    def nvmlDeviceGetMemoryInfo(
        self, handle: api.DeviceHandle, version: None = None
    ) -> api.Memory: ...

    @overload
    def nvmlDeviceGetMemoryInfo(
        self, handle: api.DeviceHandle, version: api.MemoryInfoVersion
    ) -> api.MemoryV2: ...

    def nvmlDeviceGetMemoryInfo(
        self, handle: api.DeviceHandle, version: api.MemoryInfoVersion | None = None
    ) -> api.Memory | api.MemoryV2:
        """Bytes. A whole GPU reserves :data:`RESERVED_MIB` (v1 counts it as used); a MIG device
        has its GPU instance's memory and nothing reserved. ``used`` follows the load: scripted
        memory plus the processes' (a MIG device: its processes')."""
        slot, instance = self._device(handle)
        self._inject("nvmlDeviceGetMemoryInfo", slot.index)
        if instance is None:
            total, reserved = slot.spec.memory_bytes, RESERVED_MIB * MIB
            used = min(self._memory_used(slot.index, None), total - reserved)
        else:
            total, reserved = slot.spec.profile(instance[0].profile_id).memory_mib * MIB, 0
            used = min(self._memory_used(slot.index, instance[0].id), total)
        if not version:
            v1 = pynvml.c_nvmlMemory_t()
            v1.total, v1.used, v1.free = total, reserved + used, total - reserved - used
            return cast(api.Memory, v1)
        if version != pynvml.nvmlMemory_v2:
            raise nvml_error(
                pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH, f"memory info version {version:#x}"
            )
        v2 = pynvml.c_nvmlMemory_v2_t()
        v2.version = version
        v2.total, v2.reserved, v2.used = total, reserved, used
        v2.free = total - reserved - used
        return cast(api.MemoryV2, v2)

    # -- NVLink ----------------------------------------------------------------------------------
    def _link(self, device: api.DeviceHandle, link: int) -> LinkEnd | None:
        """NOT_SUPPORTED without NVLink; INVALID_ARGUMENT for a link the GPU does not have."""
        slot = self._gpu(device)
        if self._link_table is None:
            self._link_table = nvlink_table(self.model)
        ends = self._link_table[slot.index]
        if not ends:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, f"{slot.spec.name} has no NVLink")
        if not 0 <= link < min(len(ends), pynvml.NVML_NVLINK_MAX_LINKS):
            raise nvml_error(
                pynvml.NVML_ERROR_INVALID_ARGUMENT, f"{slot.spec.name} has no NVLink {link}"
            )
        return ends[link]

    def _active_link(self, device: api.DeviceHandle, link: int) -> LinkEnd:
        end = self._link(device, link)
        if end is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, f"NVLink {link} is not active")
        return end

    def nvmlDeviceGetNvLinkState(self, device: api.DeviceHandle, link: int) -> int:
        """NVML_FEATURE_ENABLED (1) for an active link, else NVML_FEATURE_DISABLED (0)."""
        return 1 if self._link(device, link) is not None else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: api.DeviceHandle, link: int) -> api.PciInfo:
        """The remote end's PCI info (``pciSubSystemId`` is not filled, as in NVML)."""
        end = self._active_link(device, link)
        return pci_info(end.bus, end.pci_device_id, 0)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: api.DeviceHandle, link: int) -> int:
        """NVML_NVLINK_DEVICE_TYPE_GPU (0) or _SWITCH (2)."""
        return self._active_link(handle, link).device_type


def _copy_pynvml_constants(cls: type[Any]) -> None:
    """Make ``cls`` usable like the pynvml module: its constants, error classes, ctypes types."""
    for name, value in pynvml_constants().items():
        if not hasattr(cls, name):
            setattr(cls, name, value)


_copy_pynvml_constants(FakeNvml)
