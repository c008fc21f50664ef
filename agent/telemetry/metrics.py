"""Prometheus metrics: custom collectors on the agent's own registry.

``SnapshotCollector`` serves the sampler's latest ``Snapshot``: nothing on the scrape path reads
NVML or Kubernetes, and one scrape reads one snapshot, so concurrent scrapes are consistent.
Every metric is declared once in ``SPECS`` (name, type, help, labels); ``describe()`` and
``collect()`` both come from that table and docs/metrics.md lists it (a test checks).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.telemetry.snapshot import GpuTelemetry, Snapshot
from agent.usage.counters import Counters, HoldingKey

GPU = ("node", "gpu", "uuid", "pci_bus_id", "model")
MIG = (*GPU, "mig_profile", "gpu_instance")
CLAIM = ("node", "namespace", "claim", "claim_uid", "pool", "device", "rule")
"""A claim's series carry its UID: a claim deleted and made again under the same name is another
series, never a second sample with the first one's labels."""
PREPARED = ("node", "pool", "device", "namespace", "claim", "claim_uid")
NODE = ("node",)

THROTTLE_REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


@dataclass(frozen=True)
class Spec:
    name: str
    """Without ``_total`` for counters (prometheus_client adds it)."""
    kind: str
    """``gauge`` or ``counter``."""
    help: str
    labels: tuple[str, ...]


