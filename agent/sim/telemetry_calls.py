"""The simulated NVML's device telemetry calls (pynvml names, parameters, types and units).

Units are NVML's: power mW, energy mJ since driver load, temperature degrees C, clocks MHz, PCIe
throughput KB/s, NVLink counters KiB, memory bytes, utilization percent. What a MIG device
handle gets: memory and processes of its own; clocks, clocks-event reasons and temperature of
its parent; NOT_SUPPORTED for power, energy, utilization, PCIe and field values (no per-MIG
power or utilization in NVML; GPM has per-MIG utilization). A MIG-enabled GPU has no whole-GPU
or per-process utilization (NOT_SUPPORTED), as on real drivers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import pynvml

from agent.nvml import api_types as api
from agent.sim import telemetry_model as tm
from agent.sim.mig import nvml_error
from agent.sim.model import GpuSlot
from agent.sim.nvlink import nvlink_table
from agent.sim.telemetry_base import NOT_MIG, TelemetryBase
from agent.sim.telemetry_state import SimGpu

_UI: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
_ULL: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
_NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED
_INVALID_ARGUMENT: int = pynvml.NVML_ERROR_INVALID_ARGUMENT
_ALL_LINKS = 0xFFFFFFFF
"""scopeId of the NVLink throughput fields that sums over all links."""
_NVLINK_FIELDS = {
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: (0, 1.0),
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: (1, 1.0),
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX: (0, tm.RAW_OVERHEAD),
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX: (1, tm.RAW_OVERHEAD),
}


def _field_ids(fieldIds: Any) -> list[tuple[int, int]]:
    """pynvml's forms: field ids, or ``(fieldId, scopeId)`` tuples (scope 0 for bare ids)."""
    out: list[tuple[int, int]] = []
    for item in fieldIds:
        try:
            field_id, scope = item
        except TypeError:
            field_id, scope = item, 0
        out.append((int(field_id), int(scope)))
    return out


