"""Building the cluster objects the budget planner reads (GpuUsageReport, GpuBudget, Namespace,
Pod, ResourceClaim) for the tests, in the forms of issue 22's contract and Tessera's CRDs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from agent.sim.apiserver_crd import violations

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = ROOT / "deploy" / "daemonset" / "budgets"
SUMMARY_CRD: dict[str, Any] = yaml.safe_load((BUDGETS / "gpuusagesummary-crd.yaml").read_text())
BUDGET_CRD: dict[str, Any] = yaml.safe_load((BUDGETS / "gpubudget-crd.yaml").read_text())
H100 = "NVIDIA H100 80GB HBM3"


def entry(
    namespace: str,
    claim: str = "train",
    allocated: float = 900.0,
    energy: float = 0.0,
    *,
    device_class: str = "gpu.tessera.dev",
    product: str = H100,
    mig: str | None = None,
    busy: float = 0.0,
) -> dict[str, Any]:
    e: dict[str, Any] = {
        "namespace": namespace,
        "claim": claim,
        "claimUID": f"uid-{namespace}-{claim}",
        "deviceClass": device_class,
        "product": product,
        "allocatedGpuSeconds": allocated,
        "busyGpuSeconds": busy,
        "energyJoules": energy,
        "unobservedSeconds": 0.0,
    }
    if mig:
        e["migProfile"] = mig
    return e


def bucket(start: str, *usage: dict[str, Any], closed: bool = True) -> dict[str, Any]:
    return {"start": start, "closed": closed, "usage": list(usage)}


def report(
    node: str,
    *buckets: dict[str, Any],
    ack: str | None = None,
    labels: dict[str, str] | None = None,
    rv: str = "1",
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuUsageReport",
        "metadata": {"name": node, "resourceVersion": rv, "labels": {"tessera.dev/node": node}},
        "spec": {
            "nodeName": node,
            "nodeLabels": labels or {},
            "through": buckets[-1]["start"] if buckets else "2026-12-04T00:00:00Z",
            "buckets": list(buckets),
        },
    }
    if ack:
        obj["status"] = {"acknowledgedThrough": ack}
    return obj


def budget(name: str, status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuBudget",
        "metadata": {"name": name, "generation": 3, "resourceVersion": "7"},
        "spec": {"thresholds": [80, 90], "action": "Warn", **spec},
    }
    if status is not None:
        obj["status"] = copy.deepcopy(status)
    assert violations(BUDGET_CRD, obj) == [], violations(BUDGET_CRD, obj)
    return obj


def namespace(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def check_summary(obj: dict[str, Any]) -> None:
    assert violations(SUMMARY_CRD, obj) == [], violations(SUMMARY_CRD, obj)


def check_budget(obj: dict[str, Any]) -> None:
    assert violations(BUDGET_CRD, obj) == [], violations(BUDGET_CRD, obj)
