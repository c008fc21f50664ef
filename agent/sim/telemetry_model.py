"""The simulator's load model: what a GPU reports for a given load (pure functions).

The load of a GPU is its scripted utilization plus the SM utilization of its processes, capped
at 1 (``u``). From it, in NVML's units:

* power (mW) = limit x (idle + u x (1 - idle)), idle = 12 % of the board (default) limit;
* under a power cap (``nvmlDeviceSetPowerManagementLimit``; kept in ``SimGpu.power_limit_mw``
  until a driver reload, as NVML keeps it): the draw is ``min(that power, cap)``, never more.
  The GPU stays busy (utilization is the fraction of time a kernel runs, which a cap does not
  change) but runs slower: the SM clock is scaled by the dynamic power it may still draw,
  ``(cap - idle) / (power - idle)``, with the SW power cap clocks-event reason. The cap is
  within ``power_constraints_mw`` (each product's minimum, in ``PROFILES``, up to its board
  limit), so it is always above the idle power;
* energy (mJ since driver load) = the integral of the (capped) power over the injected clock;
* GPU utilization = 100 u %, memory-copy utilization = 60 u %;
* temperature 30 + 45 u degrees C, HBM memory 4 degrees warmer (GDDR products have no memory
  sensor: NOT_SUPPORTED);
* SM clock idle when u = 0, else the product's boost clock (93 % of it when power capped at
  u >= 0.95, with the SW power cap clocks-event reason); memory clock fixed;
* PCIe throughput (KB/s) and NVLink traffic (KiB, a counter per link) proportional to u.

Counters are stored as the value at ``SimGpu.since``; between changes of the load their rates are
constant, so the value at a later time is ``stored + rate x (now - since)``. A change of the load
first :func:`advance`-s the counters to "now" with the old rates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from agent.sim.specs import GpuSpec
from agent.sim.telemetry_state import SimGpu

IDLE_POWER_FRACTION = 0.12
MEMORY_UTILIZATION_FACTOR = 0.6
SM_OCCUPANCY_FACTOR = 0.5
"""GPM SM occupancy relative to SM utilization."""
POWER_CAP_UTILIZATION = 0.95
POWER_CAPPED_CLOCK = 0.93
RAW_OVERHEAD = 1.1
"""NVLink raw (data + protocol) bytes per data byte."""

# pynvml constants the model needs (stable NVML ABI values)
CLOCKS_EVENT_GPU_IDLE = 0x1
CLOCKS_EVENT_SW_POWER_CAP = 0x4


@dataclass(frozen=True)
class TelemetryProfile:
    """What a product reports beyond its spec (clocks, sensors, link rates)."""

    sm_idle_mhz: int
    sm_boost_mhz: int
    memory_mhz: int
    hbm: bool
    """HBM products have a memory temperature sensor (NVML_FI_DEV_MEMORY_TEMP)."""
    pcie_full_kbps: int
    """PCIe RX throughput at full load (TX is half of it), KB/s."""
    nvlink_full_kibps: int
    """Per active link and direction at full load, KiB/s."""
    power_min_w: int = 100
    """The lowest power limit NVML accepts (``nvmlDeviceGetPowerManagementLimitConstraints``'s
    minimum); the maximum is the board limit."""


_GIB_KIB = 1024 * 1024
PROFILES: dict[str, TelemetryProfile] = {
    "H100-SXM5-80GB": TelemetryProfile(345, 1980, 2619, True, 24_000_000, 12 * _GIB_KIB, 200),
    "H200-SXM5-141GB": TelemetryProfile(345, 1980, 3201, True, 24_000_000, 12 * _GIB_KIB, 200),
    "A100-SXM4-40GB": TelemetryProfile(210, 1410, 1215, True, 12_000_000, 10 * _GIB_KIB, 100),
    "A100-PCIE-80GB": TelemetryProfile(210, 1410, 1512, True, 12_000_000, 10 * _GIB_KIB, 150),
    "L40S": TelemetryProfile(210, 2520, 9001, False, 12_000_000, 0, 100),
    "L4": TelemetryProfile(210, 2040, 6251, False, 6_000_000, 0, 40),
}
_DEFAULT = TelemetryProfile(210, 1500, 1500, False, 12_000_000, 10 * _GIB_KIB)


def profile(spec: GpuSpec) -> TelemetryProfile:
    return PROFILES.get(spec.key, _DEFAULT)


def clamp01(value: float) -> float:
    return min(1.0, max(0.0, value))


def utilization(g: SimGpu) -> float:
    """The GPU's load ``u`` (0-1): scripted utilization plus its processes' SM shares."""
    return clamp01(g.utilization + sum(p.sm_utilization or 0.0 for p in g.processes))


def gi_utilization(g: SimGpu, gi_id: int, gi_sms: int, total_sms: int) -> float:
    """SM utilization of one GPU instance (0-1): the scripted load applies to every instance;
    each process's share of the GPU's SMs is scaled to the instance's SMs."""
    shares = sum(p.sm_utilization or 0.0 for p in g.processes if p.gpu_instance_id == gi_id)
    return clamp01(g.utilization + shares * total_sms / max(gi_sms, 1))


