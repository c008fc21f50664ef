"""A GpuBudget's new status, its Events and its gauges at ``now`` (pure; docs/budgets.md,
"Budget status").

- **Used and remaining** per limit over the current period (``agent.usage.budget_amounts``);
  remaining is never below 0. The budget is **exhausted** when any limit's used amount, as
  shown, reaches the limit.
- **Thresholds**: a Warning ``GpuBudgetThreshold`` Event the first time the highest ratio of
  used to limit reaches each of ``spec.thresholds`` in the period; ``status.thresholdsReached``
  records it. A CalendarMonth budget forgets them when the month changes; a Rolling or None
  budget forgets a threshold once usage falls back below it (its window moved, or the limit was
  raised), so it can warn again.
- **Exhausted**: ``exhaustedSince`` is set when usage first reaches a limit (a Warning
  ``GpuBudgetExhausted``) and cleared when it no longer does (a Normal ``GpuBudgetRestored``).
- **Projected exhaustion**: the period's average rate so far (used / time since the period's
  start; for a None period, since its first bucket with usage) carried forward in a straight
  line; the earliest over the limits; absent when exhausted, when nothing is used, or (for a
  calendar month) when it falls after the month's end.
- **Reconciled** is False, with the reason, when the period cannot be read, or a cost limit
  cannot be evaluated (no price table, another currency than the table's, usage without a
  price): a cost is never guessed. The other limits are still evaluated; with none left, the
  last ``Exhausted`` verdict stands (``Unknown`` if there was none) and nothing is evicted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from agent.usage.budget_amounts import (
    UNITS,
    Amounts,
    Memo,
    Usage,
    in_scope,
    scope_namespaces,
    shown,
)
from agent.usage.cluster_usage import ClusterUsage
from agent.usage.periods import Period, PeriodError, current_period, parse_duration
from agent.usage.plan_types import BudgetEvent, BudgetGauge
from agent.usage.prices import PriceTable

Obj = dict[str, Any]
LIMITS = ("gpuHours", "energyKWh", "cost")


@dataclass(frozen=True)
class Outcome:
    budget: Obj
    """The GpuBudget with its new status (metadata as read: a replace of .../status)."""
    events: list[BudgetEvent]
    gauges: list[BudgetGauge]
    namespaces: list[str]
    terminate: bool
    """Terminate is due: exhausted for its grace period, and the action is Terminate."""


@dataclass(frozen=True)
class _Limit:
    name: str
    limit: Decimal
    used: Decimal

    @property
    def ratio(self) -> float:
        if self.limit == 0:
            return float("inf") if self.used > 0 else 1.0
        return float(self.used / self.limit)

    def phrase(self, currency: str) -> str:
        unit = UNITS.get(self.name, currency)
        return f"used {self.used} of {self.limit} {unit}"


def evaluate(
    budget: Mapping[str, Any],
    usage: ClusterUsage,
    namespaces: Mapping[str, Mapping[str, str]],
    prices: PriceTable | None,
    now: datetime,
    memo: Memo | None = None,
) -> Outcome:
    """The outcome of one budget (see the module's text); ``memo``: one per plan, shared."""
    name = budget["metadata"]["name"]
    spec = budget.get("spec") or {}
    old = budget.get("status") or {}
    scope = scope_namespaces(spec.get("scope") or {}, namespaces)
    try:
        period = current_period(name, spec.get("period"), now)
        grace = parse_duration(
            spec.get("gracePeriod") or "0s", f"GpuBudget {name}: spec.gracePeriod"
        )
    except PeriodError as exc:
        status = {**old, **_base(budget, now)}  # the last good figures stay
        status["conditions"] = _conditions(
            old, now, budget, [_cond("Reconciled", "False", "InvalidPeriod", str(exc))]
        )
        return Outcome(_with(budget, status), [], [], scope, False)
    classes = spec.get("deviceClasses")
    only = None if classes is None else frozenset(classes)
    found = in_scope(usage, scope, period, only, prices, memo)
    limits, problems = _limits(spec.get("limits") or {}, found, prices)
    return _outcome(budget, old, scope, period, grace, found, limits, problems, prices, now)


def _limits(
    spec: Mapping[str, Any], found: Usage, prices: PriceTable | None
) -> tuple[list[_Limit], list[tuple[str, str]]]:
    out: list[_Limit] = []
    problems: list[tuple[str, str]] = []
    if "gpuHours" in spec:
        out.append(
            _Limit("gpuHours", Decimal(spec["gpuHours"]), shown("gpuHours", found.total.gpu_hours))
        )
    if "energyKWh" in spec:
        out.append(
            _Limit(
                "energyKWh", Decimal(spec["energyKWh"]), shown("energyKWh", found.total.energy_kwh)
            )
        )
    money = spec.get("cost")
    if isinstance(money, Mapping):
        currency = money.get("currency")
        if prices is None:
            problems.append(
                (
                    "NoPriceTable",
                    "spec.limits.cost needs a price table (the prices"
                    " ConfigMap); none is loaded, so cost is not evaluated",
                )
            )
        elif prices.currency != currency:
            problems.append(
                (
                    "CurrencyMismatch",
                    f"spec.limits.cost.currency is {currency!r} but"
                    f" the price table's is {prices.currency!r}; cost is not evaluated",
                )
            )
        elif found.total.cost is None:
            problems.append(
                (
                    "Unpriced",
                    "the price table has no price for "
                    + ", ".join(found.unpriced[:5])
                    + "; cost is not evaluated",
                )
            )
        else:
            out.append(_Limit("cost", Decimal(money["amount"]), shown("cost", found.total.cost)))
    return out, problems


def _outcome(
    budget: Mapping[str, Any],
    old: Mapping[str, Any],
    scope: list[str],
    period: Period,
    grace: timedelta,
    found: Usage,
    limits: list[_Limit],
    problems: list[tuple[str, str]],
    prices: PriceTable | None,
    now: datetime,
) -> Outcome:
    name = budget["metadata"]["name"]
    spec = budget.get("spec") or {}
    currency = (
        prices.currency
        if prices is not None
        else (spec.get("limits", {}).get("cost") or {}).get("currency", "")
    )
    new_period = period.kind == "CalendarMonth" and old.get("periodStart") != _iso(period.start)
    reached_before: set[int] = set() if new_period else set(old.get("thresholdsReached") or ())
    was_since = None if new_period else old.get("exhaustedSince")
    top = max(limits, key=lambda lim: lim.ratio, default=None)
    exhausted = [lim for lim in limits if lim.used >= lim.limit]
    where = period.describe()
    message = (
        "" if top is None else f"{(exhausted[0] if exhausted else top).phrase(currency)} ({where})"
    )
    events: list[BudgetEvent] = []

    def event(kind: str, reason: str, text: str) -> None:
        events.extend(BudgetEvent(ns, name, kind, reason, text) for ns in scope)

    percent = 0.0 if top is None else top.ratio * 100
    reached = {t for t in reached_before if period.kind == "CalendarMonth" or percent >= t}
    for t in sorted(spec.get("thresholds") or (80, 90)):
        if percent >= t and t not in reached:
            reached.add(t)
            event(
                "Warning",
                "GpuBudgetThreshold",
                f"GpuBudget {name}: {t} % of a limit reached: {message}",
            )
    status = _base(budget, now)
    if period.start is not None:
        status["periodStart"] = _iso(period.start)
    if period.end is not None:
        status["periodEnd"] = _iso(period.end)
    status["used"], status["remaining"] = _used(found.total, limits, prices is not None)
    status["byDeviceClass"] = [
        {"deviceClass": c, **_amounts(a, prices is not None)}
        for c, a in sorted(found.by_class.items())
    ]
    status["thresholdsReached"] = sorted(reached)
    since: str | None = None
    exhausted_cond = _cond("Exhausted", "False", "WithinLimits", message)
    if not limits:
        # nothing could be evaluated (a cost limit without prices): the last verdict stands,
        # and nothing is announced or evicted on it
        since = None
        if was_since:
            status["exhaustedSince"] = was_since
        if _condition(old, "Exhausted") is None:
            exhausted_cond = _cond("Exhausted", "Unknown", "NotEvaluated", "no limit evaluated")
        else:
            exhausted_cond = {}
    elif exhausted:
        since = was_since or _iso(now.astimezone(UTC))
        status["exhaustedSince"] = since
        exhausted_cond = _cond("Exhausted", "True", "LimitReached", message)
        if not was_since:
            action = spec.get("action", "Warn")
            extra = (
                f"; its pods are evicted after {spec.get('gracePeriod', '0s')}"
                if action == "Terminate"
                else ""
            )
            event(
                "Warning",
                "GpuBudgetExhausted",
                f"GpuBudget {name} is exhausted: {message}; action {action}{extra}",
            )
    else:
        if _condition(old, "Exhausted") == "True":
            event(
                "Normal", "GpuBudgetRestored", f"GpuBudget {name} is no longer exhausted: {message}"
            )
        projected = _projection(limits, period, found, now)
        if projected is not None:
            status["projectedExhaustion"] = _iso(projected)
    if problems:
        reconciled = _cond("Reconciled", "False", problems[0][0], problems[0][1])
    else:
        reconciled = _cond("Reconciled", "True", "Reconciled", "usage and status are up to date")
    conds = [reconciled, exhausted_cond] if exhausted_cond else [reconciled]
    status["conditions"] = _conditions(old, now, budget, conds)
    gauges = [
        BudgetGauge(name, lim.name, float(lim.used), float(lim.limit), bool(exhausted))
        for lim in limits
    ]
    terminate = (
        spec.get("action") == "Terminate"
        and since is not None
        and now >= datetime.fromisoformat(since) + grace
    )
    return Outcome(_with(budget, status), events, gauges, scope, terminate)


def _used(total: Amounts, limits: Sequence[_Limit], with_cost: bool) -> tuple[Obj, Obj]:
    used = _amounts(total, with_cost)
    remaining = {
        lim.name: str(max(lim.limit - lim.used, Decimal(0)).quantize(lim.used)) for lim in limits
    }
    if "cost" not in {lim.name for lim in limits}:
        used.pop("cost", None)
    return used, remaining


def _amounts(a: Amounts, with_cost: bool) -> Obj:
    out: Obj = {
        "gpuHours": str(shown("gpuHours", a.gpu_hours)),
        "energyKWh": str(shown("energyKWh", a.energy_kwh)),
    }
    if with_cost and a.cost is not None:
        out["cost"] = str(shown("cost", a.cost))
    return out


def _projection(
    limits: Sequence[_Limit], period: Period, found: Usage, now: datetime
) -> datetime | None:
    start = period.start_epoch if period.start is not None else found.first_bucket
    if start is None:
        return None
    elapsed = now.timestamp() - start
    best: float | None = None
    for lim in limits:
        if lim.used <= 0 or elapsed <= 0:
            continue
        rate = float(lim.used) / elapsed  # per second
        at = now.timestamp() + float(lim.limit - lim.used) / rate
        best = at if best is None else min(best, at)
    if best is None or (period.end_epoch is not None and best >= period.end_epoch):
        return None
    return datetime.fromtimestamp(int(best), UTC)


def _base(budget: Mapping[str, Any], now: datetime) -> Obj:
    status: Obj = {}
    status["lastReconcileTime"] = _iso(now.astimezone(UTC))
    generation = (budget.get("metadata") or {}).get("generation")
    if isinstance(generation, int):
        status["observedGeneration"] = generation
    return status


def _cond(kind: str, status: str, reason: str, message: str) -> Obj:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def _condition(old: Mapping[str, Any], kind: str) -> str | None:
    for c in old.get("conditions") or ():
        if c.get("type") == kind:
            return str(c.get("status"))
    return None


def _conditions(
    old: Mapping[str, Any], now: datetime, budget: Mapping[str, Any], new: list[Obj]
) -> list[Obj]:
    """``new`` merged over the old conditions: a condition keeps its lastTransitionTime while its
    status stays; conditions this reconcile did not decide are kept as they were."""
    before = {c.get("type"): c for c in old.get("conditions") or ()}
    generation = (budget.get("metadata") or {}).get("generation")
    out = {k: dict(v) for k, v in before.items() if isinstance(k, str)}
    for c in new:
        prev = before.get(c["type"])
        same = prev is not None and prev.get("status") == c["status"]
        c["lastTransitionTime"] = (
            prev["lastTransitionTime"] if same and prev else _iso(now.astimezone(UTC))
        )
        if isinstance(generation, int):
            c["observedGeneration"] = generation
        out[c["type"]] = c
    return [out[k] for k in sorted(out)]


def _with(budget: Mapping[str, Any], status: Obj) -> Obj:
    return {**budget, "status": status}


def _iso(at: datetime | None) -> str:
    if at is None:
        return ""
    if at.tzinfo is UTC or at.utcoffset() == timedelta(0):
        return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return at.isoformat()
