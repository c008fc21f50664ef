"""The GpuBudget CRD (deploy/daemonset/budgets/): valid for the API servers Tessera supports,
its examples accepted by its schema and CEL rules, and broken budgets refused with the rule's
message. The checker is the API-server emulator's own (agent/sim/apiserver_crd.py), so the words
are the real server's."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.sim.apiserver_crd import version_schema, violations
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = ROOT / "deploy" / "daemonset" / "budgets"
CRD: dict[str, Any] = yaml.safe_load((BUDGETS / "gpubudget-crd.yaml").read_text())
EXAMPLES = sorted((BUDGETS / "examples").glob("*.yaml"))
GOOD: dict[str, Any] = yaml.safe_load((BUDGETS / "examples" / "team-a-monthly.yaml").read_text())


@pytest.mark.parametrize("version", ["1.34.0", "1.35.0"])
def test_the_crd_is_a_valid_customresourcedefinition(version):
    validate_k8s(CRD, version)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_accepted(path):
    for doc in yaml.safe_load_all(path.read_text()):
        assert violations(CRD, doc) == []


def spec(**change: Any) -> dict[str, Any]:
    obj = copy.deepcopy(GOOD)
    for key, value in change.items():
        if value is None:
            obj["spec"].pop(key, None)
        else:
            obj["spec"][key] = value
    return obj


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        (spec(scope={}), "scope names exactly one of namespace and namespaceSelector"),
        (
            spec(scope={"namespace": "a", "namespaceSelector": {"matchLabels": {"x": "y"}}}),
            "scope names exactly one",
        ),
        (spec(limits={}), "a budget needs at least one of gpuHours, energyKWh and cost"),
        (
            spec(limits={"gpuHours": "-3"}),
            'spec.limits.gpuHours: Invalid value: "-3": spec.limits.gpuHours in body should match',
        ),
        (spec(period={"type": "CalendarMonth"}), "a CalendarMonth period needs a timeZone"),
        (spec(period={"type": "Rolling"}), "window is set exactly when type is Rolling"),
        (spec(period={"type": "None", "window": "1h"}), "window is set exactly when type"),
        (spec(gracePeriod="1h"), "gracePeriod applies to action Terminate only"),
        (spec(action="Kill"), 'spec.action: Unsupported value: "Kill": supported values:'),
        (
            spec(thresholds=[0, 90]),
            "spec.thresholds[0]: Invalid value: 0: spec.thresholds[0] in body should be greater"
            " than or equal to 1",
        ),
        (spec(limit={"gpuHours": "1"}), 'unknown field "spec.limit"'),
        (
            spec(limits={"cost": {"amount": "10", "currency": "euro"}}),
            'spec.limits.cost.currency: Invalid value: "euro": spec.limits.cost.currency in body'
            " should match",
        ),
    ],
)
def test_a_broken_budget_is_refused_with_the_reason(obj, words):
    found = violations(CRD, obj)
    assert any(words in v for v in found), found


def test_defaults_warn_at_80_and_90_percent_and_only_warn_at_100():
    schema = version_schema(CRD, "v1alpha1")["properties"]["spec"]["properties"]
    assert schema["thresholds"]["default"] == [80, 90]
    assert schema["action"]["default"] == "Warn"
    assert violations(CRD, spec(action=None)) == []


def test_status_is_a_subresource_and_every_printer_column_names_a_schema_field():
    (version,) = CRD["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    schema = version["schema"]["openAPIV3Schema"]
    for column in version["additionalPrinterColumns"]:
        node = schema
        path = re.sub(r"\[[^\]]*\]", "[]", column["jsonPath"])  # a filter names an item
        for part in path.lstrip(".").split("."):
            name = part.split("[", 1)[0]
            if name == "metadata":
                break
            node = node["properties"][name]
            if "[" in part:
                node = node["items"]


# -- GpuUsageSummary (the cluster's record) and GpuBudget's status ----------------------------

SUMMARY_CRD: dict[str, Any] = yaml.safe_load((BUDGETS / "gpuusagesummary-crd.yaml").read_text())
SUMMARY: dict[str, Any] = {
    "apiVersion": "tessera.dev/v1alpha1",
    "kind": "GpuUsageSummary",
    "metadata": {
        "name": "team-a.2026-12-04",
        "labels": {"tessera.dev/namespace": "team-a", "tessera.dev/day": "2026-12-04"},
    },
    "spec": {
        "namespace": "team-a",
        "day": "2026-12-04",
        "buckets": [
            {
                "start": "2026-12-04T12:00:00Z",
                "usage": [
                    {
                        "node": "gpu-node-1",
                        "deviceClass": "gpu.tessera.dev",
                        "product": "NVIDIA H100 80GB HBM3",
                        "migProfile": "3g.40gb",
                        "allocatedGpuSeconds": 412.5,
                        "busyGpuSeconds": 201.0,
                        "energyJoules": 90210.0,
                        "unobservedSeconds": 0.0,
                    }
                ],
            }
        ],
        "claims": [
            {
                "claimUID": "7d0c",
                "claim": "train-1",
                "deviceClass": "gpu.tessera.dev",
                "allocatedGpuSeconds": 412.5,
                "busyGpuSeconds": 201.0,
                "energyJoules": 90210.0,
            }
        ],
        "nodes": [
            {
                "name": "gpu-node-1",
                "labels": {"tessera.dev/pool": "reserved"},
                "foldedThrough": "2026-12-04T12:15:00Z",
            }
        ],
    },
}


@pytest.mark.parametrize("version", ["1.34.0", "1.35.0"])
def test_the_summary_crd_is_a_valid_customresourcedefinition(version):
    validate_k8s(SUMMARY_CRD, version)


def test_the_summary_crd_is_cluster_scoped_and_shows_namespace_day_and_age():
    assert SUMMARY_CRD["spec"]["scope"] == "Cluster"  # a deleted namespace keeps its usage
    (version,) = SUMMARY_CRD["spec"]["versions"]
    columns = [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]]
    assert columns == [
        ("Namespace", ".spec.namespace"),
        ("Day", ".spec.day"),
        ("Age", ".metadata.creationTimestamp"),
    ]


def test_the_contracts_summary_is_accepted():
    assert violations(SUMMARY_CRD, SUMMARY) == []


def summary(change: dict[str, Any], path: tuple[Any, ...] = ()) -> dict[str, Any]:
    obj = copy.deepcopy(SUMMARY)
    node = obj["spec"]
    for p in path:
        node = node[p]
    for key, value in change.items():
        if value is None:
            node.pop(key)
        else:
            node[key] = value
    return obj


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        (
            summary({"namespace": "Team_A"}),
            'spec.namespace: Invalid value: "Team_A": spec.namespace in body should match',
        ),
        (
            summary({"day": "4.12.2026"}),
            'spec.day: Invalid value: "4.12.2026": spec.day in body should match',
        ),
        (summary({"nodes": None}), "spec.nodes: Required value"),
        (
            summary({"allocatedGpuSeconds": -1}, ("buckets", 0, "usage", 0)),
            "allocatedGpuSeconds in body should be greater than or equal to 0",
        ),
        (
            summary({"energyJoules": "9"}, ("buckets", 0, "usage", 0)),
            "energyJoules in body must be of type number",
        ),
        (
            summary({"foldedThrough": None}, ("nodes", 0)),
            "spec.nodes[0].foldedThrough: Required value",
        ),
        (
            summary({"buckets": [SUMMARY["spec"]["buckets"][0]] * 97}),
            "spec.buckets: Too many: 97: must have at most 96 items",
        ),
        (summary({"cost": "1"}, ("claims", 0)), 'unknown field "spec.claims[0].cost"'),
    ],
)
def test_a_broken_summary_is_refused_with_the_reason(obj, words):
    found = violations(SUMMARY_CRD, obj)
    assert any(words in v for v in found), found


def with_status(**status: Any) -> dict[str, Any]:
    obj = copy.deepcopy(GOOD)
    obj["status"] = status
    return obj


def test_a_budgets_full_status_is_accepted():
    obj = with_status(
        periodStart="2026-12-01T00:00:00+01:00",
        periodEnd="2027-01-01T00:00:00+01:00",
        used={"gpuHours": "1200.400", "energyKWh": "80.000"},
        remaining={"gpuHours": "0.000"},
        byDeviceClass=[
            {"deviceClass": "gpu.tessera.dev", "gpuHours": "1200.400", "energyKWh": "80.000"}
        ],
        thresholdsReached=[80, 90],
        exhaustedSince="2026-12-28T09:15:00Z",
        lastReconcileTime="2026-12-28T09:15:30Z",
        observedGeneration=3,
        conditions=[
            {
                "type": "Exhausted",
                "status": "True",
                "reason": "LimitReached",
                "message": "used 1200.400 of 1200 GPU-hours (period 2026-12-01T00:00:00+01:00"
                " to 2027-01-01T00:00:00+01:00)",
                "lastTransitionTime": "2026-12-28T09:15:00Z",
                "observedGeneration": 3,
            },
            {
                "type": "Reconciled",
                "status": "True",
                "reason": "Reconciled",
                "message": "usage and status are up to date",
                "lastTransitionTime": "2026-12-01T00:00:00Z",
            },
        ],
    )
    assert violations(CRD, obj) == []


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        (
            with_status(thresholdsReached=[100]),
            "thresholdsReached[0] in body should be less than or equal to 99",
        ),
        (
            with_status(thresholdsReached=["80"]),
            "thresholdsReached[0] in body must be of type integer",
        ),
        (with_status(exhaustedSince=5), "status.exhaustedSince in body must be of type string"),
    ],
)
def test_a_broken_budget_status_is_refused(obj, words):
    found = violations(CRD, obj)
    assert any(words in v for v in found), found
