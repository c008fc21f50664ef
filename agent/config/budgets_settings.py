"""The settings of the budget controller (``tessera budgets``, docs/budgets.md "The controller";
issue 22's contract, section 5). A command's own options, not part of the agent's ``Config``: the
controller runs in its own Deployment, and its ``--metrics-address`` has its own default."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.config.converters import dns_subdomain, host_port, parse_host_port, seconds
from agent.config.declare import setting


@dataclass(frozen=True, kw_only=True)
class BudgetsSettings:
    """``tessera budgets``: the API server, the Lease, the reconcile, the endpoint, the logs."""

    kubeconfig: Path | None = setting(
        None,
        "kubeconfig file for the API server. Unset: the in-cluster service account.",
        metavar="FILE",
    )
    namespace: str = setting(
        "tessera-system",
        "The namespace of the Lease and of the price ConfigMap (the controller's own).",
        parse=dns_subdomain,
    )
    lease_name: str = setting(
        "tessera-budgets",
        "The coordination.k8s.io Lease the replicas elect their leader on.",
        parse=dns_subdomain,
    )
    identity: str | None = setting(
        None,
        "This replica's name in the Lease (holderIdentity), before a random suffix that keeps"
        " a restarted replica apart from its former self. Unset: $POD_NAME (the Deployment sets"
        " it from the downward API), else the host name.",
        extra_env=("POD_NAME",),
    )
    lease_duration: float = setting(
        15.0,
        "Seconds a silent leader's Lease lasts before another replica may take it over"
        " (leaseDurationSeconds, whole seconds). The leader stops writing two thirds of it after"
        " its last renewal.",
        metavar="SECONDS",
        parse=seconds,
    )
    lease_renew_period: float = setting(
        5.0,
        "Seconds between the leader's renewals of the Lease (below two thirds of"
        " --lease-duration).",
        metavar="SECONDS",
        parse=seconds,
    )
    lease_retry_period: float = setting(
        2.0,
        "Seconds between a standby replica's tries to take the Lease.",
        metavar="SECONDS",
        parse=seconds,
    )
    reconcile_interval: float = setting(
        30.0,
        "Seconds between the leader's reconciles (fold the reports, write summaries, budgets'"
        " status, Events, evictions).",
        metavar="SECONDS",
        parse=seconds,
    )
    metrics_address: str = setting(
        "0.0.0.0:9410",
        "host:port of the HTTP endpoint serving /metrics, /healthz and /readyz.",
        metavar="HOST:PORT",
        parse=host_port,
        listen=True,
    )
    prices_configmap: str = setting(
        "tessera-prices",
        "The ConfigMap (in --namespace) whose key prices.yaml holds the price table"
        " (docs/budgets.md). Absent: no costs (cost limits are not evaluated).",
        parse=dns_subdomain,
    )
    log_format: str = setting(
        "json",
        "Log line format: json (one object per line) or text.",
        choices=("json", "text"),
    )
    log_level: str = setting(
        "info",
        "Lowest log level written.",
        choices=("debug", "info", "warning", "error"),
    )

    def host_port(self) -> tuple[str, int]:
        return parse_host_port("metrics-address", self.metrics_address)
