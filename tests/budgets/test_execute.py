"""A plan written to a real emulator (real HTTP): in the contract's order, stopping at the first
failed write, nothing written once the Lease is lost, and a PodDisruptionBudget's 429 retried
next time without holding up the rest. The plans are the tests' own (the planner is pure and
tested on its own)."""

from __future__ import annotations

import pytest

from agent.sim.apiserver import ApiServer
from agent.usage.budget_plan import PodEviction
from dra_driver.budgets.execute import Executor
from dra_driver.cluster.kube import KubeClient
from tests.budgets.cluster import a_plan, seeded
from tests.fakeclock import FakeClock
from tests.k8sschema import VERSIONS, validate

NOW = 1_796_385_600.0  # 2026-12-04T12:00:00Z


def writes(server: ApiServer) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in server.requests.snapshot() if r.method != "GET"]


def test_a_plan_is_written_in_the_contracts_order(kube: tuple[ApiServer, KubeClient]) -> None:
    server, client = kube
    plan = a_plan(seeded(server))
    server.requests.clear()
    out = Executor(client, "ctrl-0", FakeClock(NOW)).execute(plan, lambda: True, {})
    assert out.failed is None and out.error is None
    t, core = "/apis/tessera.dev/v1alpha1", "/api/v1/namespaces/team-a"
    assert writes(server) == [
        ("POST", f"{t}/gpuusagesummaries"),
        ("PUT", f"{t}/gpuusagesummaries/team-a.2026-12-03"),
        ("PUT", f"{t}/gpuusagereports/gpu-node-1/status"),
        ("DELETE", f"{t}/gpuusagereports/gpu-node-gone"),
        ("POST", f"{core}/events"),
        ("POST", f"{core}/events"),
        ("PUT", f"{t}/gpubudgets/team-a-monthly/status"),
        ("POST", f"{core}/pods/train-1/eviction"),
        ("POST", f"{core}/pods/train-2/eviction"),
    ]
    assert server.get_object("gpuusagesummaries", "team-a.2026-12-04") is not None
    stored = server.get_object("gpuusagesummaries", "team-a.2026-12-03")
    assert stored is not None and stored["spec"]["claims"][0]["claim"] == "train-1"
    acked = server.get_object("gpuusagereports", "gpu-node-1")
    assert acked is not None and acked["status"]["acknowledgedThrough"] == "2026-12-04T12:00:00Z"
    assert server.get_object("gpuusagereports", "gpu-node-gone") is None
    budget = server.get_object("gpubudgets", "team-a-monthly")
    assert budget is not None and budget["status"]["thresholdsReached"] == [80]


def test_the_events_are_core_events_in_the_namespace_about_the_budget(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    objs = seeded(server)
    uid = objs["budget"]["metadata"]["uid"]
    plan = a_plan(objs)
    Executor(client, "ctrl-0", FakeClock(NOW)).execute(plan, lambda: True, {"team-a-monthly": uid})
    events = sorted(server.objects("events", "team-a"), key=lambda e: e["metadata"]["name"])
    assert [e["reason"] for e in events] == ["GpuBudgetExhausted", "GpuBudgetTerminating"]
    assert len({e["metadata"]["name"] for e in events}) == 2  # same instant, distinct names
    for e in events:
        for version in VERSIONS:
            validate(e, version)
        assert e["type"] == "Warning" and e["reportingComponent"] == "tessera-budgets"
        assert e["involvedObject"] == {
            "kind": "GpuBudget", "apiVersion": "tessera.dev/v1alpha1", "name": "team-a-monthly",
            "uid": uid, "namespace": "team-a",
        }  # fmt: skip
    assert server.rejected == []


@pytest.mark.parametrize(
    ("fault", "stopped_at", "then"),
    [
        (("PUT", r"gpuusagesummaries/", "409"), "summaries", 2),
        (("PUT", r"gpuusagereports/.*/status", "409"), "acks", 3),
        (("DELETE", r"gpuusagereports/", "503"), "report_deletions", 4),
        (("POST", r"/events$", "500"), "events", 5),
        (("PUT", r"gpubudgets/.*/status", "409"), "statuses", 7),
    ],
)
def test_the_first_failed_write_ends_the_plan(
    kube: tuple[ApiServer, KubeClient], fault: tuple[str, str, str], stopped_at: str, then: int
) -> None:
    server, client = kube
    plan = a_plan(seeded(server))
    server.requests.clear()
    server.faults.add(*fault)
    out = Executor(client, "ctrl-0", FakeClock(NOW)).execute(plan, lambda: True, {})
    assert out.failed == stopped_at and out.error is not None and not out.lost_lease
    done = writes(server)
    assert len(done) == then  # the failed write is the last one tried
    assert not any(path.endswith("/eviction") for _, path in done)


def test_a_disruption_budgets_429_is_retried_next_time_without_stopping_the_rest(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    plan = a_plan(seeded(server))
    server.faults.add("POST", r"pods/train-1/eviction", "429")
    server.requests.clear()
    out = Executor(client, "ctrl-0", FakeClock(NOW)).execute(plan, lambda: True, {})
    assert out.failed is None
    assert out.refused == [PodEviction("team-a", "train-1", "team-a-monthly")]
    assert writes(server)[-1] == ("POST", "/api/v1/namespaces/team-a/pods/train-2/eviction")


def test_nothing_more_is_written_once_the_lease_is_lost(
    kube: tuple[ApiServer, KubeClient],
) -> None:
    server, client = kube
    plan = a_plan(seeded(server))
    server.requests.clear()
    checks = iter([True, True, False])  # the lease is lost before the third batch
    out = Executor(client, "ctrl-0", FakeClock(NOW)).execute(plan, lambda: next(checks), {})
    assert out.failed == "report_deletions" and out.lost_lease and out.error is None
    assert [m for m, _ in writes(server)] == ["POST", "PUT", "PUT"]  # summaries and the ack
    assert server.get_object("gpuusagereports", "gpu-node-gone") is not None
