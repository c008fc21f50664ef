"""Budgets end to end (issue 22, "Tests that must exist"): one API-server emulator with the budgets
bundle applied over HTTP, two kube-mode agents (two nodes) writing their GpuUsageReports, two
`tessera budgets` replicas (real subprocesses, short lease), claims of two teams prepared through
the agents' kubelet sockets. Every step waits on the cluster's state (bounded only so a broken
part fails instead of hanging); every object read back is checked against the upstream schemas
(1.34, 1.35) or its CRD."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from agent.sim.apiserver import ApiServer
from tests.integration.budgets_e2e import (
    ADMIN,
    MIG_1G,
    MIG_1G_WEIGHT,
    HttpError,
    allocate,
    apply_bundle,
    budget,
    call,
    claim,
    condition,
    create,
    events,
    namespace,
    node,
    pod,
    read,
    url_of,
    wait,
)
from tests.integration.daemon import Daemon
from tests.integration.test_budgets_failover import Replica

TEAMS = ("team-a", "team-b")
BUDGET = "team-a-gpus"


@contextmanager
def cluster(tmp: Path) -> Iterator[tuple[ApiServer, Path, list[Daemon], list[Replica]]]:
    """The emulator with the bundle, the teams' namespaces, two nodes with their agents, and two
    controller replicas; everything stopped at the end."""
    ns = ("default", "kube-system", "tessera-system")
    with ApiServer(identity=ADMIN, namespaces=ns) as server:
        kubeconfig = server.kubeconfig(tmp / "kubeconfig")
        apply_bundle(server)
        for team in TEAMS:
            create(server, namespace(team))
        daemons = [
            Daemon(tmp / model, model, "--kubeconfig", str(kubeconfig),
                   "--telemetry-interval", "0.2", "--usage-report-interval", "0.5")
            for model in ("dgx-h100", "dgx-a100")
        ]  # fmt: skip
        replicas: list[Replica] = []
        try:
            for d in daemons:
                create(server, node(d.node))
                d.start()
            replicas += [Replica(kubeconfig, f"budgets-{i}", lease_duration=3) for i in range(2)]
            yield server, kubeconfig, daemons, replicas
            assert server.rejected == [], server.rejected
        finally:
            for r in replicas:
                r.stop()
            for d in daemons:
                d.kill()


def refused(server: ApiServer, obj: dict[str, Any]) -> str:
    """The message of the 403 the server answers a create of ``obj`` with."""
    with pytest.raises(HttpError) as info:
        create(server, obj)
    assert info.value.code == 403, info.value.body
    return str(info.value.body["message"])


def the_budget(server: ApiServer) -> dict[str, Any]:
    (b,) = [b for b in read(server, "gpubudgets") if b["metadata"]["name"] == BUDGET]
    return b


def threshold_events(server: ApiServer, pct: int) -> list[dict[str, Any]]:
    said = f": {pct} % of a limit reached"
    return [e for e in events(server, "team-a", "GpuBudgetThreshold") if said in e["message"]]


def exhausted(server: ApiServer, status: str) -> dict[str, Any] | None:
    c = condition(the_budget(server), "Exhausted")
    return c if c is not None and c["status"] == status else None


def test_thresholds_exhaustion_denial_termination_and_a_raised_limit(short_tmp: Path) -> None:
    with cluster(short_tmp) as (server, _, (h100, a100), _replicas):
        # 0.002 GPU-hours = 7.2 GPU-seconds: two whole H100s use it up in about 4 s
        create(server, budget(BUDGET, "team-a", "0.002", grace="2s"))
        a = allocate(server, h100, "team-a", "train-a", ["gpu-0", "gpu-1"], 2.0)
        b = allocate(server, a100, "team-b", "train-b", [MIG_1G], MIG_1G_WEIGHT)

        for pct in (50, 80):  # a Warning Event on the namespace at each threshold
            ev = wait(f"the {pct} % Event", functools.partial(threshold_events, server, pct))
            assert ev[0]["type"] == "Warning"
            assert ev[0]["involvedObject"]["kind"] == "GpuBudget"
            assert ev[0]["involvedObject"]["name"] == BUDGET
        assert events(server, "team-b", "GpuBudgetThreshold") == []

        cond = wait("Exhausted True", lambda: exhausted(server, "True"))
        assert "of 0.002 GPU-hours" in cond["message"], cond
        status = the_budget(server)["status"]
        assert status["thresholdsReached"] == [50, 80] and "exhaustedSince" in status

        # DenyNew's policy refuses team-a's new claims and pods with claims, naming the budget
        # and carrying used/limit; team-b is not affected
        for obj in (claim("team-a", "more"), pod("team-a", "more", "more")):
            message = refused(server, obj)
            assert f"GpuBudget '{BUDGET}' is exhausted" in message, message
            assert cond["message"] in message, message
        create(server, claim("team-b", "more"))
        create(server, pod("team-b", "more", "more"))

        # after the grace period, team-a's pod is evicted (and only it), with an Event
        wait("team-a's pod evicted", lambda: [
            e for e in server.evictions if (e.namespace, e.pod) == ("team-a", a.pod)])  # fmt: skip
        term = wait(
            "GpuBudgetTerminating", lambda: events(server, "team-a", "GpuBudgetTerminating")
        )
        assert a.pod in term[0]["message"] and term[0]["type"] == "Warning"
        (evicted,) = [e for e in server.evictions if e.pod == a.pod]
        assert evicted.grace == 5  # the pod's terminationGracePeriodSeconds was honoured
        assert all(e.namespace != "team-b" for e in server.evictions), server.evictions
        assert b.pod in {p["metadata"]["name"] for p in read(server, "pods", "team-b")}

        # raising the limit lifts the denial within a reconcile
        raised = the_budget(server)
        raised["spec"]["limits"]["gpuHours"] = "1000"
        call("PUT", url_of(server, raised, BUDGET), raised)
        wait("Exhausted False", lambda: exhausted(server, "False"))
        create(server, claim("team-a", "again"))
        # both nodes' reports, as their CRD accepts them (no 15-minute bucket has closed here,
        # so nothing is folded into summaries yet: the budget counted the reports' live buckets)
        assert {r["metadata"]["name"] for r in read(server, "gpuusagereports")} == {
            h100.node, a100.node}  # fmt: skip
