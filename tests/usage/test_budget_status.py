"""A GpuBudget's status, Events and gauges from the cluster's usage record: used and remaining
per limit over its period (summaries plus the live report buckets, never counted twice),
thresholds once per period, exhaustion and restoration, exact cost, projected exhaustion, and
a clear Reconciled=False instead of a guess."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from agent.usage.budget_plan import ClusterView, Plan, plan
from agent.usage.prices import price_table
from tests.usage.clusterobjs import bucket, budget, check_budget, entry, namespace, report

DEC4 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
MONTH = {"type": "CalendarMonth", "timeZone": "Europe/Berlin"}
PRICES = price_table(
    {
        "currency": "EUR",
        "gpuHour": [{"match": {"deviceClass": "gpu.tessera.dev"}, "price": "2.50"}],
        "energy": [{"pricePerKWh": "0.20"}],
    }
)


def hours(n: float) -> float:
    return n * 3600.0


def view(reports=(), summaries=(), budgets=(), namespaces=(), prices=None, pods=(), claims=()):
    nodes = frozenset(r["spec"]["nodeName"] for r in reports)
    return ClusterView(
        list(reports),
        list(summaries),
        list(budgets),
        list(namespaces),
        nodes,
        list(pods),
        list(claims),
        prices,
    )


def status_of(p: Plan, name: str) -> dict[str, Any]:
    (obj,) = [b for b in p.statuses if b["metadata"]["name"] == name]
    check_budget(obj)
    return obj["status"]


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    (c,) = [c for c in status["conditions"] if c["type"] == kind]
    return c


def test_a_months_usage_counts_the_buckets_of_the_local_month_once_summaries_and_live_together():
    r = report(
        "n1",
        # 23:45 UTC on 30 November is 00:45 on 1 December in Berlin: in the month
        bucket("2026-11-30T23:45:00Z", entry("team-a", allocated=hours(10))),
        bucket("2026-11-30T22:45:00Z", entry("team-a", allocated=hours(100))),  # November in Berlin
        bucket("2026-12-04T11:45:00Z", entry("team-a", allocated=hours(2), energy=7.2e6)),
        bucket("2026-12-04T12:00:00Z", entry("team-a", allocated=hours(1)), closed=False),
        bucket("2026-12-04T11:30:00Z", entry("team-b", allocated=hours(500))),  # another team
    )
    b = budget(
        "team-a-monthly", scope={"namespace": "team-a"}, period=MONTH, limits={"gpuHours": "1200"}
    )
    first = plan(view([r], budgets=[b]), DEC4)
    s = status_of(first, "team-a-monthly")
    assert s["used"] == {"gpuHours": "13.000", "energyKWh": "2.000"}
    assert s["remaining"] == {"gpuHours": "1187.000"}
    assert s["periodStart"] == "2026-12-01T00:00:00+01:00"
    assert s["periodEnd"] == "2027-01-01T00:00:00+01:00"
    assert s["byDeviceClass"] == [
        {"deviceClass": "gpu.tessera.dev", "gpuHours": "13.000", "energyKWh": "2.000"}
    ]
    assert s["lastReconcileTime"] == "2026-12-04T12:00:00Z" and s["observedGeneration"] == 3
    assert condition(s, "Exhausted")["status"] == "False"
    assert condition(s, "Reconciled")["status"] == "True"
    # once folded (the summaries written, the report acknowledged), the figures are the same
    acked = first.acks[0]
    again = plan(view([acked], first.summaries, [b]), DEC4)
    assert status_of(again, "team-a-monthly")["used"] == s["used"]


def test_thresholds_warn_once_each_exhaustion_is_announced_and_a_raised_limit_restores():
    ns = [namespace("team-a")]
    b = budget("a", scope={"namespace": "team-a"}, period=MONTH, limits={"gpuHours": "10"})

    def at(used_hours: float, current: dict[str, Any]) -> Plan:
        r = report(
            "n1",
            bucket(
                "2026-12-04T11:45:00Z", entry("team-a", allocated=hours(used_hours)), closed=False
            ),
        )
        return plan(view([r], budgets=[current], namespaces=ns), DEC4)

    p = at(8.5, b)
    assert [(e.namespace, e.type, e.reason) for e in p.events] == [
        ("team-a", "Warning", "GpuBudgetThreshold")
    ]
    assert "80 %" in p.events[0].message
    b = {**b, "status": status_of(p, "a")}
    assert b["status"]["thresholdsReached"] == [80]
    assert at(8.6, b).events == []  # once per threshold
    p = at(10.4, b)
    assert [e.reason for e in p.events] == ["GpuBudgetThreshold", "GpuBudgetExhausted"]
    s = status_of(p, "a")
    assert s["thresholdsReached"] == [80, 90]
    assert s["exhaustedSince"] == "2026-12-04T12:00:00Z"
    exhausted = condition(s, "Exhausted")
    assert exhausted["status"] == "True" and exhausted["reason"] == "LimitReached"
    assert exhausted["message"] == (
        "used 10.400 of 10 GPU-hours"
        " (period 2026-12-01T00:00:00+01:00 to 2027-01-01T00:00:00+01:00)"
    )
    assert s["remaining"] == {"gpuHours": "0.000"}
    assert [g.exhausted for g in p.gauges] == [True]
    b = {**b, "status": s}
    assert at(10.5, b).events == []
    raised = {**b, "spec": {**b["spec"], "limits": {"gpuHours": "20"}}}
    p = at(10.5, raised)
    assert [(e.type, e.reason) for e in p.events] == [("Normal", "GpuBudgetRestored")]
    s = status_of(p, "a")
    assert "exhaustedSince" not in s
    assert condition(s, "Exhausted")["status"] == "False"
    assert s["thresholdsReached"] == [80, 90]  # a calendar month warns once per threshold


def test_a_new_month_forgets_the_thresholds_and_the_exhaustion():
    old = {
        "periodStart": "2026-11-01T00:00:00+01:00",
        "thresholdsReached": [80, 90],
        "exhaustedSince": "2026-11-20T00:00:00Z",
        "conditions": [
            {
                "type": "Exhausted",
                "status": "True",
                "reason": "LimitReached",
                "message": "x",
                "lastTransitionTime": "2026-11-20T00:00:00Z",
            }
        ],
    }
    b = budget("a", old, scope={"namespace": "team-a"}, period=MONTH, limits={"gpuHours": "10"})
    r = report(
        "n1", bucket("2026-12-04T11:45:00Z", entry("team-a", allocated=hours(8.5)), closed=False)
    )
    p = plan(view([r], budgets=[b], namespaces=[namespace("team-a")]), DEC4)
    s = status_of(p, "a")
    assert s["thresholdsReached"] == [80]
    assert "exhaustedSince" not in s
    assert [e.reason for e in p.events] == ["GpuBudgetThreshold", "GpuBudgetRestored"]
    assert condition(s, "Exhausted")["lastTransitionTime"] == "2026-12-04T12:00:00Z"


def test_cost_is_exact_and_by_device_class_and_a_selector_picks_namespaces_by_label():
    r = report(
        "n1",
        bucket(
            "2026-12-04T11:45:00Z",
            entry("r1", allocated=hours(1), energy=3.6e6),  # 2.50 + 0.20
            entry("r2", allocated=hours(2), device_class="mig.tessera.dev", mig="1g.10gb"),
            entry("other", allocated=hours(50)),
        ),
    )
    b = budget(
        "research",
        scope={"namespaceSelector": {"matchLabels": {"org": "research"}}},
        deviceClasses=["gpu.tessera.dev"],
        period={"type": "Rolling", "window": "720h"},
        limits={"cost": {"amount": "100", "currency": "EUR"}},
    )
    namespaces = [
        namespace("r1", org="research"),
        namespace("r2", org="research"),
        namespace("other"),
    ]
    s = status_of(
        plan(view([r], budgets=[b], namespaces=namespaces, prices=PRICES), DEC4), "research"
    )
    assert s["used"] == {"gpuHours": "1.000", "energyKWh": "1.000", "cost": "2.70"}
    assert s["remaining"] == {"cost": "97.30"}
    assert s["byDeviceClass"] == [
        {
            "deviceClass": "gpu.tessera.dev",
            "gpuHours": "1.000",
            "energyKWh": "1.000",
            "cost": "2.70",
        }
    ]
    assert s["periodStart"] == "2026-11-04T12:00:00Z" and "periodEnd" not in s
    # without the class filter, the MIG slice has no price: cost is not guessed
    b["spec"].pop("deviceClasses")
    s = status_of(
        plan(view([r], budgets=[b], namespaces=namespaces, prices=PRICES), DEC4), "research"
    )
    reconciled = condition(s, "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("False", "Unpriced")
    assert "NVIDIA H100 80GB HBM3 1g.10gb (mig.tessera.dev)" in reconciled["message"]
    assert "cost" not in s["used"]
    assert condition(s, "Exhausted")["status"] == "Unknown"


def test_a_cost_limit_in_another_currency_than_the_price_tables_is_not_reconciled():
    b = budget(
        "a",
        scope={"namespace": "a"},
        limits={"gpuHours": "5", "cost": {"amount": "10", "currency": "USD"}},
    )
    r = report("n1", bucket("2026-12-04T11:45:00Z", entry("a", allocated=hours(6))))
    p = plan(view([r], budgets=[b], prices=PRICES), DEC4)
    s = status_of(p, "a")
    reconciled = condition(s, "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("False", "CurrencyMismatch")
    assert "'USD'" in reconciled["message"] and "'EUR'" in reconciled["message"]
    assert condition(s, "Exhausted")["status"] == "True"  # the GPU-hour limit still counts
    assert [g.limit for g in p.gauges] == ["gpuHours"]
    no_table = status_of(plan(view([r], budgets=[b]), DEC4), "a")
    assert condition(no_table, "Reconciled")["reason"] == "NoPriceTable"


def test_an_unknown_time_zone_is_a_condition_naming_it_and_the_last_figures_stay():
    old = {"used": {"gpuHours": "3.000", "energyKWh": "0.000"}}
    b = budget(
        "a",
        old,
        scope={"namespace": "a"},
        period={"type": "CalendarMonth", "timeZone": "Mars/Olympus"},
        limits={"gpuHours": "5"},
    )
    p = plan(view(budgets=[b]), DEC4)
    s = status_of(p, "a")
    c = condition(s, "Reconciled")
    assert (c["status"], c["reason"]) == ("False", "InvalidPeriod")
    assert c["message"] == (
        "GpuBudget a: spec.period.timeZone: unknown time zone 'Mars/Olympus';"
        " expected an IANA name such as Europe/Berlin"
    )
    assert s["used"] == old["used"]
    assert p.events == [] and p.gauges == []


def test_projected_exhaustion_carries_the_months_rate_forward():
    # 85 hours into December in Berlin (since 23:00 UTC on 30 November), 85 GPU-hours used:
    # 1 GPU-hour an hour, so the other 15 last 15 hours
    b = budget("a", scope={"namespace": "a"}, period=MONTH, limits={"gpuHours": "100"})
    r = report("n1", bucket("2026-12-04T11:45:00Z", entry("a", allocated=hours(85))))
    s = status_of(plan(view([r], budgets=[b]), DEC4), "a")
    assert s["projectedExhaustion"] == "2026-12-05T03:00:00Z"
    # past the month's end: no projection
    b["spec"]["limits"] = {"gpuHours": "10000"}
    assert "projectedExhaustion" not in status_of(plan(view([r], budgets=[b]), DEC4), "a")


def test_the_dashboard_gets_each_namespaces_gpu_hours_this_utc_month():
    r = report(
        "n1",
        bucket("2026-11-30T23:45:00Z", entry("a", allocated=hours(5))),
        bucket("2026-12-01T00:00:00Z", entry("a", allocated=hours(2))),
    )
    assert plan(view([r]), DEC4).namespace_gpu_hours == {"a": 2.0}


def test_the_worked_example_of_docs_budgets_md_team_a_on_4_december():
    # two whole H100s around the clock since 00:00 on 1 December in Berlin, about 600 W each
    start = datetime(2026, 11, 30, 23, 0, tzinfo=UTC).timestamp()
    buckets = [
        bucket(
            datetime.fromtimestamp(start + i * 900, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            entry("team-a", "gpu-0", allocated=900.0, energy=540_000.0),
            entry("team-a", "gpu-1", allocated=900.0, energy=540_000.0),
        )
        for i in range(85 * 4)
    ]
    b = budget(
        "team-a-monthly",
        scope={"namespace": "team-a"},
        period=MONTH,
        limits={"gpuHours": "1200"},
        action="DenyNew",
    )
    s = status_of(plan(view([report("n1", *buckets)], budgets=[b]), DEC4), "team-a-monthly")
    assert s["used"] == {"gpuHours": "170.000", "energyKWh": "102.000"}
    assert s["remaining"] == {"gpuHours": "1030.000"}
    assert s["projectedExhaustion"] == "2026-12-25T23:00:00Z"
    assert s["thresholdsReached"] == []


def test_a_rolling_budget_warns_again_once_usage_has_left_its_window_and_come_back():
    b = budget(
        "r",
        scope={"namespace": "a"},
        period={"type": "Rolling", "window": "1h"},
        limits={"gpuHours": "1"},
    )

    def at(now: datetime, current: dict[str, Any], *starts: str) -> Plan:
        r = report("n1", *(bucket(s, entry("a", allocated=900.0 * 3.5)) for s in starts))
        return plan(view([r], budgets=[current]), now)

    p = at(DEC4, b, "2026-12-04T11:30:00Z")  # 0.875 of the limit
    assert [e.reason for e in p.events] == ["GpuBudgetThreshold"]
    b = {**b, "status": status_of(p, "r")}
    assert b["status"]["thresholdsReached"] == [80]
    later = datetime(2026, 12, 4, 14, 0, tzinfo=UTC)  # the bucket has left the window
    p = at(later, b, "2026-12-04T11:30:00Z")
    assert p.events == [] and status_of(p, "r")["thresholdsReached"] == []
    b = {**b, "status": status_of(p, "r")}
    p = at(later, b, "2026-12-04T11:30:00Z", "2026-12-04T13:30:00Z")
    assert [e.reason for e in p.events] == ["GpuBudgetThreshold"]


def test_a_cost_budget_whose_prices_go_missing_keeps_its_last_verdict_and_announces_nothing():
    b = budget("c", scope={"namespace": "a"}, limits={"cost": {"amount": "1", "currency": "EUR"}})
    r = report("n1", bucket("2026-12-04T11:45:00Z", entry("a", allocated=hours(1))))
    p = plan(view([r], budgets=[b], prices=PRICES), DEC4)
    assert [e.reason for e in p.events] == [
        "GpuBudgetThreshold",
        "GpuBudgetThreshold",
        "GpuBudgetExhausted",
    ]
    b = {**b, "status": status_of(p, "c")}
    p = plan(view([r], budgets=[b]), DEC4)  # the price table is gone
    s = status_of(p, "c")
    assert p.events == []
    assert condition(s, "Exhausted")["status"] == "True"
    assert condition(s, "Reconciled")["reason"] == "NoPriceTable"
    assert s["exhaustedSince"] == b["status"]["exhaustedSince"]