class TelemetryCalls(TelemetryBase):
    """Utilization, power, energy, temperature, clocks, PCIe, field values, processes."""

    def _now_us(self) -> int:
        return int(self._clock() * 1_000_000)

    def _whole(self, call: str, handle: api.DeviceHandle) -> tuple[GpuSlot, SimGpu]:
        slot, _, g = self._telemetry_device(call, handle, mig_handle=False)
        return slot, g

    def _parent(self, call: str, handle: api.DeviceHandle) -> tuple[GpuSlot, SimGpu]:
        slot, _, g = self._telemetry_device(call, handle, mig_handle=True)
        return slot, g

    def _no_mig_mode(self, slot: GpuSlot, call: str) -> None:
        if self._gpu_state(slot.index).mig_current:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, f"{call}: GPU is in MIG mode")

    # -- utilization, power, energy ------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: api.DeviceHandle) -> api.Utilization:
        """``c_nvmlUtilization_t``: ``gpu`` and ``memory`` in percent."""
        slot, g = self._whole("nvmlDeviceGetUtilizationRates", handle)
        self._no_mig_mode(slot, "nvmlDeviceGetUtilizationRates")
        u = tm.utilization(g)
        util: api.Utilization = pynvml.c_nvmlUtilization_t()
        util.gpu = round(100 * u)
        util.memory = round(100 * u * tm.MEMORY_UTILIZATION_FACTOR)
        return util

    def nvmlDeviceGetPowerUsage(self, handle: api.DeviceHandle) -> int:
        """Milliwatts, never above the limit in force."""
        slot, g = self._whole("nvmlDeviceGetPowerUsage", handle)
        return tm.power_mw(slot.spec, tm.utilization(g), g)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: api.DeviceHandle) -> int:
        """Milliwatts: the limit in force (the one set, else the board limit)."""
        slot, g = self._whole("nvmlDeviceGetEnforcedPowerLimit", handle)
        return tm.enforced_limit_mw(slot.spec, g)

    def nvmlDeviceGetPowerManagementLimit(self, handle: api.DeviceHandle) -> int:
        """Milliwatts: the limit set since the driver loaded, else the default."""
        slot, g = self._whole("nvmlDeviceGetPowerManagementLimit", handle)
        return tm.enforced_limit_mw(slot.spec, g)

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: api.DeviceHandle) -> int:
        """Milliwatts: the limit the GPU boots with (the board limit)."""
        slot, _ = self._whole("nvmlDeviceGetPowerManagementDefaultLimit", handle)
        return tm.power_limit_mw(slot.spec)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: api.DeviceHandle) -> list[int]:
        """``[minimum, maximum]`` milliwatts (pynvml returns a list)."""
        slot, _ = self._whole("nvmlDeviceGetPowerManagementLimitConstraints", handle)
        return list(tm.power_constraints_mw(slot.spec))

    def nvmlDeviceSetPowerManagementLimit(self, handle: api.DeviceHandle, limit: int) -> None:
        """Set the GPU's power limit in milliwatts until the driver reloads; INVALID_ARGUMENT
        outside the constraints, NOT_SUPPORTED on a MIG device handle (a power limit is the
        physical GPU's). The counters are accumulated to now at the old limit first."""
        slot, _ = self._whole("nvmlDeviceSetPowerManagementLimit", handle)
        low, high = tm.power_constraints_mw(slot.spec)
        if not low <= int(limit) <= high:
            raise nvml_error(
                _INVALID_ARGUMENT, f"power limit {limit} mW is outside {low}..{high} mW"
            )
        default = tm.power_limit_mw(slot.spec)
        value = None if int(limit) == default else int(limit)
        self._change_gpu(slot.index, lambda g: replace(g, power_limit_mw=value))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: api.DeviceHandle) -> int:
        """Millijoules since the driver was loaded."""
        slot, g = self._whole("nvmlDeviceGetTotalEnergyConsumption", handle)
        return tm.floor_int(tm.energy_mj(slot.spec, g, self._clock()))

    # -- temperature, clocks ------------------------------------------------------------------
    def nvmlDeviceGetTemperature(self, handle: api.DeviceHandle, sensor: int) -> int:
        """Degrees C of NVML_TEMPERATURE_GPU (the only sensor)."""
        _, g = self._parent("nvmlDeviceGetTemperature", handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"temperature sensor {sensor}")
        return tm.temperature_c(tm.utilization(g))

    def nvmlDeviceGetClockInfo(self, handle: api.DeviceHandle, type: int) -> int:
        """MHz: NVML_CLOCK_GRAPHICS / NVML_CLOCK_SM (the same clock) or NVML_CLOCK_MEM."""
        slot, g = self._parent("nvmlDeviceGetClockInfo", handle)
        if type in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM):
            return tm.sm_clock_mhz(slot.spec, tm.utilization(g), g)
        if type == pynvml.NVML_CLOCK_MEM:
            return tm.profile(slot.spec).memory_mhz
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"clock type {type}")

    def nvmlDeviceGetMaxClockInfo(self, handle: api.DeviceHandle, type: int) -> int:
        slot, _ = self._parent("nvmlDeviceGetMaxClockInfo", handle)
        if type in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM):
            return tm.profile(slot.spec).sm_boost_mhz
        if type == pynvml.NVML_CLOCK_MEM:
            return tm.profile(slot.spec).memory_mhz
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"clock type {type}")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: api.DeviceHandle) -> int:
        """Bitmask of nvmlClocksEventReason* (GpuIdle when idle, SwPowerCap near full load)."""
        slot, g = self._parent("nvmlDeviceGetCurrentClocksEventReasons", handle)
        return tm.clocks_event_reasons(tm.utilization(g), slot.spec, g)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: api.DeviceHandle) -> int:
        """The deprecated name of :meth:`nvmlDeviceGetCurrentClocksEventReasons`."""
        slot, g = self._parent("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
        return tm.clocks_event_reasons(tm.utilization(g), slot.spec, g)

    # -- PCIe ----------------------------------------------------------------------------------
    def nvmlDeviceGetPcieThroughput(self, device: api.DeviceHandle, counter: int) -> int:
        """KB/s over the last 20 ms: NVML_PCIE_UTIL_TX_BYTES or NVML_PCIE_UTIL_RX_BYTES."""
        slot, g = self._whole("nvmlDeviceGetPcieThroughput", device)
        if counter not in (pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"PCIe counter {counter}")
        tx = counter == pynvml.NVML_PCIE_UTIL_TX_BYTES
        return tm.pcie_kbps(slot.spec, tm.utilization(g), tx)

    def nvmlDeviceGetPcieReplayCounter(self, handle: api.DeviceHandle) -> int:
        _, g = self._whole("nvmlDeviceGetPcieReplayCounter", handle)
        return g.pcie_replays

    # -- field values --------------------------------------------------------------------------
    def nvmlDeviceGetFieldValues(
        self, handle: api.DeviceHandle, fieldIds: Sequence[int | tuple[int, int]]
    ) -> api.CArray[api.FieldValue]:
        """A ``c_nvmlFieldValue_t`` array, one entry per requested field with its own
        ``nvmlReturn``: NOT_SUPPORTED for fields this product (or a MIG device handle) lacks,
        INVALID_ARGUMENT for unknown field ids or NVLink scopes. NVLink throughput fields take
        the link id as ``scopeId``; ``0xFFFFFFFF`` sums over all links (KiB)."""
        slot, instance, g = self._telemetry_device(
            "nvmlDeviceGetFieldValues", handle, mig_handle=True
        )
        requested = _field_ids(fieldIds)
        values = (pynvml.c_nvmlFieldValue_t * len(requested))()
        now_us = self._now_us()
        for i, (field_id, scope) in enumerate(requested):
            v = values[i]
            v.fieldId, v.scopeId, v.timestamp, v.latencyUsec = field_id, scope, now_us, 0
            if instance is not None:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            answer = self._field(slot, g, field_id, scope)
            if isinstance(answer, int):
                v.nvmlReturn = answer
                continue
            value_type, value = answer
            v.nvmlReturn = pynvml.NVML_SUCCESS
            v.valueType = value_type
            if value_type == _UI:
                v.value.uiVal = value
            else:
                v.value.ullVal = value
        return cast(api.CArray[api.FieldValue], values)

    def _field(self, slot: GpuSlot, g: SimGpu, field_id: int, scope: int) -> int | tuple[int, int]:
        """(value type, value) of one field, or the NVML return code when there is none."""
        spec, now = slot.spec, self._clock()
        u = tm.utilization(g)
        f = pynvml
        if field_id in _NVLINK_FIELDS:
            if spec.nvlinks == 0:
                return _NOT_SUPPORTED
            active = self._active_links(slot.index)
            if scope != _ALL_LINKS and not 0 <= scope < len(active):
                return _INVALID_ARGUMENT
            direction, factor = _NVLINK_FIELDS[field_id]
            per_link = tm.floor_int(tm.nvlink_kib(spec, g, now)[direction] * factor)
            links = sum(active) if scope == _ALL_LINKS else int(active[scope])
            return _ULL, per_link * links
        simple: dict[int, tuple[int, int] | None] = {
            f.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: (
                _ULL,
                tm.floor_int(tm.energy_mj(spec, g, now)),
            ),
            f.NVML_FI_DEV_POWER_INSTANT: (_UI, tm.power_mw(spec, u, g)),
            f.NVML_FI_DEV_POWER_AVERAGE: (_UI, tm.power_mw(spec, u, g)),
            f.NVML_FI_DEV_MEMORY_TEMP: (
                (_UI, tm.memory_temperature_c(u)) if tm.profile(spec).hbm else None
            ),
            f.NVML_FI_DEV_PCIE_REPLAY_COUNTER: (_ULL, g.pcie_replays),
            f.NVML_FI_DEV_NVLINK_LINK_COUNT: (_UI, spec.nvlinks) if spec.nvlinks else None,
            f.NVML_FI_DEV_ECC_CURRENT: (_UI, 1),
            f.NVML_FI_DEV_ECC_PENDING: (_UI, 1),
            f.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: (_ULL, g.ecc_corrected_volatile),
            f.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (_ULL, g.ecc_uncorrected_volatile),
            f.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: (_ULL, g.ecc_corrected_aggregate),
            f.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: (_ULL, g.ecc_uncorrected_aggregate),
            f.NVML_FI_DEV_REMAPPED_COR: (_UI, g.remapped_correctable),
            f.NVML_FI_DEV_REMAPPED_UNC: (_UI, g.remapped_uncorrectable),
            f.NVML_FI_DEV_REMAPPED_PENDING: (_UI, int(g.remap_pending)),
            f.NVML_FI_DEV_REMAPPED_FAILURE: (_UI, 0),
        }
        if field_id in simple:
            answer = simple[field_id]
            return _NOT_SUPPORTED if answer is None else answer
        if not 0 < field_id < f.NVML_FI_MAX:
            return _INVALID_ARGUMENT
        return _NOT_SUPPORTED

    _links_active: dict[int, tuple[bool, ...]] | None = None

    def _active_links(self, index: int) -> tuple[bool, ...]:
        """Per link of GPU ``index``: whether it is active (the topology never changes)."""
        if self._links_active is None:
            table = nvlink_table(self.model)
            self._links_active = {
                i: tuple(e is not None for e in ends) for i, ends in table.items()
            }
        return self._links_active[index]

    # -- processes -----------------------------------------------------------------------------
    def nvmlDeviceGetComputeRunningProcesses_v3(
        self, handle: api.DeviceHandle
    ) -> list[api.ProcessInfo]:
        """pynvml's friendly objects with ``pid``, ``usedGpuMemory`` (bytes), ``gpuInstanceId``
        and ``computeInstanceId`` (0xFFFFFFFF outside MIG). A GPU handle lists every process
        (all MIG devices' on a MIG-enabled GPU); a MIG device handle lists its own."""
        _, instance, g = self._telemetry_device(
            "nvmlDeviceGetComputeRunningProcesses", handle, mig_handle=True
        )
        out: list[api.ProcessInfo] = []
        for p in sorted(g.processes, key=lambda p: p.pid):
            if instance is not None and (
                p.gpu_instance_id != instance[0].id or p.compute_instance_id != instance[1].id
            ):
                continue
            info = pynvml.c_nvmlProcessInfo_v3_t()
            info.pid = p.pid
            info.usedGpuMemory = p.used_memory_bytes
            info.gpuInstanceId = NOT_MIG if p.gpu_instance_id is None else p.gpu_instance_id
            info.computeInstanceId = (
                NOT_MIG if p.compute_instance_id is None else p.compute_instance_id
            )
            out.append(pynvml.nvmlStructToFriendlyObject(info))
        return out

    def nvmlDeviceGetComputeRunningProcesses(
        self, handle: api.DeviceHandle
    ) -> list[api.ProcessInfo]:
        return self.nvmlDeviceGetComputeRunningProcesses_v3(handle)

    def nvmlDeviceGetProcessUtilization(
        self, handle: api.DeviceHandle, timeStamp: int
    ) -> list[api.ProcessUtilizationSample]:
        """``c_nvmlProcessUtilizationSample_t`` for each process with a sample newer than
        ``timeStamp`` (microseconds of the simulator's clock); NOT_FOUND when there is none."""
        slot, g = self._whole("nvmlDeviceGetProcessUtilization", handle)
        self._no_mig_mode(slot, "nvmlDeviceGetProcessUtilization")
        now_us = self._now_us()
        samples: list[api.ProcessUtilizationSample] = []
        if now_us > timeStamp:
            for p in sorted(g.processes, key=lambda p: p.pid):
                if p.sm_utilization is None:
                    continue
                s = pynvml.c_nvmlProcessUtilizationSample_t()
                s.pid, s.timeStamp = p.pid, now_us
                s.smUtil = round(100 * p.sm_utilization)
                s.memUtil = round(100 * p.sm_utilization * tm.MEMORY_UTILIZATION_FACTOR)
                s.encUtil = s.decUtil = 0
                samples.append(s)
        if not samples:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND, "no process utilization samples")
        return samples
