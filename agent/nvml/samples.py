"""Raw telemetry read through the NVML facade: one frozen ``GpuSample`` per GPU per read.

Units are base units (bytes, watts, joules, celsius, hertz, ratios 0-1). A field the GPU does not
support is ``None`` ("absent"), never zero. Counters (energy, replays, NVLink bytes, ECC) are the
driver's raw values: they reset when the driver reloads; the telemetry layer makes them monotonic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    used_memory_bytes: int | None
    gpu_instance_id: int | None
    """MIG GPU instance the process runs in; None on a whole GPU."""
    compute_instance_id: int | None
    sm_utilization: float | None
    """Share of the GPU's SMs this process used over the last interval (0-1), when NVML has it."""


@dataclass(frozen=True)
class MigSample:
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization: float | None
    """SM utilization of the MIG device (0-1) from GPM on Hopper+; None where NVML has none."""


@dataclass(frozen=True)
class GpuSample:
    index: int
    uuid: str
    timestamp: float
    """Monotonic seconds when the read finished (the sampler's clock)."""
    lost: bool = False
    """The GPU fell off the bus (NVML GpuIsLost): every other field is absent."""
    utilization_gpu: float | None = None
    utilization_memory: float | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    power_watts: float | None = None
    energy_joules: float | None = None
    """The driver's total-energy counter (since driver load)."""
    temperature_gpu_celsius: float | None = None
    temperature_memory_celsius: float | None = None
    clock_sm_hertz: float | None = None
    clock_memory_hertz: float | None = None
    throttle_reasons: int | None = None
    """NVML clocks-event/throttle reasons bitmask."""
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    pcie_replays: int | None = None
    nvlink_tx_bytes: int | None = None
    """Sum over the GPU's links (counter)."""
    nvlink_rx_bytes: int | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    processes: tuple[ProcessSample, ...] = ()
    mig: tuple[MigSample, ...] = ()
    errors: tuple[str, ...] = ()
    """Calls that failed unexpectedly during this read (the read still returns what it got)."""


@dataclass(frozen=True)
class XidEvent:
    gpu_index: int
    xid: int
    gpu_instance_id: int | None
    compute_instance_id: int | None
