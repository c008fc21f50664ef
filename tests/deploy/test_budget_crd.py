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