def memory_used(g: SimGpu, gi_id: int | None = None) -> int:
    """Bytes used: scripted plus processes (of one GPU instance when ``gi_id`` is given)."""
    if gi_id is not None:
        return sum(p.used_memory_bytes for p in g.processes if p.gpu_instance_id == gi_id)
    return g.memory_used_bytes + sum(p.used_memory_bytes for p in g.processes)


def power_limit_mw(spec: GpuSpec) -> int:
    """The board's (default) power limit: what the GPU boots with."""
    return spec.power_limit_w * 1000


def power_constraints_mw(spec: GpuSpec) -> tuple[int, int]:
    """(minimum, maximum) power limit NVML accepts for the product."""
    return profile(spec).power_min_w * 1000, power_limit_mw(spec)


def enforced_limit_mw(spec: GpuSpec, g: SimGpu) -> int:
    """The limit in force: the one set since the driver loaded, else the default."""
    return g.power_limit_mw if g.power_limit_mw is not None else power_limit_mw(spec)


def _uncapped_mw(spec: GpuSpec, u: float) -> float:
    limit = power_limit_mw(spec)
    return limit * (IDLE_POWER_FRACTION + clamp01(u) * (1 - IDLE_POWER_FRACTION))


def capped(spec: GpuSpec, g: SimGpu, u: float) -> bool:
    """Whether the power limit holds the GPU back at load ``u``."""
    return _uncapped_mw(spec, u) > enforced_limit_mw(spec, g)


def power_mw(spec: GpuSpec, u: float, g: SimGpu | None = None) -> int:
    """The draw at load ``u``: never above the limit in force on ``g`` (the default one when
    ``g`` is None)."""
    cap = enforced_limit_mw(spec, g) if g is not None else power_limit_mw(spec)
    return round(min(_uncapped_mw(spec, u), cap))


def temperature_c(u: float) -> int:
    return round(30 + 45 * clamp01(u))


def memory_temperature_c(u: float) -> int:
    return temperature_c(u) + 4


def sm_clock_mhz(spec: GpuSpec, u: float, g: SimGpu | None = None) -> int:
    """The SM clock at load ``u``; under a cap that holds the GPU back (``capped``), scaled by
    the share of the dynamic power it may still draw."""
    p = profile(spec)
    if u <= 0:
        return p.sm_idle_mhz
    clock = p.sm_boost_mhz * (POWER_CAPPED_CLOCK if u >= POWER_CAP_UTILIZATION else 1.0)
    if g is not None and capped(spec, g, u):
        idle = power_limit_mw(spec) * IDLE_POWER_FRACTION
        share = (enforced_limit_mw(spec, g) - idle) / (_uncapped_mw(spec, u) - idle)
        clock = max(p.sm_idle_mhz, clock * clamp01(share))
    return round(clock)


