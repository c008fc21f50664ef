"""The simulated NVML's events and GPM calls (pynvml names, parameters and types).

Events: the node's event log lives in the telemetry state file, so an XID injected by any process
(``tessera sim fault xid``) reaches event sets of every process on the same state directory.
An event set receives the events raised after its GPU was registered, once each, in order.
:meth:`EventCalls.nvmlEventSetWait_v2` blocks in real time (it polls the state file every
:data:`POLL_SECONDS`); the injected clock only drives telemetry values.

GPM (Hopper and newer; NOT_SUPPORTED on older GPUs): samples record the SM-busy integral of the
GPU or of one GPU instance; ``nvmlGpmMetricsGet`` returns the average utilization between two
samples (percent): NVML_GPM_METRIC_GRAPHICS_UTIL and _SM_UTIL equal it, _SM_OCCUPANCY is half of
it; other metrics are NOT_SUPPORTED.
"""

from __future__ import annotations

import time
from typing import cast

import pynvml

from agent.nvml import api_types as api
from agent.sim import handles
from agent.sim import telemetry_model as tm
from agent.sim.handles import Ref
from agent.sim.mig import nvml_error
from agent.sim.telemetry_base import (
    EVENT_SET_TAG,
    GPM_SAMPLE_TAG,
    NOT_MIG,
    EventSet,
    GpmSample,
    TelemetryBase,
    make_pointer,
    pointer_id,
)
from agent.sim.telemetry_state import SimEvent

POLL_SECONDS = 0.005
SUPPORTED_EVENTS: int = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypePState
    | pynvml.nvmlEventTypeClock
)
_GPM_UTIL_METRICS = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: 1.0,
    pynvml.NVML_GPM_METRIC_SM_UTIL: 1.0,
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: tm.SM_OCCUPANCY_FACTOR,
}


class EventCalls(TelemetryBase):
    """nvmlEventSet*, nvmlDeviceRegisterEvents, nvmlDeviceGetSupportedEventTypes."""

    def _event_set(self, eventSet: api.EventSet) -> tuple[int, EventSet]:
        self._require_init()
        set_id = pointer_id(eventSet, pynvml.c_nvmlEventSet_t, EVENT_SET_TAG)
        with self._objects_lock:
            found = self._event_sets.get(set_id) if set_id is not None else None
        if set_id is None or found is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"{eventSet!r} is no event set")
        return set_id, found

    def nvmlEventSetCreate(self) -> api.EventSet:
        self._require_init()
        set_id = self._new_object_id()
        with self._objects_lock:
            self._event_sets[set_id] = EventSet()
        return api.EventSet(make_pointer(pynvml.c_nvmlEventSet_t, EVENT_SET_TAG, set_id))

    def nvmlDeviceGetSupportedEventTypes(self, handle: api.DeviceHandle) -> int:
        self._telemetry_device("nvmlDeviceGetSupportedEventTypes", handle, mig_handle=False)
        return SUPPORTED_EVENTS

    def nvmlDeviceRegisterEvents(
        self, handle: api.DeviceHandle, eventTypes: int, eventSet: api.EventSet
    ) -> None:
        """Register a GPU (not a MIG device) for ``eventTypes``; NOT_SUPPORTED when any of the
        types is one this simulator never raises."""
        slot, _, _ = self._telemetry_device("nvmlDeviceRegisterEvents", handle, mig_handle=False)
        _, event_set = self._event_set(eventSet)
        if eventTypes & ~SUPPORTED_EVENTS or not eventTypes:
            raise nvml_error(
                pynvml.NVML_ERROR_NOT_SUPPORTED, f"event types {eventTypes:#x} are not supported"
            )
        first = self._telemetry.read().next_seq
        with self._objects_lock:
            mask, start = event_set.registrations.get(slot.index, (0, first))
            event_set.registrations[slot.index] = (mask | eventTypes, start)

    def _next_event(self, event_set: EventSet) -> SimEvent | None:
        """The next event for ``event_set`` in the log (marked delivered), else None."""
        events = self._telemetry.read().events
        with self._objects_lock:
            for e in events:
                if e.seq <= event_set.delivered:
                    continue
                mask, start = event_set.registrations.get(e.gpu, (0, 0))
                if mask & e.event_type and e.seq >= start:
                    event_set.delivered = e.seq
                    return e
        return None

    def nvmlEventSetWait_v2(self, eventSet: api.EventSet, timeoutms: int) -> api.EventData:
        """The next event as ``c_nvmlEventData_t``; NVMLError_Timeout after ``timeoutms``."""
        _, event_set = self._event_set(eventSet)
        deadline = time.monotonic() + max(0, timeoutms) / 1000
        while True:
            event = self._next_event(event_set)
            if event is not None:
                data: api.EventData = pynvml.c_nvmlEventData_t()
                data.device = handles.device(Ref(handles.KIND_GPU, event.gpu))
                data.eventType = event.event_type
                data.eventData = event.data
                gi, ci = event.gpu_instance_id, event.compute_instance_id
                data.gpuInstanceId = NOT_MIG if gi is None else gi
                data.computeInstanceId = NOT_MIG if ci is None else ci
                return data
            left = deadline - time.monotonic()
            if left <= 0:
                raise nvml_error(pynvml.NVML_ERROR_TIMEOUT, f"no event in {timeoutms} ms")
            time.sleep(min(POLL_SECONDS, left))

    def nvmlEventSetWait(self, eventSet: api.EventSet, timeoutms: int) -> api.EventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: api.EventSet) -> None:
        set_id, _ = self._event_set(eventSet)
        with self._objects_lock:
            self._event_sets.pop(set_id, None)


