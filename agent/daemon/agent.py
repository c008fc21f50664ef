"""The running agent's lifecycle: ``Agent.start``/``stop`` bring the loops up and down in order;
``run`` blocks until asked to stop (SIGINT/SIGTERM in the CLI) or until a task fails. The agent
is built whole by the composition root (:mod:`agent.daemon.compose`); it changes none of its
parts' wiring."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.config import DaemonSettings
from agent.daemon.devices import NodeDevices
from agent.daemon.gone_claims import GoneClaims
from agent.daemon.handover import StateDir
from agent.daemon.node_owner import NodeOwner
from agent.daemon.readiness import AgentChecks, Checks
from agent.daemon.sampling import Sampling
from agent.daemon.unrecovered import follow_unrecovered
from agent.hotplug import EventSource, Rediscovery
from agent.http import HttpEndpoint, Readiness
from agent.logs import fields_
from agent.node import NodeSource, discover
from agent.supervisor import Deadline, Supervisor
from dra_driver.advertise.publisher import Publisher
from dra_driver.cluster.node_events import NodeEventRecorder
from dra_driver.errors import CdiError, KubeError
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.kubeletplugin.server import PluginServer

if TYPE_CHECKING:  # imported where kube mode starts (build_agent)
    from dra_driver.cluster.claim_usage_status import ClaimUsageStatusWriter
    from dra_driver.cluster.kube import KubeClient
    from dra_driver.cluster.usage_report import UsageReporter

USAGE_SAVE_S = 5.0
"""The longest the stop waits for a telemetry tick still running before it saves the usage
counted (within the shutdown timeout): a tick stuck in a read is not waited for."""
FINAL_REPORT_S = 5.0
"""The longest the last usage report at a clean stop may take (within the shutdown timeout)."""
CLAIM_STATUS_FLUSH_S = 3.0
"""The longest the claims' usage summaries still queued at a clean stop may take to write
(within the shutdown timeout); the rest are dropped, logged."""
STARTING = "the agent is still starting (reading the node and recovering its prepared claims)"
"""Why DRA calls wait at the gate during a start (the answer of one whose deadline runs out)."""
STOP_RESERVE_S = 2.0
"""Of the shutdown timeout, what is kept for stopping the servers and loops after the claims
(at most half of it)."""


@dataclass
class Agent:
    settings: DaemonSettings
    """--shutdown-timeout and --rolling-update, among the daemon's lifecycle settings."""
    cleanup_on_exit: bool
    driver_name: str
    source: NodeSource
    state: StateDir
    http: HttpEndpoint
    checks: AgentChecks
    node: NodeDevices
    publisher: Publisher
    preparer: Preparer
    plugin: PluginServer
    kube: KubeClient | None
    owner: NodeOwner
    node_events: NodeEventRecorder
    gone: GoneClaims
    """Prepared claims holding devices the node no longer has: reported after the reconcile
    (and by each rediscovery that changed the node)."""
    telemetry: Sampling
    log: logging.Logger
    triggers: EventSource | None = None
    """Where udev's PCI events come from (None: no rediscovery loop at all)."""
    rediscovery: Rediscovery | None = None
    """The loop that re-reads the node on those events and periodically."""
    usage_report: UsageReporter | None = None
    """Writes the node's GpuUsageReport (kube mode)."""
    claim_status: ClaimUsageStatusWriter | None = None
    """Writes unprepared claims' usage into their status (kube mode)."""
    stop_event: threading.Event = field(default_factory=threading.Event)
    supervisor: Supervisor | None = None
    unfinished: list[str] = field(default_factory=list)
    """What had not stopped when the shutdown deadline passed (threads still running)."""

    @property
    def readiness(self) -> Readiness:
        """/readyz's checks."""
        return self.http.readiness

    def start(self, stop: threading.Event | None = None) -> None:
        """Discover the node, start publishing, open the HTTP endpoint (NVML is initialized).
        With --rolling-update, first serve the kubelet and wait for the state directory
        (:meth:`StateDir.take_over`; ``stop`` ends the wait, and then nothing else starts)."""
        if not self.state.lock.held and not self.state.take_over(
            stop or self.stop_event, self.plugin, self.http, self.checks.handover
        ):
            return
        # The kubelet's registration comes first: GetInfo needs only the driver's name, its DRA
        # socket and the versions, and the kubelet registers the plugin on that answer alone
        # (docs/gpu-facts.md, "The kubelet and several plugins of a driver"). What it sends on
        # the DRA socket after (claim calls, the health stream) waits at the closed gate, within
        # the kubelet's deadline, until the claims prepared before are recovered from the
        # checkpoint (reconcile_on_start) and plugin.start() opens it: the same gate a rolling
        # update's successor serves behind while it waits for the state directory.
        self.plugin.gate.waiting_for(STARTING)
        self.plugin.serve()
        self.state.sweep_temp_files(*self.preparer.cdi.remove_temp_files())
        self.telemetry.restore()
        try:
            self.preparer.cdi.write_base()
        except CdiError as exc:  # a full disk: the first claim's spec writes it (or says why)
            self.log.error("cannot write the base CDI spec", extra=fields_(error=str(exc)))
        inventory = discover(self.source, self.node.vm)
        self.owner.read()  # the Node's uid: the slices' owner and the events' subject
        self.node.apply_inventory(inventory)
        self.preparer.reconcile_on_start()
        if self.node.vm is not None:
            # the start's repair may have moved GPUs between nvidia and vfio-pci (a VM's claim
            # bound again, one rolled back): NVML's indexes shift, and the kernel's events for
            # those rebindings came before the rediscovery loop listens. Read the node again
            # before the sampler reads GPUs by stale indexes (it would report a bystander lost)
            self.node.rediscover()
        self.gone.observe()
        self._say_if_degraded()
        self.plugin.start()
        self.telemetry.start()
        _register(self.http.readiness, self.checks.ready)
        _register(self.http.liveness, self.checks.live)
        self.supervisor = Supervisor(self.log, self.stop_event.set)
        recorder, sampler, stop_event = self.node_events, self.telemetry.sampler, self.stop_event
        self.supervisor.spawn("node-events", lambda: recorder.run(stop_event))
        self.supervisor.spawn("sampler", lambda: sampler.run(stop_event))
        self.supervisor.spawn(
            "telemetry-notify", lambda: self.telemetry.notify_watchers(stop_event)
        )
        preparer = self.preparer
        self.supervisor.spawn("mps-watch", lambda: preparer.watch_mps(stop_event))
        self.supervisor.spawn("publisher", lambda: self.publisher.run(stop_event))
        if preparer.unrecovered():  # tried again while running, with backoff
            self.supervisor.spawn(
                "unrecovered-claims", lambda: follow_unrecovered(preparer, stop_event)
            )
        if self.owner.unknown:  # read at start failed: keep reading, then own the slices
            owner, publisher = self.owner, self.publisher
            self.supervisor.spawn("node-owner", lambda: owner.follow(stop_event, publisher.poke))
        if self.publisher.store.watchable:
            self.supervisor.spawn("slice-watch", lambda: self.publisher.watch_loop(stop_event))
        if self.rediscovery is not None:
            loop = self.rediscovery
            self.supervisor.spawn("rediscovery", lambda: loop.run(stop_event))
        if self.usage_report is not None:
            reporter = self.usage_report
            self.supervisor.spawn("usage-report", lambda: reporter.run(stop_event))
        if self.claim_status is not None:
            writer = self.claim_status
            self.supervisor.spawn("claim-usage-status", lambda: writer.run(stop_event))
        self.http.start()
        host, port = self.http.address
        self.log.info(
            "agent started",
            extra=fields_(
                node=self.source.hostname,
                simulated=self.source.model,
                driver=self.driver_name,
                mode="standalone" if self.kube is None else "kube",
                healthz=f"{'https' if self.http.tls else 'http'}://{host}:{port}/healthz",
                state_dir=str(self.state.path),
            ),
        )

    def _say_if_degraded(self) -> None:
        """One log line when the agent starts on a disk it cannot write (a full or read-only
        state directory or CDI root): it runs, claims already prepared are answered, and every
        claim that needs a write fails saying why until there is room; /readyz's ``disk`` check
        says the same and passes again once there is."""
        disk = dict(self.checks.ready).get("disk")
        ok, problem = disk() if disk is not None else (True, "")
        if not ok:
            self.log.warning(
                "started on a disk that cannot be written",
                extra=fields_(problem=problem, state_dir=str(self.state.path)),
            )

    def stop(self) -> None:
        """Stop in reverse order of start, all of it within ``--shutdown-timeout``.

        Claims being prepared get most of that time to finish (new kubelet calls are refused
        meanwhile); claims still running at the deadline are left to the next start's
        reconcile, and what had not stopped is listed in ``unfinished``. The state directory's
        lock is released last, or with --rolling-update as soon as nothing of ours writes the
        directory or the API any more (the claims answered, the loops stopped, the energy state
        saved), so the agent taking over waits no longer than that; never while something of
        ours is still running (the process then exits with it)."""
        deadline = Deadline(self.settings.shutdown_timeout)
        self.stop_event.set()
        if self.triggers is not None:
            self.triggers.close()
        self.http.stop()
        total = deadline.remaining()
        running = self.preparer.close(total - min(STOP_RESERVE_S, total / 2))
        if running:
            self.log.warning(
                "claims still running at the shutdown deadline; the next start rolls them back",
                extra=fields_(claims=running),
            )
            self.unfinished += [f"claim {c}" for c in running]
        # the sockets go only once every call is answered: the kubelet closes its connection to
        # a plugin whose registration socket is removed, cancelling calls still in flight
        self.plugin.stop(grace=deadline.remaining(1.0))
        # its socket is in the state directory: gone before a successor binds its own there
        self.telemetry.server.stop(grace=deadline.remaining(1.0))
        self.publisher.stop()
        if self.supervisor is not None:
            stuck = self.supervisor.join(deadline)
            if stuck:
                self.log.warning("tasks did not stop in time", extra=fields_(tasks=stuck))
                self.unfinished += stuck
        self.node_events.close()  # the loop flushed what it could; logs what is left
        if self.claim_status is not None:  # its loop stopped: what the last unprepares queued
            self.claim_status.close(deadline.remaining(CLAIM_STATUS_FLUSH_S))
        if self.state.lock.held:  # an agent that never got its state directory has nothing to save
            self.telemetry.save(deadline.remaining(USAGE_SAVE_S))
            if self.usage_report is not None:  # before a handover: the successor reports next
                self.usage_report.final(deadline.remaining(FINAL_REPORT_S))
        if self.settings.rolling_update:
            self.state.release(self.unfinished)  # hand over now
        self.telemetry.close()
        if self.cleanup_on_exit:
            try:
                self.publisher.cleanup()
            except KubeError as exc:
                self.log.error("could not remove ResourceSlices", extra=fields_(error=str(exc)))
        if self.kube is not None:
            self.kube.close()
        self.source.nvml.shutdown()
        self.state.release(self.unfinished)
        self.log.info("agent stopped", extra=fields_(unfinished=self.unfinished))

    def run(self, stop: threading.Event) -> int:
        """Run until ``stop`` is set or a task fails; the exit code (1 when a task failed).
        A start that fails half way still stops what it had started."""
        try:
            self.start(stop)
            while not stop.wait(0.2) and not self.stop_event.is_set():
                pass
        finally:
            self.stop()
        return 1 if self.supervisor and self.supervisor.failures else 0


def _register(readiness: Readiness, checks: Checks) -> None:
    for name, check in checks:
        readiness.add(name, check)
