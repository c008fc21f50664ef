"""Budgets end to end (issue 22, "Tests that must exist"): one API-server emulator with the budgets
bundle applied over HTTP, two kube-mode agents (two nodes) writing their GpuUsageReports, two
`tessera budgets` replicas (real subprocesses, short lease), claims of two teams prepared through
the agents' kubelet sockets. Every step waits on the cluster's state (bounded only so a broken
part fails instead of hanging); every object read back is checked against the upstream schemas
(1.34, 1.35) or its CRD."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
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
    Held,
    HttpError,
    allocate,
    apply_bundle,
    budget,
    call,
    check_builtin,
    claim,
    condition,
    create,
    events,
    namespace,
    node,
    pod,
    read,
    release,
    url_of,
    wait,
)
from tests.integration.daemon import Daemon
from tests.integration.test_budgets_failover import Replica, wait_holder

TEAMS = ("team-a", "team-b")
BUDGET = "team-a-gpus"
USED_OF_LIMIT = re.compile(r"used [0-9.]+ of 0\.002 GPU-hours \(no period: all time\)")
"""The Exhausted condition's sentence, which the DenyNew policy's message carries."""
INTERVAL = 0.2
"""The agents' --telemetry-interval."""
SLACK = 0.05
"""Seconds a claim's count may be off at each prepare and unprepare: the agents count from and
to those calls, not from ticks (docs/budgets.md "When a claim starts and stops counting"); this
only absorbs rounding (a quarter of the interval, so a count from or to a tick fails)."""
ROUNDING = 0.5e-6 * 3600
"""`tessera usage -o json` rounds GPU-hours to 6 decimals (half a unit, in GPU-seconds)."""
TESSERA = os.path.join(os.path.dirname(sys.executable), "tessera")


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
                   "--telemetry-interval", str(INTERVAL), "--usage-report-interval", "0.5")
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
            # every log line of every process is structured
            assert all(rec.get("msg") != "NOT JSON" for r in replicas for rec in r.logs)
            for d in daemons:
                for line in d.raw:
                    json.loads(line)
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
        assert USED_OF_LIMIT.match(cond["message"]), cond
        status = the_budget(server)["status"]
        assert status["thresholdsReached"] == [50, 80] and "exhaustedSince" in status

        # DenyNew's policy refuses team-a's new claims and pods with claims, naming the budget
        # and carrying used/limit; team-b is not affected
        for obj in (claim("team-a", "more"), pod("team-a", "more", "more")):
            message = refused(server, obj)
            assert f"GpuBudget '{BUDGET}' is exhausted" in message, message
            # the used amount moves on each reconcile: the one the server read at the request
            assert USED_OF_LIMIT.search(message), message
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
        check_builtin(evicted.body)  # a policy/v1 Eviction
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


def reports(server: ApiServer) -> set[str]:
    return {r["metadata"]["name"] for r in read(server, "gpuusagereports")}


def errors_above(d: Daemon, n: float) -> bool:
    return report_errors(d) > n


def report_errors(d: Daemon) -> float:
    return sum(d.scrape().get("tessera_usage_report_errors_total", {}).values())


def reported(server: ApiServer, held: list[Held]) -> bool:
    """Every claim of ``held`` has usage in its node's report."""
    uids = {
        u["claimUID"]
        for r in read(server, "gpuusagereports")
        for b in r["spec"]["buckets"]
        for u in b["usage"]
        if u["allocatedGpuSeconds"] > 0
    }
    return all(h.ref.uid in uids for h in held)


def bounds(held: list[Held]) -> tuple[float, float]:
    """The GPU-seconds the claims of ``held`` may have been counted, at least and at most:
    docs/budgets.md ("When a claim starts and stops counting") says each claim's devices count
    from its prepare to its unprepare, whatever the ticks, and a kill -9 and restart lose
    nothing. So a claim's GPU-seconds are its weight x the time between its prepare and its
    unprepare call (bracketed by the test's instants around each call), give or take
    ``SLACK`` per call."""
    low = sum(h.weight * (h.released[0] - h.prepared[1] - 2 * SLACK) for h in held)
    high = sum(h.weight * (h.released[1] - h.prepared[0] + 2 * SLACK) for h in held)
    return low, high


