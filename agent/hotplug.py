"""What makes the agent read its inventory again: udev's PCI events, a periodic re-read, debounced.

The trigger layer. An :class:`EventSource` yields :class:`PciEvent` values (small frozen values:
an action and a PCI bus id); :class:`UdevSource` is the real node's (pyudev, the ``pci``
subsystem, NVIDIA's vendor id, add/remove/bind/unbind; pyudev's objects never leave this module),
:class:`NoEvents` the fallback where udev cannot be reached (the periodic re-read still runs), and
the simulator has its own (``agent.sim.udev``); only the composition root chooses which.

:class:`Rediscovery` runs the loop: a burst of events gives one rediscovery once no event came for
``debounce`` seconds (at the latest five times that after the first one), and the periodic re-read
(``interval``; 0 turns it off) catches what sends no event at all, such as an administrator's MIG
change with ``nvidia-smi``. :func:`inventory_change` is the pure diff of two inventories that the
composition root reports as a :class:`DevicesChanged`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agent.discovery.inventory import NodeInventory
from agent.logs import fields_

NVIDIA_VENDOR = "10DE"
ACTIONS = frozenset({"add", "remove", "bind", "unbind"})
"""The uevent actions that can change what the node has: a function appears or goes
(add/remove), a driver takes or leaves it (bind/unbind)."""
REBIND_ACTIONS = frozenset({"add", "bind"})
MAX_DELAY_FACTOR = 5.0
"""A burst is read at the latest this many debounce intervals after its first event."""
UDEV_RUN_DIR = Path("/run/udev")
"""systemd-udevd's runtime directory: without it nothing re-broadcasts the kernel's events to
libudev listeners (a container without /run/udev mounted, a machine without udevd)."""


@dataclass(frozen=True)
class PciEvent:
    """One udev event of an NVIDIA PCI function."""

    action: str
    """``add``, ``remove``, ``bind`` or ``unbind``."""
    bus_id: str
    """The function's address as sysfs names it: ``0000:1b:00.0``."""


class EventSource(Protocol):
    """Where PCI events come from (udev on a real node, the simulator's event log)."""

    def poll(self, timeout_s: float) -> Sequence[PciEvent]:
        """The events that arrived, waiting up to ``timeout_s`` for the first one; empty when
        none came in time."""
        ...

    def close(self) -> None: ...


def accept(action: str | None, properties: Mapping[str, str], sys_name: str) -> PciEvent | None:
    """The :class:`PciEvent` of a udev event, or None when it is not an NVIDIA PCI function's
    add/remove/bind/unbind (pure). The vendor comes from the event's own ``PCI_ID`` property
    (``10DE:2330``), which the kernel puts in every PCI uevent, removals included (the sysfs
    attributes are gone by then); the bus id from ``PCI_SLOT_NAME``, else the device's name."""
    if action not in ACTIONS:
        return None
    vendor = properties.get("PCI_ID", "").partition(":")[0].upper()
    if vendor != NVIDIA_VENDOR:
        return None
    bus_id = properties.get("PCI_SLOT_NAME") or sys_name
    return PciEvent(action, bus_id.lower())


class NoEvents:
    """The source of a node whose udev cannot be reached: no event ever (the periodic re-read
    still runs). ``poll`` waits out its timeout unless :meth:`close` is called."""

    def __init__(self) -> None:
        self._closed = threading.Event()

    def poll(self, timeout_s: float) -> Sequence[PciEvent]:
        self._closed.wait(timeout_s)
        return ()

    def close(self) -> None:
        self._closed.set()


class UdevSource:
    """udev's PCI events of NVIDIA functions, through pyudev's netlink monitor (libudev's
    re-broadcast of the kernel's events, after udevd has processed them)."""

    def __init__(self, monitor: object) -> None:
        self._monitor = monitor

    def poll(self, timeout_s: float) -> Sequence[PciEvent]:
        events: list[PciEvent] = []
        timeout: float | None = timeout_s
        while True:
            device = self._monitor.poll(timeout)  # type: ignore[attr-defined]
            if device is None:
                return events
            event = accept(device.action, dict(device.properties), device.sys_name)
            if event is not None:
                events.append(event)
            timeout = 0  # take what is already queued, then return

    def close(self) -> None:
        stop = getattr(self._monitor, "stop", None)
        if stop is not None:
            stop()


def open_udev(log: logging.Logger, run_dir: Path = UDEV_RUN_DIR) -> EventSource:
    """The real node's udev source; :class:`NoEvents` with one warning where udev is not there
    (no ``run_dir``) or its netlink socket cannot be opened."""
    reason: str | None = None
    if not run_dir.is_dir():
        reason = f"{run_dir} does not exist (no udevd on this machine, or not mounted)"
    else:
        try:
            import pyudev

            monitor = pyudev.Monitor.from_netlink(pyudev.Context())
            monitor.filter_by("pci")
            monitor.start()
            return UdevSource(monitor)
        except (OSError, ImportError, ValueError) as exc:
            reason = f"cannot open udev's netlink monitor: {exc}"
    log.warning(
        "udev is not available: GPUs that come or go are seen at the next periodic re-read",
        extra=fields_(reason=reason),
    )
    return NoEvents()


