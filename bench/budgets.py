"""The budget controller's reconcile: one ``plan()`` (agent/usage/budget_plan.py) over a
simulated cluster of 10,000 nodes' GpuUsageReports and 100,000 claims (issue 22: at most 2 s
and 1 GiB RSS).

The view, as the controller would read it from the API server (decoded JSON):
- 10,000 reports, each with one closed and one open 15-minute bucket, each bucket with one
  entry for each of the node's 10 claims (100,000 claims; 200,000 usage entries);
- 1,000 namespaces (100 claims each, on 100 nodes), 10 ``org`` labels;
- 1,000 GpuUsageSummaries: each namespace's day so far, holding the bucket before (100 entries);
- 200 GpuBudgets: 100 of one namespace each (CalendarMonth, Europe/Berlin, GPU-hours; half of
  them exhausted, Terminate), 100 by label selector (Rolling 720h, kWh and cost);
- 100,000 ResourceClaims (allocated by gpu.tessera.dev) and 100,000 Pods holding them;
- a price table.

The cold plan (the first reconcile after a start, or after an outage: every closed bucket still
to fold) folds 10,000 closed buckets into 1,000 summaries, acknowledges 10,000 reports, and
writes 200 statuses, with Events and evictions. Then the plan after that fold's writes (the
summaries written, the reports acknowledged), and the warm plan, the steady state: the next
reconcile, with every other report rewritten (a new resourceVersion, one more second in its open
bucket), as a 30 s reconcile against once-a-minute report writes sees.

It runs in a child process, so that the peak RSS (``ru_maxrss``) is this view's and plans'
alone: the figure includes the views themselves. Each plan runs as the controller's reconcile
runs it: right after the view is built, within
``dra_driver.budgets.heap.collector_paused`` (no garbage collection walks the view).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

from bench.common import report
from bench.table import Figure, at_most, measured

NAME = "budgets"
NODES, CLAIMS_PER_NODE, NAMESPACES, BUDGETS = 10_000, 10, 1_000, 200
GOAL_S, GOAL_RSS_MIB = 2.0, 1024.0
RUNS, QUICK_RUNS = 3, 1
NOW = datetime(2026, 12, 4, 12, 7, tzinfo=UTC)
CLOSED, OPEN, BEFORE = "2026-12-04T11:45:00Z", "2026-12-04T12:00:00Z", "2026-12-04T11:30:00Z"
PRODUCT = "NVIDIA H100 80GB HBM3"


def _entry(ns: str, claim: str) -> dict[str, Any]:
    return {
        "namespace": ns,
        "claim": claim,
        "claimUID": f"uid-{claim}",
        "deviceClass": "gpu.tessera.dev",
        "product": PRODUCT,
        "allocatedGpuSeconds": 900.0,
        "busyGpuSeconds": 450.0,
        "energyJoules": 630000.0,
        "unobservedSeconds": 0.0,
    }


def view_objects() -> dict[str, Any]:
    """The simulated cluster (see the module's text), as plain decoded objects."""
    reports, claims, pods = [], [], []
    summaries: dict[str, dict[str, Any]] = {}
    for n in range(NODES):
        node = f"gpu-{n:05d}"
        entries = []
        for c in range(CLAIMS_PER_NODE):
            ns = f"team-{(n * CLAIMS_PER_NODE + c) % NAMESPACES:04d}"
            claim = f"claim-{n:05d}-{c}"
            entries.append((ns, claim))
            claims.append(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"name": claim, "namespace": ns, "uid": f"uid-{claim}"},
                    "spec": {
                        "devices": {
                            "requests": [
                                {"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}
                            ]
                        }
                    },
                    "status": {
                        "allocation": {
                            "devices": {
                                "results": [
                                    {
                                        "request": "gpu",
                                        "driver": "gpu.tessera.dev",
                                        "pool": node,
                                        "device": f"gpu-{c}",
                                    }
                                ]
                            }
                        },
                        "reservedFor": [
                            {"resource": "pods", "name": f"pod-{claim}", "uid": f"p-{claim}"}
                        ],
                    },
                }
            )
            pods.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"pod-{claim}", "namespace": ns},
                    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]},
                    "status": {"phase": "Running"},
                }
            )
            s = summaries.setdefault(ns, _summary(ns))
            s["spec"]["buckets"][0]["usage"].append(
                {
                    "node": node,
                    "deviceClass": "gpu.tessera.dev",
                    "product": PRODUCT,
                    "allocatedGpuSeconds": 900.0,
                    "busyGpuSeconds": 450.0,
                    "energyJoules": 630000.0,
                    "unobservedSeconds": 0.0,
                }
            )
            s["spec"]["nodes"].append(
                {
                    "name": node,
                    "labels": {"pool": "reserved"},
                    "foldedThrough": OPEN.replace("12:00", "11:45"),
                }
            )
        reports.append(
            {
                "apiVersion": "tessera.dev/v1alpha1",
                "kind": "GpuUsageReport",
                "metadata": {"name": node, "resourceVersion": str(n + 1)},
                "spec": {
                    "nodeName": node,
                    "nodeLabels": {"pool": "reserved"},
                    "through": "2026-12-04T12:06:00Z",
                    "buckets": [
                        {
                            "start": CLOSED,
                            "closed": True,
                            "usage": [_entry(ns, c) for ns, c in entries],
                        },
                        {
                            "start": OPEN,
                            "closed": False,
                            "usage": [_entry(ns, c) for ns, c in entries],
                        },
                    ],
                },
                "status": {"acknowledgedThrough": CLOSED},
            }
        )
    namespaces = [
        {"metadata": {"name": f"team-{i:04d}", "labels": {"org": f"org-{i % 10}"}}}
        for i in range(NAMESPACES)
    ]
    budgets = []
    for b in range(BUDGETS // 2):
        budgets.append(
            {
                "metadata": {"name": f"ns-{b}", "generation": 1},
                "spec": {
                    "scope": {"namespace": f"team-{b:04d}"},
                    "thresholds": [80, 90],
                    "period": {"type": "CalendarMonth", "timeZone": "Europe/Berlin"},
                    "limits": {"gpuHours": "20" if b % 2 else "100000"},
                    "action": "Terminate",
                    "gracePeriod": "0s",
                },
            }
        )
        budgets.append(
            {
                "metadata": {"name": f"org-{b}", "generation": 1},
                "spec": {
                    "scope": {"namespaceSelector": {"matchLabels": {"org": f"org-{b % 10}"}}},
                    "thresholds": [50, 80, 95],
                    "period": {"type": "Rolling", "window": "720h"},
                    "limits": {
                        "energyKWh": "100000",
                        "cost": {"amount": "50000", "currency": "EUR"},
                    },
                    "action": "Warn",
                },
            }
        )
    return {
        "reports": reports,
        "summaries": list(summaries.values()),
        "budgets": budgets,
        "namespaces": namespaces,
        "nodes": [f"gpu-{n:05d}" for n in range(NODES)],
        "pods": pods,
        "claims": claims,
    }


def _summary(ns: str) -> dict[str, Any]:
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuUsageSummary",
        "metadata": {"name": f"{ns}.2026-12-04", "resourceVersion": "1"},
        "spec": {
            "namespace": ns,
            "day": "2026-12-04",
            "buckets": [{"start": BEFORE, "usage": []}],
            "claims": [],
            "nodes": [],
        },
    }


