"""The checks behind /readyz and /healthz for the parts whose own modules do not offer them:
the claims (prepare), the kubelet's and the telemetry API's sockets. Each part's checks are a
list of ``(name, check)``, as :meth:`Publisher.readiness_checks` and
:meth:`Sampler.readiness_checks` give theirs; the composition root hands them to the agent,
which registers them with the HTTP endpoint's :class:`Readiness` when it starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent.fsutil import disk_trouble
from agent.telemetry.stream import TelemetryServer
from dra_driver.kubeletplugin.prepare import Preparer
from dra_driver.kubeletplugin.server import PluginServer

Check = Callable[[], tuple[bool, str]]
Checks = list[tuple[str, Check]]


@dataclass(frozen=True)
class AgentChecks:
    """Every check of the agent, by when it applies."""

    handover: Checks
    """/readyz while a --rolling-update agent waits for the state directory."""
    ready: Checks
    """/readyz once the agent runs (a check named as a handover one takes its place)."""
    live: Checks
    """/healthz once the agent runs: what a restart repairs (the kubelet restarts the container
    when it fails)."""


class ClaimChecks:
    """Whether claims are prepared and unprepared: none stuck, the disk writable, every prepared
    claim accounted for."""

    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    def readiness_checks(self) -> Checks:
        return [
            ("claims", self.claims_moving),
            ("disk", self.disk_writable),
            ("unrecovered-claims", self.claims_accounted_for),
            ("mps-daemons", self.mps_daemons_running),
        ]

    def claims_moving(self) -> tuple[bool, str]:
        """Not ready while a prepare or unprepare is stuck past the kubelet's deadline."""
        stuck = self.preparer.stuck()
        return (not stuck, f"stuck past the deadline: {'; '.join(stuck)}" if stuck else "moving")

    def disk_writable(self) -> tuple[bool, str]:
        """Not ready while the checkpoint or a CDI spec cannot be written (a read-only or full
        disk): every prepare and unprepare fails until the disk is fixed, which a restart does
        not do (so /healthz passes). The check follows the disk: ready again once there is room."""
        checkpoint = self.preparer.store.path
        try:
            size = checkpoint.stat().st_size
        except OSError:
            size = 0
        problems = [
            p
            for p in (
                disk_trouble(checkpoint.parent, size),
                disk_trouble(self.preparer.cdi.cdi_root),
            )
            if p is not None
        ]
        if not problems:
            return True, "writable"
        return False, "; ".join(problems) + ": claims that need a write there fail"

    def claims_accounted_for(self) -> tuple[bool, str]:
        """Passes, naming the claims a lost checkpoint could not be rebuilt for (their devices
        stay held; the kubelet can still unprepare them): an operator's problem, not one a
        restart or taking the agent out of service would repair (docs/reliability.md)."""
        lost = self.preparer.unrecovered()
        if not lost:
            return True, "every prepared claim is accounted for"
        return True, f"{len(lost)} held but not rebuilt: {'; '.join(str(u) for u in lost)}"

    def mps_daemons_running(self) -> tuple[bool, str]:
        """Not ready while a prepared claim's MPS daemon is gone and could not be started again
        (its containers cannot use the GPU): the watch loop retries, and the check follows."""
        failing = self.preparer.failing_mps()
        if not failing:
            return True, "every prepared claim's MPS daemon runs"
        return False, f"gone and not started again: {'; '.join(failing)}"


class SocketChecks:
    """The kubelet's registration (kube mode) and the sockets its clients reach us by."""

    def __init__(self, plugin: PluginServer, telemetry: TelemetryServer, standalone: bool) -> None:
        self.plugin = plugin
        self.telemetry = telemetry
        self.standalone = standalone

    def handover_checks(self) -> Checks:
        """While waiting for the state directory only the kubelet plugin serves."""
        return [("kubelet", self.registered), ("sockets", self.plugin.sockets_intact)]

    def readiness_checks(self) -> Checks:
        return [("sockets", self.sockets_intact), ("kubelet", self.registered)]

    def liveness_checks(self) -> Checks:
        return [("sockets", self.sockets_intact)]

    def registered(self) -> tuple[bool, str]:
        """Ready only once the kubelet has registered us (kube mode)."""
        if self.standalone:
            return True, "standalone mode"
        if self.plugin.registered:
            return True, "registered"
        return False, f"not registered ({self.plugin.registration_error or 'waiting for kubelet'})"

    def sockets_intact(self) -> tuple[bool, str]:
        """Ready only while the kubelet and telemetry clients can still reach our sockets."""
        results = (self.plugin.sockets_intact(), self.telemetry.socket_intact())
        problems = [detail for ok, detail in results if not ok]
        return (not problems, "; ".join(problems) or "serving")
