"""The ledger's 15-minute UTC buckets: what was counted in each quarter hour, per claim, device
class, product and MIG profile (the cluster's record, ``GpuUsageReport``, carries them).

Why 15 minutes: every IANA time zone's offset from UTC is a multiple of it (India +5:30, Nepal
+5:45), so a calendar month in any time zone, and a rolling window rounded down to 15 minutes,
is a whole number of buckets: a period's usage is a sum of buckets, with no interpolation.

**Splitting.** An interval's counters (allocated, busy, energy, unobserved) cover a span of
wall-clock time; :meth:`Buckets.add` splits each across the bucket boundaries the span crosses in
proportion to the seconds on each side (a span of no length goes whole into the bucket holding
its instant). A span never reaches back before the buckets' ``horizon`` (the latest second ever
counted): a span that would (the wall clock stepped back) is moved forward to start there, so a
bucket whose end is at or before the horizon (a **closed** bucket) never changes again.

**Dropping.** :meth:`Buckets.acknowledge` drops the closed buckets that start before an
acknowledged instant (the controller folded them); an open bucket, or one not acknowledged, is
never dropped.

Pure arithmetic on plain data (no I/O); the ledger (:mod:`agent.usage.counters`) stores the
buckets in its state file with its counters, under the same exactly-once rules.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from agent.decode import fields

BUCKET_SECONDS = 900
"""15 minutes."""

EntryKey = tuple[str, str, str, str | None]
"""(claim UID, device class, product, MIG profile or None for a whole GPU)."""


class Usage:
    """What one (claim, device class, product, MIG profile) counted in one bucket (mutable: the
    ledger adds to it every interval)."""

    __slots__ = ("allocated", "busy", "claim", "energy", "namespace", "unobserved")

    def __init__(
        self,
        namespace: str,
        claim: str,
        allocated: float = 0.0,
        busy: float = 0.0,
        energy: float = 0.0,
        unobserved: float = 0.0,
    ) -> None:
        self.namespace, self.claim = namespace, claim
        self.allocated, self.busy, self.energy, self.unobserved = (
            allocated,
            busy,
            energy,
            unobserved,
        )


class Share(NamedTuple):
    """One interval's counters for one holding, before they are split (a named tuple: one is
    made per held device every tick)."""

    key: EntryKey
    namespace: str
    claim: str
    allocated: float
    busy: float
    energy: float
    unobserved: float


def bucket_start(t: float) -> int:
    """The start (UTC epoch seconds, a multiple of 15 minutes) of the bucket holding ``t``."""
    return math.floor(t / BUCKET_SECONDS) * BUCKET_SECONDS


def pieces(start: float, end: float) -> list[tuple[int, float]]:
    """(bucket start, fraction of the span ``start``-``end`` in it), in order; the fractions sum
    to 1. A span of no length is wholly in the bucket holding ``end``."""
    if end <= start:
        return [(bucket_start(end), 1.0)]
    span = end - start
    out: list[tuple[int, float]] = []
    b = bucket_start(start)
    while b < end:  # one pass in the common case: an interval of a second within one bucket
        seconds = min(end, b + BUCKET_SECONDS) - max(start, b)
        if seconds > 0:
            out.append((b, seconds / span))
        b += BUCKET_SECONDS
    return out


def rfc3339(t: float) -> str:
    """``t`` (epoch seconds) as RFC 3339 UTC with microseconds, e.g. 2026-12-04T12:07:31.250000Z
    (whole seconds without the fraction)."""
    d = datetime.fromtimestamp(t, UTC)
    if d.microsecond:
        return d.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return d.strftime("%Y-%m-%dT%H:%M:%SZ")


class Buckets:
    """A ledger's buckets (see the module docstring). One thread."""

    def __init__(
        self, buckets: Mapping[int, Mapping[EntryKey, Usage]] | None = None, horizon: float = 0.0
    ) -> None:
        self._buckets: dict[int, dict[EntryKey, Usage]] = {
            b: dict(e) for b, e in sorted((buckets or {}).items())
        }
        self.horizon = horizon
        """The latest second ever counted: buckets ending at or before it are closed."""

    def add(self, start: float, end: float, shares: Sequence[Share]) -> None:
        """Count ``shares`` over the span ``start``-``end`` (wall clock), split by seconds; the
        span is moved forward to start no earlier than the horizon."""
        if start < self.horizon:
            end += self.horizon - start
            start = self.horizon
        self.horizon = max(self.horizon, end)
        if not shares:
            return
        for b, frac in pieces(start, end):
            entries = self._buckets.get(b)
            if entries is None:
                entries = self._buckets[b] = {}  # always the latest: spans only move forward
            for s in shares:
                u = entries.get(s.key)
                if u is None:
                    u = entries[s.key] = Usage(s.namespace, s.claim)
                u.namespace, u.claim = s.namespace, s.claim
                u.allocated += s.allocated * frac
                u.busy += s.busy * frac
                u.energy += s.energy * frac
                u.unobserved += s.unobserved * frac

    def single(self, start: float, end: float) -> int | None:
        """When the span ``start``-``end`` (moved forward to the horizon as :meth:`add` moves
        it) lies within one bucket: that bucket's start, with the horizon moved to the span's
        end, for the caller to add to its :meth:`entries` directly; else None (then :meth:`add`
        splits it). The common case, every tick: a second within a quarter hour, counted
        without building a :class:`Share` per holding (``python -m bench telemetry`` measures
        the sampler's CPU per tick)."""
        if start < self.horizon:
            end += self.horizon - start
            start = self.horizon
        b = bucket_start(end) if end <= start else bucket_start(start)
        if end > b + BUCKET_SECONDS:
            return None  # it crosses a boundary (pieces() splits it)
        self.horizon = max(self.horizon, end)
        return b

    def entries(self, start: int) -> dict[EntryKey, Usage]:
        """The entries of the bucket at ``start`` (made when missing), to add to."""
        entries = self._buckets.get(start)
        if entries is None:
            entries = self._buckets[start] = {}
        return entries

    def closed(self, start: int) -> bool:
        return start + BUCKET_SECONDS <= self.horizon

    def acknowledge(self, through: float) -> int:
        """Drop the closed buckets that start before ``through``; how many were dropped."""
        gone = [b for b in self._buckets if b < through and self.closed(b)]
        for b in gone:
            del self._buckets[b]
        return len(gone)

    def items(self) -> Iterator[tuple[int, dict[EntryKey, Usage]]]:
        """(start, entries) in start order."""
        return iter(self._buckets.items())

    def totals(self) -> dict[EntryKey, tuple[float, float, float, float]]:
        """Each entry key's sums over every bucket (allocated, busy, energy, unobserved)."""
        out: dict[EntryKey, tuple[float, float, float, float]] = {}
        for entries in self._buckets.values():
            for k, u in entries.items():
                a, b, e, n = out.get(k, (0.0, 0.0, 0.0, 0.0))
                out[k] = (a + u.allocated, b + u.busy, e + u.energy, n + u.unobserved)
        return out

    # -- the state file ---------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "horizon": self.horizon,
            "buckets": [
                {
                    "start": b,
                    "usage": [
                        {
                            "claimUID": k[0],
                            "deviceClass": k[1],
                            "product": k[2],
                            "migProfile": k[3],
                            "namespace": u.namespace,
                            "claim": u.claim,
                            "allocatedGpuSeconds": u.allocated,
                            "busyGpuSeconds": u.busy,
                            "energyJoules": u.energy,
                            "unobservedSeconds": u.unobserved,
                        }
                        for k, u in sorted(entries.items(), key=_entry_order)
                    ],
                }
                for b, entries in self._buckets.items()
            ],
        }

    @classmethod
    def decode(cls, value: object, path: str) -> Buckets:
        """From :meth:`state`'s form; raises FieldError naming the field."""
        obj = fields.obj(value, path)
        horizon = fields.number(obj.get("horizon"), f"{path}.horizon", low=0)
        buckets: dict[int, dict[EntryKey, Usage]] = {}
        for i, b in enumerate(fields.objects(obj.get("buckets"), f"{path}.buckets")):
            p = f"{path}.buckets[{i}]"
            start = fields.integer(b.get("start"), f"{p}.start", low=0)
            if start % BUCKET_SECONDS:
                raise fields.FieldError(
                    f"{p}.start", f"must be a multiple of {BUCKET_SECONDS}, got {start}"
                )
            entries: dict[EntryKey, Usage] = {}
            for j, e in enumerate(fields.objects(b.get("usage"), f"{p}.usage")):
                q = f"{p}.usage[{j}]"
                key = (
                    fields.text(e.get("claimUID"), f"{q}.claimUID"),
                    fields.text(e.get("deviceClass"), f"{q}.deviceClass"),
                    fields.text(e.get("product"), f"{q}.product"),
                    fields.opt_text(e.get("migProfile"), f"{q}.migProfile"),
                )
                entries[key] = Usage(
                    fields.text(e.get("namespace"), f"{q}.namespace"),
                    fields.text(e.get("claim"), f"{q}.claim"),
                    fields.number(e.get("allocatedGpuSeconds"), f"{q}.allocatedGpuSeconds", low=0),
                    fields.number(e.get("busyGpuSeconds"), f"{q}.busyGpuSeconds", low=0),
                    fields.number(e.get("energyJoules"), f"{q}.energyJoules", low=0),
                    fields.number(e.get("unobservedSeconds"), f"{q}.unobservedSeconds", low=0),
                )
            buckets[start] = entries
        return cls(buckets, horizon)


