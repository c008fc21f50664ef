"""A budget's period at a moment: calendar months in a time zone (DST included), rolling windows
rounded down to 15-minute buckets, all time; and errors that name the budget, field and value."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.usage.periods import BUCKET_SECONDS, PeriodError, current_period, parse_duration


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def test_a_calendar_month_runs_from_local_midnight_to_the_next_months():
    p = current_period(
        "b", {"type": "CalendarMonth", "timeZone": "Europe/Berlin"}, utc("2026-12-04T12:00:00")
    )
    assert p.start.isoformat() == "2026-12-01T00:00:00+01:00"
    assert p.end.isoformat() == "2027-01-01T00:00:00+01:00"
    assert p.describe() == "period 2026-12-01T00:00:00+01:00 to 2027-01-01T00:00:00+01:00"


def test_the_first_local_hours_of_a_month_belong_to_it_though_utc_says_the_month_before():
    # 2026-11-30T23:30Z is 00:30 on 1 December in Berlin
    p = current_period(
        "b", {"type": "CalendarMonth", "timeZone": "Europe/Berlin"}, utc("2026-11-30T23:30:00")
    )
    assert p.start == utc("2026-11-30T23:00:00")
    assert p.contains(utc("2026-11-30T23:00:00").timestamp())
    assert not p.contains(utc("2026-11-30T22:45:00").timestamp())


def test_a_month_that_crosses_into_summer_time_is_an_hour_shorter():
    p = current_period(
        "b", {"type": "CalendarMonth", "timeZone": "Europe/Berlin"}, utc("2027-03-15T00:00:00")
    )
    assert p.start.isoformat() == "2027-03-01T00:00:00+01:00"
    assert p.end.isoformat() == "2027-04-01T00:00:00+02:00"
    assert p.end_epoch - p.start_epoch == 31 * 86400 - 3600  # real seconds, not wall-clock


def test_a_zone_with_a_quarter_hour_offset_cuts_months_on_bucket_boundaries():
    p = current_period(
        "b", {"type": "CalendarMonth", "timeZone": "Asia/Kathmandu"}, utc("2026-12-04T00:00:00")
    )
    assert p.start.isoformat() == "2026-12-01T00:00:00+05:45"
    assert p.start_epoch % BUCKET_SECONDS == 0


@given(st.integers(min_value=0, max_value=10**8), st.integers(min_value=1, max_value=10**6))
def test_a_rolling_window_starts_on_a_bucket_at_or_before_now_minus_the_window(now_s, window_s):
    now = datetime(2020, 1, 1, tzinfo=UTC) + timedelta(seconds=now_s)
    p = current_period("b", {"type": "Rolling", "window": f"{window_s}s"}, now)
    assert p.start_epoch % BUCKET_SECONDS == 0
    assert (
        now - timedelta(seconds=window_s) - timedelta(minutes=15)
        < p.start
        <= now - timedelta(seconds=window_s)
    )
    assert p.end is None


def test_a_rolling_window_reads_hours_and_minutes():
    p = current_period("b", {"type": "Rolling", "window": "1h30m"}, utc("2026-12-04T12:07:00"))
    assert p.start == utc("2026-12-04T10:30:00")
    assert parse_duration("720h", "x") == timedelta(days=30)


def test_no_period_is_all_time():
    for period in (None, {"type": "None"}):
        p = current_period("b", period, utc("2026-12-04T12:00:00"))
        assert (p.start, p.end) == (None, None)
        assert p.contains(0.0)


@pytest.mark.parametrize(
    ("period", "words"),
    [
        (
            {"type": "CalendarMonth", "timeZone": "Mars/Olympus"},
            "GpuBudget b: spec.period.timeZone: unknown time zone 'Mars/Olympus'",
        ),
        ({"type": "CalendarMonth", "timeZone": "../etc"}, "unknown time zone '../etc'"),
        (
            {"type": "Rolling", "window": "3d"},
            "GpuBudget b: spec.period.window: '3d' is not a duration",
        ),
        ({"type": "Rolling", "window": "0h"}, "spec.period.window: '0h' must be longer than 0s"),
        ({"type": "Weekly"}, "spec.period.type: unknown period type 'Weekly'"),
    ],
)
def test_a_bad_period_names_the_budget_the_field_and_the_value(period, words):
    with pytest.raises(PeriodError) as err:
        current_period("b", period, utc("2026-12-04T12:00:00"))
    assert words in str(err.value)
