"""The Prometheus exposition: conventions, absent-not-zero, consistency, documentation."""

from __future__ import annotations

import re
import threading
from dataclasses import replace
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.telemetry.agent_metrics import AGENT_SPECS, AgentCollector, AgentStatus, DriverMetrics
from agent.telemetry.metrics import SPECS, SnapshotCollector
from tests.telemetry.snapshots import make_snapshot

ROOT = Path(__file__).resolve().parents[2]
UNIT_SUFFIXES = (
    "_ratio", "_bytes", "_watts", "_joules", "_celsius", "_hertz", "_seconds",
    "_bytes_per_second", "_timestamp_seconds",
)  # fmt: skip
UNITLESS = {
    "tessera_gpu_clock_throttle_active", "tessera_gpu_pcie_replays", "tessera_gpu_ecc_errors",
    "tessera_gpu_remapped_rows", "tessera_gpu_row_remap_pending", "tessera_gpu_xid_errors",
    "tessera_gpu_healthy", "tessera_gpu_processes", "tessera_device_prepared",
    "tessera_sampler_ticks", "tessera_kubelet_registered", "tessera_resourceslice_pool_generation",
    "tessera_resourceslice_writes", "tessera_resourceslice_errors", "tessera_prepare_errors",
    "tessera_claims_stuck", "tessera_claims_unrecovered", "tessera_node_events",
    "tessera_usage_report_errors", "tessera_prepared_devices_gone",
    "tessera_claim_usage_status_errors", "tessera_gpu_passthrough",
}  # fmt: skip
UNIT_WORDS = ("bytes", "watts", "joules", "celsius", "hertz", "seconds", "ratio")


def registry(snapshot_fn, status=None) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(snapshot_fn))
    reg.register(AgentCollector(status or (lambda: AgentStatus("node-a", True, 3, 7, 1))))
    m = DriverMetrics(reg)
    m.observe("prepare", 0.004, None)
    m.observe("prepare", 0.010, "device_busy")
    return reg


def exposition(reg) -> str:
    return generate_latest(reg).decode()


def test_the_usage_reports_are_exported_in_kube_mode_only():
    status = AgentStatus("node-a", True, 3, 7, 1, usage_report_last_success=1.5e9,
                         usage_report_errors=2)  # fmt: skip
    text = exposition(registry(lambda: make_snapshot(tick=3), lambda: status))
    assert 'tessera_usage_report_last_success_timestamp_seconds{node="node-a"} 1.5e+09' in text
    assert 'tessera_usage_report_errors_total{node="node-a"} 2.0' in text
    standalone = exposition(registry(lambda: make_snapshot(tick=3)))
    assert "tessera_usage_report_errors_total{" not in standalone
    assert "tessera_claim_usage_status_errors_total{" not in standalone


def test_claim_usage_status_errors_are_exported_in_kube_mode():
    status = AgentStatus("node-a", True, 3, 7, 1, claim_usage_status_errors=4)
    text = exposition(registry(lambda: make_snapshot(tick=3), lambda: status))
    assert 'tessera_claim_usage_status_errors_total{node="node-a"} 4.0' in text


def test_exposition_follows_the_conventions():
    text = exposition(registry(lambda: make_snapshot(tick=3)))
    families = list(text_string_to_metric_families(text))
    assert families, "nothing exposed"
    assert "# HELP tessera_gpu_power_watts" in text
    for fam in families:
        name = fam.name
        assert re.fullmatch(r"tessera_[a-z][a-z0-9_]*", name), name
        assert fam.documentation.strip(), f"{name} has no HELP"
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples), name
        base = name
        if base not in UNITLESS:
            assert base.endswith(UNIT_SUFFIXES) or fam.type == "histogram", f"{name}: no unit"
        for word in UNIT_WORDS:  # a unit appears only as the suffix
            assert f"_{word}_" not in base.replace("_bytes_per_second", "") or base.endswith(
                "_timestamp_seconds"
            ), name
        seen = set()
        for s in fam.samples:
            for label in s.labels:
                assert re.fullmatch(r"[a-z][a-z0-9_]*", label), (name, label)
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in seen, f"duplicate series {key}"
            seen.add(key)


