"""A namespace's usage per 15-minute bucket, from the cluster's record (pure): the summaries'
buckets plus the report buckets not yet folded into them, closed or open (docs/budgets.md, "The
live view"). A report bucket counts only if it starts at or after the report's
``acknowledgedThrough`` and the summary's ``foldedThrough`` for its node, so nothing is counted
twice while a fold is under way, and usage is at most one report interval old.

The budget planner and ``tessera usage --cluster`` both sum this index, so they agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.usage.cluster_objects import Clock, Report, Summary, day_of

DeviceKey = tuple[str, str, str, int]
"""(deviceClass, product, migProfile, the index of the node's labels in ``label_sets``); ""
for a field not known. Usage is kept by the node's labels, not by node: the energy price
depends on nothing else, and nodes share a few label sets, so a namespace has a few keys."""


@dataclass
class ClusterUsage:
    """Per namespace, per bucket start (epoch seconds), per device key, the four counters in
    ``COUNTERS``' order."""

    namespaces: dict[str, dict[float, dict[DeviceKey, list[float]]]] = field(default_factory=dict)
    label_sets: list[Mapping[str, str]] = field(default_factory=list)


def _labels_index(
    reports: Iterable[Report], summaries: Mapping[str, Summary], out: ClusterUsage
) -> dict[str, int]:
    """Each node's labels (its report's, else those a summary recorded) as an index into
    ``out.label_sets``, equal label sets sharing one index."""
    labels: dict[str, Mapping[str, str]] = {}
    for summary in summaries.values():
        for node, found in summary.labels.items():
            labels.setdefault(node, found)
    for report in reports:
        labels[report.node] = report.labels  # the newest labels win
    ids: dict[tuple[tuple[str, str], ...], int] = {(): 0}  # 0: no labels known
    out.label_sets.append({})
    out_ids: dict[str, int] = {}
    for node, found in labels.items():
        frozen = tuple(sorted(found.items()))
        i = ids.get(frozen)
        if i is None:
            i = ids[frozen] = len(out.label_sets)
            out.label_sets.append(dict(found))
        out_ids[node] = i
    return out_ids


def _add(keys: dict[DeviceKey, list[float]], label: int, u: Mapping[str, Any]) -> None:
    # the reconcile's innermost step (300,000 entries in bench/budgets.py): one ``get`` per
    # field, bound once, no loop over COUNTERS, no copy of the entry
    get = u.get
    key = (get("deviceClass") or "", get("product") or "", get("migProfile") or "", label)
    sums = keys.get(key)
    if sums is None:
        keys[key] = [
            get("allocatedGpuSeconds") or 0.0,
            get("busyGpuSeconds") or 0.0,
            get("energyJoules") or 0.0,
            get("unobservedSeconds") or 0.0,
        ]
    else:
        sums[0] += get("allocatedGpuSeconds") or 0.0
        sums[1] += get("busyGpuSeconds") or 0.0
        sums[2] += get("energyJoules") or 0.0
        sums[3] += get("unobservedSeconds") or 0.0


def collect(
    reports: Iterable[Report],
    summaries: Mapping[str, Summary],
    clock: Clock,
) -> ClusterUsage:
    """The index of every namespace's usage (this loop is the reconcile's hot path: it visits
    every usage entry of every summary and report; bench/budgets.py measures it)."""
    reports = list(reports)
    out = ClusterUsage()
    label_of = _labels_index(reports, summaries, out)
    namespaces = out.namespaces
    for summary in summaries.values():
        buckets = namespaces.setdefault(summary.namespace, {})
        for bucket in (summary.obj.get("spec") or {}).get("buckets") or ():
            keys = buckets.setdefault(clock.epoch(bucket["start"]), {})
            for u in bucket.get("usage") or ():
                _add(keys, label_of.get(u["node"], 0), u)
    for report, start, live in live_buckets(reports, summaries):
        label = label_of[report.node]
        for u in live:
            by_start = namespaces.get(u["namespace"])
            if by_start is None:
                by_start = namespaces[u["namespace"]] = {}
            by_key = by_start.get(start)
            if by_key is None:
                by_key = by_start[start] = {}
            _add(by_key, label, u)
    return out


def live_buckets(
    reports: Iterable[Report], summaries: Mapping[str, Summary]
) -> Iterator[tuple[Report, float, list[Mapping[str, Any]]]]:
    """(report, bucket start, its entries not yet folded) of every report bucket that starts at
    or after the report's ``acknowledgedThrough``; an entry is not yet folded while its bucket
    starts at or after its summary's ``foldedThrough`` for the node. The one rule of what counts
    live, for the planner and ``tessera usage --cluster``. One tuple a bucket, not a tuple an
    entry: the planner visits 200,000 entries a reconcile (bench/budgets.py)."""
    for report in reports:
        node = report.node
        for bucket in report.buckets:
            start = bucket.start
            if start < report.acknowledged:
                continue
            suffix = f".{day_of(start)}"
            live = []
            for u in bucket.usage:
                into = summaries.get(u["namespace"] + suffix)  # summary_name, inlined: hot
                if into is None or start >= into.folded.get(node, 0.0):
                    live.append(u)
            yield report, start, live


def live_entries(
    reports: Iterable[Report], summaries: Mapping[str, Summary]
) -> Iterator[tuple[Report, float, Mapping[str, Any]]]:
    """(report, bucket start, entry) of every report entry not yet folded (``live_buckets``,
    entry by entry)."""
    for report, start, live in live_buckets(reports, summaries):
        for u in live:
            yield report, start, u
