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


def _add(keys: dict[DeviceKey, list[float]], key: DeviceKey, u: Mapping[str, Any]) -> None:
    sums = keys.get(key)
    if sums is None:
        keys[key] = [
            u.get("allocatedGpuSeconds") or 0.0,
            u.get("busyGpuSeconds") or 0.0,
            u.get("energyJoules") or 0.0,
            u.get("unobservedSeconds") or 0.0,
        ]
    else:
        sums[0] += u.get("allocatedGpuSeconds") or 0.0
        sums[1] += u.get("busyGpuSeconds") or 0.0
        sums[2] += u.get("energyJoules") or 0.0
        sums[3] += u.get("unobservedSeconds") or 0.0


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
    for summary in summaries.values():
        buckets = out.namespaces.setdefault(summary.namespace, {})
        for bucket in (summary.obj.get("spec") or {}).get("buckets") or ():
            keys = buckets.setdefault(clock.epoch(bucket["start"]), {})
            for u in bucket.get("usage") or ():
                key = (
                    u.get("deviceClass") or "",
                    u.get("product") or "",
                    u.get("migProfile") or "",
                    label_of.get(u["node"], 0),
                )
                _add(keys, key, u)
    for report, start, u in live_entries(reports, summaries):
        ns = u["namespace"]
        by_start = out.namespaces.get(ns)
        if by_start is None:
            by_start = out.namespaces[ns] = {}
        by_key = by_start.get(start)
        if by_key is None:
            by_key = by_start[start] = {}
        key = (
            u.get("deviceClass") or "",
            u.get("product") or "",
            u.get("migProfile") or "",
            label_of[report.node],
        )
        _add(by_key, key, u)
    return out


def live_entries(
    reports: Iterable[Report], summaries: Mapping[str, Summary]
) -> Iterator[tuple[Report, float, Mapping[str, Any]]]:
    """(report, bucket start, entry) of every report entry not yet folded: its bucket starts at
    or after the report's ``acknowledgedThrough`` and its summary's ``foldedThrough`` for the
    node. The one rule of what counts live, for the planner and ``tessera usage --cluster``."""
    for report in reports:
        node = report.node
        for bucket in report.buckets:
            start = bucket.start
            if start < report.acknowledged:
                continue
            day = day_of(start)
            for u in bucket.usage:
                into = summaries.get(f"{u['namespace']}.{day}")  # summary_name, inlined: hot
                if into is not None and start < into.folded.get(node, 0.0):
                    continue
                yield report, start, u