SPECS: tuple[Spec, ...] = (
    Spec(
        "tessera_gpu_utilization_ratio",
        "gauge",
        "Share of time a kernel ran on the GPU over the last sample period (0-1).",
        GPU,
    ),
    Spec(
        "tessera_gpu_memory_utilization_ratio",
        "gauge",
        "Share of time device memory was read or written (0-1).",
        GPU,
    ),
    Spec("tessera_gpu_memory_used_bytes", "gauge", "Device memory in use.", GPU),
    Spec("tessera_gpu_memory_free_bytes", "gauge", "Device memory free.", GPU),
    Spec(
        "tessera_gpu_memory_reserved_bytes", "gauge", "Device memory reserved by the driver.", GPU
    ),
    Spec("tessera_gpu_power_watts", "gauge", "Power draw.", GPU),
    Spec(
        "tessera_gpu_energy_joules",
        "counter",
        "Energy used; monotonic across driver reloads and agent restarts.",
        GPU,
    ),
    Spec(
        "tessera_gpu_temperature_celsius",
        "gauge",
        "Temperature by sensor (gpu, memory).",
        (*GPU, "sensor"),
    ),
    Spec(
        "tessera_gpu_clock_hertz", "gauge", "Current clock by domain (sm, memory).", (*GPU, "clock")
    ),
    Spec(
        "tessera_gpu_clock_throttle_active",
        "gauge",
        "1 when the clocks are held back for this reason.",
        (*GPU, "reason"),
    ),
    Spec(
        "tessera_gpu_pcie_throughput_bytes_per_second",
        "gauge",
        "PCIe throughput by direction (tx, rx).",
        (*GPU, "direction"),
    ),
    Spec(
        "tessera_gpu_pcie_replays",
        "counter",
        "PCIe replays (the driver's counter; resets on driver reload).",
        GPU,
    ),
    Spec(
        "tessera_gpu_nvlink_bytes",
        "counter",
        "NVLink data bytes by direction, all links (the driver's counter).",
        (*GPU, "direction"),
    ),
    Spec(
        "tessera_gpu_ecc_errors",
        "counter",
        "ECC errors by type (corrected, uncorrected).",
        (*GPU, "type"),
    ),
    Spec(
        "tessera_gpu_remapped_rows",
        "counter",
        "Memory rows remapped by type (correctable, uncorrectable).",
        (*GPU, "type"),
    ),
    Spec(
        "tessera_gpu_row_remap_pending", "gauge", "1 when a row remap waits for a GPU reset.", GPU
    ),
    Spec(
        "tessera_gpu_xid_errors",
        "counter",
        "XID errors seen since the agent started, by XID.",
        (*GPU, "xid"),
    ),
    Spec(
        "tessera_gpu_healthy",
        "gauge",
        "1 when the GPU is healthy: not lost, no fatal XID since a recovery.",
        GPU,
    ),
    Spec("tessera_gpu_processes", "gauge", "Compute processes running on the GPU.", GPU),
    Spec("tessera_mig_memory_used_bytes", "gauge", "Memory in use on a MIG device.", MIG),
    Spec("tessera_mig_memory_total_bytes", "gauge", "Memory of a MIG device.", MIG),
    Spec(
        "tessera_mig_utilization_ratio",
        "gauge",
        "SM utilization of a MIG device (Hopper+, GPM) (0-1).",
        MIG,
    ),
    Spec(
        "tessera_claim_energy_joules",
        "counter",
        "Energy attributed to a claim's device (rule label: how its share is found; fixed while"
        " the claim holds the device).",
        CLAIM,
    ),
    Spec(
        "tessera_claim_gpu_seconds",
        "counter",
        "GPU-seconds attributed to a claim's device (a whole GPU for 1 s = 1).",
        CLAIM,
    ),
    Spec(
        "tessera_claim_share_ratio",
        "gauge",
        "Fraction of its GPU's energy and time a claim's device got over the latest interval"
        " (0-1; absent once released).",
        CLAIM,
    ),
    Spec(
        "tessera_usage_allocated_gpu_seconds",
        "counter",
        "Seconds a claim's device was held x the share of the physical GPU it holds (rule label:"
        " whole-gpu, mig-slices, memory-share or time-sliced; docs/budgets.md). Durable: kept in"
        " the state directory's usage ledger, counted once across restarts and crashes.",
        CLAIM,
    ),
    Spec(
        "tessera_usage_busy_gpu_seconds",
        "counter",
        "Seconds x the GPUs' worth a claim's device kept busy (utilization-integrated).",
        CLAIM,
    ),
    Spec(
        "tessera_usage_unobserved_seconds",
        "counter",
        "Seconds a claim's device was held while its busy time could not be measured (the agent"
        " was down, or no utilization was read): what tessera_usage_busy_gpu_seconds may lack.",
        CLAIM,
    ),
    Spec(
        "tessera_usage_accounted_through_timestamp_seconds",
        "gauge",
        "Unix time up to which the usage ledger has counted (written to disk): behind the clock"
        " by more than a few intervals means accounting has stalled.",
        NODE,
    ),
    Spec(
        "tessera_device_prepared",
        "gauge",
        "1 for every device prepared for a claim on this node.",
        PREPARED,
    ),
    Spec(
        "tessera_sampler_tick_duration_seconds",
        "gauge",
        "How long the last sampling tick's reads took.",
        NODE,
    ),
    Spec(
        "tessera_sampler_lag_seconds",
        "gauge",
        "How late the last tick started against its schedule.",
        NODE,
    ),
    Spec(
        "tessera_sampler_last_tick_timestamp_seconds", "gauge", "Unix time of the last tick.", NODE
    ),
    Spec("tessera_sampler_ticks", "counter", "Sampling ticks since the agent started.", NODE),
)
BY_NAME = {s.name: s for s in SPECS}


def _family(spec: Spec) -> Metric:
    if spec.kind == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


Usage = Callable[[], tuple[Mapping[HoldingKey, Counters], float | None]]
"""The usage ledger's counters now and the second they are on disk up to (read per scrape)."""


class SnapshotCollector(Collector):
    """Serves the latest snapshot; ``latest`` must be a cheap, non-blocking read. ``usage``: the
    usage counters, read at each scrape (they are not in the per-tick snapshot)."""

    def __init__(self, latest: Callable[[], Snapshot | None], usage: Usage | None = None) -> None:
        self.latest = latest
        self.usage = usage

    def describe(self) -> Iterator[Metric]:
        for spec in SPECS:
            yield _family(spec)

    def collect(self) -> Iterator[Metric]:
        snap = self.latest()  # one snapshot per scrape: consistent under concurrent scrapes
        families = {s.name: _family(s) for s in SPECS}
        if snap is not None:
            _fill(families, snap)
            if self.usage is not None:
                _usage(families, snap.node, *self.usage())
        yield from families.values()


