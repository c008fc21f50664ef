"""The API-server emulator evaluates ValidatingAdmissionPolicies on every write, as the real
server does: policies and bindings are written over HTTP (and checked against the upstream
schemas like every write), then requests are refused, warned about or audited with the real
server's words (k8s.io/apiserver pkg/admission/plugin/policy/validating, dispatcher.go)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.sim.apiserver import ApiServer, UserInfo
from agent.sim.apiserver_admission_match import Attributes, matches
from agent.sim.apiserver_types import RESOURCES
from tests.apiclient import api_client

Obj = dict[str, Any]
ADM = "/apis/admissionregistration.k8s.io/v1"
PREFIX = "ValidatingAdmissionPolicy 'p' with binding 'b' denied request: "


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer() as s:
        s.put_object("namespaces", {"metadata": {"name": "team-a", "labels": {"org": "ml"}}})
        yield s


@pytest.fixture
def api(server: ApiServer) -> Iterator[client.ApiClient]:
    c = api_client(server, retries=False)
    yield c
    c.close()


def call(
    api: client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Obj, list[str]]:
    """(status, JSON body, Warning headers) of one request."""
    try:
        resp = api.call_api(
            *api.param_serialize(method, path, body=body, header_params=headers or {}),
            _request_timeout=5,
        )
    except ApiException as exc:
        return int(exc.status), json.loads(exc.body), []
    resp.read()
    return resp.status, json.loads(resp.data), resp.getheaders().get_all("Warning") or []


def rule(
    resources: Sequence[str],
    group: str = "",
    operations: Sequence[str] = ("CREATE", "UPDATE", "DELETE"),
    **more: Any,
) -> Obj:
    return {
        "apiGroups": [group],
        "apiVersions": ["*"],
        "operations": list(operations),
        "resources": list(resources),
        **more,
    }


def install(
    api: client.ApiClient,
    validations: Sequence[Obj],
    rules: Sequence[Obj] = (rule(["configmaps"]),),
    actions: Sequence[str] = ("Deny",),
    binding: Obj | None = None,
    **spec: Any,
) -> None:
    """Policy ``p`` and its binding ``b``, written over HTTP."""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "p"},
        "spec": {"matchConstraints": {"resourceRules": list(rules)}, "validations": validations}
        | spec,
    }
    assert call(api, "POST", f"{ADM}/validatingadmissionpolicies", policy)[0] == 201
    bound = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": "b"},
        "spec": {"policyName": "p", "validationActions": list(actions)} | (binding or {}),
    }
    assert call(api, "POST", f"{ADM}/validatingadmissionpolicybindings", bound)[0] == 201


def configmap(name: str, data: dict[str, str], labels: dict[str, str] | None = None) -> Obj:
    meta: Obj = {"name": name}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def create_cm(api: client.ApiClient, cm: Obj, ns: str = "team-a") -> tuple[int, Obj, list[str]]:
    return call(api, "POST", f"/api/v1/namespaces/{ns}/configmaps", cm)


NO_SECRET = {"expression": "!has(object.data) || !('secret' in object.data)"}


def test_a_failed_validation_refuses_the_write_with_the_real_servers_words(server, api):
    install(api, [NO_SECRET | {"message": "no secrets in ConfigMaps"}])
    status, body, _ = create_cm(api, configmap("cm1", {"secret": "x"}))
    message = PREFIX + "no secrets in ConfigMaps"
    # no reason: Invalid, 422 (dispatcher.go: an empty reason is StatusReasonInvalid)
    assert (status, body["reason"], body["code"]) == (422, "Invalid", 422)
    assert body["message"] == f'configmaps "cm1" is forbidden: {message}'
    assert body["details"] == {
        "name": "cm1",
        "kind": "configmaps",
        "causes": [{"message": message}],
    }
    assert server.get_object("configmaps", "cm1", "team-a") is None
    assert create_cm(api, configmap("cm2", {"plain": "x"}))[0] == 201
    # a dry run is admitted the same way
    path = "/api/v1/namespaces/team-a/configmaps?dryRun=All"
    assert call(api, "POST", path, configmap("cm3", {"secret": "x"}))[0] == 422


@pytest.mark.parametrize(
    ("reason", "code"),
    [("Forbidden", 403), ("Unauthorized", 401), ("RequestEntityTooLarge", 413), ("Invalid", 422)],
)
def test_the_reason_sets_the_code(api, reason, code):
    install(api, [NO_SECRET | {"reason": reason}])
    status, body, _ = create_cm(api, configmap("cm1", {"secret": "x"}))
    assert (status, body["reason"]) == (code, reason)


@pytest.mark.parametrize(
    ("validation", "message"),
    [
        ({"messageExpression": "'has ' + string(size(object.data)) + ' keys'"}, "has 1 keys"),
        ({"messageExpression": "object.missing", "message": "static"}, "static"),
        ({"messageExpression": "'two\\nlines'", "message": "static"}, "static"),
        ({"messageExpression": "'  '", "message": " padded "}, "padded"),
        ({}, f"failed expression: {NO_SECRET['expression']}"),
    ],
    ids=["expression", "expression-error", "multi-line", "blank", "no-message"],
)
def test_the_message_falls_back_as_upstream(api, validation, message):
    install(api, [NO_SECRET | validation])
    _, body, _ = create_cm(api, configmap("cm1", {"secret": "x"}))
    assert body["details"]["causes"] == [{"message": PREFIX + message}]


def test_params_are_looked_up_by_kind_name_and_namespace(server, api):
    """A ConfigMap as paramKind: paramRef.name in the request's namespace (none given)."""
    install(
        api,
        [{"expression": "int(object.data.gpus) <= int(params.data.max)", "message": "too many"}],
        paramKind={"apiVersion": "v1", "kind": "ConfigMap"},
        rules=[rule(["configmaps"], resourceNames=["request"])],
        binding={"paramRef": {"name": "limits", "parameterNotFoundAction": "Deny"}},
    )
    status, body, _ = create_cm(api, configmap("request", {"gpus": "2"}))
    assert status == 422
    assert body["details"]["causes"] == [
        {
            "message": PREFIX + "failed to configure binding: no params found for policy binding"
            " with `Deny` parameterNotFoundAction"
        }
    ]
    assert create_cm(api, configmap("limits", {"max": "1"}))[0] == 201
    assert create_cm(api, configmap("limits", {"max": "8"}), "default")[0] == 201  # elsewhere
    assert create_cm(api, configmap("request", {"gpus": "2"}))[1]["details"]["causes"] == [
        {"message": PREFIX + "too many"}
    ]
    assert create_cm(api, configmap("request", {"gpus": "1"}))[0] == 201