def cluster_usage(kubeconfig: Path) -> dict[str, float]:
    """GPU-seconds per namespace as `tessera usage --cluster -o json` says (summaries plus the
    reports' buckets not yet folded: the controller's live view)."""
    out = subprocess.run(
        [TESSERA, "usage", "--cluster", "--kubeconfig", str(kubeconfig), "-o", "json"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    totals: dict[str, float] = {}
    for row in json.loads(out)["rows"]:
        totals[row["namespace"]] = totals.get(row["namespace"], 0.0) + float(row["gpuHours"]) * 3600
    return totals


def test_usage_survives_agent_and_leader_kills_deletions_a_removed_node_and_an_outage(
    short_tmp: Path,
) -> None:
    with cluster(short_tmp) as (server, kubeconfig, (h100, a100), replicas):
        held = [
            allocate(server, h100, "team-a", "a-kept", ["gpu-0"]),
            allocate(server, h100, "team-a", "a-deleted", ["gpu-1"]),
            allocate(server, h100, "team-b", "b-kept", ["gpu-2"]),
            allocate(server, a100, "team-b", "b-on-removed-node", [MIG_1G], MIG_1G_WEIGHT),
        ]
        a_kept, a_deleted, b_kept, b_removed = held
        wait("every claim's usage reported", lambda: reported(server, held))

        # kill -9 of an agent mid-period; while it is down, kill -9 of the leader: the other
        # replica takes the Lease over once it expires (so the agent is down for a lease at
        # least); then the agent's restart, which counts the downtime from its ledger
        h100.kill()
        ids = {r.identity: r for r in replicas}
        leader, _ = wait_holder(server, set(ids))
        ids[leader].proc.kill()
        ids[leader].proc.wait(timeout=30)
        wait_holder(server, set(ids) - {leader})
        h100.start()

        # a claim released by the kubelet, then deleted with its pod
        release(a_deleted)
        for kind, name in (("Pod", a_deleted.pod), ("ResourceClaim", a_deleted.ref.name)):
            ref = {"apiVersion": "v1" if kind == "Pod" else "resource.k8s.io/v1", "kind": kind,
                   "metadata": {"name": name, "namespace": "team-a"}}  # fmt: skip
            call("DELETE", url_of(server, ref, name))

        # an API outage long enough that both agents' reports fail
        before = [report_errors(d) for d in (h100, a100)]
        server.faults.start_outage("503")
        try:
            for d, n in zip((h100, a100), before, strict=True):
                wait(f"{d.node}'s report refused", functools.partial(errors_above, d, n))
        finally:
            server.faults.end_outage()

        # a node removed: drained (its claim released), its agent stopped, its Node deleted;
        # the controller folds its report as closed, then deletes it
        release(b_removed)
        assert a100.stop() == 0
        call("DELETE", url_of(server, node(a100.node), a100.node))
        wait("the removed node's report folded and deleted", lambda: reports(server) == {h100.node})
        # everything it counted is in the summaries now (its claim, within the bound below)
        folded = sum(
            c["allocatedGpuSeconds"]
            for s in read(server, "gpuusagesummaries")
            for c in s["spec"]["claims"]
            if c["claimUID"] == b_removed.ref.uid
        )
        low, high = bounds([b_removed])
        assert low <= folded <= high, (low, folded, high)

        # the end: every claim released, the last agent stopped (its last report written)
        release(a_kept)
        release(b_kept)
        assert h100.stop() == 0
        used = cluster_usage(kubeconfig)

    # each namespace's usage as the cluster says it, against the integral of what it held
    for ns in TEAMS:
        low, high = bounds([h for h in held if h.ref.namespace == ns])
        assert low - ROUNDING <= used[ns] <= high + ROUNDING, (ns, low, used[ns], high)