def after_writes(objs: dict[str, Any], p: Any) -> tuple[list[Any], list[Any]]:
    """The reports and summaries once ``p``'s writes are applied, as the next reconcile lists
    them: every summary written and every report acknowledged, each with a new
    resourceVersion."""
    summaries = [
        {**s, "metadata": {**s["metadata"], "resourceVersion": f"s{i}"}}
        for i, s in enumerate(p.summaries)
    ]
    reports = [
        {**a, "metadata": {**a["metadata"], "resourceVersion": f"a{i}"}}
        for i, a in enumerate(p.acks)
    ]
    return reports, summaries


def rewritten(reports: list[Any]) -> list[Any]:
    """Every other report as its node rewrites it (once a minute; the controller reconciles
    every 30 s): a new resourceVersion, one more second in each entry of the open bucket."""
    out = []
    for i, r in enumerate(reports):
        if i % 2 == 0:
            buckets = list(r["spec"]["buckets"])
            buckets[-1] = {
                **buckets[-1],
                "usage": [
                    {**u, "allocatedGpuSeconds": u["allocatedGpuSeconds"] + 1.0}
                    for u in buckets[-1]["usage"]
                ],
            }
            r = {
                **r,
                "metadata": {**r["metadata"], "resourceVersion": f"w{i}"},
                "spec": {**r["spec"], "buckets": buckets},
            }
        out.append(r)
    return out