def report_buckets(buckets: Buckets, max_bytes: int) -> list[dict[str, Any]]:
    """The buckets as a ``GpuUsageReport``'s ``spec.buckets`` carries them (contract: oldest
    first, ``closed``, one ``usage`` entry per key, ``migProfile`` omitted for a whole GPU),
    as many as fit in about ``max_bytes`` of JSON (the oldest always, whatever its size: the
    rest wait for the next report, once the controller has acknowledged these). Pure."""
    out: list[dict[str, Any]] = []
    size = 0
    for start, entries in buckets.items():
        usage = []
        for k, u in sorted(entries.items(), key=_entry_order):
            entry: dict[str, Any] = {
                "namespace": u.namespace,
                "claim": u.claim,
                "claimUID": k[0],
                "deviceClass": k[1],
                "product": k[2],
            }
            if k[3] is not None:
                entry["migProfile"] = k[3]
            entry.update(
                allocatedGpuSeconds=u.allocated,
                busyGpuSeconds=u.busy,
                energyJoules=u.energy,
                unobservedSeconds=u.unobserved,
            )
            usage.append(entry)
        bucket = {"start": rfc3339(start), "closed": buckets.closed(start), "usage": usage}
        size += len(json.dumps(bucket, separators=(",", ":")))
        if out and size > max_bytes:
            break
        out.append(bucket)
    return out


def _entry_order(item: tuple[EntryKey, Usage]) -> tuple[str, str, str, str]:
    k = item[0]
    return (k[0], k[1], k[2], k[3] or "")
