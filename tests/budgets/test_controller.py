"""The controller's loop against a real emulator with fake clocks and the tests' own planner: only
the leader reconciles; the metrics show the plan's figures and drop what it stops naming; an API
outage, a bad price table and a planner bug are logged and counted, never a crash; the price
table comes from its ConfigMap."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.sim.apiserver import ApiServer
from agent.usage.budget_plan import BudgetGauge, ClusterView, Plan
from dra_driver.budgets.budget_metrics import BudgetMetrics
from dra_driver.budgets.controller import BudgetController, ControllerSettings
from dra_driver.budgets.view import PricesInvalid, PricesRef, read_prices, read_view
from dra_driver.cluster.kube import KubeClient
from dra_driver.cluster.lease import LeaseElector, LeaseTiming
from tests.budgets import cluster
from tests.crds import create
from tests.fakeclock import FakeClock
from tests.k8sschema import VERSIONS, validate

NOW = 1_796_385_600.0  # 2026-12-04T12:00:00Z
PRICES = "currency: EUR\ngpuHour:\n  - price: '2.50'\n"
TIMING = LeaseTiming(duration_s=15, renew_period_s=5, retry_period_s=2, renew_deadline_s=10)


class Planner:
    """Returns the plans a test chooses, and remembers what it was shown."""

    def __init__(self, *plans: Plan) -> None:
        self.plans = list(plans)
        self.seen: list[tuple[ClusterView, datetime]] = []

    def __call__(self, view: ClusterView, now: datetime) -> Plan:
        self.seen.append((view, now))
        return self.plans.pop(0)


def gauges_plan(*gauges: BudgetGauge, oldest: datetime | None = None) -> Plan:
    return Plan([], [], [], [], [], [], list(gauges), oldest)


def controller(
    client: KubeClient, planner: Planner, clock: FakeClock, who: str = "ctrl-0"
) -> BudgetController:
    elector = LeaseElector(client, "tessera-system", "tessera-budgets", who, TIMING, clock, clock)
    return BudgetController(
        client,
        elector,
        planner,
        BudgetMetrics(),
        ControllerSettings(PricesRef("tessera-system", "tessera-prices"), 30.0),
        logging.getLogger("test.budgets"),
        clock=clock,
        monotonic=clock,
    )


def scrape(c: BudgetController) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = c.metrics.exposition()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_only_the_leader_reconciles_and_its_metrics_show_the_plan(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    clock = FakeClock(NOW)
    exhausted = BudgetGauge("team-a", "gpuHours", 12.0, 10.0, True)
    energy = BudgetGauge("team-a", "energyKWh", 5.0, 50.0, False)
    oldest = datetime(2026, 12, 4, 11, 0, tzinfo=UTC)
    planner = Planner(gauges_plan(exhausted, energy, oldest=oldest))
    leader, standby = controller(client, planner, clock), controller(client, planner, clock, "b")
    leader.tick()
    assert standby.tick() == TIMING.retry_period_s  # a standby only retries the lease
    assert len(planner.seen) == 1 and planner.seen[0][1] == datetime.fromtimestamp(NOW, UTC)
    m = scrape(leader)
    budget = (("budget", "team-a"), ("limit", "gpuHours"))
    assert m[("tessera_budget_used", budget)] == 12.0
    assert m[("tessera_budget_limit", budget)] == 10.0
    assert m[("tessera_budget_used_ratio", budget)] == pytest.approx(1.2)
    assert m[("tessera_budget_exhausted", (("budget", "team-a"),))] == 1
    assert m[("tessera_budget_leader", ())] == 1
    assert m[("tessera_budget_last_reconcile_timestamp_seconds", ())] == NOW
    assert m[("tessera_budget_oldest_unfolded_bucket_age_seconds", ())] == 3600
    assert m[("tessera_budget_reconcile_errors_total", ())] == 0
    assert scrape(standby)[("tessera_budget_leader", ())] == 0
    lease = server.get_object("leases", "tessera-budgets", "tessera-system")
    assert lease is not None and lease["spec"]["holderIdentity"] == "ctrl-0"


def test_the_next_reconcile_comes_after_the_interval_and_drops_what_the_plan_no_longer_names(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    _, client = kube
    clock = FakeClock(NOW)
    energy = BudgetGauge("team-a", "energyKWh", 5.0, 50.0, False)
    planner = Planner(
        gauges_plan(BudgetGauge("team-a", "gpuHours", 1.0, 10.0, False), energy),
        gauges_plan(energy),
    )
    c = controller(client, planner, clock)
    wait = c.tick()
    assert wait == TIMING.renew_period_s  # renewals come before the next reconcile (30 s)
    for _ in range(5):  # 25 s: renewals only
        clock.advance(wait)
        wait = c.tick()
    assert wait == 5
    assert len(planner.seen) == 1
    clock.advance(5)
    c.tick()  # 30 s after the first
    assert len(planner.seen) == 2
    names = {(name, labels) for name, labels in scrape(c)}
    assert ("tessera_budget_used", (("budget", "team-a"), ("limit", "gpuHours"))) not in names
    assert ("tessera_budget_used", (("budget", "team-a"), ("limit", "energyKWh"))) in names


def test_an_api_outage_is_counted_and_retried_never_a_crash(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    clock = FakeClock(NOW)
    gauge = BudgetGauge("team-a", "gpuHours", 1.0, 10.0, False)
    planner = Planner(gauges_plan(gauge), gauges_plan())
    c = controller(client, planner, clock)
    c.tick()
    assert c.elector.is_leader()
    used = ("tessera_budget_used", (("budget", "team-a"), ("limit", "gpuHours")))
    assert used in scrape(c)
    server.faults.start_outage("503")
    clock.advance(30)
    c.tick()  # the lease cannot be renewed, no reconcile is possible
    errors = scrape(c)[("tessera_budget_reconcile_errors_total", ())]
    assert errors == 1 and not c.elector.is_leader()
    assert scrape(c)[("tessera_budget_leader", ())] == 0
    assert used not in scrape(c)  # a replica that lost the Lease shows no budget's figures
    server.faults.end_outage()
    clock.advance(2)
    c.tick()
    assert c.elector.is_leader() and len(planner.seen) == 2  # it picks up where it left off


def test_a_planner_bug_is_logged_and_counted_and_the_loop_goes_on(
    kube: tuple[ApiServer, KubeClient], caplog: pytest.LogCaptureFixture
) -> None:
    _, client = kube
    clock = FakeClock(NOW)

    def broken(view: ClusterView, now: datetime) -> Plan:
        raise ZeroDivisionError("a budget's arithmetic")

    c = controller(client, Planner(), clock)
    c._planner = broken
    with caplog.at_level(logging.ERROR):
        c.tick()
    assert scrape(c)[("tessera_budget_reconcile_errors_total", ())] == 1
    assert "ZeroDivisionError: a budget's arithmetic" in caplog.text
    assert c.elector.is_leader()


def test_the_price_table_comes_from_its_configmap(kube: tuple[ApiServer, KubeClient]) -> None:
    server, client = kube
    ref = PricesRef("tessera-system", "tessera-prices")
    assert read_prices(client, ref) is None  # absent: no costs
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "tessera-prices", "namespace": "tessera-system"},
        "data": {"prices.yaml": PRICES},
    }
    for version in VERSIONS:
        validate(cm, version)
    server.put_object("configmaps", cm)
    table = read_prices(client, ref)
    assert table is not None and table.currency == "EUR"
    cm["data"] = {"prices.yaml": "currency: euro\n"}
    server.put_object("configmaps", cm)
    with pytest.raises(PricesInvalid) as exc:
        read_prices(client, ref)
    message = str(exc.value)
    assert "tessera-system/tessera-prices key prices.yaml" in message and "'euro'" in message


def test_the_view_reads_every_list_and_pages_through_them(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    for i in range(1203):  # more than two pages
        create(server, "gpuusagereports", cluster.report(f"node-{i:04d}"))
    create(server, "pods", cluster.pod("train-1"))
    plain = cluster.pod("web")
    del plain["spec"]["resourceClaims"]
    create(server, "pods", plain)
    view = read_view(client, PricesRef("tessera-system", "tessera-prices"))
    assert len(view.reports) == 1203
    assert all(r["kind"] == "GpuUsageReport" for r in view.reports)
    assert [p["metadata"]["name"] for p in view.pods] == ["train-1"]  # only pods with claims
    assert {n["metadata"]["name"] for n in view.namespaces} >= {"team-a", "tessera-system"}
    assert view.prices is None


def test_each_namespaces_gpu_hours_this_month_come_from_its_summaries(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    for name, seconds in (("team-a.2026-12-04", 5400.0), ("team-a.2026-12-01", 1800.0),
                          ("team-a.2026-11-30", 3600.0), ("team-b.2026-12-02", 360.0)):  # fmt: skip
        s = cluster.summary(name)
        s["spec"]["buckets"] = [{"start": f"{s['spec']['day']}T00:00:00Z", "usage": [
            cluster.summary_usage("n1", seconds / 2),
            cluster.summary_usage("n2", seconds / 2)]}]  # fmt: skip
        create(server, "gpuusagesummaries", s)
    clock = FakeClock(NOW)
    c = controller(client, Planner(gauges_plan()), clock)
    c.tick()
    m = scrape(c)
    assert m[("tessera_budget_namespace_gpu_hours", (("namespace", "team-a"),))] == 2.0
    assert m[("tessera_budget_namespace_gpu_hours", (("namespace", "team-b"),))] == 0.1


def test_the_controllers_metrics_have_no_created_series() -> None:
    """Like the agent's (tests/telemetry/test_metrics.py): prometheus_client's ``_created``
    gauges are not served; docs/metrics.md lists what is."""
    m = BudgetMetrics()
    m.errors.inc()
    m.evictions.labels("team-a").inc()
    m.duration.observe(0.2)
    body = m.exposition()[0].decode()
    assert "tessera_budget_evictions_total{" in body
    assert "tessera_budget_reconcile_duration_seconds_count" in body
    assert "_created" not in body
