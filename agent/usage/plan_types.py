"""What a budget reconcile does besides writing objects (pure data): the Events to raise, the
pods to evict and the figures to export. ``agent.usage.budget_plan`` re-exports them with the
plan they belong to (the interface of /work's issue 22 contract, section 4)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetEvent:
    namespace: str
    """The namespace the Event is recorded in (each namespace of the budget's scope)."""
    budget: str
    type: str
    """Normal or Warning."""
    reason: str
    """GpuBudgetThreshold, GpuBudgetExhausted, GpuBudgetRestored or GpuBudgetTerminating."""
    message: str


@dataclass(frozen=True)
class PodEviction:
    namespace: str
    pod: str
    budget: str


@dataclass(frozen=True)
class BudgetGauge:
    budget: str
    limit: str
    """gpuHours, energyKWh or cost."""
    used: float
    limit_value: float
    exhausted: bool
    """Whether the budget is exhausted (by any of its limits): the same on each of its gauges."""
