"""What a budget's scope used over a period (pure): GPU-hours, kWh and cost, in all and by
DeviceClass, summed from the cluster's usage index (``agent.usage.cluster_usage``).

- GPU-hours are allocated (weighted) GPU-seconds / 3600; kWh are joules / 3,600,000.
- Cost is ``agent.usage.prices.cost`` of each (DeviceClass, product, MIG profile, node): exact
  ``Decimal``. A device or node the table has no price for leaves the cost unknown (None) and
  is named in ``unpriced``: it is never guessed, nor counted as free.
- Amounts are shown with a fixed number of decimals: 3 for GPU-hours and kWh (a GPU-hour's
  thousandth is 3.6 s), 2 for cost (a currency's cents), rounded half to even.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal

from agent.usage.cluster_usage import ClusterUsage, DeviceKey
from agent.usage.periods import Period
from agent.usage.prices import JOULES_PER_KWH, SECONDS_PER_HOUR, PriceTable, cost

QUANTUM = {"gpuHours": Decimal("0.001"), "energyKWh": Decimal("0.001"), "cost": Decimal("0.01")}
UNITS = {"gpuHours": "GPU-hours", "energyKWh": "kWh"}


def shown(limit: str, amount: Decimal) -> Decimal:
    """An amount rounded as the status shows it."""
    return amount.quantize(QUANTUM[limit])


@dataclass
class Amounts:
    gpu_hours: Decimal = Decimal(0)
    energy_kwh: Decimal = Decimal(0)
    cost: Decimal | None = None
    """None without a price table, or when some usage has no price."""


@dataclass
class Usage:
    total: Amounts
    by_class: dict[str, Amounts]
    unpriced: list[str] = field(default_factory=list)
    """What had no price: ``product (deviceClass)`` or ``energy on node N``."""
    first_bucket: float | None = None
    """The earliest bucket with usage in the period (epoch), for the None period's rate."""


Sums = dict[DeviceKey, list[float]]
"""Per device key: [allocated GPU-seconds, energy joules, first bucket with usage (epoch)]."""
Memo = dict[tuple[str, float | None, float | None, frozenset[str] | None], Sums]


def namespace_sums(
    usage: ClusterUsage,
    ns: str,
    period: Period,
    device_classes: frozenset[str] | None,
    memo: Memo,
) -> Sums:
    """One namespace's sums over a period; ``memo`` (one per plan) keeps them, as budgets
    with the same period and classes share namespaces (a team's budget and its org's)."""
    token = (ns, period.start_epoch, period.end_epoch, device_classes)
    found = memo.get(token)
    if found is not None:
        return found
    sums: Sums = {}
    for start, keys in (usage.namespaces.get(ns) or {}).items():
        if not period.contains(start):
            continue
        for key, counters in keys.items():
            if device_classes is not None and key[0] not in device_classes:
                continue
            s = sums.get(key)
            if s is None:
                sums[key] = [counters[0], counters[2], start]
            else:
                s[0] += counters[0]
                s[1] += counters[2]
                s[2] = min(s[2], start)
    memo[token] = sums
    return sums


def in_scope(
    usage: ClusterUsage,
    namespaces: Iterable[str],
    period: Period,
    device_classes: frozenset[str] | None,
    prices: PriceTable | None,
    memo: Memo | None = None,
) -> Usage:
    """The sums of ``namespaces``' usage over ``period``, only of ``device_classes`` if given."""
    memo = {} if memo is None else memo
    sums: dict[DeviceKey, list[float]] = {}
    for ns in namespaces:
        for key, (allocated, joules, start) in namespace_sums(
            usage, ns, period, device_classes, memo
        ).items():
            s = sums.get(key)
            if s is None:
                sums[key] = [allocated, joules, start]
            else:
                s[0] += allocated
                s[1] += joules
                s[2] = min(s[2], start)
    first = min((s[2] for s in sums.values()), default=None)
    by_class: dict[str, Amounts] = {}
    unpriced: set[str] = set()
    total = Amounts(cost=None if prices is None else Decimal(0))
    priced_classes: dict[str, bool] = {}
    for key in sorted(sums):
        allocated, joules, _ = sums[key]
        device_class, product, mig, labels = key
        hours = Decimal(repr(allocated)) / SECONDS_PER_HOUR
        kwh = Decimal(repr(joules)) / JOULES_PER_KWH
        amounts = by_class.setdefault(device_class, Amounts())
        amounts.gpu_hours += hours
        amounts.energy_kwh += kwh
        total.gpu_hours += hours
        total.energy_kwh += kwh
        if prices is None:
            continue
        node_labels = usage.label_sets[labels]
        priced = cost(
            prices,
            allocated,
            joules,
            product=product,
            mig_profile=mig or None,
            device_class=device_class or None,
            node_labels=node_labels,
        )
        if priced.gpu is None:
            unpriced.add(f"{product}{' ' + mig if mig else ''} ({device_class or 'no class'})")
        if priced.energy is None:
            unpriced.add(f"energy on nodes labelled {dict(node_labels)}")
        ok = priced.total is not None and priced_classes.get(device_class, True)
        priced_classes[device_class] = ok
        if priced.total is not None:
            amounts.cost = (amounts.cost or Decimal(0)) + priced.total
            if total.cost is not None:
                total.cost += priced.total
    for device_class, ok in priced_classes.items():
        if not ok:
            by_class[device_class].cost = None
    if unpriced:
        total.cost = None
    return Usage(total, by_class, sorted(unpriced), first)


def scope_namespaces(
    scope: Mapping[str, object], namespaces: Mapping[str, Mapping[str, str]]
) -> list[str]:
    """The namespaces a budget's scope names: its ``namespace`` (whether or not the Namespace
    still exists: a deleted namespace's usage stays its team's), or every Namespace whose labels
    include all of ``namespaceSelector.matchLabels``."""
    name = scope.get("namespace")
    if isinstance(name, str) and name:
        return [name]
    selector = scope.get("namespaceSelector")
    match = selector.get("matchLabels") if isinstance(selector, Mapping) else None
    if not isinstance(match, Mapping):
        return []
    wanted = list(match.items())
    return sorted(
        n for n, labels in namespaces.items() if all(labels.get(k) == v for k, v in wanted)
    )
