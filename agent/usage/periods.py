"""Periods: the stretch of time a GpuBudget counts at a given moment (pure).

- ``CalendarMonth`` in an IANA time zone: from local midnight of the 1st to local midnight of the
  next month's 1st. zoneinfo gives the offset in force at that local time, so a month that
  starts in winter time and ends in summer time is one hour shorter, as a wall clock says.
- ``Rolling`` with a ``window`` such as ``720h`` or ``1h30m``: from ``now - window`` rounded
  **down** to a 15-minute bucket boundary, to now. Down, because the record is cut in 15-minute
  buckets (docs/budgets.md): rounding down counts the whole bucket that holds the window's
  start, so a budget is never under-counted (it may count up to 15 minutes more of old usage);
  rounding up would let up to 15 minutes of usage escape every budget.
- ``None`` (or no period): all time.

Every IANA zone's present UTC offset is a multiple of 15 minutes, so each period is a whole
number of buckets. A bad zone or window raises a PeriodError naming the budget, the field and
the value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

BUCKET_SECONDS = 900
DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
MAX_DURATION = timedelta(days=3660)


class PeriodError(ValueError):
    """A budget's period (or grace period) cannot be read; the text names budget, field, value."""


@dataclass(frozen=True)
class Period:
    kind: str
    """CalendarMonth, Rolling or None."""
    start: datetime | None
    """Inclusive; None: all time. Aware; in the budget's zone for CalendarMonth, else UTC."""
    end: datetime | None
    """Exclusive; None: open (Rolling and None periods end now)."""
    window: str = ""

    @property
    def start_epoch(self) -> float | None:
        return None if self.start is None else self.start.timestamp()

    @property
    def end_epoch(self) -> float | None:
        return None if self.end is None else self.end.timestamp()

    def contains(self, bucket_start: float) -> bool:
        """Whether the bucket starting at this epoch second lies in the period."""
        s, e = self.start_epoch, self.end_epoch
        return (s is None or bucket_start >= s) and (e is None or bucket_start < e)

    def describe(self) -> str:
        """How the period reads in a condition's message."""
        if self.kind == "CalendarMonth" and self.start is not None and self.end is not None:
            return f"period {self.start.isoformat()} to {self.end.isoformat()}"
        if self.kind == "Rolling" and self.start is not None:
            return f"rolling {self.window} window from {_utc(self.start)}"
        return "no period: all time"


def floor_bucket(epoch: float) -> float:
    """The start of the 15-minute UTC bucket holding this epoch second."""
    return float(int(epoch // BUCKET_SECONDS) * BUCKET_SECONDS)


def parse_duration(text: str, where: str) -> timedelta:
    """A Go-style duration limited to hours, minutes and seconds (``720h``, ``1h30m``, ``90s``),
    as the CRD's pattern allows; ``where`` names the budget and field for the error."""
    m = DURATION.fullmatch(text) if isinstance(text, str) else None
    if m is None or not text:
        raise PeriodError(
            f"{where}: {text!r} is not a duration; expected hours, minutes and/or seconds such"
            " as 720h or 1h30m"
        )
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    value = timedelta(hours=h, minutes=mi, seconds=s)
    if value > MAX_DURATION:
        raise PeriodError(f"{where}: {text!r} is longer than the 87840h allowed")
    return value


def zone(name: object, where: str) -> ZoneInfo:
    """An IANA time zone by name; a PeriodError naming ``where`` and the value otherwise."""
    if not isinstance(name, str) or not name:
        raise PeriodError(
            f"{where}: {name!r} is not a time zone; expected an IANA name such as Europe/Berlin"
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise PeriodError(
            f"{where}: unknown time zone {name!r}; expected an IANA name such as Europe/Berlin"
        ) from None


def current_period(budget: str, period: Mapping[str, Any] | None, now: datetime) -> Period:
    """The period of budget ``budget`` (its name, for errors) holding ``now`` (aware)."""
    where = f"GpuBudget {budget}: spec.period"
    kind = "None" if not period else period.get("type", "None")
    if kind == "None":
        return Period("None", None, None)
    assert period is not None
    if kind == "CalendarMonth":
        tz = zone(period.get("timeZone"), f"{where}.timeZone")
        local = now.astimezone(tz)
        start = datetime(local.year, local.month, 1, tzinfo=tz)
        year, month = (local.year + 1, 1) if local.month == 12 else (local.year, local.month + 1)
        return Period(kind, start, datetime(year, month, 1, tzinfo=tz))
    if kind == "Rolling":
        window = period.get("window", "")
        length = parse_duration(window, f"{where}.window")
        if length <= timedelta(0):
            raise PeriodError(f"{where}.window: {window!r} must be longer than 0s")
        start = datetime.fromtimestamp(floor_bucket((now - length).timestamp()), UTC)
        return Period(kind, start, None, window)
    raise PeriodError(
        f"{where}.type: unknown period type {kind!r}; expected CalendarMonth, Rolling or None"
    )


def _utc(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
