"""The fold: every closed bucket of every node's report lands in exactly one namespace-day
summary, reports are acknowledged and deleted, and planning again after a plan cut short at any
write (a leader killed mid-reconcile) folds nothing twice and loses nothing."""

from __future__ import annotations

import copy
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.usage.budget_plan import ClusterView, plan
from agent.usage.cluster_objects import Clock, read_report, read_summary
from agent.usage.cluster_usage import collect
from tests.usage.clusterobjs import bucket, check_summary, entry, report

NOW = datetime(2026, 12, 5, 1, 0, tzinfo=UTC)


def view(reports, summaries=(), nodes=None) -> ClusterView:
    names = frozenset(r["spec"]["nodeName"] for r in reports) if nodes is None else nodes
    return ClusterView(list(reports), list(summaries), [], [], names, [], [], None)


def test_closed_buckets_go_to_their_namespace_days_summary_and_the_report_is_acknowledged():
    r = report(
        "n1",
        bucket(
            "2026-12-04T23:45:00Z", entry("team-a", allocated=900), entry("team-b", allocated=450)
        ),
        bucket("2026-12-05T00:00:00Z", entry("team-a", allocated=300, energy=1e5)),
        bucket("2026-12-05T00:15:00Z", entry("team-a", allocated=60), closed=False),
        labels={"tessera.dev/pool": "reserved"},
    )
    p = plan(view([r]), NOW)
    by_name = {s["metadata"]["name"]: s for s in p.summaries}
    assert sorted(by_name) == ["team-a.2026-12-04", "team-a.2026-12-05", "team-b.2026-12-04"]
    for s in p.summaries:
        check_summary(s)
        assert "resourceVersion" not in s["metadata"]  # a create
    a5 = by_name["team-a.2026-12-05"]
    assert a5["metadata"]["labels"] == {
        "tessera.dev/namespace": "team-a",
        "tessera.dev/day": "2026-12-05",
    }
    assert [b["start"] for b in a5["spec"]["buckets"]] == [
        "2026-12-05T00:00:00Z"
    ]  # not the open one
    (u,) = a5["spec"]["buckets"][0]["usage"]
    assert (u["node"], u["allocatedGpuSeconds"], u["energyJoules"]) == ("n1", 300.0, 1e5)
    assert a5["spec"]["nodes"] == [
        {
            "name": "n1",
            "labels": {"tessera.dev/pool": "reserved"},
            "foldedThrough": "2026-12-05T00:15:00Z",
        }
    ]
    assert a5["spec"]["claims"][0]["claimUID"] == "uid-team-a-train"
    (ack,) = p.acks
    assert ack["status"] == {"acknowledgedThrough": "2026-12-05T00:15:00Z"}
    assert ack["metadata"]["resourceVersion"] == "1"
    assert ack["spec"] == r["spec"]
    assert p.report_deletions == []
    assert p.oldest_unfolded_bucket == datetime(2026, 12, 4, 23, 45, tzinfo=UTC)


def test_a_replaced_summary_keeps_its_resource_version_and_adds_to_what_it_held():
    first = plan(
        view([report("n1", bucket("2026-12-05T00:00:00Z", entry("a", allocated=100)))]), NOW
    )
    (s,) = first.summaries
    s["metadata"]["resourceVersion"] = "41"
    second = report(
        "n1",
        bucket("2026-12-05T00:00:00Z", entry("a", allocated=100)),  # folded, not yet dropped
        bucket("2026-12-05T00:15:00Z", entry("a", allocated=200)),
    )
    p = plan(view([second], [s]), NOW)
    (s2,) = p.summaries
    check_summary(s2)
    assert s2["metadata"]["resourceVersion"] == "41"
    assert [(b["start"], b["usage"][0]["allocatedGpuSeconds"]) for b in s2["spec"]["buckets"]] == [
        ("2026-12-05T00:00:00Z", 100.0),
        ("2026-12-05T00:15:00Z", 200.0),
    ]
    assert s2["spec"]["claims"][0]["allocatedGpuSeconds"] == 300.0


