"""Device health as the kubelet sees it (DRAResourceHealth): one board, many watchers.

Today every advertised device is HEALTHY once discovered; the health watchers (XIDs, GPU lost)
mark devices here. Watchers get the complete list on every change and at least every
``resend_interval`` seconds (the kubelet marks unlisted devices Unknown after a timeout).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

HEALTHY, UNHEALTHY, UNKNOWN = "HEALTHY", "UNHEALTHY", "UNKNOWN"


@dataclass(frozen=True)
class DeviceHealthState:
    pool: str
    device: str
    health: str
    updated_at: int
    """Unix seconds."""


class HealthBoard:
    def __init__(self, pool: str, clock: Callable[[], float] = time.time) -> None:
        self.pool = pool
        self._clock = clock
        self._states: dict[str, DeviceHealthState] = {}
        self._version = 0
        self._cond = threading.Condition()

    def set_devices(self, names: Iterable[str]) -> None:
        """The advertised set changed: new devices start HEALTHY, gone ones are dropped."""
        now = int(self._clock())
        with self._cond:
            wanted = set(names)
            states = {n: s for n, s in self._states.items() if n in wanted}
            for n in wanted - set(states):
                states[n] = DeviceHealthState(self.pool, n, HEALTHY, now)
            self._states = states
            self._version += 1
            self._cond.notify_all()

    def mark(self, device: str, health: str) -> None:
        with self._cond:
            if device in self._states and self._states[device].health != health:
                self._states[device] = DeviceHealthState(
                    self.pool, device, health, int(self._clock())
                )
                self._version += 1
                self._cond.notify_all()

    def snapshot(self) -> tuple[int, list[DeviceHealthState]]:
        with self._cond:
            return self._version, sorted(self._states.values(), key=lambda s: s.device)

    def wait_change(self, seen: int, timeout: float) -> bool:
        """Block until the version moves past ``seen`` or the timeout; True when it moved."""
        with self._cond:
            return self._cond.wait_for(lambda: self._version != seen, timeout)

    def wake_all(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()
