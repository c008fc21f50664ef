"""The budget controller's Prometheus metrics (names fixed by issue 22's contract, section 5; the
alerts in deploy/daemonset/components/monitoring and the dashboard's "Budgets" row use them;
docs/metrics.md lists them). One registry per controller (no global state): the composition root
builds it and serves it on ``--metrics-address``.

The per-budget gauges are the last plan's: a label set that no plan names any more (a budget
deleted, a limit removed) is dropped, so a dashboard never shows a stale budget. Only the leader
publishes them (a replica that loses the Lease drops them); a standby reports
``tessera_budget_leader 0`` and its own errors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from agent.nocreated import WithoutCreated
from agent.usage.budget_plan import BudgetGauge

DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
"""Seconds: the goal is 2 s for 10,000 nodes (bench), a stalled API server shows above."""


class BudgetMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        """What /metrics serves: the instruments, without ``_created`` series (agent.nocreated)."""
        r = CollectorRegistry(auto_describe=True)
        labels = ("budget", "limit")
        self.used = Gauge(
            "tessera_budget_used",
            "What the budget's scope used in its current period, in the limit's unit"
            " (GPU-hours, kWh, or the price table's currency).",
            labels,
            registry=r,
        )
        self.limit = Gauge(
            "tessera_budget_limit", "The budget's limit, in the limit's unit.", labels, registry=r
        )
        self.used_ratio = Gauge(
            "tessera_budget_used_ratio",
            "Used over limit (1 or more: exhausted).",
            labels,
            registry=r,
        )
        self.exhausted = Gauge(
            "tessera_budget_exhausted",
            "1 while the budget is exhausted (any limit reached), else 0.",
            ("budget",),
            registry=r,
        )
        self.namespace_gpu_hours = Gauge(
            "tessera_budget_namespace_gpu_hours",
            "The namespace's allocated GPU-hours in the current UTC month, from the folded"
            " summaries (the dashboard's per-namespace view).",
            ("namespace",),
            registry=r,
        )
        self.leader = Gauge(
            "tessera_budget_leader", "1 while this replica holds the Lease, else 0.", registry=r
        )
        self.last_reconcile = Gauge(
            "tessera_budget_last_reconcile_timestamp_seconds",
            "Unix time the last reconcile finished every write of its plan.",
            registry=r,
        )
        self.duration = Histogram(
            "tessera_budget_reconcile_duration_seconds",
            "Seconds one reconcile took (read, plan, write), finished or not.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "tessera_budget_reconcile_errors",
            "Reconciles and lease attempts that failed (an API error, a bad price table, a lost"
            " lease mid-plan); the next interval retries.",
            registry=r,
        )
        self.oldest_unfolded = Gauge(
            "tessera_budget_oldest_unfolded_bucket_age_seconds",
            "Age of the oldest closed report bucket not yet folded into a summary (0: none).",
            registry=r,
        )
        self.evictions = Counter(
            "tessera_budget_evictions",
            "Pods evicted for a Terminate budget.",
            ("budget",),
            registry=r,
        )
        self.registry.register(WithoutCreated(r))
        self._shown: set[tuple[str, str]] = set()
        self._shown_budgets: set[str] = set()
        self._shown_namespaces: set[str] = set()

    def exposition(self) -> tuple[bytes, str]:
        """/metrics: the body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def show_gauges(self, gauges: Iterable[BudgetGauge]) -> None:
        """The plan's per-budget figures; label sets it no longer names are dropped."""
        shown: set[tuple[str, str]] = set()
        exhausted: dict[str, bool] = {}
        for g in gauges:
            key = (g.budget, g.limit)
            shown.add(key)
            self.used.labels(*key).set(g.used)
            self.limit.labels(*key).set(g.limit_value)
            ratio = g.used / g.limit_value if g.limit_value > 0 else float("inf")
            self.used_ratio.labels(*key).set(ratio)
            exhausted[g.budget] = exhausted.get(g.budget, False) or g.exhausted
        for key in self._shown - shown:
            for gauge in (self.used, self.limit, self.used_ratio):
                gauge.remove(*key)
        for budget, flag in exhausted.items():
            self.exhausted.labels(budget).set(1 if flag else 0)
        for budget in self._shown_budgets - set(exhausted):
            self.exhausted.remove(budget)
        self._shown, self._shown_budgets = shown, set(exhausted)

    def show_namespaces(self, summaries: Iterable[Mapping[str, Any]], now: datetime) -> None:
        """Each namespace's allocated GPU-hours this UTC month, from its summaries' buckets."""
        month = now.strftime("%Y-%m-")
        hours: dict[str, float] = {}
        for s in summaries:
            spec = s.get("spec")
            if not isinstance(spec, Mapping) or not str(spec.get("day", "")).startswith(month):
                continue
            ns = str(spec.get("namespace", ""))
            seconds = 0.0
            for bucket in spec.get("buckets") or ():
                for use in (bucket or {}).get("usage") or ():
                    value = (use or {}).get("allocatedGpuSeconds", 0.0)
                    if isinstance(value, int | float) and not isinstance(value, bool):
                        seconds += float(value)
            hours[ns] = hours.get(ns, 0.0) + seconds / 3600
        for ns, value in hours.items():
            self.namespace_gpu_hours.labels(ns).set(value)
        for ns in self._shown_namespaces - set(hours):
            self.namespace_gpu_hours.remove(ns)
        self._shown_namespaces = set(hours)

    def forget_plan(self) -> None:
        """Drop every per-budget and per-namespace series (this replica no longer leads: the new
        leader's are the ones to read)."""
        self.show_gauges(())
        for ns in self._shown_namespaces:
            self.namespace_gpu_hours.remove(ns)
        self._shown_namespaces = set()
        self.oldest_unfolded.set(0)

    def show_oldest_unfolded(self, oldest: datetime | None, now: datetime) -> None:
        age = 0.0 if oldest is None else max(0.0, (now - oldest).total_seconds())
        self.oldest_unfolded.set(age)