def test_params_not_found_with_allow_evaluate_nothing(api):
    install(
        api,
        [{"expression": "false"}],
        paramKind={"apiVersion": "v1", "kind": "ConfigMap"},
        binding={"paramRef": {"name": "absent", "parameterNotFoundAction": "Allow"}},
    )
    assert create_cm(api, configmap("cm1", {}))[0] == 201


def test_an_unknown_param_kind_fails_by_the_failure_policy(api):
    install(
        api,
        [{"expression": "true"}],
        paramKind={"apiVersion": "example.com/v1", "kind": "Nothing"},
        binding={"paramRef": {"name": "x", "parameterNotFoundAction": "Allow"}},
    )
    _, body, _ = create_cm(api, configmap("cm1", {}))
    assert "failed to configure binding: paramKind kind" in body["message"]


def test_a_selector_evaluates_the_policy_once_per_param_and_warns_for_each(server, api):
    for name, max_ in (("a", "1"), ("b", "2"), ("c", "9")):
        labels = {"role": "limit"} if name != "c" else {"role": "other"}
        assert create_cm(api, configmap(name, {"max": max_}, labels), "default")[0] == 201
    install(
        api,
        [
            {
                "expression": "int(object.data.gpus) <= int(params.data.max)",
                "messageExpression": "'over ' + params.metadata.name",
            }
        ],
        rules=[rule(["configmaps"], resourceNames=["request"])],
        actions=["Warn", "Audit"],
        paramKind={"apiVersion": "v1", "kind": "ConfigMap"},
        binding={
            "paramRef": {
                "namespace": "default",
                "selector": {"matchLabels": {"role": "limit"}},
                "parameterNotFoundAction": "Deny",
            }
        },
    )
    status, _, warnings = create_cm(api, configmap("request", {"gpus": "3"}))
    assert status == 201
    assert warnings == [
        f"299 - \"Validation failed for ValidatingAdmissionPolicy 'p' with binding 'b': over {n}\""
        for n in ("a", "b")
    ]
    assert [(a.policy, a.binding, a.message, a.name) for a in server.audits] == [
        ("p", "b", "over a", "request"),
        ("p", "b", "over b", "request"),
    ]


