"""The DenyNew policy (deploy/daemonset/budgets/deny-new-policy.yaml), evaluated by the API-server
emulator as the real server evaluates it: written over HTTP, with GpuBudgets as its params,
against claims and pods created over HTTP through the kubernetes client; and the same policy
evaluated directly with budget objects (the emulator's evaluator, one per budget)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cel
import jsonschema
import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.sim.apiserver import RESOURCES, ApiServer, ResourceType
from agent.sim.apiserver_admission import Programs, validate
from agent.sim.apiserver_admission_match import Attributes, UserInfo
from tests.apiclient import api_client
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = ROOT / "deploy" / "daemonset" / "budgets"
POLICY_FILE = BUDGETS / "deny-new-policy.yaml"
NAME = "tessera-gpubudget-deny-new"
PREFIX = f"ValidatingAdmissionPolicy '{NAME}' with binding '{NAME}' denied request: "
USED = (
    "used 1200.4 of 1200 GPU-hours (period 2026-12-01T00:00:00+01:00 to 2027-01-01T00:00:00+01:00)"
)

Obj = dict[str, Any]

GPUBUDGET = ResourceType(
    "gpubudgets", "GpuBudget", "tessera.dev", "v1alpha1", status=True, generation=True
)
"""Served as a plain type here; the emulator's CRD support serves it from the CRD itself."""


def documents() -> list[Obj]:
    return [d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d]


def budget_schema() -> Obj:
    crd = yaml.safe_load((BUDGETS / "gpubudget-crd.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    schema: Obj = version["schema"]["openAPIV3Schema"]
    return schema


def budget(
    name: str,
    scope: Obj,
    action: str = "DenyNew",
    exhausted: bool | None = True,
    message: str = USED,
) -> Obj:
    """A GpuBudget as the controller leaves it (checked against the CRD's schema)."""
    obj: Obj = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "GpuBudget",
        "metadata": {"name": name},
        "spec": {"scope": scope, "limits": {"gpuHours": "1200"}, "action": action},
    }
    if action == "Terminate":
        obj["spec"]["gracePeriod"] = "1h"
    if exhausted is not None:
        obj["status"] = {
            "conditions": [
                {
                    "type": "Exhausted",
                    "status": "True" if exhausted else "False",
                    "reason": "LimitReached" if exhausted else "WithinLimits",
                    "message": message if exhausted else "used 10.0 of 1200 GPU-hours",
                    "lastTransitionTime": "2026-12-04T12:00:00Z",
                }
            ]
        }
    jsonschema.Draft7Validator(budget_schema()).validate(obj)
    return obj


def claim(name: str = "train-1") -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
        },
    }


DRIVER = "gpu.tessera.dev"


def pod(name: str = "trainer", claims: bool = True) -> Obj:
    spec: Obj = {"containers": [{"name": "main", "image": "trainer:1"}]}
    if claims:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


# ------------------------------------------------------------------------------ the manifest


def test_the_manifests_validate_strictly_on_1_34_and_1_35():
    docs = documents()
    assert [d["kind"] for d in docs] == [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    for doc in docs:
        for version in VERSIONS:
            validate_k8s(doc, version)


def test_every_budget_is_a_param_and_only_creates_are_matched():
    policy, binding = documents()
    spec = policy["spec"]
    assert spec["paramKind"] == {"apiVersion": "tessera.dev/v1alpha1", "kind": "GpuBudget"}
    assert binding["spec"] == {
        "policyName": NAME,
        "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"},
        "validationActions": ["Deny"],
    }
    assert {op for r in spec["matchConstraints"]["resourceRules"] for op in r["operations"]} == {
        "CREATE"
    }
    for entry in spec["matchConditions"] + spec["variables"] + spec["validations"]:
        cel.compile(entry["expression"])
        if "messageExpression" in entry:
            cel.compile(entry["messageExpression"])


# ------------------------------------------------------------------------------ over HTTP


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer(resources=(*RESOURCES, GPUBUDGET)) as s:
        s.put_object("namespaces", {"metadata": {"name": "team-a"}})
        s.put_object("namespaces", {"metadata": {"name": "team-b"}})
        for ns in ("research-1", "research-2"):
            s.put_object("namespaces", {"metadata": {"name": ns, "labels": {"org": "research"}}})
        s.put_object("namespaces", {"metadata": {"name": "web", "labels": {"org": "web"}}})
        yield s