def test_acknowledged_buckets_are_not_folded_again_and_nothing_new_writes_nothing():
    r = report("n1", bucket("2026-12-05T00:00:00Z", entry("a")), ack="2026-12-05T00:15:00Z")
    p = plan(view([r]), NOW)
    assert (p.summaries, p.acks, p.oldest_unfolded_bucket) == ([], [], None)


def test_a_gone_nodes_report_is_folded_open_bucket_included_then_deleted():
    r = report(
        "gone",
        bucket("2026-12-05T00:00:00Z", entry("a", allocated=10)),
        bucket("2026-12-05T00:15:00Z", entry("a", allocated=5), closed=False),
    )
    p = plan(view([r], nodes=frozenset()), NOW)
    (s,) = p.summaries
    assert sum(b["usage"][0]["allocatedGpuSeconds"] for b in s["spec"]["buckets"]) == 15.0
    assert p.report_deletions == ["gone"]
    assert p.acks == []
    # the deletion failed: planning again folds nothing twice, and deletes again
    again = plan(view([r], [s], nodes=frozenset()), NOW)
    assert again.summaries == [] and again.report_deletions == ["gone"]


# -- the property: a leader killed after any prefix of a plan's writes ------------------------

START = datetime(2026, 12, 4, 23, 0, tzinfo=UTC)
NAMESPACES = ("a", "b", "c")


class Cluster:
    """The cluster's usage objects, written as the API server would: creates, replaces with a
    resourceVersion check, status replaces, deletes."""

    def __init__(self) -> None:
        self.rv = 0
        self.reports: dict[str, dict[str, Any]] = {}
        self.summaries: dict[str, dict[str, Any]] = {}

    def next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def put(
        self, store: dict[str, dict[str, Any]], obj: dict[str, Any], *, status: bool = False
    ) -> None:
        name = obj["metadata"]["name"]
        old = store.get(name)
        rv = obj["metadata"].get("resourceVersion")
        if old is None:
            assert rv is None, f"replace of {name} that does not exist"
            new = copy.deepcopy(obj)
        else:
            assert rv == old["metadata"]["resourceVersion"], f"conflict on {name}"
            new = copy.deepcopy(old)
            if status:
                new["status"] = copy.deepcopy(obj["status"])
            else:
                new["spec"] = copy.deepcopy(obj["spec"])
                new["metadata"]["labels"] = obj["metadata"]["labels"]
        new["metadata"]["resourceVersion"] = self.next_rv()
        store[name] = new


