"""The energy a GPU used between two readings (pure): the rules for the driver's total-energy
counter (which restarts at 0 when the driver reloads) and the power fallback, as
:mod:`agent.telemetry.energy` documents them. The telemetry's attribution and the usage ledger's
gap after a restart read the counter by the same rules."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_WATTS = 2000.0
"""Above any GPU's power draw: a counter delta larger than this x seconds is not believed."""

COUNTER, COUNTER_RESET, POWER, NONE = "counter", "counter-reset", "power", "none"


@dataclass(frozen=True)
class Reading:
    """What one sample says about energy: the baseline of the next interval."""

    timestamp: float
    energy_joules: float | None
    power_watts: float | None


def _power(watts: float | None, max_watts: float) -> float | None:
    if watts is None or not math.isfinite(watts):
        return None
    return min(max(watts, 0.0), max_watts)


def energy_delta(prev: Reading, now: Reading, max_watts: float = MAX_WATTS) -> tuple[float, str]:
    """Joules used between two readings and how they were found (``counter``,
    ``counter-reset``, ``power`` or ``none``); never negative. Pure; the rules are in
    :mod:`agent.telemetry.energy`'s docstring."""
    dt = now.timestamp - prev.timestamp
    if dt <= 0:
        return 0.0, NONE
    limit = max_watts * dt
    if prev.energy_joules is not None and now.energy_joules is not None:
        diff = now.energy_joules - prev.energy_joules
        if 0 <= diff <= limit:
            return diff, COUNTER
        if 0 <= now.energy_joules <= limit:
            return now.energy_joules, COUNTER_RESET
    a, b = _power(prev.power_watts, max_watts), _power(now.power_watts, max_watts)
    if a is None and b is None:
        return 0.0, NONE
    mean = (a + b) / 2 if a is not None and b is not None else (a if a is not None else b)
    assert mean is not None
    return mean * dt, POWER
