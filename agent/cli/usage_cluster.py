"""``tessera usage --cluster``: a cluster's usage per namespace and DeviceClass over a time range,
from its record (the GpuUsageSummaries and the GpuUsageReports not yet folded into them,
docs/budgets.md), summed by the same code as the budget controller's
(``agent.usage.cluster_usage`` and ``agent.usage.budget_amounts``), so both show the same
figures. Only ``dra_driver.cluster`` talks to the API server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from agent.errors import ConfigError
from agent.usage.budget_amounts import in_scope
from agent.usage.cluster_objects import Clock, Report, Summary, read_report, read_summary
from agent.usage.cluster_usage import collect, live_entries
from agent.usage.periods import Period, PeriodError, floor_bucket, zone
from agent.usage.prices import JOULES_PER_KWH, SECONDS_PER_HOUR, PriceTable

GROUP = "/apis/tessera.dev/v1alpha1"
PAGE = 500
Request = Callable[[str, str, Mapping[str, str]], dict[str, Any]]
"""``KubeClient.request`` without the body: (method, path, query) -> the decoded object."""


@dataclass(frozen=True)
class ClusterRow:
    namespace: str
    device_class: str
    gpu_hours: Decimal
    energy_kwh: Decimal
    cost: Decimal | None


def list_all(request: Request, resource: str) -> list[dict[str, Any]]:
    """Every object of a tessera.dev resource, in pages of ``PAGE`` (``limit``/``continue``)."""
    out: list[dict[str, Any]] = []
    token = ""
    while True:
        query = {"limit": str(PAGE), **({"continue": token} if token else {})}
        page = request("GET", f"{GROUP}/{resource}", query)
        out.extend(page.get("items") or ())
        token = (page.get("metadata") or {}).get("continue") or ""
        if not token:
            return out


def time_range(
    since: str, until: str, period: str, time_zone: str, now: datetime
) -> tuple[datetime | None, datetime | None]:
    """The range asked for, each end on a 15-minute boundary (rounded down, as budgets are):
    ``--period month`` is the calendar month holding now in ``--time-zone``; otherwise
    ``--since`` and ``--until`` (a day, ``yyyy-mm-dd``, midnight in ``--time-zone``, or an RFC
    3339 time); either may be left out (all time, now)."""
    try:
        tz = zone(time_zone, "--time-zone")
    except PeriodError as exc:
        raise ConfigError(str(exc)) from None
    if period == "month":
        if since or until:
            raise ConfigError("--period month goes against --since/--until: give one")
        local = now.astimezone(tz)
        start = datetime(local.year, local.month, 1, tzinfo=tz)
        year, month = (local.year + 1, 1) if local.month == 12 else (local.year, local.month + 1)
        return start, datetime(year, month, 1, tzinfo=tz)
    return _moment(since, "--since", tz), _moment(until, "--until", tz)


def _moment(text: str, flag: str, tz: Any) -> datetime | None:
    if not text:
        return None
    try:
        if len(text) == 10:
            day = datetime.strptime(text, "%Y-%m-%d")
            return datetime(day.year, day.month, day.day, tzinfo=tz)
        at = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r}: expected a day (2026-12-01) or an RFC 3339 time"
            " (2026-12-01T08:00:00Z)"
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=tz)
    return datetime.fromtimestamp(floor_bucket(at.timestamp()), UTC)


@dataclass(frozen=True)
class ClaimRow:
    namespace: str
    claim: str
    claim_uid: str
    device_class: str
    gpu_hours: Decimal
    energy_kwh: Decimal


def _read(
    request: Request, start: datetime | None, end: datetime | None
) -> tuple[Clock, list[Report], dict[str, Summary]]:
    if start is not None and end is not None and end <= start:
        raise ConfigError(
            f"the range ends ({end.isoformat()}) before it starts ({start.isoformat()})"
        )
    clock = Clock()
    reports = [read_report(r, clock) for r in list_all(request, "gpuusagereports")]
    summaries = {
        s.name: s for s in (read_summary(o, clock) for o in list_all(request, "gpuusagesummaries"))
    }
    return clock, reports, summaries


def cluster_rows(
    request: Request,
    start: datetime | None,
    end: datetime | None,
    prices: PriceTable | None,
) -> list[ClusterRow]:
    """One row per (namespace, DeviceClass) with usage in [start, end)."""
    clock, reports, summaries = _read(request, start, end)
    usage = collect(reports, summaries, clock)
    period = Period("Range", start, end)
    rows = []
    for ns in sorted(usage.namespaces):
        found = in_scope(usage, [ns], period, None, prices)
        for device_class, amounts in sorted(found.by_class.items()):
            rows.append(
                ClusterRow(ns, device_class, amounts.gpu_hours, amounts.energy_kwh, amounts.cost)
            )
    return rows


def describe(start: datetime | None, end: datetime | None) -> str:
    def at(d: datetime | None, none: str) -> str:
        return none if d is None else d.isoformat()

    return f"from {at(start, 'the beginning')} to {at(end, 'now')}"


def claim_rows(request: Request, start: datetime | None, end: datetime | None) -> list[ClaimRow]:
    """One row per (namespace, claim, DeviceClass) with usage in [start, end): the summaries'
    per-claim day totals plus the report entries not yet folded. Summaries keep a claim's
    totals per UTC day, so the range must be whole UTC days; they hold no product or node, so
    a claim has no cost here (the namespace rows have)."""
    for flag, at in (("--since", start), ("--until", end)):
        if at is not None and at.timestamp() % 86400:
            raise ConfigError(
                f"{flag} {at.isoformat()}: claims can be shown over whole UTC days only"
                " (summaries keep each claim's totals per UTC day); give days with --time-zone"
                " UTC, or --by namespace for any range"
            )
    _, reports, summaries = _read(request, start, end)
    period = Period("Range", start, end)
    sums: dict[tuple[str, str, str], list[Any]] = {}

    def add(ns: str, c: Mapping[str, Any]) -> None:
        key = (ns, c.get("claimUID", ""), c.get("deviceClass") or "")
        row = sums.setdefault(key, [c.get("claim", ""), 0.0, 0.0])
        row[1] += c.get("allocatedGpuSeconds") or 0.0
        row[2] += c.get("energyJoules") or 0.0

    for summary in summaries.values():
        day = datetime.strptime(summary.day, "%Y-%m-%d").replace(tzinfo=UTC).timestamp()
        if period.contains(day):  # the whole day, as the range is whole days
            for c in (summary.obj.get("spec") or {}).get("claims") or ():
                add(summary.namespace, c)
    for _, bucket_start, entry in live_entries(reports, summaries):
        if period.contains(bucket_start):
            add(entry["namespace"], entry)
    return [
        ClaimRow(
            ns,
            name,
            uid,
            device_class,
            Decimal(repr(seconds)) / SECONDS_PER_HOUR,
            Decimal(repr(joules)) / JOULES_PER_KWH,
        )
        for (ns, uid, device_class), (name, seconds, joules) in sorted(sums.items())
    ]