def test_match_conditions_skip_or_fail_by_the_failure_policy(api):
    conditions = [
        {"name": "labelled", "expression": "has(object.metadata.labels)"},
        {"name": "team", "expression": "object.metadata.labels.team == 'x'"},
    ]
    install(api, [{"expression": "false", "message": "no"}], matchConditions=conditions)
    assert create_cm(api, configmap("plain", {}))[0] == 201  # a false condition: not matched
    _, body, _ = create_cm(api, configmap("other", {}, {"app": "y"}))  # an error: Fail
    assert "expression 'object.metadata.labels.team == 'x'' resulted in error" in body["message"]
    assert create_cm(api, configmap("team", {}, {"team": "x"}))[1]["details"]["causes"] == [
        {"message": PREFIX + "no"}
    ]


def test_errors_are_ignored_under_failure_policy_ignore(api):
    install(api, [{"expression": "object.nothing == 1"}], failurePolicy="Ignore")
    assert create_cm(api, configmap("cm1", {}))[0] == 201


def test_variables_are_computed_only_when_used(api):
    variables = [
        {"name": "broken", "expression": "object.nothing"},
        {"name": "keys", "expression": "has(object.data) ? size(object.data) : 0"},
        {"name": "many", "expression": "variables.keys > 1"},
    ]
    install(
        api,
        [
            {"expression": "!variables.many", "message": "too many keys"},
            {"expression": "object.metadata.name != 'use-broken' || variables.broken"},
        ],
        variables=variables,
    )
    assert create_cm(api, configmap("cm1", {"a": "1"}))[0] == 201  # broken is never used
    _, body, _ = create_cm(api, configmap("cm2", {"a": "1", "b": "2"}))
    assert body["details"]["causes"] == [{"message": PREFIX + "too many keys"}]
    _, body, _ = create_cm(api, configmap("use-broken", {}))
    assert 'composited variable "broken" fails to evaluate' in body["message"]


SHOW = (
    "request.operation + ' by ' + request.userInfo.username + ' ['"
    " + request.userInfo.groups[0] + '] old=' + (oldObject != null ? 'true' : 'false')"
    " + ' new=' + (object != null ? 'true' : 'false') + ' ns='"
    " + (namespaceObject == null ? 'null' : namespaceObject.metadata.name)"
)


def shown(body: Obj) -> str:
    return str(body["details"]["causes"][0]["message"]).removeprefix(PREFIX)


def test_request_user_object_old_object_and_namespace_object(server, api):
    install(
        api,
        [
            {
                "expression": "object != null && has(object.metadata.labels)",
                "messageExpression": SHOW,
            }
        ],
        rules=[rule(["configmaps"]), rule(["deviceclasses"], "resource.k8s.io")],
    )
    _, body, _ = create_cm(api, configmap("cm1", {}))
    agent = "system:serviceaccount:tessera-system:tessera"
    assert shown(body) == f"CREATE by {agent} [system:serviceaccounts] old=false new=true ns=team-a"
    server.put_object("configmaps", {"metadata": {"name": "cm2", "namespace": "team-a"}})
    _, body, _ = call(api, "DELETE", "/api/v1/namespaces/team-a/configmaps/cm2")
    assert shown(body).startswith("DELETE by") and shown(body).endswith(
        "old=true new=false ns=team-a"
    )
    _, body, _ = call(
        api,
        "PUT",
        "/api/v1/namespaces/team-a/configmaps/cm2",
        configmap("cm2", {"a": "b"}) | {"metadata": {"name": "cm2", "namespace": "team-a"}},
        {"Impersonate-User": "alice"},
    )
    assert shown(body) == "UPDATE by alice [system:authenticated] old=true new=true ns=team-a"
    dc = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "gpu"},
        "spec": {},
    }
    _, body, _ = call(api, "POST", "/apis/resource.k8s.io/v1/deviceclasses", dc)
    assert shown(body).endswith("ns=null")  # cluster-scoped: no namespaceObject


def test_impersonation_sets_groups_and_extra(api):
    install(
        api,
        [
            {
                "expression": "false",
                "messageExpression": "request.userInfo.username + ' ' + request.userInfo.groups[0]"
                " + ' ' + string(size(request.userInfo.groups)) + ' ' + request.userInfo.extra["
                "'authentication.kubernetes.io/node-name'][0]",
            }
        ],
    )
    headers = {
        "Impersonate-User": "bob",
        "Impersonate-Group": "team-a",
        "Impersonate-Extra-Authentication.kubernetes.io%2fnode-name": "gpu-node-1",
    }
    _, body, _ = call(
        api, "POST", "/api/v1/namespaces/team-a/configmaps", configmap("x", {}), headers
    )
    # groups as given (no system:authenticated added), the extra key lowercased and unescaped
    assert shown(body) == "bob team-a 1 gpu-node-1"


