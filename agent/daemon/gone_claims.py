"""Prepared claims holding a device the node no longer has, made visible (issue 23, item 5).

The claim stays prepared until the kubelet unprepares it (dra_driver/kubeletplugin/gone.py says
which devices count as gone, by UUID). What the agent does about it is to say so, three ways:

- ``/readyz`` check ``gone-devices`` names each (claim, device, GPU UUID, why). It passes, as
  ``unrecovered-claims`` does: the kubelet unprepares the claim when its pod goes, and neither a
  restart nor taking the agent out of service would bring the device back, while failing
  readiness would stall a rolling upgrade of every node's agent and drop the pod from a Service's
  endpoints, hiding the metric below;
- the gauge ``tessera_prepared_devices_gone`` (docs/metrics.md), read at each scrape;
- a ``PreparedDeviceGone`` Warning Event on the Node and a log record, once per device when it
  is first seen gone (at the start, after the reconcile, and after each rediscovery that changed
  the node); a device that comes back and goes again is reported again.

Telemetry never attributes the usage or energy of another GPU to such a device
(agent/telemetry/attribution.py matches GPUs by UUID).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from agent.discovery.inventory import NodeInventory
from agent.logs import fields_
from dra_driver.cluster.node_events import NodeEventRecorder, prepared_device_gone
from dra_driver.kubeletplugin.gone import GoneDevice, gone_devices
from dra_driver.kubeletplugin.prepare import Preparer

Check = Callable[[], tuple[bool, str]]
ALL_THERE = "every prepared device is on the node"


class GoneClaims:
    """Which prepared devices are gone (computed from the checkpoint and the inventory when
    asked), and the one-time report of each."""

    def __init__(
        self,
        preparer: Preparer,
        inventory: Callable[[], NodeInventory | None],
        node_events: NodeEventRecorder,
        log: logging.Logger,
    ) -> None:
        self._preparer = preparer
        self._inventory = inventory
        self._events = node_events
        self._log = log
        self._lock = threading.Lock()
        self._reported: set[tuple[str, str, str]] = set()

    def current(self) -> tuple[GoneDevice, ...]:
        """The prepared devices the node does not have now (none before the start's reconcile
        or the first inventory)."""
        inventory = self._inventory()
        if inventory is None:
            return ()
        try:
            claims = self._preparer.checkpoint.claims.values()
        except RuntimeError:  # before the start's reconcile loaded the checkpoint
            return ()
        return gone_devices(claims, inventory)

    def count(self) -> int:
        """For the gauge ``tessera_prepared_devices_gone``."""
        return len(self.current())

    def readiness_checks(self) -> list[tuple[str, Check]]:
        return [("gone-devices", self._check)]

    def _check(self) -> tuple[bool, str]:
        gone = self.current()
        if not gone:
            return True, ALL_THERE
        named = "; ".join(g.describe() for g in gone)
        return True, (
            f"{len(gone)} prepared device(s) the node no longer has, kept until the kubelet"
            f" unprepares their claims: {named}"
        )

    def observe(self) -> None:
        """Report the devices newly seen gone (a Node event and a log record each); forget the
        ones that are no longer gone (unprepared, or back)."""
        gone = self.current()
        with self._lock:
            fresh = [g for g in gone if g.key not in self._reported]
            self._reported = {g.key for g in gone}
        for g in fresh:
            self._log.warning(
                "a prepared claim holds a device the node no longer has; nothing is attributed"
                " to it until its claim is unprepared",
                extra=fields_(
                    claim=f"{g.namespace}/{g.name}",
                    uid=g.uid,
                    device=g.device,
                    gpu_uuid=g.gpu_uuid,
                    mig_uuid=g.mig_uuid,
                    reason=g.why,
                ),
            )
            self._events.record(*prepared_device_gone(g.describe()))
