"""The state directory across agents: a --rolling-update agent serves the kubelet at once and
waits for the directory until the agent before it hands it over; every agent gives it up when
it stops, unless something of its own may still write it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from agent.daemon.readiness import Checks
from agent.fsutil import remove_temp_files
from agent.http import HttpEndpoint
from agent.logs import fields_
from agent.statelock import StateLock
from dra_driver.kubeletplugin.server import PluginServer

TAKING_OVER = (
    "the agent is taking over from the one before it and is still waiting for the state directory"
)
"""Why DRA calls wait at the gate during a handover (the answer of one whose deadline runs out)."""
HANDOVER_LOG_S = 30.0
"""While waiting for the state directory, one log line this often."""


class StateDir:
    """The agent's state directory and its lock."""

    def __init__(self, path: Path, lock: StateLock, log: logging.Logger) -> None:
        self.path = path
        self.lock = lock
        self.log = log

    def handover_checks(self) -> Checks:
        """/readyz's ``state-dir`` check of a --rolling-update agent: whom it waits for."""
        return [("state-dir", lambda: (True, self.handover_detail()))]

    def liveness_checks(self) -> Checks:
        """/healthz's: the directory (and the lock in it) is still the one the agent started
        with (what a restart repairs)."""
        return [("state-dir", self.intact)]

    def take_over(
        self, stop: threading.Event, plugin: PluginServer, http: HttpEndpoint, checks: Checks
    ) -> bool:
        """--rolling-update: serve the kubelet at once (it sends new calls to the newest plugin
        of a driver; they wait at the plugin's gate), then wait for the state directory until
        the agent before us hands it over. Ready while waiting (``checks``): the DaemonSet
        deletes the old pod only once this one is ready, and only then does the old agent let
        go (a deadlock otherwise). False when ``stop`` was set first."""
        plugin.gate.waiting_for(f"{TAKING_OVER} {self.path}")
        plugin.serve()
        for name, check in checks:
            http.readiness.add(name, check)
        http.start()
        host, port = http.address
        started, previous, timeout = time.monotonic(), None, 0.0
        while not self.lock.acquire(wait=True, stop=stop, timeout=timeout):
            if stop.is_set():
                self.log.info("stopped before the state directory was handed over")
                return False
            previous, timeout = self.lock.holder(), HANDOVER_LOG_S
            plugin.gate.waiting_for(f"{TAKING_OVER} {self.path} ({previous})")
            self.log.info(
                "waiting for the state directory",
                extra=fields_(
                    state_dir=str(self.path),
                    holder=str(previous),
                    waited_s=round(time.monotonic() - started, 1),
                    healthz=f"{http.scheme}://{host}:{port}/healthz",
                ),
            )
        self.log.info(
            "took over the state directory",
            extra=fields_(
                state_dir=str(self.path),
                previous=str(previous) if previous else None,
                waited_s=round(time.monotonic() - started, 3),
            ),
        )
        return True

    def handover_detail(self) -> str:
        if self.lock.held:
            return "held"
        return (
            f"waiting for {self.lock.holder()} to hand {self.path} over; the kubelet's calls"
            " wait meanwhile"
        )

    def release(self, unfinished: list[str]) -> None:
        """Give the state directory up unless something of ours may still write it
        (``unfinished``): then the kernel releases it when the process exits (the CLI ends it
        at once)."""
        if not self.lock.held:
            return
        if unfinished:
            self.log.warning(
                "keeping the state directory locked until the process exits: work is still running",
                extra=fields_(state_dir=str(self.path), unfinished=unfinished),
            )
            return
        self.lock.release()
        self.log.info("released the state directory", extra=fields_(state_dir=str(self.path)))

    def sweep_temp_files(self, *more: Path) -> None:
        """Temporary files that a crash mid-write left (the lock says no one else writes here),
        in the directory, its ``resourceslices`` and the ones given (``more``: removed already,
        by their owner)."""
        removed = [
            *remove_temp_files(self.path),
            *remove_temp_files(self.path / "resourceslices"),
            *more,
        ]
        for path in removed:
            self.log.info("removed a temporary file left by a crash", extra=fields_(path=str(path)))

    def intact(self) -> tuple[bool, str]:
        """The state directory (and the lock in it) is still the one this agent started with."""
        if self.lock.intact():
            return True, "intact"
        return False, f"{self.path} was deleted or replaced while the agent runs"
