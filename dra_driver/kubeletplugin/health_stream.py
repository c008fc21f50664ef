"""Device health as the kubelet sees it (DRAResourceHealth): one board, many watchers.

Every advertised device is HEALTHY once discovered; the health watchers (XIDs, GPU lost)
mark devices here. A device that is no longer advertised (its GPU was removed) but that a prepared
claim still holds (``held``) stays on the board as UNHEALTHY until the claim is unprepared, so
the kubelet hears that the claim's device is gone rather than stops hearing of it. Watchers get
the complete list on every change and at least every ``resend_interval`` seconds (the kubelet
marks unlisted devices Unknown after a timeout).
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
    def __init__(
        self,
        pool: str,
        clock: Callable[[], float] = time.time,
        held: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        """``held``: the devices of this pool that prepared claims hold now."""
        self.pool = pool
        self._clock = clock
        self._held = held
        self._advertised: set[str] = set()
        self._states: dict[str, DeviceHealthState] = {}
        self._version = 0
        self._cond = threading.Condition()

    def set_devices(self, names: Iterable[str]) -> None:
        """The advertised set changed: new devices (and ones that return) start HEALTHY; gone
        ones that a claim still holds become UNHEALTHY and stay until unprepared; other gone
        ones are dropped."""
        now = int(self._clock())
        wanted = set(names)
        held = set(self._held())
        with self._cond:
            states: dict[str, DeviceHealthState] = {}
            for n, s in self._states.items():
                if n in wanted and n in self._advertised:
                    states[n] = s
                elif n not in wanted and n in held:
                    states[n] = s if s.health == UNHEALTHY else self._state(n, UNHEALTHY, now)
            for n in wanted - set(states):
                states[n] = self._state(n, HEALTHY, now)
            self._advertised = wanted
            self._states = states
            self._version += 1
            self._cond.notify_all()

    def _state(self, device: str, health: str, now: int) -> DeviceHealthState:
        return DeviceHealthState(self.pool, device, health, now)

    def mark(self, device: str, health: str) -> None:
        """A watcher's verdict on an advertised device (one that is gone stays UNHEALTHY)."""
        with self._cond:
            if device not in self._advertised:
                return
            if device in self._states and self._states[device].health != health:
                self._states[device] = DeviceHealthState(
                    self.pool, device, health, int(self._clock())
                )
                self._version += 1
                self._cond.notify_all()

    def snapshot(self) -> tuple[int, list[DeviceHealthState]]:
        """The version and every device's state: the advertised ones, and the gone ones while a
        claim still holds them (one whose claim was unprepared is dropped here)."""
        held = set(self._held())
        with self._cond:
            gone = [n for n in self._states if n not in self._advertised and n not in held]
            for n in gone:
                del self._states[n]
            return self._version, sorted(self._states.values(), key=lambda s: s.device)

    def wait_change(self, seen: int, timeout: float) -> bool:
        """Block until the version moves past ``seen`` or the timeout; True when it moved."""
        with self._cond:
            return self._cond.wait_for(lambda: self._version != seen, timeout)

    def wake_all(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()
