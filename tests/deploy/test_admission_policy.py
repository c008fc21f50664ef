"""The ValidatingAdmissionPolicy in deploy/daemonset/admission-policy.yaml, evaluated as the API
server evaluates it, by the API-server emulator's evaluator (agent/sim/apiserver_admission): its
matchConstraints, matchConditions, variables and validations, against the requests the agent
makes on its own node (allowed) and the ones a compromised agent could make (denied, saying what
was wrong and the offending values); every other user is not matched at all. The last tests send
the requests over HTTP to the emulator with the policy installed, as the agent's service account
with its bound token's node, and as other users (impersonation)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cel
import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.cli.node_commands import slices_for
from agent.config import Config
from agent.sim.apiserver import RESOURCES, ApiServer
from agent.sim.apiserver_access import DEFAULT_IDENTITY
from agent.sim.apiserver_admission import Programs, validate
from agent.sim.apiserver_admission_match import Attributes, UserInfo, matches
from dra_driver.device_model import DeviceModel
from tests.apiclient import api_client
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
POLICY_FILE = ROOT / "deploy" / "daemonset" / "admission-policy.yaml"
AGENT = "system:serviceaccount:tessera-system:tessera"
NODE_KEY = "authentication.kubernetes.io/node-name"
DRIVER = "gpu.tessera.dev"
OWN, OTHER = "gpu-node-1", "gpu-node-2"

Obj = dict[str, Any]


def documents() -> list[Obj]:
    return [d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d]


def policy() -> Obj:
    (found,) = [d for d in documents() if d["kind"] == "ValidatingAdmissionPolicy"]
    return found


@dataclass
class Decision:
    matched: bool
    denials: list[str]
    """The message of each failed validation (messageExpression, else message); a validation
    that cannot be evaluated denies too (failurePolicy Fail)."""

    @property
    def allowed(self) -> bool:
        return not self.denials


def admit(
    operation: str,
    obj: Obj | None,
    old: Obj | None,
    username: str = AGENT,
    extra: dict[str, list[str]] | None = None,
    resource: str = "resourceslices",
) -> Decision:
    """What the policy decides about one request (the admission request as the API server
    builds it: ``object`` is null for a DELETE, ``oldObject`` for a CREATE)."""
    rt = {t.plural: t for t in RESOURCES}[resource]
    name = (obj or old or {}).get("metadata", {}).get("name", "")
    user = UserInfo(username, extra={k: tuple(v) for k, v in (extra or {}).items()})
    attrs = Attributes(operation, rt, "", name, obj, old, user)
    if not matches(policy()["spec"]["matchConstraints"], attrs, None):
        return Decision(False, [])
    failures = validate(policy(), attrs, None, None, Programs())
    if failures is None:  # a matchCondition is false
        return Decision(False, [])
    return Decision(True, [f.message for f in failures])


def a_slice(node: str | None = OWN, driver: str = DRIVER) -> Obj:
    """A ResourceSlice as the agent publishes it (built by the driver's own code)."""
    (obj,) = slices_for(Config(), node or OWN, DeviceModel((), ()))
    obj = copy.deepcopy(obj)
    obj["spec"]["driver"] = driver
    if node is None:  # a slice for every node instead of one
        del obj["spec"]["nodeName"]
        obj["spec"]["allNodes"] = True
    return obj


BOUND = {NODE_KEY: [OWN], "authentication.kubernetes.io/pod-name": ["tessera-x7k2p"]}
"""The user info extra of the agent's bound token, issued to its pod on OWN."""


def test_the_manifests_validate_strictly_on_1_34_and_1_35():
    docs = documents()
    assert [d["kind"] for d in docs] == [
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    for doc in docs:
        for version in ("1.34.0", "1.35.0"):
            validate_k8s(doc, version)
    kust = yaml.safe_load((POLICY_FILE.parent / "kustomization.yaml").read_text())
    assert POLICY_FILE.name in kust["resources"]


def test_the_binding_denies_and_a_broken_expression_fails_closed():
    spec = policy()["spec"]
    (binding,) = [d for d in documents() if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == policy()["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "paramRef" not in binding["spec"] and "matchResources" not in binding["spec"]
    assert spec["failurePolicy"] == "Fail"
    # a request through v1beta1/v1beta2 is converted to v1 and checked too
    assert spec["matchConstraints"]["matchPolicy"] == "Equivalent"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["CREATE", "UPDATE", "DELETE"]


def test_every_expression_compiles():
    spec = policy()["spec"]
    for entry in spec["matchConditions"] + spec["variables"] + spec["validations"]:
        cel.compile(entry["expression"])
        if "messageExpression" in entry:
            cel.compile(entry["messageExpression"])


def test_the_agent_writes_its_own_nodes_slices():
    mine = a_slice()
    assert admit("CREATE", mine, None, extra=BOUND) == Decision(True, [])
    changed = copy.deepcopy(mine)
    changed["spec"]["pool"]["generation"] = 2
    assert admit("UPDATE", changed, mine, extra=BOUND) == Decision(True, [])
    assert admit("DELETE", None, mine, extra=BOUND) == Decision(True, [])


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_another_nodes_slice_is_denied_naming_both_nodes(operation):
    theirs = a_slice(OTHER)
    obj, old = {"CREATE": (theirs, None), "UPDATE": (theirs, theirs), "DELETE": (None, theirs)}[
        operation
    ]
    decision = admit(operation, obj, old, extra=BOUND)
    (message,) = decision.denials
    assert message.startswith(f"{operation} of ResourceSlice '{theirs['metadata']['name']}'")
    assert f"the Tessera agent on node '{OWN}'" in message
    assert f"spec.nodeName '{OWN}'" in message and f"'{OTHER}'" in message


def test_a_slice_cannot_be_moved_off_or_onto_the_agents_node():
    mine, theirs = a_slice(OWN), a_slice(OTHER)
    moved_off = copy.deepcopy(mine)
    moved_off["spec"]["nodeName"] = OTHER
    (message,) = admit("UPDATE", moved_off, mine, extra=BOUND).denials
    assert f"it has '{OWN}' and would have '{OTHER}'" in message
    taken = copy.deepcopy(theirs)
    taken["spec"]["nodeName"] = OWN
    (message,) = admit("UPDATE", taken, theirs, extra=BOUND).denials
    assert f"it has '{OTHER}' and would have '{OWN}'" in message


def test_a_slice_for_all_nodes_is_denied():
    everywhere = a_slice(None)
    (message,) = admit("CREATE", everywhere, None, extra=BOUND).denials
    assert "this one has ''" in message and "a slice for all nodes" in message


def test_another_drivers_slice_is_denied_naming_the_driver():
    nic = a_slice(OWN, driver="nic.example.com")
    (message,) = admit("CREATE", nic, None, extra=BOUND).denials
    assert "spec.driver 'gpu.tessera.dev'" in message and "has 'nic.example.com'" in message
    (message,) = admit("DELETE", None, nic, extra=BOUND).denials
    assert "has 'nic.example.com'" in message
    renamed = copy.deepcopy(a_slice())
    renamed["spec"]["driver"] = "nic.example.com"
    (message,) = admit("UPDATE", renamed, a_slice(), extra=BOUND).denials
    assert f"it has '{DRIVER}' and would have 'nic.example.com'" in message


@pytest.mark.parametrize(
    "extra",
    [None, {}, {"authentication.kubernetes.io/pod-name": ["tessera-x7k2p"]}, {NODE_KEY: []}],
    ids=["no-extra", "empty-extra", "no-node-name", "empty-node-name"],
)
def test_credentials_without_a_node_are_denied_with_how_to_fix_it(extra):
    """A token not bound to a pod on a node (a Secret, `kubectl create token`) says nothing
    about which node's slices it may write: every write is denied, even of a plausible slice."""
    for operation, obj, old in (
        ("CREATE", a_slice(), None),
        ("UPDATE", a_slice(), a_slice()),
        ("DELETE", None, a_slice()),
    ):
        decision = admit(operation, obj, old, extra=extra)
        (message,) = decision.denials  # one reason, not a node mismatch against ''
        assert f"the credentials of {AGENT} name no node" in message
        assert NODE_KEY in message and "bound service-account token" in message


@pytest.mark.parametrize(
    "user",
    [
        "kubernetes-admin",
        "system:serviceaccount:kube-system:resourceclaim-controller",
        "system:serviceaccount:tessera-system:other",
        "system:node:gpu-node-2",
    ],
)
def test_other_users_are_not_matched(user):
    """Whatever they write (another node's slice, another driver's, without a node in their
    credentials), the policy is not theirs: RBAC alone decides."""
    for operation, obj, old in (
        ("CREATE", a_slice(OTHER, "nic.example.com"), None),
        ("UPDATE", a_slice(OTHER), a_slice(OWN)),
        ("DELETE", None, a_slice(OTHER)),
    ):
        assert admit(operation, obj, old, username=user) == Decision(False, [])
        assert admit(operation, obj, old, username=user, extra=BOUND) == Decision(False, [])


def test_only_resourceslice_writes_are_matched():
    assert not admit("CREATE", a_slice(OTHER), None, extra=BOUND, resource="resourceclaims").matched
    assert not admit("CONNECT", a_slice(OTHER), None, extra=BOUND).matched


# ------------------------------------------------------------------------------ over HTTP

AGENT_ON_OWN = UserInfo(AGENT, DEFAULT_IDENTITY.groups, {k: tuple(v) for k, v in BOUND.items()})
"""The agent's pod on OWN, as the API server authenticates its bound token."""


@pytest.fixture
def api() -> Iterator[client.ApiClient]:
    with ApiServer(identity=AGENT_ON_OWN) as server:
        c = api_client(server, retries=False)
        adm = client.AdmissionregistrationV1Api(c)
        binding = [d for d in documents() if d["kind"] == "ValidatingAdmissionPolicyBinding"]
        adm.create_validating_admission_policy(policy())
        adm.create_validating_admission_policy_binding(binding[0])
        yield c
        c.close()


def refusal(call: Any) -> tuple[int, str]:
    try:
        call()
    except ApiException as exc:
        return int(exc.status), str(yaml.safe_load(exc.body)["message"])
    return 200, ""


def test_over_http_the_agent_writes_its_own_slices_and_no_other_nodes(api):
    slices = client.ResourceV1Api(api)
    mine = slices.create_resource_slice(a_slice())
    mine.spec.pool.generation = 2
    slices.replace_resource_slice(mine.metadata.name, mine)
    theirs = a_slice(OTHER)
    status, message = refusal(lambda: slices.create_resource_slice(theirs))
    name = theirs["metadata"]["name"]
    assert status == 422  # the policy sets no reason: Invalid
    assert message.startswith(
        f'resourceslices.resource.k8s.io "{name}" is forbidden: ValidatingAdmissionPolicy'
        " 'tessera-resourceslices-own-node' with binding 'tessera-resourceslices-own-node'"
        f" denied request: CREATE of ResourceSlice '{name}' denied: the Tessera agent on node"
        f" '{OWN}'"
    )
    moved = slices.read_resource_slice(mine.metadata.name)
    moved.spec.node_name = OTHER
    status, message = refusal(lambda: slices.replace_resource_slice(moved.metadata.name, moved))
    assert status == 422 and f"it has '{OWN}' and would have '{OTHER}'" in message
    slices.delete_resource_slice(mine.metadata.name)


def test_over_http_another_user_is_not_matched(api):
    """The resourceslice controller (impersonated) writes another node's slice: RBAC's call."""
    api.set_default_header(
        "Impersonate-User", "system:serviceaccount:kube-system:resourceclaim-controller"
    )
    client.ResourceV1Api(api).create_resource_slice(a_slice(OTHER, "nic.example.com"))
