"""The budget controller's pure planner: from what the cluster holds, everything one reconcile
writes (issue 22's contract, section 4). No I/O: ``dra_driver.budgets`` reads the
:class:`ClusterView`, calls :func:`plan` and executes the :class:`Plan` in order (summaries,
acks, report deletions, events, statuses, evictions), stopping at the first failed write.

This file holds the contract's interface; the planner itself is written separately.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agent.usage.prices import PriceTable


@dataclass(frozen=True)
class ClusterView:
    reports: Sequence[Mapping[str, Any]]  # GpuUsageReport objects as read (with resourceVersion)
    summaries: Sequence[Mapping[str, Any]]  # GpuUsageSummary objects as read
    budgets: Sequence[Mapping[str, Any]]  # GpuBudget objects as read
    namespaces: Sequence[Mapping[str, Any]]  # Namespace objects (their labels select scopes)
    nodes: frozenset[str]  # names of the Nodes that exist
    pods: Sequence[Mapping[str, Any]]  # Pods with spec.resourceClaims (Terminate's targets)
    claims: Sequence[Mapping[str, Any]]  # ResourceClaims (which pods hold which claims)
    prices: PriceTable | None  # agent.usage.prices, from the ConfigMap; None: no costs


@dataclass(frozen=True)
class BudgetEvent:
    namespace: str
    budget: str
    type: str  # "Normal" | "Warning"
    reason: str
    # GpuBudgetThreshold | GpuBudgetExhausted | GpuBudgetRestored | GpuBudgetTerminating
    message: str


@dataclass(frozen=True)
class PodEviction:
    namespace: str
    pod: str
    budget: str


@dataclass(frozen=True)
class BudgetGauge:
    budget: str
    limit: str  # "gpuHours" | "energyKWh" | "cost"
    used: float
    limit_value: float
    exhausted: bool


@dataclass(frozen=True)
class Plan:
    summaries: list[dict[str, Any]]  # whole GpuUsageSummary objects: create or replace
    acks: list[dict[str, Any]]  # GpuUsageReport objects with the new status.acknowledgedThrough
    report_deletions: list[str]  # GpuUsageReport names (node gone, everything folded)
    events: list[BudgetEvent]
    statuses: list[dict[str, Any]]  # GpuBudget objects with their new status: PUT .../status
    evictions: list[PodEviction]
    gauges: list[BudgetGauge]
    oldest_unfolded_bucket: datetime | None


def plan(view: ClusterView, now: datetime) -> Plan:
    """Everything one reconcile writes, from ``view`` at ``now`` (contract section 4)."""
    raise NotImplementedError("the budget planner is written separately (issue 22, section 4)")
