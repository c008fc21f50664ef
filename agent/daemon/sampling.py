"""Telemetry in the running agent: the sampler and what it reads (NVML telemetry and XID
events), the energy accounts and fatal XIDs it keeps across restarts, and the telemetry API that
serves its snapshots."""

from __future__ import annotations

import logging
import threading
import time

from agent.logs import fields_
from agent.nvml.events import EventWatcher
from agent.nvml.telemetry import TelemetryReader
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.faults import FaultStore
from agent.telemetry.sampler import Sampler
from agent.telemetry.stream import TelemetryServer


class Sampling:
    """The sampler with its sources, its saved state and its API server."""

    def __init__(
        self,
        *,
        sampler: Sampler,
        reader: TelemetryReader,
        events: EventWatcher,
        accounting: EnergyAccounting,
        faults: FaultStore,
        server: TelemetryServer,
        log: logging.Logger,
    ) -> None:
        self.sampler = sampler
        self.reader = reader
        self.events = events
        self.accounting = accounting
        self.faults = faults
        self.server = server
        self.log = log

    def restore(self) -> None:
        """Load the energy accounts and the fatal XIDs that hold GPUs unhealthy (``faults.json``)
        once the state directory is ours."""
        self.accounting.load()
        restored = self.faults.load(time.time())
        self.sampler.restore_faults(restored)
        if restored:
            self.log.warning(
                "GPUs with a fatal XID no recovery cleared stay unhealthy",
                extra=fields_(gpus=sorted(restored), path=str(self.faults.path)),
            )

    def start(self) -> None:
        """Sample the discovered GPUs; serve the telemetry API once a first sample exists."""
        self.sampler.tick()
        self.server.start()

    def notify_watchers(self, stop: threading.Event) -> None:
        """Wake telemetry watchers on every new snapshot (a latest-wins subscription)."""
        sub = self.sampler.subscribe()
        try:
            while not stop.is_set():
                if sub.get(timeout=0.5) is not None:
                    self.server.notify()
        finally:
            sub.close()

    def save(self, timeout: float) -> None:
        """Save the energy accounts and the usage counted up to now (once the state directory
        is ours; the sampler's loop has ended) and stop accounting, waiting at most ``timeout``
        seconds for a tick still running."""
        self.accounting.close()
        self.sampler.finish_usage(timeout)

    def close(self) -> None:
        """Close the NVML readers."""
        self.reader.close()
        self.events.close()
