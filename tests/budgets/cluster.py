"""The budget controller's test cluster: the API-server emulator serving, besides its built-in
resources, the three tessera.dev resources the controller reads and writes from their real CRDs
(tests/crds.py), and a few objects, written through the API so that the CRDs check them."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from agent.sim.apiserver import ApiServer
from agent.usage.budget_plan import BudgetEvent, Plan, PodEviction
from tests.crds import create, serving


def server(**kwargs: Any) -> AbstractContextManager[ApiServer]:
    """The started emulator serving the CRDs (use it as a context manager)."""
    return serving(namespaces=("default", "team-a", "tessera-system"), **kwargs)


def report(node: str) -> dict[str, Any]:
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuUsageReport",
        "metadata": {"name": node, "labels": {"tessera.dev/node": node}},
        "spec": {"nodeName": node, "nodeLabels": {}, "through": "2026-12-04T12:07:31Z",
                 "buckets": []},
    }  # fmt: skip


def summary(name: str) -> dict[str, Any]:
    ns, day = name.split(".", 1)
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuUsageSummary",
        "metadata": {"name": name, "labels": {"tessera.dev/namespace": ns, "tessera.dev/day": day}},
        "spec": {"namespace": ns, "day": day, "buckets": [], "claims": [], "nodes": []},
    }


def summary_usage(node: str, allocated: float) -> dict[str, Any]:
    """One usage entry of a summary's bucket, every counter the CRD requires."""
    return {"node": node, "deviceClass": "gpu.tessera.dev", "product": "NVIDIA H100 80GB HBM3",
            "allocatedGpuSeconds": allocated, "busyGpuSeconds": 0.0, "energyJoules": 0.0,
            "unobservedSeconds": 0.0}  # fmt: skip


def budget(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuBudget",
        "metadata": {"name": name},
        "spec": {"scope": {"namespace": "team-a"}, "limits": {"gpuHours": "10"},
                 "action": "Terminate"},
    }  # fmt: skip


def pod(name: str, namespace: str = "team-a") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "containers": [{"name": "main", "image": "registry.example/train:1"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}],
        },
    }


def seeded(server: ApiServer) -> dict[str, Any]:
    """A cluster with a report, a summary and a budget; the objects as stored."""
    create(server, "gpuusagereports", report("gpu-node-1"))
    create(server, "gpuusagereports", report("gpu-node-gone"))
    create(server, "gpuusagesummaries", summary("team-a.2026-12-03"))
    create(server, "gpubudgets", budget("team-a-monthly"))
    for name in ("train-1", "train-2"):
        create(server, "pods", pod(name))
    return {
        "report": server.get_object("gpuusagereports", "gpu-node-1"),
        "summary": server.get_object("gpuusagesummaries", "team-a.2026-12-03"),
        "budget": server.get_object("gpubudgets", "team-a-monthly"),
    }


def a_plan(objs: dict[str, Any]) -> Plan:
    old = objs["summary"]
    old["spec"]["claims"] = [{
        "claimUID": "u1", "claim": "train-1", "deviceClass": "gpu.tessera.dev",
        "allocatedGpuSeconds": 900.0, "busyGpuSeconds": 450.0, "energyJoules": 0.0,
    }]  # fmt: skip
    ack = objs["report"]
    ack["status"] = {"acknowledgedThrough": "2026-12-04T12:00:00Z"}
    status = objs["budget"]
    status["status"] = {"thresholdsReached": [80], "exhaustedSince": "2026-12-04T11:00:00Z"}
    return Plan(
        summaries=[summary("team-a.2026-12-04"), old],
        acks=[ack],
        report_deletions=["gpu-node-gone"],
        events=[
            BudgetEvent("team-a", "team-a-monthly", "Warning", "GpuBudgetExhausted", "used 10"),
            BudgetEvent("team-a", "team-a-monthly", "Warning", "GpuBudgetTerminating", "train-1"),
        ],
        statuses=[status],
        evictions=[PodEviction("team-a", "train-1", "team-a-monthly"),
                   PodEviction("team-a", "train-2", "team-a-monthly")],
        gauges=[],
        oldest_unfolded_bucket=None,
    )  # fmt: skip
