"""The budget controller's plan (pure, no I/O): from what the cluster holds, everything one
reconcile writes (docs/budgets.md; the interface of issue 22's contract, section 4).

The plumbing (``dra_driver.budgets``) reads a ``ClusterView``, calls ``plan(view, now)`` and
executes the plan in this order, stopping at the first failed write: summaries, acks, report
deletions, events, statuses, evictions. The next reconcile reads the cluster again and plans
again. Every step is idempotent on what the cluster then holds (``agent.usage.fold``), so a
plan cut short anywhere loses nothing and counts nothing twice; Events come before the status
that records them, so a crash may repeat an Event, never lose one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agent.usage.budget_amounts import Memo
from agent.usage.budget_status import evaluate
from agent.usage.cluster_objects import Clock, read_report, read_summary
from agent.usage.cluster_usage import ClusterUsage, collect
from agent.usage.evictions import by_namespace, pods_to_evict
from agent.usage.fold import fold
from agent.usage.plan_types import BudgetEvent, BudgetGauge, PodEviction
from agent.usage.prices import PriceTable

__all__ = ["BudgetEvent", "BudgetGauge", "ClusterView", "Plan", "PodEviction", "plan"]


@dataclass(frozen=True)
class ClusterView:
    reports: Sequence[Mapping[str, Any]]
    """GpuUsageReport objects as read (with resourceVersion)."""
    summaries: Sequence[Mapping[str, Any]]
    """GpuUsageSummary objects as read."""
    budgets: Sequence[Mapping[str, Any]]
    """GpuBudget objects as read."""
    namespaces: Sequence[Mapping[str, Any]]
    """Namespace objects (their labels select scopes)."""
    nodes: frozenset[str]
    """Names of the Nodes that exist."""
    pods: Sequence[Mapping[str, Any]]
    """Pods with spec.resourceClaims (Terminate's targets)."""
    claims: Sequence[Mapping[str, Any]]
    """ResourceClaims (which pods hold which claims)."""
    prices: PriceTable | None
    """The price table from the ConfigMap; None: no costs."""


@dataclass(frozen=True)
class Plan:
    summaries: list[dict[str, Any]]
    """Whole GpuUsageSummary objects: create (no resourceVersion) or replace (as read)."""
    acks: list[dict[str, Any]]
    """GpuUsageReport objects with the new status.acknowledgedThrough: PUT .../status."""
    report_deletions: list[str]
    """GpuUsageReport names (Node gone, everything folded by this plan's summaries)."""
    events: list[BudgetEvent]
    statuses: list[dict[str, Any]]
    """GpuBudget objects with their new status: PUT .../status."""
    evictions: list[PodEviction]
    gauges: list[BudgetGauge]
    oldest_unfolded_bucket: datetime | None
    """The start of the oldest closed bucket not yet acknowledged, as read (before this plan)."""
    namespace_gpu_hours: dict[str, float] = field(default_factory=dict)
    """Each namespace's GPU-hours in the current UTC month (the dashboard's gauge)."""


def plan(view: ClusterView, now: datetime) -> Plan:
    """Everything one reconcile writes, from ``view`` at ``now`` (aware)."""
    clock = Clock()
    reports = [read_report(r, clock) for r in view.reports]
    summaries = {s.name: s for s in (read_summary(o, clock) for o in view.summaries)}
    folded = fold(reports, summaries, view.nodes, clock)
    usage = collect(reports, summaries, clock)
    namespaces = {
        n["metadata"]["name"]: (n["metadata"].get("labels") or {}) for n in view.namespaces
    }
    events: list[BudgetEvent] = []
    statuses: list[dict[str, Any]] = []
    evictions: list[PodEviction] = []
    gauges: list[BudgetGauge] = []
    memo: Memo = {}
    terminating: list[tuple[str, list[str], frozenset[str] | None]] = []
    for budget in sorted(view.budgets, key=lambda b: str(b["metadata"]["name"])):
        outcome = evaluate(budget, usage, namespaces, view.prices, now, memo)
        events.extend(outcome.events)
        statuses.append(outcome.budget)
        gauges.extend(outcome.gauges)
        if outcome.terminate:
            classes = (budget.get("spec") or {}).get("deviceClasses")
            only = None if classes is None else frozenset(classes)
            terminating.append((outcome.budget["metadata"]["name"], outcome.namespaces, only))
    wanted = {ns for _, scope, _ in terminating for ns in scope}
    pods = by_namespace(view.pods, wanted) if wanted else {}
    claims = by_namespace(view.claims, wanted) if wanted else {}
    for name, scope, only in terminating:
        for ns, pod in pods_to_evict(scope, only, pods, claims):
            evictions.append(PodEviction(ns, pod, name))
            events.append(
                BudgetEvent(
                    ns,
                    name,
                    "Warning",
                    "GpuBudgetTerminating",
                    f"GpuBudget {name} is exhausted: evicting pod {ns}/{pod}",
                )
            )
    oldest = folded.oldest_unfolded
    return Plan(
        folded.summaries,
        folded.acks,
        folded.deletions,
        events,
        statuses,
        evictions,
        gauges,
        None if oldest is None else datetime.fromtimestamp(oldest, UTC),
        _month_gpu_hours(usage, now),
    )


def _month_gpu_hours(usage: ClusterUsage, now: datetime) -> dict[str, float]:
    utc = now.astimezone(UTC)
    start = datetime(utc.year, utc.month, 1, tzinfo=UTC).timestamp()
    out: dict[str, float] = {}
    for ns, buckets in usage.namespaces.items():
        seconds = 0.0
        for bucket_start, keys in buckets.items():
            if bucket_start >= start:
                for counters in keys.values():
                    seconds += counters[0]
        out[ns] = seconds / 3600
    return out