def test_labels_identify_gpu_mig_and_claim():
    fams = {f.name: f for f in text_string_to_metric_families(exposition(registry(make_snapshot)))}
    (power0,) = [s for s in fams["tessera_gpu_power_watts"].samples if s.labels["gpu"] == "0"]
    assert power0.labels == {
        "node": "node-a", "gpu": "0", "uuid": "GPU-0", "pci_bus_id": "0000:1b:00.0",
        "model": "NVIDIA H100 80GB HBM3",
    }  # fmt: skip
    mig = fams["tessera_mig_memory_used_bytes"].samples[0].labels
    assert mig["mig_profile"] == "1g.10gb" and mig["gpu_instance"] == "1"
    claim = fams["tessera_claim_energy_joules"].samples[0].labels
    assert {"namespace", "claim", "pool", "device", "rule"} <= set(claim)
    assert fams["tessera_prepare_errors"].samples[0].labels == {
        "operation": "prepare", "reason": "device_busy",
    }  # fmt: skip


def test_the_gpu_label_is_the_minor_number_not_the_shifting_index():
    """After a GPU before it left, NVML lists ``gpu-6`` at index 5: its series keep ``gpu="6"``."""
    first = make_snapshot(lost_gpu=False)
    moved = replace(first.gpus[1], sample=replace(first.gpus[1].sample, index=5), minor=6)
    snap = replace(first, gpus=(first.gpus[0], moved))
    fams = {f.name: f for f in text_string_to_metric_families(exposition(registry(lambda: snap)))}
    gpus = {s.labels["uuid"]: s.labels["gpu"] for s in fams["tessera_gpu_healthy"].samples}
    assert gpus == {"GPU-0": "0", "GPU-1": "6"}
    assert {s.labels["gpu"] for s in fams["tessera_mig_memory_used_bytes"].samples} == {"6"}


def test_a_claim_made_again_under_its_name_is_another_series():
    """Deleted and created again (same namespace, name and device, a new UID) within the
    retention: two series, not two samples with one label set (Prometheus keeps one of those)."""
    first = make_snapshot(claims=1)
    again = replace(first.claims[0], uid="uid-again", energy_joules_total=5.0)
    snap = replace(
        first,
        claims=(*first.claims, again),
        prepared=(*first.prepared, replace(first.prepared[0], uid="uid-again")),
    )
    fams = {f.name: f for f in text_string_to_metric_families(exposition(registry(lambda: snap)))}
    for family in ("tessera_claim_energy_joules", "tessera_device_prepared"):
        uids = sorted(s.labels["claim_uid"] for s in fams[family].samples if s.name == family
                      or s.name == f"{family}_total")  # fmt: skip
        assert uids == ["uid-0", "uid-again"], family


def test_absent_fields_are_absent_not_zero():
    fams = {f.name: f for f in text_string_to_metric_families(exposition(registry(make_snapshot)))}
    util_gpus = {s.labels["gpu"] for s in fams["tessera_gpu_utilization_ratio"].samples}
    assert util_gpus == {"0", "1"}  # the lost GPU 2 reports no utilization at all
    sensors = {
        (s.labels["gpu"], s.labels["sensor"])
        for s in fams["tessera_gpu_temperature_celsius"].samples
    }
    assert ("0", "memory") not in sensors  # not supported there: no series, not 0
    healthy = {s.labels["gpu"]: s.value for s in fams["tessera_gpu_healthy"].samples}
    assert healthy == {"0": 1.0, "1": 1.0, "2": 0.0}
    migutil = fams["tessera_mig_utilization_ratio"].samples
    assert len(migutil) == 1  # one MIG device has GPM data, the other none


def test_the_latest_share_is_a_gauge_with_the_claims_labels_absent_when_unknown():
    fams = {f.name: f for f in text_string_to_metric_families(exposition(registry(make_snapshot)))}
    (share,) = fams["tessera_claim_share_ratio"].samples
    (energy,) = [
        s for s in fams["tessera_claim_energy_joules"].samples if s.labels["claim"] == "job-0"
    ]
    assert share.labels == energy.labels and share.labels["rule"] == "exclusive"
    assert share.value == 1.0  # job-1 has no share (released): no series, not 0


def test_no_snapshot_yet_still_describes_and_serves_empty_families():
    reg = registry(lambda: None)
    text = exposition(reg)
    assert "# TYPE tessera_gpu_power_watts gauge" in text
    assert "tessera_gpu_power_watts{" not in text


def test_describe_matches_collect_and_does_not_read_the_snapshot():
    calls = []

    def latest():
        calls.append(1)
        return make_snapshot()

    collector = SnapshotCollector(latest)
    described = [m.name for m in collector.describe()]
    assert calls == []
    assert described == [m.name for m in collector.collect()]
    assert len(calls) == 1