class Agent:
    """A node's ledger as the contract describes it: 15-minute buckets, the open one last; it
    drops the closed buckets the controller acknowledged and writes the rest as its report."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.buckets: dict[datetime, list[dict[str, Any]]] = {}
        self.open = START

    def count(self, at: datetime, ns: str, claim: str, allocated: float, energy: float) -> None:
        start = at - timedelta(minutes=at.minute % 15, seconds=at.second)
        assert start >= self.open
        self.open = start
        self.buckets.setdefault(start, []).append(entry(ns, claim, allocated, energy))

    def write(self, cluster: Cluster, *, close_all: bool = False) -> None:
        old = cluster.reports.get(self.node)
        ack = ((old or {}).get("status") or {}).get("acknowledgedThrough")
        if ack:
            through = datetime.fromisoformat(ack)
            for start in [
                s
                for s in self.buckets
                if s + timedelta(minutes=15) <= through and (s < self.open or close_all)
            ]:
                del self.buckets[start]
        obj = report(
            self.node,
            *(
                bucket(
                    s.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    *self.buckets[s],
                    closed=close_all or s < self.open,
                )
                for s in sorted(self.buckets)
            ),
        )
        obj["metadata"]["resourceVersion"] = (
            None if old is None else old["metadata"]["resourceVersion"]
        )
        if old is None:
            del obj["metadata"]["resourceVersion"]
        cluster.put(cluster.reports, obj)


def reconcile(cluster: Cluster, nodes: frozenset[str], now: datetime, writes: int | None) -> int:
    """Plan and execute at most ``writes`` of the plan's writes, in the plumbing's order."""
    p = plan(view(list(cluster.reports.values()), list(cluster.summaries.values()), nodes), now)
    steps = (
        [lambda s=s: cluster.put(cluster.summaries, s) for s in p.summaries]
        + [lambda a=a: cluster.put(cluster.reports, a, status=True) for a in p.acks]
        + [lambda n=n: cluster.reports.pop(n) for n in p.report_deletions]
    )
    for step in steps[:writes]:
        step()
    return len(steps)


def live_totals(cluster: Cluster) -> dict[str, float]:
    clock = Clock()
    reports = [read_report(r, clock) for r in cluster.reports.values()]
    summaries = {s["metadata"]["name"]: read_summary(s, clock) for s in cluster.summaries.values()}
    usage = collect(reports, summaries, clock)
    return {
        ns: sum(c[0] for keys in buckets.values() for c in keys.values())
        for ns, buckets in usage.namespaces.items()
    }


def folded_totals(cluster: Cluster) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for s in cluster.summaries.values():
        for b in s["spec"]["buckets"]:
            for u in b["usage"]:
                out[s["spec"]["namespace"]] += u["allocatedGpuSeconds"]
    return dict(out)


step = st.one_of(
    st.tuples(
        st.just("count"), st.integers(0, 1), st.sampled_from(NAMESPACES), st.integers(1, 400)
    ),
    st.tuples(st.just("advance"), st.integers(1, 40)),  # minutes
    # the writes done before the leader dies (None: all of them)
    st.tuples(st.just("reconcile"), st.none() | st.integers(0, 8)),
    st.tuples(st.just("remove"), st.integers(0, 1)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, min_size=1, max_size=40))
def test_a_leader_killed_after_any_write_folds_nothing_twice_and_loses_nothing(steps):
    cluster = Cluster()
    agents = {f"n{i}": Agent(f"n{i}") for i in range(2)}
    nodes = set(agents)
    counted: dict[str, float] = defaultdict(float)
    now = START
    for s in steps:
        if s[0] == "count" and f"n{s[1]}" in nodes:
            agent = agents[f"n{s[1]}"]
            allocated = s[3] / 4  # quarters: float sums are exact, so totals compare with ==
            agent.count(now, s[2], "job", allocated, allocated * 100)
            counted[s[2]] += allocated
            agent.write(cluster)
        elif s[0] == "advance":
            now += timedelta(minutes=s[1])
            for name in sorted(nodes):
                agents[name].open = max(agents[name].open, now - timedelta(minutes=now.minute % 15))
                agents[name].write(cluster)
        elif s[0] == "reconcile":
            reconcile(cluster, frozenset(nodes), now, s[1])
        elif s[0] == "remove":
            nodes.discard(f"n{s[1]}")
        # at every moment, the live view counts everything counted once
        assert live_totals(cluster) == {k: v for k, v in counted.items() if v}
    # the end: every node stops (its last bucket closes); the controller finishes the fold
    for name in sorted(nodes):
        agents[name].write(cluster, close_all=True)
    for _ in range(3):
        reconcile(cluster, frozenset(nodes), now, None)
        for name in sorted(nodes):
            agents[name].write(cluster, close_all=True)
    assert reconcile(cluster, frozenset(nodes), now, None) == 0  # nothing left to write
    assert folded_totals(cluster) == {k: v for k, v in counted.items() if v}
    assert all(not r["spec"]["buckets"] for r in cluster.reports.values())
    assert set(cluster.reports) <= nodes  # gone nodes' reports were deleted
    for s in cluster.summaries.values():
        check_summary(s)