@pytest.fixture
def api(server: ApiServer) -> Iterator[client.ApiClient]:
    c = api_client(server, retries=False)
    adm = client.AdmissionregistrationV1Api(c)
    policy, binding = documents()
    adm.create_validating_admission_policy(policy)
    adm.create_validating_admission_policy_binding(binding)
    yield c
    c.close()


def create_claim(api: client.ApiClient, ns: str, name: str = "train-1") -> tuple[int, str]:
    try:
        client.ResourceV1Api(api).create_namespaced_resource_claim(ns, claim(name))
    except ApiException as exc:
        body = yaml.safe_load(exc.body)
        return int(exc.status), str(body["message"])
    return 201, ""


def create_pod(api: client.ApiClient, ns: str, claims: bool = True) -> tuple[int, str]:
    try:
        client.CoreV1Api(api).create_namespaced_pod(ns, pod(claims=claims))
    except ApiException as exc:
        body = yaml.safe_load(exc.body)
        return int(exc.status), str(body["message"])
    return 201, ""


def test_claims_and_pods_with_claims_are_refused_in_an_exhausted_namespace(server, api):
    server.put_object("gpubudgets", budget("team-a-monthly", {"namespace": "team-a"}))
    status, message = create_claim(api, "team-a")
    assert status == 403
    assert message == (
        f'resourceclaims.resource.k8s.io "train-1" is forbidden: {PREFIX}GpuBudget'
        f" 'team-a-monthly' is exhausted: {USED}; new ResourceClaims in namespace 'team-a' are"
        " refused (action DenyNew) until the budget is raised or its period ends"
    )
    status, message = create_pod(api, "team-a")
    assert status == 403
    assert "GpuBudget 'team-a-monthly' is exhausted: used 1200.4 of 1200 GPU-hours" in message
    assert "new Pods with ResourceClaims in namespace 'team-a'" in message
    # nothing else is affected: a pod without claims, another namespace
    assert create_pod(api, "team-a", claims=False) == (201, "")
    assert create_claim(api, "team-b") == (201, "")
    assert create_pod(api, "team-b") == (201, "")


def test_a_namespace_selector_scope_refuses_in_every_matching_namespace(server, api):
    scope = {"namespaceSelector": {"matchLabels": {"org": "research"}}}
    server.put_object("gpubudgets", budget("research", scope, action="Terminate"))
    for ns in ("research-1", "research-2"):
        status, message = create_claim(api, ns)
        assert status == 403 and "GpuBudget 'research' is exhausted" in message
        assert "(action Terminate)" in message
    assert create_claim(api, "web") == (201, "")
    assert create_claim(api, "team-a") == (201, "")


@pytest.mark.parametrize(
    "kwargs",
    [{"action": "Warn"}, {"exhausted": False}, {"exhausted": None}],
    ids=["warn-budget", "not-exhausted", "no-status-yet"],
)
def test_a_budget_that_does_not_deny_lets_claims_through(server, api, kwargs):
    server.put_object("gpubudgets", budget("team-a-monthly", {"namespace": "team-a"}, **kwargs))
    assert create_claim(api, "team-a") == (201, "")
    assert create_pod(api, "team-a") == (201, "")


def test_no_budget_at_all_denies_nothing(api):
    assert create_claim(api, "team-a") == (201, "")


def test_existing_claims_can_be_updated_and_deleted_once_exhausted(server, api):
    assert create_claim(api, "team-a") == (201, "")
    server.put_object("gpubudgets", budget("team-a-monthly", {"namespace": "team-a"}))
    resource = client.ResourceV1Api(api)
    resource.patch_namespaced_resource_claim(
        "train-1", "team-a", {"metadata": {"labels": {"phase": "done"}}}
    )
    resource.delete_namespaced_resource_claim("train-1", "team-a")
    assert server.get_object("resourceclaims", "train-1", "team-a") is None


