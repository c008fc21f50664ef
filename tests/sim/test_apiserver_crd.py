"""CustomResourceDefinitions in the API-server emulator, driven by the real ``kubernetes`` client
over HTTP: a CRD is served at once (URLs, discovery, scope), custom objects are defaulted, pruned
and validated (structural schema, CEL rules with ``oldSelf``) with the real server's 422 causes,
the status subresource and ``metadata.generation`` follow the CRD strategy, list/watch/patch work
as for built-ins, ``kubectl get``'s Table shows the printer columns, and deleting the CRD stops
serving it."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import yaml
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from agent.sim.apiserver import ApiServer
from tests.apiclient import api_client as client_for
from tests.crds import install
from tests.fakeclock import FakeClock

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = ROOT / "deploy" / "daemonset" / "budgets"
GPUBUDGET_CRD: dict[str, Any] = yaml.safe_load((BUDGETS / "gpubudget-crd.yaml").read_text())
TEAM_A: dict[str, Any] = yaml.safe_load((BUDGETS / "examples" / "team-a-monthly.yaml").read_text())
GROUP, VERSION = "tessera.dev", "v1alpha1"

#: A namespaced test CRD with a transition rule (oldSelf), a messageExpression, a fieldPath and
#: a reason, a map, and a subtree that keeps unknown fields.
WIDGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.size >= oldSelf.size",
                                        "messageExpression": "'size may not shrink from '"
                                        " + string(oldSelf.size) + ' to ' + string(self.size)",
                                        "fieldPath": ".size",
                                    },
                                    {
                                        "rule": "!has(self.owner) || self.owner != 'root'",
                                        "message": "root may not own a widget",
                                        "reason": "FieldValueForbidden",
                                    },
                                ],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1, "default": 1},
                                    "owner": {"type": "string", "maxLength": 8},
                                    "labels": {
                                        "type": "object",
                                        "additionalProperties": {"type": "string"},
                                    },
                                    "extra": {
                                        "type": "object",
                                        "x-kubernetes-preserve-unknown-fields": True,
                                    },
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_800_000_000.0)


@pytest.fixture
def server(clock: FakeClock) -> Iterator[ApiServer]:
    with ApiServer(clock=lambda: datetime.fromtimestamp(clock(), UTC)) as srv:
        yield srv


@pytest.fixture
def api(server: ApiServer) -> Iterator[Any]:
    api_client = client_for(server, retries=False)
    yield api_client
    api_client.close()


def budget(name: str = "team-a-monthly", **spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(TEAM_A)
    obj["metadata"]["name"] = name
    for key, value in spec.items():
        if value is None:
            obj["spec"].pop(key, None)
        else:
            obj["spec"][key] = value
    return obj


def widget(name: str = "w", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": "demo"}},
        "spec": spec,
    }


def call(
    api: Any,
    path: str,
    method: str = "GET",
    body: Any = None,
    query: list[tuple[str, str]] | None = None,
    accept: str = "application/json",
) -> tuple[int, Any, Any]:
    """(status, JSON body, headers) of a raw request through the client (>= 400 raises)."""
    url = api.configuration.host + path + (f"?{urlencode(query)}" if query else "")
    headers = {"Content-Type": "application/json", "Accept": accept}
    resp = api.call_api(method, url, header_params=headers, body=body)
    data = resp.read()
    if resp.status >= 400:
        raise ApiException(status=resp.status, reason=resp.reason, body=data.decode())
    return resp.status, json.loads(data), resp.headers


def refusal(exc: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.value.body)
    return body


def test_a_crd_is_established_and_served_at_once_with_discovery(api: Any) -> None:
    crd = install(api, GPUBUDGET_CRD)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    assert crd["status"]["acceptedNames"]["listKind"] == "GpuBudgetList"
    assert crd["status"]["storedVersions"] == [VERSION]
    groups = call(api, "/apis")[1]
    found = [g for g in groups["groups"] if g["name"] == GROUP]
    assert found and found[0]["preferredVersion"]["groupVersion"] == f"{GROUP}/{VERSION}"
    resources = client.CustomObjectsApi(api).get_api_resources(GROUP, VERSION).resources
    by_name = {r.name: r for r in resources}
    assert set(by_name) == {"gpubudgets", "gpubudgets/status"}
    assert not by_name["gpubudgets"].namespaced
    assert by_name["gpubudgets"].short_names == ["gpub"]
    objects = client.CustomObjectsApi(api)
    objects.create_cluster_custom_object(GROUP, VERSION, "gpubudgets", budget())
    listed = objects.list_cluster_custom_object(GROUP, VERSION, "gpubudgets")
    assert [o["metadata"]["name"] for o in listed["items"]] == ["team-a-monthly"]


def test_a_write_is_defaulted_its_status_dropped_and_generation_counts_spec_changes(
    api: Any,
) -> None:
    install(api, GPUBUDGET_CRD)
    objects = client.CustomObjectsApi(api)
    sent = budget(action=None) | {"status": {"used": {"gpuHours": "5"}}}
    made = objects.create_cluster_custom_object(GROUP, VERSION, "gpubudgets", sent)
    assert made["spec"]["thresholds"] == [80, 90] and made["spec"]["action"] == "Warn"
    assert "status" not in made and made["metadata"]["generation"] == 1
    # the status subresource: only the status changes, generation stays
    made["status"] = {"used": {"gpuHours": "7"}}
    made["spec"]["action"] = "DenyNew"
    after = objects.replace_cluster_custom_object_status(
        GROUP, VERSION, "gpubudgets", "team-a-monthly", made
    )
    assert after["status"] == {"used": {"gpuHours": "7"}}
    assert after["spec"]["action"] == "Warn" and after["metadata"]["generation"] == 1
    # a normal write: the spec changes (generation 2), the status is kept as stored
    after["spec"]["action"] = "DenyNew"
    after["status"] = {}
    again = objects.replace_cluster_custom_object(
        GROUP, VERSION, "gpubudgets", "team-a-monthly", after
    )
    assert again["spec"]["action"] == "DenyNew" and again["status"] == {"used": {"gpuHours": "7"}}
    assert again["metadata"]["generation"] == 2
    # the same spec again (defaults left out): nothing changes, not even the resourceVersion
    same = objects.replace_cluster_custom_object(
        GROUP, VERSION, "gpubudgets", "team-a-monthly", budget() | {"metadata": again["metadata"]}
    )
    assert same["metadata"]["resourceVersion"] == again["metadata"]["resourceVersion"]


@pytest.mark.parametrize(
    ("spec", "causes"),
    [
        (
            {"action": "Kill", "limits": {"gpuHours": "-3"}},
            [
                (
                    "spec.action",
                    "FieldValueNotSupported",
                    'Unsupported value: "Kill": supported values: "Warn", "DenyNew", "Terminate"',
                ),
                (
                    "spec.limits.gpuHours",
                    "FieldValueInvalid",
                    'Invalid value: "-3": spec.limits.gpuHours in body should match'
                    " '^[0-9]+(\\.[0-9]+)?$'",
                ),
            ],
        ),
        (
            {"thresholds": [0, 90, 90]},
            [
                (
                    "spec.thresholds[0]",
                    "FieldValueInvalid",
                    "Invalid value: 0: spec.thresholds[0] in body should be greater than or"
                    " equal to 1",
                ),
                ("spec.thresholds[2]", "FieldValueDuplicate", "Duplicate value: 90"),
            ],
        ),
        (
            {"scope": None},
            [("spec.scope", "FieldValueRequired", "Required value")],
        ),
        (
            {"scope": {"namespace": "x" * 64}},
            [
                (
                    "spec.scope.namespace",
                    "FieldValueTooLong",
                    "Too long: may not be more than 63 bytes",
                )
            ],
        ),
        (
            {"gracePeriod": "1h"},
            [
                (
                    "spec",
                    "FieldValueInvalid",
                    'Invalid value: "object": gracePeriod applies to action Terminate only',
                )
            ],
        ),
        (
            {"period": {"type": "Rolling"}},
            [
                (
                    "spec.period",
                    "FieldValueInvalid",
                    'Invalid value: "object": window is set exactly when type is Rolling',
                )
            ],
        ),
    ],
    ids=["enum-and-pattern", "minimum-and-set", "required", "max-length", "cel", "cel-nested"],
)
def test_a_refused_budget_is_422_with_the_real_servers_causes(
    api: Any, server: ApiServer, spec: dict[str, Any], causes: list[tuple[str, str, str]]
) -> None:
    install(api, GPUBUDGET_CRD)
    with pytest.raises(ApiException) as exc:
        client.CustomObjectsApi(api).create_cluster_custom_object(
            GROUP, VERSION, "gpubudgets", budget("bad", **spec)
        )
    assert exc.value.status == 422
    status = refusal(exc)
    assert status["reason"] == "Invalid"
    assert status["details"]["kind"] == "GpuBudget" and status["details"]["group"] == GROUP
    found = [(c["field"], c["reason"], c["message"]) for c in status["details"]["causes"]]
    assert sorted(found) == sorted(causes)  # the real server's order is its map order
    said = [f"{f}: {m}" for f, _, m in found]
    joined = said[0] if len(said) == 1 else f"[{', '.join(said)}]"
    assert status["message"] == f'GpuBudget.tessera.dev "bad" is invalid: {joined}'
    assert [r.name for r in server.rejected] == ["bad"]
    assert server.get_object("gpubudgets", "bad") is None


def test_unknown_fields_are_pruned_with_a_warning_and_refused_when_strict(api: Any) -> None:
    install(api, GPUBUDGET_CRD)
    body = budget(limit={"gpuHours": "1"})
    code, data, headers = call(api, "/apis/tessera.dev/v1alpha1/gpubudgets", "POST", body)
    assert code == 201 and "limit" not in data["spec"]
    assert headers["Warning"] == '299 - "unknown field \\"spec.limit\\""'
    with pytest.raises(ApiException) as exc:
        call(
            api,
            "/apis/tessera.dev/v1alpha1/gpubudgets",
            "POST",
            budget("strict", limit={"gpuHours": "1"}),
            [("fieldValidation", "Strict")],
        )
    assert exc.value.status == 400
    assert refusal(exc)["message"] == 'strict decoding error: unknown field "spec.limit"'


def test_transition_rules_see_oldself_only_on_updates_and_custom_messages(api: Any) -> None:
    install(api, WIDGET_CRD)
    objects = client.CustomObjectsApi(api)
    made = objects.create_namespaced_custom_object(
        "example.com", "v1", "default", "widgets", widget(size=3, extra={"any": {"thing": 1}})
    )
    assert made["spec"]["extra"] == {"any": {"thing": 1}}  # preserved, not pruned
    with pytest.raises(ApiException) as exc:
        objects.patch_namespaced_custom_object(
            "example.com", "v1", "default", "widgets", "w", {"spec": {"size": 2}}
        )
    assert exc.value.status == 422
    (cause,) = refusal(exc)["details"]["causes"]
    assert cause == {
        "reason": "FieldValueInvalid",
        "message": 'Invalid value: "object": size may not shrink from 3 to 2',
        "field": "spec.size",
    }
    with pytest.raises(ApiException) as exc:
        objects.patch_namespaced_custom_object(
            "example.com", "v1", "default", "widgets", "w", {"spec": {"owner": "root"}}
        )
    (cause,) = refusal(exc)["details"]["causes"]
    assert cause["reason"] == "FieldValueForbidden"
    assert cause["message"] == "Forbidden: root may not own a widget"
    grown = objects.patch_namespaced_custom_object(
        "example.com", "v1", "default", "widgets", "w", {"spec": {"size": 4, "labels": {"a": "b"}}}
    )
    assert grown["spec"]["size"] == 4 and grown["metadata"]["generation"] == 2


def test_a_namespaced_custom_resource_lists_and_watches_by_labels(api: Any) -> None:
    install(api, WIDGET_CRD)
    objects = client.CustomObjectsApi(api)
    objects.create_namespaced_custom_object("example.com", "v1", "default", "widgets", widget("a"))
    other = widget("b") | {"metadata": {"name": "b", "namespace": "kube-system"}}
    objects.create_namespaced_custom_object("example.com", "v1", "kube-system", "widgets", other)
    listed = objects.list_cluster_custom_object(
        "example.com", "v1", "widgets", label_selector="app=demo"
    )
    assert [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in listed["items"]] == [
        ("default", "a")
    ]
    assert listed["items"][0]["spec"] == {"size": 1}
    seen = [
        (e["type"], e["object"]["metadata"]["name"])
        for e in watch.Watch().stream(
            objects.list_namespaced_custom_object,
            "example.com",
            "v1",
            "default",
            "widgets",
            timeout_seconds=1,
        )
    ]
    assert seen == [("ADDED", "a")]
    with pytest.raises(ApiException) as exc:
        call(api, "/apis/example.com/v1/widgets/a")
    assert exc.value.status == 404  # namespaced: no cluster-scoped object URL


def test_deleting_the_crd_deletes_its_objects_and_stops_serving_it(
    api: Any, server: ApiServer
) -> None:
    install(api, WIDGET_CRD)
    objects = client.CustomObjectsApi(api)
    objects.create_namespaced_custom_object("example.com", "v1", "default", "widgets", widget())
    client.ApiextensionsV1Api(api).delete_custom_resource_definition("widgets.example.com")
    with pytest.raises(ApiException) as exc:
        objects.list_namespaced_custom_object("example.com", "v1", "default", "widgets")
    assert exc.value.status == 404
    groups = call(api, "/apis")[1]
    assert "example.com" not in [g["name"] for g in groups["groups"]]
    install(api, WIDGET_CRD)
    listed = objects.list_namespaced_custom_object("example.com", "v1", "default", "widgets")
    assert listed["items"] == []


def test_a_crd_named_apart_from_its_plural_and_group_is_refused(api: Any) -> None:
    crd = copy.deepcopy(WIDGET_CRD)
    crd["metadata"]["name"] = "gadgets.example.com"
    with pytest.raises(ApiException) as exc:
        client.ApiextensionsV1Api(api).create_custom_resource_definition(crd)
    assert exc.value.status == 422
    (cause,) = refusal(exc)["details"]["causes"]
    assert cause["field"] == "metadata.name"
    assert cause["message"] == (
        'Invalid value: "gadgets.example.com": must be spec.names.plural+"."+spec.group'
    )


def test_kubectl_get_gets_a_table_of_the_printer_columns(
    api: Any, server: ApiServer, clock: FakeClock
) -> None:
    install(api, GPUBUDGET_CRD)
    objects = client.CustomObjectsApi(api)
    objects.create_cluster_custom_object(GROUP, VERSION, "gpubudgets", budget())
    made = objects.get_cluster_custom_object(GROUP, VERSION, "gpubudgets", "team-a-monthly")
    made["status"] = {
        "conditions": [
            {
                "type": "Exhausted",
                "status": "True",
                "lastTransitionTime": "2027-01-15T08:00:00Z",
                "reason": "LimitReached",
                "message": "used 1200.4 of 1200 GPU-hours",
            }
        ]
    }
    objects.replace_cluster_custom_object_status(
        GROUP, VERSION, "gpubudgets", "team-a-monthly", made
    )
    clock.advance(330)
    accept = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
    got = call(api, "/apis/tessera.dev/v1alpha1/gpubudgets", accept=accept)[1]
    assert got["kind"] == "Table" and got["apiVersion"] == "meta.k8s.io/v1"
    names = [c["name"] for c in got["columnDefinitions"]]
    assert names == ["Name", "Namespace", "Action", "GPU-h used", "GPU-h limit", "Exhausted", "Age"]
    (row,) = got["rows"]
    assert row["cells"] == ["team-a-monthly", "team-a", "DenyNew", None, "1200", "True", "5m30s"]
    assert row["object"]["metadata"]["name"] == "team-a-monthly"
    namespaces = call(api, "/api/v1/namespaces/default", accept=accept)[1]
    assert [c["name"] for c in namespaces["columnDefinitions"]] == ["Name", "Age"]
    assert [r["cells"][0] for r in namespaces["rows"]] == ["default"]


def test_a_root_rule_reads_the_objects_name_and_fails_at_nil(api: Any) -> None:
    crd = copy.deepcopy(WIDGET_CRD)
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root["x-kubernetes-validations"] = [
        {"rule": "self.metadata.name.startsWith('w-')", "message": "a widget's name starts w-"}
    ]
    install(api, crd)
    objects = client.CustomObjectsApi(api)
    objects.create_namespaced_custom_object(
        "example.com", "v1", "default", "widgets", widget("w-1")
    )
    with pytest.raises(ApiException) as exc:
        objects.create_namespaced_custom_object(
            "example.com", "v1", "default", "widgets", widget("gadget")
        )
    assert refusal(exc)["message"] == (
        'Widget.example.com "gadget" is invalid: <nil>: Invalid value: "object": a widget\'s'
        " name starts w-"
    )


def test_a_crd_whose_rule_does_not_compile_is_refused(api: Any) -> None:
    crd = copy.deepcopy(WIDGET_CRD)
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"] = [{"rule": "self.size >"}]
    with pytest.raises(ApiException) as exc:
        client.ApiextensionsV1Api(api).create_custom_resource_definition(crd)
    (cause,) = refusal(exc)["details"]["causes"]
    assert cause["field"] == (
        "spec.versions[0].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule"
    )
    assert cause["message"].startswith('Invalid value: "self.size >": compilation failed: ')