def child(runs: int) -> None:
    """In the child process: build the view, run ``plan`` ``runs`` times the way the
    controller's reconcile does (right after reading the view, within ``collector_paused``): each
    time cold (the first reconcile after a start), then the two reconciles after it (the fold's
    writes applied; then half the reports rewritten); print the figures."""
    import gc
    import resource

    from agent.usage.budget_plan import ClusterView, Plan, plan
    from agent.usage.prices import price_table
    from dra_driver.budgets.heap import collector_paused

    objs = view_objects()
    prices = price_table(
        {"currency": "EUR", "gpuHour": [{"price": "2.50"}], "energy": [{"pricePerKWh": "0.20"}]}
    )

    def view_of(reports: list[Any], summaries: list[Any]) -> ClusterView:
        return ClusterView(
            reports,
            summaries,
            objs["budgets"],
            objs["namespaces"],
            frozenset(objs["nodes"]),
            objs["pods"],
            objs["claims"],
            prices,
        )

    def timed(view: ClusterView, into: dict[str, list[float]]) -> Plan:
        t0, c0 = time.perf_counter(), time.process_time()
        with collector_paused():
            p = plan(view, NOW)
        into["wall"].append(time.perf_counter() - t0)
        into["cpu"].append(time.process_time() - c0)
        return p

    view = view_of(objs["reports"], objs["summaries"])
    view_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    view_objects_tracked = len(gc.get_objects())
    # no gc.collect() here: the controller plans right after decoding the view, with all of it
    # young to the collector; collector_paused is what keeps a full collection off it
    cold: dict[str, list[float]] = {"wall": [], "cpu": []}
    folded: dict[str, list[float]] = {"wall": [], "cpu": []}
    warm: dict[str, list[float]] = {"wall": [], "cpu": []}
    collections = []
    cold_rss = 0.0
    for _ in range(runs):
        before = sum(g["collections"] for g in gc.get_stats())
        p = timed(view, cold)
        collections.append(sum(g["collections"] for g in gc.get_stats()) - before)
        cold_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        reports, summaries = after_writes(objs, p)
        second = timed(view_of(reports, summaries), folded)
        third = timed(view_of(rewritten(reports), summaries), warm)
        if second.summaries or second.acks or third.summaries or third.acks:
            raise AssertionError("the reconciles after the fold found more to fold")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "samples_s": cold["wall"],
                "cpu_s": cold["cpu"],
                "folded_s": folded["wall"],
                "folded_cpu_s": folded["cpu"],
                "warm_s": warm["wall"],
                "warm_cpu_s": warm["cpu"],
                "collections": collections,
                "load": os.getloadavg(),
                "view_rss_mib": view_rss,
                "cold_rss_mib": cold_rss,
                "peak_rss_mib": peak,
                "view_objects": view_objects_tracked,
                "summaries": len(p.summaries),
                "acks": len(p.acks),
                "statuses": len(p.statuses),
                "events": len(p.events),
                "evictions": len(p.evictions),
                "usage_entries": sum(
                    len(b["usage"]) for r in objs["reports"] for b in r["spec"]["buckets"]
                ),
            }
        )
    )


def run(quick: bool) -> list[Figure]:
    runs = QUICK_RUNS if quick else RUNS
    code = f"from bench.budgets import child; child({runs})"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    data = json.loads(out.strip().splitlines()[-1])
    if (data["summaries"], data["acks"], data["statuses"]) != (NAMESPACES, NODES, BUDGETS):
        raise AssertionError(f"unexpected plan: {data}")
    samples = data["samples_s"]
    what = f"{NODES:,} nodes' reports, {NODES * CLAIMS_PER_NODE:,} claims, {BUDGETS} budgets"
    warm = "the steady-state reconcile (half the reports rewritten, nothing to fold)"
    figures = [
        measured(NAME, f"plan(), cold: {what}", "s", samples, goal=at_most(GOAL_S, "s")),
        measured(
            NAME,
            "plan(), cold: CPU time (its wall time on an idle core)",
            "s",
            data["cpu_s"],
            goal=at_most(GOAL_S, "s"),
            note="the first reconcile after a start; the wall time waits for a core when"
            " others load the machine",
        ),
        measured(NAME, f"plan(), warm: {warm}", "s", data["warm_s"], goal=at_most(GOAL_S, "s")),
        measured(
            NAME,
            "plan(), warm: CPU time",
            "s",
            data["warm_cpu_s"],
            goal=at_most(GOAL_S, "s"),
            note="the reconciles between folds: what the controller does every 30 s",
        ),
        measured(
            NAME,
            "peak RSS (the views and plans)",
            "MiB",
            [data["peak_rss_mib"]],
            goal=at_most(GOAL_RSS_MIB, "MiB"),
        ),
    ]
    rows = [
        ("view", f"{what}, {data['usage_entries']:,} usage entries, {NAMESPACES:,} namespaces"),
        (
            "view size",
            f"{data['view_rss_mib']:.0f} MiB RSS once built;"
            f" {data['view_objects']:,} objects the garbage collector tracks",
        ),
        (
            "plan(), cold",
            f"{min(samples):.2f} s (worst of {runs}: {max(samples):.2f} s);"
            f" CPU {min(data['cpu_s']):.2f} s (worst {max(data['cpu_s']):.2f} s);"
            f" garbage collections during it {data['collections']};"
            f" load average {data['load'][0]:.2f}",
        ),
        (
            "plan(), after the fold",
            f"{min(data['folded_s']):.2f} s (worst {max(data['folded_s']):.2f} s);"
            f" CPU {min(data['folded_cpu_s']):.2f} s: the summaries written, the reports"
            " acknowledged",
        ),
        (
            "plan(), warm",
            f"{min(data['warm_s']):.2f} s (worst {max(data['warm_s']):.2f} s);"
            f" CPU {min(data['warm_cpu_s']):.2f} s (worst {max(data['warm_cpu_s']):.2f} s)",
        ),
        (
            "RSS",
            f"{data['view_rss_mib']:.0f} MiB after building the view,"
            f" {data['cold_rss_mib']:.0f} MiB peak after the cold plan,"
            f" {data['peak_rss_mib']:.0f} MiB peak after the warm ones",
        ),
        (
            "plan holds",
            f"{data['summaries']} summaries, {data['acks']} acks, {data['statuses']} statuses,"
            f" {data['events']} events, {data['evictions']:,} evictions (cold)",
        ),
    ]
    report(NAME, "budget controller: one plan() over 10,000 nodes", rows, data, figures)
    return figures
