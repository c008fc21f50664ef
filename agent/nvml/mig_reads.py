"""MIG devices and their samples in a telemetry read: the MIG device list (re-enumerated by the
reader), each MIG device's memory, and each GPU instance's SM utilization from GPM (two sample
buffers per GPU instance on Hopper+, the previous read's and this one's); see
:mod:`agent.nvml.telemetry` for the calls per read."""

from __future__ import annotations

import contextlib

from agent.nvml.api import NvmlApi
from agent.nvml.api_types import GpmSample
from agent.nvml.errors import (
    NvmlError,
    NvmlGpuLost,
    NvmlInvalidArgument,
    NvmlNotFound,
    NvmlNotSupported,
)
from agent.nvml.facade import text
from agent.nvml.gpu_reads import SUCCESS, Gpm, GpuState, Lost, MigDevice, call
from agent.nvml.samples import MigSample

_GPM_SM_UTIL = 2
_GPM_METRICS_GET_VERSION = 1


def enumerate_mig(gpu: GpuState, errors: list[str]) -> None:
    """Re-read the GPU's MIG devices (and ask the unsupported calls again); free the GPM
    buffers of GPU instances that are gone."""
    gpu.mig_stale = False
    gpu.reads_since_enumeration = 1
    gpu.skip.clear()
    api, h = gpu.api, gpu.handle
    count = call(gpu, errors, "mig_count", api.nvmlDeviceGetMaxMigDeviceCount, h)
    devices: list[MigDevice] = []
    for i in range(count or 0):
        try:
            mh = api.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            gi = api.nvmlDeviceGetGpuInstanceId(mh)
            ci = api.nvmlDeviceGetComputeInstanceId(mh)
            uuid = text(api.nvmlDeviceGetUUID(mh))
        except NvmlGpuLost as exc:
            raise Lost() from exc
        except (NvmlNotFound, NvmlNotSupported):
            continue
        except NvmlError as exc:
            errors.append(exc.call)
            continue
        devices.append(MigDevice(gi, ci, uuid, mh))
    gpu.mig = tuple(sorted(devices, key=lambda d: (d.gpu_instance_id, d.compute_instance_id)))
    for gi in set(gpu.gpm) - {d.gpu_instance_id for d in gpu.mig}:
        free_gpm(gpu, gi)


def mig_samples(gpu: GpuState, errors: list[str]) -> tuple[MigSample, ...]:
    """One sample per known MIG device; a destroyed one marks the list stale."""
    utilization = {gi: _gpm(gpu, errors, gi) for gi in _gis(gpu.mig)}
    out: list[MigSample] = []
    for d in gpu.mig:
        try:
            m = gpu.api.nvmlDeviceGetMemoryInfo(d.handle)
        except NvmlGpuLost as exc:
            raise Lost() from exc
        except (NvmlInvalidArgument, NvmlNotFound):
            gpu.mig_stale = True  # the MIG device was destroyed
            continue
        except NvmlError as exc:
            errors.append(exc.call)
            m = None
        out.append(
            MigSample(
                gpu_instance_id=d.gpu_instance_id,
                compute_instance_id=d.compute_instance_id,
                uuid=d.uuid,
                memory_used_bytes=None if m is None else m.used,
                memory_total_bytes=None if m is None else m.total,
                utilization=utilization.get(d.gpu_instance_id),
            )
        )
    return tuple(out)


def _gpm(gpu: GpuState, errors: list[str], gi: int) -> float | None:
    """SM utilization (0-1) of GPU instance ``gi`` since the previous read, from GPM."""
    if not _gpm_supported(gpu):
        return None
    api = gpu.api
    state = gpu.gpm.get(gi)
    if state is None:
        a = call(gpu, errors, "gpm", api.nvmlGpmSampleAlloc)
        b = call(gpu, errors, "gpm", api.nvmlGpmSampleAlloc) if a else None
        if a is None or b is None:
            if a is not None:
                _free_sample(api, a)
            return None
        state = gpu.gpm[gi] = Gpm(buffers=(a, b))
    current = state.buffers[1] if state.previous is state.buffers[0] else state.buffers[0]
    taken = call(gpu, errors, "gpm", api.nvmlGpmMigSampleGet, gpu.handle, gi, current)
    if taken is None:
        state.previous = None
        return None
    previous, state.previous = state.previous, current
    if previous is None:
        return None
    request = api.c_nvmlGpmMetricsGet_t()
    request.version = _GPM_METRICS_GET_VERSION
    request.numMetrics = 1
    request.sample1 = previous
    request.sample2 = current
    request.metrics[0].metricId = _GPM_SM_UTIL
    result = call(gpu, errors, "gpm_metrics", api.nvmlGpmMetricsGet, request)
    if result is None or result.metrics[0].nvmlReturn != SUCCESS:
        return None
    return min(1.0, max(0.0, result.metrics[0].value / 100))


def _gpm_supported(gpu: GpuState) -> bool:
    """Asked once per handle (``nvmlGpmQueryDeviceSupport``); False without GPM calls."""
    if gpu.gpm_supported is None:
        gpu.gpm_supported = False
        if hasattr(gpu.api, "nvmlGpmMigSampleGet"):
            try:
                support = gpu.api.nvmlGpmQueryDeviceSupport(gpu.handle)
                gpu.gpm_supported = bool(support.isSupportedDevice)
            except NvmlGpuLost as exc:
                raise Lost() from exc
            except NvmlError:
                pass
    return gpu.gpm_supported


def free_gpm(gpu: GpuState, gi: int) -> None:
    state = gpu.gpm.pop(gi, None)
    if state is not None:
        for s in state.buffers:
            _free_sample(gpu.api, s)


def _free_sample(api: NvmlApi, sample: GpmSample) -> None:
    with contextlib.suppress(NvmlError):
        api.nvmlGpmSampleFree(sample)


def _gis(devices: tuple[MigDevice, ...]) -> list[int]:
    return sorted({d.gpu_instance_id for d in devices})