def test_an_identity_given_to_the_server_is_the_requests_user():
    who = UserInfo("system:node:gpu-node-1", ("system:nodes", "system:authenticated"))
    with ApiServer(identity=who) as server:
        c = api_client(server, retries=False)
        try:
            install(
                c,
                [{"expression": "false", "messageExpression": "request.userInfo.username"}],
            )
            _, body, _ = create_cm(c, configmap("x", {}), "default")
            assert shown(body) == "system:node:gpu-node-1"
            _, review, _ = call(c, "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", {})
            assert review["status"]["userInfo"]["groups"] == list(who.groups)
        finally:
            c.close()


def test_selectors_and_the_bindings_match_resources_narrow_what_is_checked(server, api):
    server.put_object("namespaces", {"metadata": {"name": "team-b", "labels": {"org": "web"}}})
    install(
        api,
        [{"expression": "false", "message": "no"}],
        rules=[rule(["configmaps"])],
        matchConstraints={
            "resourceRules": [rule(["configmaps"])],
            "namespaceSelector": {"matchExpressions": [{"key": "org", "operator": "Exists"}]},
            "objectSelector": {"matchLabels": {"checked": "yes"}},
        },
        binding={
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"org": "ml"}},
                "excludeResourceRules": [rule(["configmaps"], resourceNames=["exempt"])],
            }
        },
    )
    checked = {"checked": "yes"}
    assert create_cm(api, configmap("a", {}, checked))[0] == 422  # team-a: org=ml
    assert create_cm(api, configmap("a", {}))[0] == 201  # objectSelector
    assert create_cm(api, configmap("a", {}, checked), "team-b")[0] == 201  # binding: org=web
    assert create_cm(api, configmap("a", {}, checked), "default")[0] == 201  # no org label
    assert create_cm(api, configmap("exempt", {}, checked))[0] == 201  # excluded


def test_a_status_update_is_checked_only_by_a_rule_naming_the_subresource(server, api):
    server.put_object(
        "resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "team-a"},
            "spec": {"devices": {}},
        },
    )
    install(
        api,
        [{"expression": "false", "message": "no"}],
        rules=[rule(["resourceclaims"], "resource.k8s.io", ["UPDATE"])],
    )
    path = "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/c"
    claim = server.get_object("resourceclaims", "c", "team-a")
    status_body = claim | {"status": {"allocation": {"devices": {}}}}
    assert call(api, "PUT", path + "/status", status_body)[0] == 200
    claim = server.get_object("resourceclaims", "c", "team-a")
    assert call(api, "PUT", path, claim)[0] == 422


@pytest.mark.parametrize(
    ("resources", "plural", "sub", "expected"),
    [
        (["*"], "pods", "", True),
        (["*"], "pods", "status", False),
        (["*/*"], "pods", "status", True),
        (["pods/*"], "pods", "", True),
        (["pods/*"], "pods", "eviction", True),
        (["pods/status"], "pods", "", False),
        (["*/status"], "resourceclaims", "status", True),
        (["pods"], "nodes", "", False),
    ],
)
def test_resource_rules_match_resources_and_subresources_as_upstream(
    resources, plural, sub, expected
):
    """k8s.io/apiserver pkg/admission/plugin/webhook/predicates/rules, Matcher.resource."""
    rt = {t.plural: t for t in RESOURCES}[plural]
    attrs = Attributes("UPDATE", rt, "", "x", {}, {}, UserInfo("u"), sub)
    criteria = {"resourceRules": [{**rule(resources, "*"), "apiGroups": ["*"]}]}
    assert matches(criteria, attrs, None) is expected


@pytest.mark.parametrize(
    ("scope", "plural", "expected"),
    [
        ("Cluster", "nodes", True),
        ("Cluster", "pods", False),
        ("Namespaced", "pods", True),
        ("Namespaced", "nodes", False),
        ("*", "nodes", True),
    ],
)
def test_a_rules_scope(scope, plural, expected):
    rt = {t.plural: t for t in RESOURCES}[plural]
    attrs = Attributes("CREATE", rt, "", "x", {}, None, UserInfo("u"))
    criteria = {"resourceRules": [rule(["*"], "*", scope=scope) | {"apiGroups": ["*"]}]}
    assert matches(criteria, attrs, None) is expected


def test_policies_cannot_lock_their_own_removal_out(api):
    install(api, [{"expression": "false"}], rules=[rule(["*"], "*") | {"apiGroups": ["*"]}])
    assert create_cm(api, configmap("x", {}))[0] == 422
    assert call(api, "DELETE", f"{ADM}/validatingadmissionpolicybindings/b")[0] == 200
    assert create_cm(api, configmap("x", {}))[0] == 201
