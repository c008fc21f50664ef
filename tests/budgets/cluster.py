"""The budget controller's test cluster: the API-server emulator serving, besides its built-in
resources, the three tessera.dev resources the controller reads and writes (until the emulator
serves CRDs from their manifests, they are plain resource types here), and a few objects."""

from __future__ import annotations

from typing import Any

from agent.sim.apiserver import RESOURCES, ApiServer, ResourceType
from agent.usage.budget_plan import BudgetEvent, Plan, PodEviction

TESSERA = ("tessera.dev", "v1alpha1")
TYPES = (
    *RESOURCES,
    ResourceType("gpuusagereports", "GpuUsageReport", *TESSERA, status=True),
    ResourceType("gpuusagesummaries", "GpuUsageSummary", *TESSERA),
    ResourceType("gpubudgets", "GpuBudget", *TESSERA, status=True, generation=True),
    ResourceType("configmaps", "ConfigMap", namespaced=True),
)


def server(**kwargs: Any) -> ApiServer:
    return ApiServer(resources=TYPES, namespaces=("default", "team-a", "tessera-system"), **kwargs)


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


def budget(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuBudget",
        "metadata": {"name": name},
        "spec": {"scope": {"namespace": "team-a"}, "limits": {"gpuHours": 10},
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
    server.put_object("gpuusagereports", report("gpu-node-1"))
    server.put_object("gpuusagereports", report("gpu-node-gone"))
    server.put_object("gpuusagesummaries", summary("team-a.2026-12-03"))
    server.put_object("gpubudgets", budget("team-a-monthly"))
    for name in ("train-1", "train-2"):
        server.put_object("pods", pod(name))
    return {
        "report": server.get_object("gpuusagereports", "gpu-node-1"),
        "summary": server.get_object("gpuusagesummaries", "team-a.2026-12-03"),
        "budget": server.get_object("gpubudgets", "team-a-monthly"),
    }


def a_plan(objs: dict[str, Any]) -> Plan:
    old = objs["summary"]
    old["spec"]["claims"] = [{"claimUID": "u1", "claim": "train-1"}]
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