@dataclass
class Debouncer:
    """When a burst of events is over (pure, times given by the caller).

    A rediscovery is due ``debounce`` seconds after the last event of a burst, and at the latest
    ``max_delay`` seconds after its first, so an endless trickle still gets read."""

    debounce: float
    max_delay: float
    first: float | None = None
    last: float | None = None
    rebound: set[str] = field(default_factory=set)

    def event(self, event: PciEvent, now: float) -> None:
        if self.first is None:
            self.first = now
        self.last = now
        if event.action in REBIND_ACTIONS:
            self.rebound.add(event.bus_id)

    def due_at(self) -> float | None:
        """When the pending burst should be read; None when nothing is pending."""
        if self.first is None or self.last is None:
            return None
        return min(self.last + self.debounce, self.first + self.max_delay)

    def take(self) -> frozenset[str]:
        """End the burst: the bus ids added or bound in it."""
        rebound = frozenset(self.rebound)
        self.first = self.last = None
        self.rebound = set()
        return rebound


class Rediscovery:
    """The loop that calls ``rediscover(rebound)`` after each debounced burst of events and every
    ``interval`` seconds (0: never periodically). ``rebound`` is the PCI bus ids added or bound
    since the previous call. ``clock`` is monotonic seconds."""

    def __init__(
        self,
        source: EventSource,
        rediscover: Callable[[frozenset[str]], None],
        *,
        interval: float,
        debounce: float,
        log: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._rediscover = rediscover
        self.interval = interval
        self._debouncer = Debouncer(debounce, debounce * MAX_DELAY_FACTOR)
        self._log = log
        self._clock = clock

    def run(self, stop: threading.Event) -> None:
        """Until ``stop`` is set (close the source to wake a waiting poll)."""
        next_periodic = self._clock() + self.interval if self.interval > 0 else math.inf
        while not stop.is_set():
            now = self._clock()
            due = self._debouncer.due_at()
            wake = min(next_periodic, math.inf if due is None else due)
            for event in self._source.poll(min(max(0.0, wake - now), 1.0)):
                self._log.debug(
                    "udev event", extra=fields_(action=event.action, pci_bus_id=event.bus_id)
                )
                self._debouncer.event(event, self._clock())
            if stop.is_set():
                return
            now = self._clock()
            due = self._debouncer.due_at()
            if (due is not None and now >= due) or now >= next_periodic:
                self._rediscover(self._debouncer.take())
                if self.interval > 0:
                    next_periodic = self._clock() + self.interval


@dataclass(frozen=True)
class GpuRef:
    """A GPU as a change names it."""

    index: int
    uuid: str
    bus_id: str


@dataclass(frozen=True)
class DevicesChanged:
    """What one rediscovery changed (the value ``on_devices_changed`` receives)."""

    added_gpus: tuple[GpuRef, ...] = ()
    removed_gpus: tuple[GpuRef, ...] = ()
    added_devices: tuple[str, ...] = ()
    removed_devices: tuple[str, ...] = ()
    rebound: tuple[str, ...] = ()
    """PCI bus ids seen in udev add/bind events since the previous rediscovery (the health code
    clears a GPU's sticky faults when its function was bound again)."""

    @property
    def devices_changed(self) -> bool:
        """Whether the advertised GPUs or devices changed (``rebound`` alone is not a change)."""
        return bool(
            self.added_gpus or self.removed_gpus or self.added_devices or self.removed_devices
        )


def _gpus(inv: NodeInventory | None) -> dict[str, GpuRef]:
    if inv is None:
        return {}
    return {g.device.uuid: GpuRef(g.device.index, g.device.uuid, g.pcie.bus_id) for g in inv.gpus}


def inventory_change(
    old: NodeInventory | None,
    new: NodeInventory,
    old_devices: Iterable[str],
    new_devices: Iterable[str],
    rebound: Iterable[str] = (),
) -> DevicesChanged:
    """What changed from ``old`` to ``new`` (pure): GPUs by UUID (indexes may shift, the UUID
    stays), devices by name; ``rebound`` is passed through, sorted."""
    before, after = _gpus(old), _gpus(new)
    was, now = set(old_devices), set(new_devices)
    return DevicesChanged(
        added_gpus=tuple(sorted((after[u] for u in after.keys() - before), key=lambda g: g.index)),
        removed_gpus=tuple(
            sorted((before[u] for u in before.keys() - after), key=lambda g: g.index)
        ),
        added_devices=tuple(sorted(now - was)),
        removed_devices=tuple(sorted(was - now)),
        rebound=tuple(sorted(set(rebound))),
    )
