"""Prometheus metrics: custom collectors on the agent's own registry.

``SnapshotCollector`` serves the sampler's latest ``Snapshot``: nothing on the scrape path reads
NVML or Kubernetes, and one scrape reads one snapshot, so concurrent scrapes are consistent.
Every metric is declared once in ``SPECS`` (name, type, help, labels); ``describe()`` and
``collect()`` both come from that table and docs/metrics.md lists it (a test checks).
``Exposition`` renders the whole registry; the agent's own state and the driver's instruments
are ``agent_metrics.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.telemetry.snapshot import GpuTelemetry, Snapshot
from agent.usage.counters import Counters, HoldingKey

GPU = ("node", "gpu", "uuid", "pci_bus_id", "model")
"""``gpu`` is the GPU's minor number (its device name's ``gpu-<minor>``), not NVML's index: the
index shifts when a GPU before it is removed, and a series must keep its labels for as long as
it is the same GPU (docs/metrics.md, "GPU identity")."""
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
    Spec(
        "tessera_gpu_passthrough",
        "gauge",
        "1 when the GPU is handed to virtual machines (bound to vfio-pci, or to no driver): the"
        " host cannot read it, and it has no other GPU series; 0 when the host reads it.",
        GPU,
    ),
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


def family(spec: Spec) -> Metric:
    """The empty metric family ``spec`` declares, for a collector to fill."""
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
            yield family(spec)

    def collect(self) -> Iterator[Metric]:
        snap = self.latest()  # one snapshot per scrape: consistent under concurrent scrapes
        families = {s.name: family(s) for s in SPECS}
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
        add_sample(families, "tessera_usage_allocated_gpu_seconds", labels, u.allocated_gpu_seconds)
        add_sample(families, "tessera_usage_busy_gpu_seconds", labels, u.busy_gpu_seconds)
        add_sample(families, "tessera_usage_unobserved_seconds", labels, u.unobserved_seconds)
    add_sample(families, "tessera_usage_accounted_through_timestamp_seconds", (node,), through)


def add_sample(
    families: dict[str, Metric], name: str, labels: Iterable[str], value: float | None
) -> None:
    """One sample of family ``name``; none where ``value`` is None (absent, not zero)."""
    if value is None:
        return  # absent, not zero
    fam = families[name]
    assert isinstance(fam, GaugeMetricFamily | CounterMetricFamily)
    fam.add_metric(list(labels), float(value))


def _gpu(families: dict[str, Metric], node: str, g: GpuTelemetry) -> None:
    s = g.sample
    base = (node, str(g.minor), s.uuid, g.pci_bus_id, g.name)

    def put(name: str, value: float | None, *extra: str) -> None:
        add_sample(families, name, (*base, *extra), value)

    put("tessera_gpu_passthrough", 0.0)
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
        add_sample(families, "tessera_mig_memory_used_bytes", labels, m.memory_used_bytes)
        add_sample(families, "tessera_mig_memory_total_bytes", labels, m.memory_total_bytes)
        add_sample(families, "tessera_mig_utilization_ratio", labels, m.utilization)


def _fill(families: dict[str, Metric], snap: Snapshot) -> None:
    node = snap.node
    for g in snap.gpus:
        _gpu(families, node, g)
    for vm in snap.passthrough:  # nothing else: the host reads nothing from it
        identity = (node, str(vm.minor), vm.uuid, vm.pci_bus_id, vm.name)
        add_sample(families, "tessera_gpu_passthrough", identity, 1)
    for c in snap.claims:
        labels = (node, c.namespace, c.claim, c.uid, c.pool, c.device, c.rule)
        add_sample(families, "tessera_claim_energy_joules", labels, c.energy_joules_total)
        add_sample(families, "tessera_claim_gpu_seconds", labels, c.gpu_seconds_total)
        add_sample(families, "tessera_claim_share_ratio", labels, c.share)
    for p in snap.prepared:
        add_sample(
            families,
            "tessera_device_prepared",
            (node, p.pool, p.device, p.namespace, p.claim, p.uid),
            1,
        )
    add_sample(
        families, "tessera_sampler_tick_duration_seconds", (node,), snap.tick_duration_seconds
    )
    add_sample(families, "tessera_sampler_lag_seconds", (node,), snap.lag_seconds)
    add_sample(families, "tessera_sampler_last_tick_timestamp_seconds", (node,), snap.wall_time)
    add_sample(families, "tessera_sampler_ticks", (node,), snap.tick)


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
