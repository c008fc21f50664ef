"""What the telemetry reader keeps per GPU between reads (:class:`GpuState`: the handle and
UUID, the MIG devices, the calls that answered NotSupported, the last process-utilization
timestamp, the GPM sample buffers) and how it makes one call (:func:`call`); see
:mod:`agent.nvml.telemetry`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from agent.nvml.api import NvmlApi
from agent.nvml.api_types import DeviceHandle, GpmSample
from agent.nvml.errors import NvmlError, NvmlGpuLost, NvmlNotSupported

P = ParamSpec("P")
R = TypeVar("R")

SUCCESS = 0
"""NVML_SUCCESS."""


@dataclass
class MigDevice:
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str
    handle: DeviceHandle


@dataclass
class Gpm:
    """Two GPM sample buffers of one GPU instance; ``previous`` holds the last read's."""

    buffers: tuple[GpmSample, GpmSample]
    previous: GpmSample | None = None


@dataclass
class GpuState:
    """What the reader keeps of one GPU between reads."""

    api: NvmlApi
    """The facade's API for this GPU (its errors name the GPU)."""
    handle: DeviceHandle
    uuid: str
    skip: set[str] = field(default_factory=set)
    """Calls that answered NotSupported since the last MIG enumeration."""
    mig: tuple[MigDevice, ...] = ()
    mig_stale: bool = True
    asks_seen: int = 0
    """The reader's latest refresh ask this state has taken (``TelemetryReader.refresh``)."""
    reads_since_enumeration: int = 0
    last_process_timestamp: int = 0
    gpm_supported: bool | None = None
    """Whether the GPU has GPM (asked once per handle)."""
    gpm: dict[int, Gpm] = field(default_factory=dict)


class Lost(Exception):
    """GpuIsLost during a read."""


def call(
    gpu: GpuState,
    errors: list[str],
    key: str,
    fn: Callable[P, R],
    *args: P.args,
    **kwargs: P.kwargs,
) -> R | None:
    """``fn(*args, **kwargs)`` (a function of ``gpu.api``); None when unsupported (then
    skipped until the next enumeration) or failed (the call named in ``errors``); GpuIsLost
    ends the read."""
    if key in gpu.skip:
        return None
    try:
        return fn(*args, **kwargs)
    except NvmlGpuLost as exc:
        raise Lost() from exc
    except NvmlNotSupported:
        gpu.skip.add(key)
        return None
    except NvmlError as exc:
        errors.append(exc.call)
        return None
