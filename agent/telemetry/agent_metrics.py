"""Prometheus metrics of the agent's own state and the driver's instruments.

``AgentCollector`` serves an ``AgentStatus`` read at each scrape (kubelet registration,
ResourceSlice publishing, stuck and unrecovered claims, prepared devices gone, usage reports,
Node events), declared once in ``AGENT_SPECS`` like the telemetry's ``SPECS`` (docs/metrics.md
lists both; a test checks). ``DriverMetrics`` holds the prepare latency and error instruments.
The GPU, claim and sampler metrics of a snapshot are ``metrics.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from agent.nocreated import WithoutCreated
from agent.telemetry.metrics import NODE, Spec, add_sample, family


class DriverMetrics:
    """The driver's own instruments (prepare latency and errors, publishing, registration)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        """The instruments are served through ``registry`` without ``_created`` series
        (``agent.nocreated``)."""
        instruments = CollectorRegistry(auto_describe=True)
        self.prepare_duration = Histogram(
            "tessera_prepare_duration_seconds",
            "Time to prepare or unprepare one claim, by operation.",
            ["operation"],
            registry=instruments,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 45),
        )
        self.prepare_errors = Counter(
            "tessera_prepare_errors",
            "Claims that failed to prepare or unprepare, by operation and reason.",
            ["operation", "reason"],
            registry=instruments,
        )
        registry.register(WithoutCreated(instruments))

        self._changes = itertools.count(1)
        self.version = 0
        """Moves on every observation (part of the exposition cache key)."""

    def observe(self, operation: str, seconds: float, reason: str | None) -> None:
        self.prepare_duration.labels(operation).observe(seconds)
        if reason is not None:
            self.prepare_errors.labels(operation, reason).inc()
        self.version = next(self._changes)


@dataclass(frozen=True)
class AgentStatus:
    node: str
    kubelet_registered: bool | None
    """None in standalone mode."""
    slice_generation: int | None
    slice_writes: int
    slice_errors: int
    claims_stuck: int = 0
    """Prepares and unprepares running longer than the kubelet's call deadline."""
    node_events: tuple[tuple[str, int], ...] = ()
    """Node events by outcome (recorded, filtered, dropped, failed)."""
    claims_unrecovered: int = 0
    """Claims held from a lost or corrupt checkpoint that could not be rebuilt."""
    usage_report_last_success: float | None = None
    """Unix time of the last GpuUsageReport the API server accepted (None: none yet)."""
    usage_report_errors: int | None = None
    """Failed GpuUsageReport writes (None in standalone mode: no reports)."""
    claim_usage_status_errors: int | None = None
    """Unprepared claims whose usage summary could not be written into their status (None in
    standalone mode)."""
    prepared_devices_gone: int = 0
    """Devices of prepared claims that the node no longer has (agent/daemon/gone_claims.py)."""


AGENT_SPECS: tuple[Spec, ...] = (
    Spec(
        "tessera_kubelet_registered",
        "gauge",
        "1 once the kubelet accepted the plugin (absent in standalone mode).",
        NODE,
    ),
    Spec(
        "tessera_resourceslice_pool_generation",
        "gauge",
        "Generation of the published ResourceSlice pool.",
        NODE,
    ),
    Spec(
        "tessera_resourceslice_writes",
        "counter",
        "ResourceSlice creates, updates and deletes.",
        NODE,
    ),
    Spec(
        "tessera_resourceslice_errors", "counter", "Failed ResourceSlice publishing rounds.", NODE
    ),
    Spec(
        "tessera_claims_stuck",
        "gauge",
        "Prepares and unprepares still running past the kubelet's call deadline (a stuck"
        " worker: a claim read or side effect that does not return).",
        NODE,
    ),
    Spec(
        "tessera_claims_unrecovered",
        "gauge",
        "Claims whose CDI spec survived a lost or corrupt checkpoint but whose prepared state"
        " could not be rebuilt: their devices stay held until the kubelet unprepares or"
        " prepares them (/readyz check unrecovered-claims names them).",
        NODE,
    ),
    Spec(
        "tessera_prepared_devices_gone",
        "gauge",
        "Devices of prepared claims that the node no longer has (their GPU lost or replaced,"
        " another node model, a MIG device an administrator removed): kept until the kubelet"
        " unprepares their claims, with no usage attributed to them (/readyz check gone-devices"
        " names them).",
        NODE,
    ),
    Spec(
        "tessera_usage_report_last_success_timestamp_seconds",
        "gauge",
        "Unix time of the last GpuUsageReport the API server accepted (absent until one was, and"
        " in standalone mode).",
        NODE,
    ),
    Spec(
        "tessera_usage_report_errors",
        "counter",
        "GpuUsageReport writes that failed (absent in standalone mode).",
        NODE,
    ),
    Spec(
        "tessera_claim_usage_status_errors",
        "counter",
        "Unprepared claims whose usage summary could not be written into their ResourceClaim's"
        " status.devices (refused, no answer, queue full, dropped at shutdown; absent in"
        " standalone mode).",
        NODE,
    ),
    Spec(
        "tessera_node_events",
        "counter",
        "Events about the Node (GPU health changes) by outcome: recorded (written, or logged in"
        " standalone mode), filtered (spam filter), dropped (queue full), failed (API server).",
        (*NODE, "outcome"),
    ),
)


class AgentCollector(Collector):
    def __init__(self, status: Callable[[], AgentStatus]) -> None:
        self.status = status

    def describe(self) -> Iterator[Metric]:
        for spec in AGENT_SPECS:
            yield family(spec)

    def collect(self) -> Iterator[Metric]:
        st = self.status()
        fams = {s.name: family(s) for s in AGENT_SPECS}
        node = (st.node,)
        if st.kubelet_registered is not None:
            add_sample(
                fams, "tessera_kubelet_registered", node, 1.0 if st.kubelet_registered else 0.0
            )
        add_sample(fams, "tessera_resourceslice_pool_generation", node, st.slice_generation)
        add_sample(fams, "tessera_resourceslice_writes", node, st.slice_writes)
        add_sample(fams, "tessera_resourceslice_errors", node, st.slice_errors)
        add_sample(fams, "tessera_claims_stuck", node, st.claims_stuck)
        add_sample(fams, "tessera_claims_unrecovered", node, st.claims_unrecovered)
        add_sample(fams, "tessera_prepared_devices_gone", node, st.prepared_devices_gone)
        if st.usage_report_last_success is not None:
            add_sample(
                fams,
                "tessera_usage_report_last_success_timestamp_seconds",
                node,
                st.usage_report_last_success,
            )
        if st.usage_report_errors is not None:
            add_sample(fams, "tessera_usage_report_errors", node, st.usage_report_errors)
        if st.claim_usage_status_errors is not None:
            add_sample(
                fams, "tessera_claim_usage_status_errors", node, st.claim_usage_status_errors
            )
        for outcome, count in st.node_events:
            add_sample(fams, "tessera_node_events", (*node, outcome), count)
        yield from fams.values()