def clocks_event_reasons(u: float, spec: GpuSpec | None = None, g: SimGpu | None = None) -> int:
    if u <= 0:
        return CLOCKS_EVENT_GPU_IDLE
    if u >= POWER_CAP_UTILIZATION or (spec is not None and g is not None and capped(spec, g, u)):
        return CLOCKS_EVENT_SW_POWER_CAP
    return 0


def pcie_kbps(spec: GpuSpec, u: float, tx: bool) -> int:
    full = profile(spec).pcie_full_kbps
    return round(clamp01(u) * full * (0.5 if tx else 1.0))


def nvlink_rates_kibps(spec: GpuSpec, u: float) -> tuple[float, float]:
    """(TX, RX) KiB/s per active link."""
    full = profile(spec).nvlink_full_kibps
    return clamp01(u) * full, clamp01(u) * full * 0.9


def _elapsed(g: SimGpu, now: float) -> float:
    """Seconds since ``g.since``; 0 when the clock reads earlier (another clock domain)."""
    return max(0.0, now - g.since)


def energy_mj(spec: GpuSpec, g: SimGpu, now: float) -> float:
    """The energy counter at ``now``: the (capped) power integrated since ``g.since``."""
    return g.energy_mj + power_mw(spec, utilization(g), g) * _elapsed(g, now)


def nvlink_kib(spec: GpuSpec, g: SimGpu, now: float) -> tuple[float, float]:
    """(TX, RX) KiB per active link since driver load."""
    tx, rx = nvlink_rates_kibps(spec, utilization(g))
    dt = _elapsed(g, now)
    return g.nvlink_tx_kib + tx * dt, g.nvlink_rx_kib + rx * dt


def busy_rates(g: SimGpu, gi_sms: Mapping[int, int], total_sms: int) -> dict[str, float]:
    """Current SM utilization per GPM scope: ``gpu`` and ``gi<id>`` for each GPU instance."""
    rates = {"gpu": utilization(g)}
    for gi_id, sms in gi_sms.items():
        rates[f"gi{gi_id}"] = gi_utilization(g, gi_id, sms, total_sms)
    return rates


def busy_integral(g: SimGpu, key: str, rate: float, now: float) -> float:
    return g.busy_value(key) + rate * _elapsed(g, now)


def advance(
    spec: GpuSpec, g: SimGpu, now: float, gi_sms: Mapping[int, int], total_sms: int
) -> SimGpu:
    """The GPU with its counters accumulated to ``now`` at the current load (pure).

    A clock reading earlier than ``since`` (another process with another clock) moves ``since``
    back without accumulating anything.
    """
    tx, rx = nvlink_kib(spec, g, now)
    rates = busy_rates(g, gi_sms, total_sms)
    keys = sorted({k for k, _ in g.busy} | set(rates))
    busy = tuple((k, busy_integral(g, k, rates.get(k, 0.0), now)) for k in keys)
    return replace(
        g,
        since=now,
        energy_mj=energy_mj(spec, g, now),
        nvlink_tx_kib=tx,
        nvlink_rx_kib=rx,
        busy=busy,
    )


def reload_driver(g: SimGpu, now: float) -> SimGpu:
    """A driver reload: processes end, load back to idle, volatile counters restart at 0, a
    power limit set since the last load is gone (the default applies again).

    Lost GPUs stay lost; aggregate ECC counts and remapped rows (kept in the InfoROM) stay.
    """
    return replace(
        g,
        utilization=0.0,
        memory_used_bytes=0,
        processes=(),
        since=now,
        energy_mj=0.0,
        nvlink_tx_kib=0.0,
        nvlink_rx_kib=0.0,
        busy=(),
        power_limit_mw=None,
        pcie_replays=0,
        ecc_corrected_volatile=0,
        ecc_uncorrected_volatile=0,
    )


def floor_int(value: float) -> int:
    return math.floor(value)
