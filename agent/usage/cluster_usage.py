"""A namespace's usage per 15-minute bucket, from the cluster's record (pure): the summaries'
buckets plus the report buckets not yet folded into them, closed or open (docs/budgets.md, "The
live view"). A report bucket counts only if it starts at or after the report's
``acknowledgedThrough`` and the summary's ``foldedThrough`` for its node, so nothing is counted
twice while a fold is under way, and usage is at most one report interval old.

The budget planner and ``tessera usage --cluster`` both sum this index, so they agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.usage.records import COUNTERS, Clock, Report, Summary, day_of, summary_name

DeviceKey = tuple[str, str, str, str]
"""(deviceClass, product, migProfile, node); "" for a field not known."""


@dataclass
class ClusterUsage:
    """Per namespace, per bucket start (epoch seconds), per device key, the four counters in
    ``COUNTERS``' order; and each node's labels (the energy prices select by them)."""

    namespaces: dict[str, dict[float, dict[DeviceKey, list[float]]]] = field(default_factory=dict)
    node_labels: dict[str, Mapping[str, str]] = field(default_factory=dict)

    def add(self, namespace: str, start: float, key: DeviceKey, entry: Mapping[str, Any]) -> None:
        buckets = self.namespaces.get(namespace)
        if buckets is None:
            buckets = self.namespaces[namespace] = {}
        keys = buckets.get(start)
        if keys is None:
            keys = buckets[start] = {}
        sums = keys.get(key)
        if sums is None:
            sums = keys[key] = [0.0, 0.0, 0.0, 0.0]
        for i, c in enumerate(COUNTERS):
            v = entry.get(c)
            if v:
                sums[i] += v


def collect(
    reports: Iterable[Report],
    summaries: Mapping[str, Summary],
    clock: Clock,
) -> ClusterUsage:
    """The index of every namespace's usage."""
    out = ClusterUsage()
    for summary in summaries.values():
        for node, labels in summary.labels.items():
            out.node_labels.setdefault(node, labels)
        ns = summary.namespace
        for bucket in (summary.obj.get("spec") or {}).get("buckets") or ():
            start = clock.epoch(bucket["start"])
            for u in bucket.get("usage") or ():
                key = (
                    u.get("deviceClass") or "",
                    u.get("product") or "",
                    u.get("migProfile") or "",
                    u["node"],
                )
                out.add(ns, start, key, u)
    for report in reports:
        out.node_labels[report.node] = report.labels  # the newest labels win
        for bucket in report.buckets:
            if bucket.start < report.acknowledged:
                continue
            day = day_of(bucket.start)
            for u in bucket.usage:
                ns = u["namespace"]
                into = summaries.get(summary_name(ns, day))
                if into is not None and bucket.start < into.folded.get(report.node, 0.0):
                    continue
                key = (
                    u.get("deviceClass") or "",
                    u.get("product") or "",
                    u.get("migProfile") or "",
                    report.node,
                )
                out.add(ns, bucket.start, key, u)
    return out
