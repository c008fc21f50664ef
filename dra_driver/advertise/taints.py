"""What the scheduler sees of unhealthy GPUs: a pure function over the DeviceModel.

``with_health(model, unhealthy, taints=..., driver_name=...)`` returns the model to publish:

- with ``taints`` (``--device-taints``; the DRA device-taint API, feature gate
  ``DRADeviceTaints``, alpha in Kubernetes 1.33-1.35): every device whose parent is an unhealthy
  GPU (the whole GPU, its MIG devices, dynamic MIG placements, shared devices) carries one taint
  ``<driver name>/unhealthy`` with effect ``NoSchedule`` and the cause as its value (``xid-79``,
  ``gpu-lost``); ``timeAdded`` is when the GPU became unhealthy, so re-rendering an unchanged
  state gives the same slices (no write);
- without: those devices are withdrawn from the pool, and so is a counter set that only they
  consumed (a counter set nothing consumes would be noise in the pool, and in the 1.34 layout a
  slice of its own).

``with_health`` is pure (nothing here reads the clock, NVML or the API server);
``UnhealthyGpus`` is the agent's thread-safe record of which GPUs are unhealthy right now.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass

from dra_driver.device_model import DeviceModel, DeviceTaint

TAINT_NAME = "unhealthy"
TAINT_EFFECT = "NoSchedule"


@dataclass(frozen=True)
class UnhealthyGpu:
    uuid: str
    cause: str
    """``xid-<n>`` or ``gpu-lost``: the taint's value (a label value, at most 63 characters)."""
    since: float
    """Unix seconds when the GPU became unhealthy (the taint's ``timeAdded``)."""


def taint_key(driver_name: str) -> str:
    """``gpu.tessera.dev/unhealthy``: the driver name is the key's domain."""
    return f"{driver_name}/{TAINT_NAME}"


def rfc3339(seconds: float) -> str:
    """``2026-01-02T03:04:05Z`` (UTC, whole seconds: what the API server stores)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(seconds)))


def unhealthy_taint(gpu: UnhealthyGpu, driver_name: str) -> DeviceTaint:
    return DeviceTaint(
        key=taint_key(driver_name),
        value=gpu.cause,
        effect=TAINT_EFFECT,
        time_added=rfc3339(gpu.since),
    )


def with_health(
    model: DeviceModel,
    unhealthy: Mapping[str, UnhealthyGpu],
    *,
    taints: bool,
    driver_name: str,
) -> DeviceModel:
    """``model`` as published while the GPUs in ``unhealthy`` (by UUID) are unhealthy: their
    devices tainted (``taints``) or withdrawn (module docstring). ``model`` itself when no
    advertised device belongs to an unhealthy GPU."""
    if not any(d.parent_uuid in unhealthy for d in model.devices):
        return model
    if taints:
        devices = tuple(
            dataclasses.replace(d, taints=(unhealthy_taint(unhealthy[d.parent_uuid], driver_name),))
            if d.parent_uuid in unhealthy
            else d
            for d in model.devices
        )
        return dataclasses.replace(model, devices=devices)
    kept = tuple(d for d in model.devices if d.parent_uuid not in unhealthy)
    consumed_before = {s for d in model.devices for s, _ in d.consumes_counters}
    consumed_now = {s for d in kept for s, _ in d.consumes_counters}
    sets = tuple(
        cs for cs in model.counter_sets if cs.name in consumed_now or cs.name not in consumed_before
    )
    return DeviceModel(devices=kept, counter_sets=sets)


class UnhealthyGpus:
    """The GPUs unhealthy right now, by UUID (the sampler's changes set it, publishing reads
    it). Thread-safe."""

    def __init__(self) -> None:
        self._gpus: dict[str, UnhealthyGpu] = {}
        self._lock = threading.Lock()

    def update(self, uuid: str, gpu: UnhealthyGpu | None) -> None:
        """``gpu`` None: the GPU is healthy again."""
        with self._lock:
            if gpu is None:
                self._gpus.pop(uuid, None)
            else:
                self._gpus[uuid] = gpu

    def snapshot(self) -> Mapping[str, UnhealthyGpu]:
        with self._lock:
            return types.MappingProxyType(dict(self._gpus))
