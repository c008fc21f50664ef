"""XID events through the NVML facade.

:class:`EventWatcher` creates one NVML event set, registers every GPU (or the given ones) for
XID critical errors, and turns what ``nvmlEventSetWait`` returns into
:class:`~agent.nvml.samples.XidEvent` values. A GPU that cannot be registered (NotSupported,
lost, or any other NVML error) is skipped and reported in :attr:`EventWatcher.skipped`; the
others are still watched. NVML errors of the event set itself are raised as ``agent.nvml.errors``
NVML errors. One thread waits; :meth:`EventWatcher.close` is called after the last wait. NVML is
called through the facade's :meth:`~agent.nvml.facade.Nvml.api`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from agent.nvml.api_types import DeviceHandle, EventData, EventSet
from agent.nvml.errors import NvmlError, NvmlGpuLost
from agent.nvml.facade import Nvml
from agent.nvml.samples import XidEvent

XID_CRITICAL_ERROR = 0x8
"""nvmlEventTypeXidCriticalError."""
NOT_MIG = 0xFFFFFFFF
TIMEOUT = 10
"""NVML_ERROR_TIMEOUT."""
MAX_EVENTS_PER_WAIT = 256


def _address(handle: DeviceHandle) -> int:
    """The pointer value of a device handle: NVML hands out the same pointer for a GPU."""
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


def _instance_id(value: int) -> int | None:
    return None if value == NOT_MIG else value


class EventWatcher:
    """Waits for XID critical-error events of the node's GPUs."""

    def __init__(self, nvml: Nvml, indices: Sequence[int] | None = None) -> None:
        """Create the event set and register ``indices`` (default: every GPU NVML counts)."""
        self._nvml = nvml
        self._api = nvml.api()
        event_set = self._api.nvmlEventSetCreate()
        self._set: EventSet | None = event_set
        self._by_address: dict[int, int] = {}
        self._ignored: set[int] = set()
        """Registered handles of GPUs that are no longer watched (removed by a rediscovery)."""
        self._skipped: dict[int, str] = {}
        try:
            for index in range(nvml.device_count()) if indices is None else indices:
                self._register(event_set, index)
        except BaseException:
            self.close()
            raise

    def _register(self, event_set: EventSet, index: int) -> None:
        try:
            handle = self._nvml.handle(index)
            api = self._nvml.api(str(index))
            api.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_ERROR, event_set)
        except NvmlError as exc:
            self._skipped[index] = str(exc)
            return
        self._by_address[_address(handle)] = index

    def watch(self, indices: Sequence[int]) -> None:
        """The node's GPUs after a rediscovery, by NVML index: GPUs not yet registered are
        registered (a GPU that came back or is new), every watched GPU's events are reported
        under its index now (indexes shift when a GPU leaves; its handle, and so the events'
        device pointer, stays the same), and GPUs not listed are no longer reported (NVML
        cannot unregister one device from an event set; their events are dropped)."""
        event_set = self._set
        if event_set is None:
            raise RuntimeError("EventWatcher is closed")
        by_address: dict[int, int] = {}
        skipped: dict[int, str] = {}
        registered = set(self._by_address) | self._ignored
        for index in indices:
            try:
                handle = self._nvml.handle(index)
                address = _address(handle)
                if address not in registered:
                    api = self._nvml.api(str(index))
                    api.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_ERROR, event_set)
                    registered.add(address)
            except NvmlError as exc:
                skipped[index] = str(exc)
                continue
            by_address[address] = index
        self._ignored = registered - set(by_address)
        self._by_address = by_address
        self._skipped = skipped

    @property
    def registered(self) -> tuple[int, ...]:
        """The GPUs whose XIDs are watched, by index."""
        return tuple(sorted(self._by_address.values()))

    @property
    def skipped(self) -> dict[int, str]:
        """GPUs that could not be registered, with why (the NVML error)."""
        return dict(self._skipped)

    def wait(self, timeout_s: float) -> list[XidEvent]:
        """XID events: blocks up to ``timeout_s`` for the first, then takes the ones already
        queued (up to :data:`MAX_EVENTS_PER_WAIT`); empty when none came in time."""
        event_set = self._set
        if event_set is None:
            raise RuntimeError("EventWatcher is closed")
        if not self._by_address:
            return []
        out: list[XidEvent] = []
        timeout_ms = max(0, round(timeout_s * 1000))
        while len(out) < MAX_EVENTS_PER_WAIT:
            data = self._next(event_set, timeout_ms if not out else 0)
            if data is None:
                break
            if data.eventType & XID_CRITICAL_ERROR and _address(data.device) not in self._ignored:
                out.append(self._event(data))
        return out

    def _next(self, event_set: EventSet, timeout_ms: int) -> EventData | None:
        try:
            return self._api.nvmlEventSetWait(event_set, timeout_ms)
        except NvmlError as exc:
            if exc.code == TIMEOUT:
                return None
            raise

    def _event(self, data: EventData) -> XidEvent:
        index = self._by_address.get(_address(data.device))
        if index is None:  # a handle NVML made anew: ask which GPU it is
            try:
                index = self._api.nvmlDeviceGetIndex(data.device)
            except NvmlGpuLost:
                index = -1
        return XidEvent(
            gpu_index=index,
            xid=data.eventData,
            gpu_instance_id=_instance_id(data.gpuInstanceId),
            compute_instance_id=_instance_id(data.computeInstanceId),
        )

    def close(self) -> None:
        """Free the event set (idempotent)."""
        event_set, self._set = self._set, None
        if event_set is not None:
            self._api.nvmlEventSetFree(event_set)

    def __enter__(self) -> EventWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