def test_concurrent_scrapes_see_one_snapshot_each():
    """20 scrapers while the snapshot keeps changing: every scrape is internally consistent.
    The test proves the concurrency it relies on: two scrapes are inside the collector at once
    (a barrier they must pass together) and the scrapes saw several different snapshots."""
    state = {"snap": make_snapshot(tick=1)}
    together = threading.Barrier(2, timeout=30)
    calls = {"n": 0}
    calls_lock = threading.Lock()

    def latest():
        with calls_lock:
            calls["n"] += 1
            first_two = calls["n"] <= 2
        if first_two:
            together.wait()  # raises BrokenBarrierError unless a second scrape is in too
        return state["snap"]

    reg = registry(latest)
    stop = threading.Event()
    problems: list[str] = []
    ticks_seen: set[float] = set()

    def swap():
        tick = 1
        while not stop.is_set():
            tick += 1
            state["snap"] = make_snapshot(tick=tick)

    def scrape():
        for _ in range(20):
            fams = {f.name: f for f in text_string_to_metric_families(exposition(reg))}
            tick = fams["tessera_sampler_ticks"].samples[0].value
            ticks_seen.add(tick)
            powers = {s.value for s in fams["tessera_gpu_power_watts"].samples}
            if powers != {100 + tick}:
                problems.append(f"tick {tick} but power {powers}")

    swapper = threading.Thread(target=swap)
    swapper.start()
    scrapers = [threading.Thread(target=scrape) for _ in range(20)]
    for t in scrapers:
        t.start()
    for t in scrapers:
        t.join()
    stop.set()
    swapper.join()
    assert problems == []
    assert not together.broken and calls["n"] >= 2 * 20  # two scrapes overlapped
    assert len(ticks_seen) > 1, "the snapshot never changed during the scrapes"


def test_every_metric_is_documented():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for spec in (*SPECS, *AGENT_SPECS):
        name = spec.name + ("_total" if spec.kind == "counter" else "")
        assert f"`{name}`" in doc, f"{name} missing from docs/metrics.md"
    for name in ("tessera_prepare_duration_seconds", "tessera_prepare_errors_total"):
        assert f"`{name}`" in doc


def test_exposition_renders_once_per_state_and_follows_changes():
    from agent.telemetry.metrics import Exposition

    state = {"snap": make_snapshot(tick=1)}
    calls = []

    def latest():
        calls.append(1)
        return state["snap"]

    reg = CollectorRegistry()
    reg.register(SnapshotCollector(latest))
    driver = DriverMetrics(reg)
    expo = Exposition(reg, lambda: (state["snap"].tick, driver.version))
    first, ctype = expo()
    assert expo()[0] == first and len(calls) == 1  # served from the cache
    assert ctype.startswith("text/plain")
    driver.observe("prepare", 0.01, "timeout")
    assert b'reason="timeout"' in expo()[0] and len(calls) == 2
    state["snap"] = make_snapshot(tick=2)
    assert b"tessera_sampler_ticks_total" in expo()[0] and len(calls) == 3
    assert expo()[0] != first


def test_node_events_are_counted_by_outcome():
    outcomes = (("recorded", 4), ("filtered", 0), ("dropped", 1), ("failed", 2))
    reg = registry(make_snapshot, lambda: AgentStatus("node-a", True, 3, 7, 1, 0, outcomes))
    fams = {f.name: f for f in text_string_to_metric_families(exposition(reg))}
    got = {
        s.labels["outcome"]: s.value
        for s in fams["tessera_node_events"].samples
        if s.name == "tessera_node_events_total"
    }
    assert got == {"recorded": 4.0, "filtered": 0.0, "dropped": 1.0, "failed": 2.0}
    assert {s.labels["node"] for s in fams["tessera_node_events"].samples} == {"node-a"}


def test_no_created_series_are_served_and_the_process_keeps_its_default():
    """prometheus_client adds a ``_created`` gauge (the instrument's creation time) beside each
    counter and histogram; docs/metrics.md does not list them and nothing reads them, so the
    agent's registry serves none. Turned off per registry, not with prometheus_client's
    process-wide ``disable_created_metrics()``: a registry of the same process still has them."""
    text = exposition(registry(lambda: make_snapshot(tick=3)))
    assert (
        "tessera_prepare_errors_total{" in text
        and "tessera_prepare_duration_seconds_count{" in text
    )
    assert "_created" not in text
    other = CollectorRegistry()
    Counter("plain", "a counter of another registry", registry=other).inc()
    assert "plain_created" in exposition(other)
