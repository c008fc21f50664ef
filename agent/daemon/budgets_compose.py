"""The budget controller's composition root (``tessera budgets``): the only place that builds its
object graph, from its settings (:class:`~agent.config.BudgetsSettings`), in one pass. The agent's
root (:mod:`agent.daemon.compose`) is separate: the controller shares no part with it but the
Kubernetes client, the HTTP endpoint and the logs.

:class:`BudgetsProcess` runs it: serve /metrics, /healthz and /readyz, run the controller loop
until ``stop`` is set (SIGTERM), release the Lease, stop serving.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from agent.config import BudgetsSettings
from agent.errors import ConfigError
from agent.http import HttpEndpoint, Readiness
from agent.logs import fields_
from agent.usage.budget_plan import plan
from dra_driver.budgets.budget_metrics import BudgetMetrics
from dra_driver.budgets.controller import BudgetController, ControllerSettings
from dra_driver.budgets.view import PricesRef
from dra_driver.cluster.kube import KubeClient
from dra_driver.cluster.lease import LeaseElector, LeaseTiming

LIVENESS_INTERVALS = 3
"""/healthz fails once the loop has not run for this many of its longest waits."""


def identity(settings: BudgetsSettings) -> str:
    """The Lease's holderIdentity: --identity (or $POD_NAME, or the host name) and a random
    suffix, as client-go's callers do (``<hostname>_<uuid>``): a replica restarted under the same
    pod name is a new holder, so it never mistakes its former self's lease for its own."""
    base = settings.identity or socket.gethostname()
    return f"{base}_{secrets.token_hex(4)}"


def lease_timing(settings: BudgetsSettings) -> LeaseTiming:
    """The Lease's timing; a ConfigError naming the flags when it cannot work."""
    try:
        return LeaseTiming(
            duration_s=settings.lease_duration,
            renew_period_s=settings.lease_renew_period,
            retry_period_s=settings.lease_retry_period,
            renew_deadline_s=settings.lease_duration * 2 / 3,
        )
    except ValueError as exc:
        raise ConfigError(
            f"--lease-duration {settings.lease_duration:g}, --lease-renew-period"
            f" {settings.lease_renew_period:g}: {exc} (the renew deadline is two thirds of the"
            " duration)"
        ) from exc


@dataclass
class BudgetsProcess:
    controller: BudgetController
    http: HttpEndpoint
    kube: KubeClient
    log: logging.Logger

    def run(self, stop: threading.Event) -> int:
        self.http.start()
        self.log.info(
            "budget controller starting",
            extra=fields_(
                identity=self.controller.elector.identity,
                lease=self.controller.elector.path,
                reconcile_interval_s=self.controller.settings.reconcile_interval_s,
            ),
        )
        try:
            self.controller.run(stop)
        finally:
            self.http.stop()
            self.kube.close()
        return 0


def build_budgets(settings: BudgetsSettings, log: logging.Logger) -> BudgetsProcess:
    """The controller's object graph (nothing below the CLI reads ``os.environ``: the settings
    carry what the environment said)."""
    timing = lease_timing(settings)
    kube = KubeClient.from_config(
        settings.kubeconfig,
        hint="run it in a pod (the in-cluster service account), or pass --kubeconfig FILE",
    )
    elector = LeaseElector(
        kube,
        settings.namespace,
        settings.lease_name,
        identity(settings),
        timing,
        clock=time.time,
        monotonic=time.monotonic,
    )
    metrics = BudgetMetrics()
    controller = BudgetController(
        kube,
        elector,
        plan,
        metrics,
        ControllerSettings(
            prices=PricesRef(settings.namespace, settings.prices_configmap),
            reconcile_interval_s=settings.reconcile_interval,
        ),
        log.getChild("budgets"),
        clock=time.time,
        monotonic=time.monotonic,
    )
    readiness, liveness = Readiness(), Readiness()
    readiness.add("api-server", controller.ready)
    longest = max(timing.retry_period_s, timing.renew_period_s, settings.reconcile_interval)
    liveness.add("loop", lambda: controller.alive(LIVENESS_INTERVALS * longest + 60.0))
    host, port = settings.host_port()
    http = HttpEndpoint(
        host,
        port,
        readiness,
        metrics=metrics.exposition,
        liveness=liveness,
        log=log.getChild("http"),
    )
    return BudgetsProcess(controller, http, kube, log)
