"""The fold (pure): which ``GpuUsageSummary`` objects to create or replace so that every closed
bucket of every node's ``GpuUsageReport`` is in exactly one summary, which reports to
acknowledge, and which to delete (docs/budgets.md, "The fold").

- A bucket's usage goes to the summary of (its namespace, its UTC day). It is added only if the
  bucket starts at or after that summary's ``foldedThrough`` for the node and at or after the
  report's ``acknowledgedThrough``; the same write moves ``foldedThrough`` to the bucket's end.
  So a plan cut short after any of its writes (a leader killed, a 409, an outage) and planned
  again from what the cluster then holds adds nothing twice and loses nothing.
- A report is acknowledged through the end of its last closed bucket once that plan's summaries
  are written (the plumbing writes summaries first and stops at the first failure).
- A report whose Node is gone is folded as if its open bucket were closed, then deleted.

Summaries that are replaced keep the ``resourceVersion`` they were read with, so a concurrent
writer (a second leader) makes the replace fail with a conflict instead of losing its fold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.usage.cluster_objects import (
    API_VERSION,
    DAY_LABEL,
    NAMESPACE_LABEL,
    Clock,
    Report,
    Summary,
    bucket_end,
    day_of,
    summary_name,
)

Obj = dict[str, Any]


@dataclass(frozen=True)
class Fold:
    summaries: list[Obj]
    acks: list[Obj]
    deletions: list[str]
    oldest_unfolded: float | None
    """The start of the oldest closed bucket not yet acknowledged (epoch), before this fold."""


class _Draft:
    """One summary being changed: its buckets, claims and nodes indexed, copied on first
    change (the objects as read are never modified)."""

    def __init__(self, namespace: str, day: str, base: Summary | None) -> None:
        self.namespace, self.day, self.base = namespace, day, base
        spec: Mapping[str, Any] = {} if base is None else base.obj.get("spec") or {}
        self.buckets: dict[str, Obj] = {b["start"]: b for b in spec.get("buckets") or ()}
        self.touched: dict[str, dict[tuple[str, str, str, str], Obj]] = {}
        self.claims: dict[tuple[str, str], Mapping[str, Any]] = {
            (c["claimUID"], c.get("deviceClass", "")): c for c in spec.get("claims") or ()
        }
        self.mine: dict[tuple[str, str], Obj] = {}
        """The claims copied or new (the others are the summary's as read, shared)."""
        self.nodes: dict[str, Mapping[str, Any]] = {n["name"]: n for n in spec.get("nodes") or ()}

    def add(self, node: str, start: str, entry: Mapping[str, Any]) -> None:
        """Add one report entry of ``node``'s bucket ``start`` (the hot path of the fold)."""
        index = self.touched.get(start)
        if index is None:
            index = {}
            for u in (self.buckets.get(start) or {}).get("usage") or ():
                u = dict(u)
                index[_usage_key(u, u["node"])] = u
            self.touched[start] = index
            self.buckets[start] = {"start": start, "usage": None}  # filled by obj()
        # JSON numbers (int or float): adding them to floats keeps floats
        get = entry.get
        allocated = get("allocatedGpuSeconds") or 0.0
        busy = get("busyGpuSeconds") or 0.0
        energy = get("energyJoules") or 0.0
        unobserved = get("unobservedSeconds") or 0.0
        device_class = get("deviceClass") or ""
        product = get("product") or ""
        mig = get("migProfile") or ""
        key = (node, device_class, product, mig)
        u = index.get(key)
        if u is None:
            u = index[key] = {
                "node": node,
                "deviceClass": device_class,
                "product": product,
                "allocatedGpuSeconds": 0.0 + allocated,
                "busyGpuSeconds": 0.0 + busy,
                "energyJoules": 0.0 + energy,
                "unobservedSeconds": 0.0 + unobserved,
            }
            if mig:
                u["migProfile"] = mig
        else:
            u["allocatedGpuSeconds"] += allocated
            u["busyGpuSeconds"] += busy
            u["energyJoules"] += energy
            u["unobservedSeconds"] += unobserved
        ckey = (entry.get("claimUID", ""), device_class)
        claim = self.mine.get(ckey)
        if claim is not None:
            claim["allocatedGpuSeconds"] += allocated
            claim["busyGpuSeconds"] += busy
            claim["energyJoules"] += energy
            return
        was = self.claims.get(ckey)
        claim = {
            "claimUID": ckey[0],
            "claim": entry.get("claim", ""),
            "deviceClass": device_class,
            "allocatedGpuSeconds": 0.0 + allocated,
            "busyGpuSeconds": 0.0 + busy,
            "energyJoules": 0.0 + energy,
        }
        if was is not None:  # the summary's own, as read: add to a copy
            claim["claim"] = was.get("claim", claim["claim"])
            for c in ("allocatedGpuSeconds", "busyGpuSeconds", "energyJoules"):
                claim[c] += was.get(c) or 0.0
        self.mine[ckey] = self.claims[ckey] = claim

    def folded(self, node: str, labels: Mapping[str, str], through: str) -> None:
        # the labels are the report's, shared: nothing here changes them
        self.nodes[node] = {"name": node, "labels": labels, "foldedThrough": through}

    def obj(self) -> Obj:
        name = summary_name(self.namespace, self.day)
        meta: Obj = {} if self.base is None else dict(self.base.obj.get("metadata") or {})
        meta["name"] = name
        meta["labels"] = {
            **(meta.get("labels") or {}),
            NAMESPACE_LABEL: self.namespace,
            DAY_LABEL: self.day,
        }
        buckets = []
        for start in sorted(self.buckets):
            index = self.touched.get(start)
            if index is None:
                buckets.append(self.buckets[start])
            else:
                buckets.append({"start": start, "usage": [index[k] for k in sorted(index)]})
        return {
            "apiVersion": API_VERSION,
            "kind": "GpuUsageSummary",
            "metadata": meta,
            "spec": {
                "namespace": self.namespace,
                "day": self.day,
                "buckets": buckets,
                "claims": [self.claims[k] for k in sorted(self.claims)],
                "nodes": [self.nodes[k] for k in sorted(self.nodes)],
            },
        }


def _usage_key(entry: Mapping[str, Any], node: str) -> tuple[str, str, str, str]:
    return (
        node,
        entry.get("deviceClass") or "",
        entry.get("product") or "",
        entry.get("migProfile") or "",
    )


def fold(
    reports: Iterable[Report],
    summaries: Mapping[str, Summary],
    nodes: frozenset[str],
    clock: Clock,
) -> Fold:
    """What to write so that every closed bucket is folded once (see the module's text)."""
    drafts: dict[str, _Draft] = {}
    acks: list[Obj] = []
    deletions: list[str] = []
    oldest: float | None = None
    for report in reports:
        gone = report.node not in nodes
        through = report.acknowledged
        for bucket in report.buckets:
            if not (bucket.closed or gone):
                break  # the open bucket is last; nothing after it is closed
            end = bucket_end(bucket.start)
            through = max(through, end)
            if bucket.start < report.acknowledged:
                continue  # acknowledged: folded before, the agent has yet to drop it
            oldest = bucket.start if oldest is None else min(oldest, bucket.start)
            _fold_bucket(report, bucket.start, bucket.usage, summaries, drafts, clock)
        if gone:
            deletions.append(report.name)
        elif through > report.acknowledged:
            acks.append(_ack(report.obj, clock.text(through)))
    return Fold([d.obj() for _, d in sorted(drafts.items())], acks, deletions, oldest)


def _fold_bucket(
    report: Report,
    start: float,
    usage: Iterable[Mapping[str, Any]],
    summaries: Mapping[str, Summary],
    drafts: dict[str, _Draft],
    clock: Clock,
) -> None:
    day = day_of(start)
    start_text = clock.text(start)
    end_text = clock.text(bucket_end(start))
    moved: set[str] = set()
    node = report.node
    suffix = f".{day}"
    for entry in usage:
        namespace = entry["namespace"]
        name = namespace + suffix  # summary_name, inlined: the fold's hot loop
        draft = drafts.get(name)
        if draft is None:
            base = summaries.get(name)
            if base is not None and start < base.folded.get(node, 0.0):
                continue  # already in this summary (a plan cut short before the ack)
            draft = drafts[name] = _Draft(namespace, day, base)
        elif draft.base is not None and start < draft.base.folded.get(node, 0.0):
            continue
        draft.add(node, start_text, entry)
        moved.add(name)
    for name in moved:
        drafts[name].folded(report.node, report.labels, end_text)


def _ack(obj: Mapping[str, Any], through: str) -> Obj:
    status = dict(obj.get("status") or {})
    status["acknowledgedThrough"] = through
    return {**obj, "status": status}