def _usage(
    families: dict[str, Metric],
    node: str,
    counters: Mapping[HoldingKey, Counters],
    through: float | None,
) -> None:
    for key, u in sorted(counters.items()):
        labels = (node, u.namespace, u.claim, *key, u.rule)
        _add(families, "tessera_usage_allocated_gpu_seconds", labels, u.allocated_gpu_seconds)
        _add(families, "tessera_usage_busy_gpu_seconds", labels, u.busy_gpu_seconds)
        _add(families, "tessera_usage_unobserved_seconds", labels, u.unobserved_seconds)
    _add(families, "tessera_usage_accounted_through_timestamp_seconds", (node,), through)


def _add(
    families: dict[str, Metric], name: str, labels: Iterable[str], value: float | None
) -> None:
    if value is None:
        return  # absent, not zero
    fam = families[name]
    assert isinstance(fam, GaugeMetricFamily | CounterMetricFamily)
    fam.add_metric(list(labels), float(value))


def _gpu(families: dict[str, Metric], node: str, g: GpuTelemetry) -> None:
    s = g.sample
    base = (node, str(s.index), s.uuid, g.pci_bus_id, g.name)

    def put(name: str, value: float | None, *extra: str) -> None:
        _add(families, name, (*base, *extra), value)

    put("tessera_gpu_healthy", 1.0 if g.healthy else 0.0)
    put("tessera_gpu_energy_joules", g.energy_joules_total)
    for xid, count in g.xid_counts:
        put("tessera_gpu_xid_errors", count, str(xid))
    if s.lost:
        return
    put("tessera_gpu_utilization_ratio", s.utilization_gpu)
    put("tessera_gpu_memory_utilization_ratio", s.utilization_memory)
    put("tessera_gpu_memory_used_bytes", s.memory_used_bytes)
    put("tessera_gpu_memory_free_bytes", s.memory_free_bytes)
    put("tessera_gpu_memory_reserved_bytes", s.memory_reserved_bytes)
    put("tessera_gpu_power_watts", s.power_watts)
    put("tessera_gpu_temperature_celsius", s.temperature_gpu_celsius, "gpu")
    put("tessera_gpu_temperature_celsius", s.temperature_memory_celsius, "memory")
    put("tessera_gpu_clock_hertz", s.clock_sm_hertz, "sm")
    put("tessera_gpu_clock_hertz", s.clock_memory_hertz, "memory")
    if s.throttle_reasons is not None:
        for reason, bit in THROTTLE_REASONS.items():
            put(
                "tessera_gpu_clock_throttle_active",
                1.0 if s.throttle_reasons & bit else 0.0,
                reason,
            )
    put("tessera_gpu_pcie_throughput_bytes_per_second", s.pcie_tx_bytes_per_second, "tx")
    put("tessera_gpu_pcie_throughput_bytes_per_second", s.pcie_rx_bytes_per_second, "rx")
    put("tessera_gpu_pcie_replays", s.pcie_replays)
    put("tessera_gpu_nvlink_bytes", s.nvlink_tx_bytes, "tx")
    put("tessera_gpu_nvlink_bytes", s.nvlink_rx_bytes, "rx")
    put("tessera_gpu_ecc_errors", s.ecc_corrected, "corrected")
    put("tessera_gpu_ecc_errors", s.ecc_uncorrected, "uncorrected")
    put("tessera_gpu_remapped_rows", s.remapped_rows_correctable, "correctable")
    put("tessera_gpu_remapped_rows", s.remapped_rows_uncorrectable, "uncorrectable")
    if s.remap_pending is not None:
        put("tessera_gpu_row_remap_pending", 1.0 if s.remap_pending else 0.0)
    put("tessera_gpu_processes", len(s.processes))
    profiles = dict(g.mig_profiles)
    for m in s.mig:
        labels = (*base, profiles.get(m.gpu_instance_id, "unknown"), str(m.gpu_instance_id))
        _add(families, "tessera_mig_memory_used_bytes", labels, m.memory_used_bytes)
        _add(families, "tessera_mig_memory_total_bytes", labels, m.memory_total_bytes)
        _add(families, "tessera_mig_utilization_ratio", labels, m.utilization)


