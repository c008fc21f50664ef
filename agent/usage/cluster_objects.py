"""Reading the cluster's usage objects (pure): a node's ``GpuUsageReport`` and a namespace-day's
``GpuUsageSummary`` (docs/budgets.md, "Usage in the cluster"), as the planner and ``tessera
usage --cluster`` need them: bucket starts as epoch seconds, each summary's per-node
``foldedThrough`` watermark. The objects are the API server's, validated by their CRDs; what
they hold is read as is, never changed here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from agent.usage.periods import BUCKET_SECONDS

API_VERSION = "tessera.dev/v1alpha1"
NAMESPACE_LABEL = "tessera.dev/namespace"
DAY_LABEL = "tessera.dev/day"
COUNTERS = ("allocatedGpuSeconds", "busyGpuSeconds", "energyJoules", "unobservedSeconds")


class Clock:
    """RFC 3339 text to epoch seconds and back, remembering what it parsed: a reconcile reads
    the same few bucket starts tens of thousands of times (one per node and namespace)."""

    def __init__(self) -> None:
        self._epochs: dict[str, float] = {}
        self._texts: dict[float, str] = {}

    def epoch(self, text: str) -> float:
        found = self._epochs.get(text)
        if found is None:
            found = datetime.fromisoformat(text).timestamp()
            self._epochs[text] = found
        return found

    def text(self, epoch: float) -> str:
        found = self._texts.get(epoch)
        if found is None:
            found = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            self._texts[epoch] = found
        return found


def day_of(epoch: float) -> str:
    """The UTC day (``yyyy-mm-dd``) of an epoch second."""
    # date.isoformat: the same text as strftime("%Y-%m-%d"), a third of its cost (hot: once
    # per report bucket)
    return datetime.fromtimestamp(epoch, UTC).date().isoformat()


def summary_name(namespace: str, day: str) -> str:
    return f"{namespace}.{day}"


class ReportBucket(NamedTuple):
    """A tuple, not a frozen dataclass: a reconcile builds 20,000 (bench/budgets.py), and a
    frozen dataclass's ``__init__`` costs a ``setattr`` per field."""

    start: float
    closed: bool
    usage: Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Report:
    name: str
    node: str
    labels: Mapping[str, str]
    acknowledged: float
    """``status.acknowledgedThrough`` (epoch seconds; 0 when never acknowledged)."""
    buckets: tuple[ReportBucket, ...]
    """In start order."""
    obj: Mapping[str, Any]


@dataclass(frozen=True)
class Summary:
    name: str
    namespace: str
    day: str
    folded: Mapping[str, float]
    """Per node, ``foldedThrough`` as epoch seconds."""
    labels: Mapping[str, Mapping[str, str]]
    """Per node, its labels when last folded."""
    obj: Mapping[str, Any]


def read_report(obj: Mapping[str, Any], clock: Clock) -> Report:
    spec = obj.get("spec") or {}
    name = obj["metadata"]["name"]
    ack_text = (obj.get("status") or {}).get("acknowledgedThrough")
    buckets = sorted(
        (
            ReportBucket(clock.epoch(b["start"]), bool(b.get("closed")), b.get("usage") or ())
            for b in spec.get("buckets") or ()
        ),
        key=lambda b: b.start,
    )
    return Report(
        name,
        spec.get("nodeName") or name,
        spec.get("nodeLabels") or {},
        clock.epoch(ack_text) if ack_text else 0.0,
        tuple(buckets),
        obj,
    )


def read_summary(obj: Mapping[str, Any], clock: Clock) -> Summary:
    spec = obj.get("spec") or {}
    nodes = spec.get("nodes") or ()
    return Summary(
        obj["metadata"]["name"],
        spec["namespace"],
        spec["day"],
        {n["name"]: clock.epoch(n["foldedThrough"]) for n in nodes if n.get("foldedThrough")},
        {n["name"]: n.get("labels") or {} for n in nodes},
        obj,
    )


def bucket_end(start: float) -> float:
    return start + BUCKET_SECONDS
