"""Terminate: once a budget has been exhausted for its grace period, the pods holding its
scope's Tessera claims are evicted (each with a Warning Event); never before, never for Warn or
DenyNew, never a pod already terminating or finished, never a pod holding another driver's
claim."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from agent.usage.budget_plan import ClusterView, PodEviction, plan
from tests.k8sschema import VERSIONS, validate
from tests.usage.clusterobjs import bucket, budget, entry, namespace, report

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
EXHAUSTED = {"exhaustedSince": "2026-12-04T10:00:00Z", "thresholdsReached": [80, 90]}


def claim(
    ns: str,
    name: str,
    driver: str = "gpu.tessera.dev",
    pod: str | None = None,
    device_class: str = "gpu.tessera.dev",
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]}
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": driver, "pool": "n1", "device": "gpu-0"}
                    ]
                }
            },
            "reservedFor": []
            if pod is None
            else [{"resource": "pods", "name": pod, "uid": f"uid-{pod}"}],
        },
    }
    return obj


def pod(
    ns: str,
    name: str,
    claim_name: str | None = None,
    *,
    template: str | None = None,
    phase: str = "Running",
    deleting: bool = False,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"containers": [{"name": "main", "image": "trainer"}], "resourceClaims": []},
        "status": {"phase": phase},
    }
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-12-04T11:59:00Z"
    if claim_name:
        obj["spec"]["resourceClaims"].append({"name": "gpu", "resourceClaimName": claim_name})
    if template:
        obj["spec"]["resourceClaims"].append({"name": "gpu", "resourceClaimTemplateName": "t"})
        obj["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": template}]
    return obj


PODS = [
    pod("team-a", "by-name", "c1"),
    pod("team-a", "from-template", template="t-gpu-x1"),
    pod("team-a", "reserved-only"),
    pod("team-a", "terminating", "c1", deleting=True),
    pod("team-a", "finished", "c1", phase="Succeeded"),
    pod("team-a", "other-driver", "c-nic"),
    pod("team-b", "elsewhere", "c-b"),
]
CLAIMS = [
    claim("team-a", "c1"),
    claim("team-a", "t-gpu-x1"),
    claim("team-a", "c-res", pod="reserved-only"),
    claim("team-a", "c-nic", driver="nic.example.com"),
    claim("team-b", "c-b"),
]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_pods_and_claims_are_valid_objects(version):
    for obj in PODS + CLAIMS:
        validate(obj, version)


def run(
    action: str,
    grace: str | None,
    now: datetime,
    status=EXHAUSTED,
    used_class="gpu.tessera.dev",
    **spec: Any,
):
    extra = {"gracePeriod": grace} if grace else {}
    b = budget(
        "a",
        status,
        scope={"namespace": "team-a"},
        limits={"gpuHours": "1"},
        action=action,
        **extra,
        **spec,
    )
    r = report(
        "n1",
        bucket("2026-12-04T11:45:00Z", entry("team-a", allocated=7200.0, device_class=used_class)),
    )
    view = ClusterView(
        [r],
        [],
        [b],
        [namespace("team-a"), namespace("team-b")],
        frozenset({"n1"}),
        PODS,
        CLAIMS,
        None,
    )
    return plan(view, now)


def test_after_the_grace_period_every_holder_of_the_scopes_gpu_claims_is_evicted_with_an_event():
    p = run("Terminate", "2h", NOW)
    assert p.evictions == [
        PodEviction("team-a", "by-name", "a"),
        PodEviction("team-a", "from-template", "a"),
        PodEviction("team-a", "reserved-only", "a"),
    ]
    terminating = [e for e in p.events if e.reason == "GpuBudgetTerminating"]
    assert [(e.namespace, e.type) for e in terminating] == [("team-a", "Warning")] * 3
    assert "team-a/by-name" in terminating[0].message


def test_nothing_is_evicted_within_the_grace_period_nor_for_warn_or_deny_new():
    assert run("Terminate", "2h", NOW - timedelta(seconds=1)).evictions == []
    assert run("Warn", None, NOW).evictions == []
    assert run("DenyNew", None, NOW).evictions == []


def test_a_budget_first_exhausted_now_waits_its_grace_period():
    p = run("Terminate", "10m", NOW, status=None)
    assert p.evictions == []
    assert [e.reason for e in p.events] == [
        "GpuBudgetThreshold",
        "GpuBudgetThreshold",
        "GpuBudgetExhausted",
    ]
    assert "its pods are evicted after 10m" in p.events[-1].message
    assert len(run("Terminate", None, NOW, status=None).evictions) == 3  # no grace period


def test_a_device_class_filter_evicts_only_the_holders_of_those_classes():
    mig = "mig.tessera.dev"
    p = run("Terminate", "1h", NOW, used_class=mig, deviceClasses=[mig])
    assert p.statuses[0]["status"]["exhaustedSince"] == EXHAUSTED["exhaustedSince"]
    assert p.evictions == []  # the scope's claims are all of gpu.tessera.dev