def _fill(families: dict[str, Metric], snap: Snapshot) -> None:
    node = snap.node
    for g in snap.gpus:
        _gpu(families, node, g)
    for c in snap.claims:
        labels = (node, c.namespace, c.claim, c.uid, c.pool, c.device, c.rule)
        _add(families, "tessera_claim_energy_joules", labels, c.energy_joules_total)
        _add(families, "tessera_claim_gpu_seconds", labels, c.gpu_seconds_total)
        _add(families, "tessera_claim_share_ratio", labels, c.share)
    for p in snap.prepared:
        _add(
            families,
            "tessera_device_prepared",
            (node, p.pool, p.device, p.namespace, p.claim, p.uid),
            1,
        )
    _add(families, "tessera_sampler_tick_duration_seconds", (node,), snap.tick_duration_seconds)
    _add(families, "tessera_sampler_lag_seconds", (node,), snap.lag_seconds)
    _add(families, "tessera_sampler_last_tick_timestamp_seconds", (node,), snap.wall_time)
    _add(families, "tessera_sampler_ticks", (node,), snap.tick)


class DriverMetrics:
    """The driver's own instruments (prepare latency and errors, publishing, registration)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.prepare_duration = Histogram(
            "tessera_prepare_duration_seconds",
            "Time to prepare or unprepare one claim, by operation.",
            ["operation"],
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 45),
        )
        self.prepare_errors = Counter(
            "tessera_prepare_errors",
            "Claims that failed to prepare or unprepare, by operation and reason.",
            ["operation", "reason"],
            registry=registry,
        )

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
            yield _family(spec)

    def collect(self) -> Iterator[Metric]:
        st = self.status()
        fams = {s.name: _family(s) for s in AGENT_SPECS}
        node = (st.node,)
        if st.kubelet_registered is not None:
            _add(fams, "tessera_kubelet_registered", node, 1.0 if st.kubelet_registered else 0.0)
        _add(fams, "tessera_resourceslice_pool_generation", node, st.slice_generation)
        _add(fams, "tessera_resourceslice_writes", node, st.slice_writes)
        _add(fams, "tessera_resourceslice_errors", node, st.slice_errors)
        _add(fams, "tessera_claims_stuck", node, st.claims_stuck)
        _add(fams, "tessera_claims_unrecovered", node, st.claims_unrecovered)
        if st.usage_report_last_success is not None:
            _add(
                fams,
                "tessera_usage_report_last_success_timestamp_seconds",
                node,
                st.usage_report_last_success,
            )
        if st.usage_report_errors is not None:
            _add(fams, "tessera_usage_report_errors", node, st.usage_report_errors)
        if st.claim_usage_status_errors is not None:
            _add(fams, "tessera_claim_usage_status_errors", node, st.claim_usage_status_errors)
        for outcome, count in st.node_events:
            _add(fams, "tessera_node_events", (*node, outcome), count)
        yield from fams.values()


class Exposition:
    """Renders the registry once per state and serves those bytes until the state moves.

    ``key`` must change whenever any collector's output would: the snapshot's tick, the driver
    metrics' version and the agent status together. Scrapes between two samples (and 20
    scrapers at once) then cost a lookup, not a render."""

    def __init__(self, registry: CollectorRegistry, key: Callable[[], object]) -> None:
        self.registry = registry
        self._key = key
        self._lock = threading.Lock()
        self._cached: tuple[object, bytes] | None = None

    def __call__(self) -> tuple[bytes, str]:
        k = self._key()
        with self._lock:
            if self._cached is not None and self._cached[0] == k:
                return self._cached[1], CONTENT_TYPE_LATEST
        body = generate_latest(self.registry)
        with self._lock:
            self._cached = (k, body)
        return body, CONTENT_TYPE_LATEST