def test_exhausted_turning_false_lets_the_next_create_through(server, api):
    server.put_object("gpubudgets", budget("team-a-monthly", {"namespace": "team-a"}))
    assert create_claim(api, "team-a")[0] == 403
    # the controller sets Exhausted False once the limit is raised (within one reconcile)
    raised = budget("team-a-monthly", {"namespace": "team-a"}, exhausted=False)
    raised["spec"]["limits"]["gpuHours"] = "2000"
    server.put_object("gpubudgets", raised)
    assert create_claim(api, "team-a") == (201, "")


def test_each_exhausted_budget_is_its_own_param(server, api):
    """Two budgets over one namespace: the first one that denies (by name) is named."""
    server.put_object("gpubudgets", budget("b-team-a", {"namespace": "team-a"}))
    server.put_object("gpubudgets", budget("a-team-a-warn", {"namespace": "team-a"}, "Warn"))
    status, message = create_claim(api, "team-a")
    assert status == 403 and "GpuBudget 'b-team-a'" in message


# ------------------------------------------------------------------------------ the evaluator


def run_policy(
    operation: str,
    resource: str,
    obj: Obj | None,
    old: Obj | None,
    params: Obj,
    namespace: Obj,
) -> list[str] | None:
    """The policy's failures with one budget as its param (None: not matched)."""
    policy, _ = documents()
    rt = {t.plural: t for t in RESOURCES}[resource]
    ns = namespace["metadata"]["name"]
    for o in (obj, old):
        if o is not None:
            o["metadata"]["namespace"] = ns
            for version in VERSIONS:
                validate_k8s(o, version)
    attrs = Attributes(operation, rt, ns, "x", obj, old, UserInfo("alice"))
    found = validate(policy, attrs, params, namespace, Programs())
    return None if found is None else [f.message for f in found]


NS_A = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}}
NS_R = {
    "apiVersion": "v1",
    "kind": "Namespace",
    "metadata": {"name": "research-1", "labels": {"org": "research", "tier": "gold"}},
}


@pytest.mark.parametrize(
    ("budget_kwargs", "namespace", "denied"),
    [
        ({"scope": {"namespace": "team-a"}}, NS_A, True),
        ({"scope": {"namespace": "team-b"}}, NS_A, False),
        ({"scope": {"namespaceSelector": {"matchLabels": {"org": "research"}}}}, NS_R, True),
        (
            {"scope": {"namespaceSelector": {"matchLabels": {"org": "research", "tier": "x"}}}},
            NS_R,
            False,
        ),
        ({"scope": {"namespaceSelector": {"matchLabels": {"org": "research"}}}}, NS_A, False),
        ({"scope": {"namespace": "team-a"}, "action": "Warn"}, NS_A, False),
        ({"scope": {"namespace": "team-a"}, "exhausted": False}, NS_A, False),
    ],
)
def test_the_policy_with_a_budget_given_directly(budget_kwargs, namespace, denied):
    params = budget("b", **budget_kwargs)
    failures = run_policy("CREATE", "resourceclaims", claim(), None, params, namespace)
    assert failures is not None
    assert bool(failures) is denied
    if denied:
        (message,) = failures
        assert message.startswith(f"GpuBudget 'b' is exhausted: {USED}")


def test_a_pod_without_claims_is_not_matched():
    params = budget("b", {"namespace": "team-a"})
    assert run_policy("CREATE", "pods", pod(claims=False), None, params, NS_A) is None
    assert run_policy("CREATE", "pods", pod(), None, params, NS_A) != []


def test_a_claim_the_controller_makes_from_a_template_is_refused_too(server, api):
    """The resourceclaim controller creates a Pod's claims from its templates under its own
    identity (impersonated here); the policy matches every user."""
    server.put_object("gpubudgets", budget("team-a-monthly", {"namespace": "team-a"}))
    api.set_default_header(
        "Impersonate-User", "system:serviceaccount:kube-system:resourceclaim-controller"
    )
    status, message = create_claim(api, "team-a", "trainer-gpu-x7k2p")
    assert status == 403 and "GpuBudget 'team-a-monthly' is exhausted" in message
