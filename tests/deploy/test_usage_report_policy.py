"""The ValidatingAdmissionPolicy that limits each agent to its own node's GpuUsageReport
(deploy/daemonset/budgets/usage-report-policy.yaml), evaluated as the API server evaluates it:
its matchConstraints, matchConditions, variables and validations read from the file and run by
the API-server emulator's evaluator against the report the agent's own writer builds."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.sim.apiserver_admission import Programs, validate
from agent.sim.apiserver_admission_match import Attributes, UserInfo, matches
from dra_driver.cluster.usage_report import UsageReporter
from tests.crds import TYPES, crd_violations
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
POLICY_FILE = ROOT / "deploy" / "daemonset" / "budgets" / "usage-report-policy.yaml"
AGENT = "system:serviceaccount:tessera-system:tessera"
NODE_KEY = "authentication.kubernetes.io/node-name"
OWN, OTHER = "gpu-node-1", "gpu-node-2"
BOUND = {NODE_KEY: [OWN]}

Obj = dict[str, Any]


def documents() -> list[Obj]:
    return [d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d]


def spec() -> Obj:
    (policy,) = [d for d in documents() if d["kind"] == "ValidatingAdmissionPolicy"]
    found: Obj = policy["spec"]
    return found


def report(node: str) -> Obj:
    """The report the agent's writer builds for ``node`` (its own code)."""

    class Kube:
        def request(self, *args: Any, **kw: Any) -> Obj:
            return {"metadata": {"labels": {}}}

    writer = UsageReporter(Kube(), node, None, logging.getLogger("t"), interval=60.0)  # type: ignore[arg-type]
    obj = writer._object(1_796_385_600.0, [], (1.0, 1.0))
    assert crd_violations("gpuusagereports", obj) == []
    return obj


def admit(operation: str, obj: Obj, user: str = AGENT, extra: Any = BOUND) -> list[str] | None:
    """The denials (empty: allowed), or None when the policy does not match the request: the
    API-server emulator's evaluator (agent/sim/apiserver_admission), as test_admission_policy.py
    runs the ResourceSlice policy."""
    (policy,) = [d for d in documents() if d["kind"] == "ValidatingAdmissionPolicy"]
    rt = {t.plural: t for t in TYPES}["gpuusagereports"]
    who = (
        UserInfo(user)
        if extra is None
        else UserInfo(user, extra={k: tuple(v) for k, v in extra.items()})
    )
    old = copy.deepcopy(obj) if operation == "UPDATE" else None
    attrs = Attributes(operation, rt, "", obj["metadata"]["name"], obj, old, who)
    if not matches(policy["spec"]["matchConstraints"], attrs, None):
        return None
    failures = validate(policy, attrs, None, None, Programs())
    return None if failures is None else [f.message for f in failures]


def test_the_manifests_validate_strictly_on_1_34_and_1_35():
    docs = documents()
    assert [d["kind"] for d in docs] == [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    for doc in docs:
        for version in VERSIONS:
            validate_k8s(doc, version)
    (binding,) = docs[1:]
    assert binding["spec"] == {
        "policyName": docs[0]["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    assert spec()["failurePolicy"] == "Fail"


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_the_agent_writes_its_own_nodes_report_and_no_other(operation):
    assert admit(operation, report(OWN)) == []
    (denied,) = admit(operation, report(OTHER)) or [""]
    assert denied == (
        f"{operation} of GpuUsageReport '{OTHER}' denied: the Tessera agent on node '{OWN}' may"
        f" write only the GpuUsageReport named '{OWN}'"
    )


@pytest.mark.parametrize("extra", [None, {}, {NODE_KEY: []}, {NODE_KEY: [OWN, OTHER]}])
def test_credentials_without_one_node_are_denied(extra):
    denials = admit("CREATE", report(OWN), extra=extra)
    assert denials and "name no node" in denials[0], denials


def test_other_users_and_deletes_are_not_matched():
    assert admit("CREATE", report(OTHER), user="system:serviceaccount:tessera-system:ctl") is None
    assert admit("DELETE", report(OTHER)) is None