class GpmCalls(TelemetryBase):
    """nvmlGpm* (GPU performance monitoring, Hopper and newer)."""

    def _gpm_sample(self, gpmSample: api.GpmSample) -> tuple[int, GpmSample]:
        self._require_init()
        sample_id = pointer_id(gpmSample, pynvml.c_nvmlGpmSample_t, GPM_SAMPLE_TAG)
        with self._objects_lock:
            found = self._gpm_samples.get(sample_id) if sample_id is not None else None
        if sample_id is None or found is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"{gpmSample!r} is no GPM sample")
        return sample_id, found

    def nvmlGpmQueryDeviceSupport(self, device: api.DeviceHandle) -> api.GpmSupport:
        slot = self._gpu(device)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(slot.spec.architecture >= pynvml.NVML_DEVICE_ARCH_HOPPER)
        return cast(api.GpmSupport, support)

    def nvmlGpmSampleAlloc(self) -> api.GpmSample:
        self._require_init()
        sample_id = self._new_object_id()
        with self._objects_lock:
            self._gpm_samples[sample_id] = GpmSample()
        return api.GpmSample(make_pointer(pynvml.c_nvmlGpmSample_t, GPM_SAMPLE_TAG, sample_id))

    def nvmlGpmSampleFree(self, gpmSample: api.GpmSample) -> None:
        sample_id, _ = self._gpm_sample(gpmSample)
        with self._objects_lock:
            self._gpm_samples.pop(sample_id, None)

    def _take(
        self, call: str, device: api.DeviceHandle, gi_id: int | None, gpmSample: api.GpmSample
    ) -> api.GpmSample:
        slot, _, g = self._telemetry_device(call, device, mig_handle=False)
        sample_id, _ = self._gpm_sample(gpmSample)
        if slot.spec.architecture < pynvml.NVML_DEVICE_ARCH_HOPPER:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, f"no GPM on {slot.spec.name}")
        gi_sms = self._gi_sms(slot.index)
        if gi_id is not None:
            if not self._gpu_state(slot.index).mig_current:
                raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED, "the GPU is not in MIG mode")
            if gi_id not in gi_sms:
                raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"no GPU instance {gi_id}")
        scope = "gpu" if gi_id is None else f"gi{gi_id}"
        rate = tm.busy_rates(g, gi_sms, slot.spec.multiprocessors)[scope]
        now = self._clock()
        sample = GpmSample(slot.index, scope, now, tm.busy_integral(g, scope, rate, now), rate)
        with self._objects_lock:
            self._gpm_samples[sample_id] = sample
        return gpmSample

    def nvmlGpmSampleGet(self, device: api.DeviceHandle, gpmSample: api.GpmSample) -> api.GpmSample:
        return self._take("nvmlGpmSampleGet", device, None, gpmSample)

    def nvmlGpmMigSampleGet(
        self, device: api.DeviceHandle, gpuInstanceId: int, gpmSample: api.GpmSample
    ) -> api.GpmSample:
        """``device`` is the parent GPU's handle."""
        return self._take("nvmlGpmMigSampleGet", device, gpuInstanceId, gpmSample)

    def nvmlGpmMetricsGet(self, metricsGet: api.GpmMetricsGet) -> api.GpmMetricsGet:
        """Fills ``metrics[i].value`` / ``.nvmlReturn`` of a ``c_nvmlGpmMetricsGet_t``."""
        self._require_init()
        struct: object = metricsGet  # (narrowing metricsGet itself would make it Any)
        if not isinstance(struct, pynvml.c_nvmlGpmMetricsGet_t):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, "not a c_nvmlGpmMetricsGet_t")
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "metricsGet.version")
        if not 0 < metricsGet.numMetrics <= pynvml.NVML_GPM_METRIC_MAX:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, "metricsGet.numMetrics")
        _, first = self._gpm_sample(metricsGet.sample1)
        _, second = self._gpm_sample(metricsGet.sample2)
        if first.gpu is None or second.gpu is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, "a GPM sample was never taken")
        if (first.gpu, first.scope) != (second.gpu, second.scope):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, "samples of different devices")
        elapsed = second.time - first.time
        average = (second.busy - first.busy) / elapsed if elapsed > 0 else second.rate
        average = tm.clamp01(average)
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            factor = _GPM_UTIL_METRICS.get(metric.metricId)
            if factor is None:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                metric.value = 0.0
            else:
                metric.nvmlReturn = pynvml.NVML_SUCCESS
                metric.value = 100.0 * average * factor
        return metricsGet
