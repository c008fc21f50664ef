"""The API-server emulator's access table: what RBAC would refuse is refused (403, the real
server's wording) and SelfSubjectAccessReviews answer from the same table, through the real
``kubernetes`` client over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.cli.sim import access_rule
from agent.sim.apiserver import ApiServer
from agent.sim.apiserver_access import Rule
from tests.apiclient import api_client
from tests.sim.test_apiserver import slice_body

SSAR = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


@pytest.fixture
def api(server: ApiServer) -> Iterator[client.ApiClient]:
    c = api_client(server, retries=False)
    yield c
    c.close()


def post(api: client.ApiClient, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    try:
        resp = api.call_api(*api.param_serialize("POST", path, body=body), _request_timeout=5)
    except ApiException as exc:
        return int(exc.status), json.loads(exc.body)
    resp.read()
    return resp.status, json.loads(resp.data)


def review(api: client.ApiClient, verb: str, resource: str, group: str = "") -> dict[str, Any]:
    attrs = {"verb": verb, "resource": resource, "group": group}
    status, body = post(api, SSAR, {"spec": {"resourceAttributes": attrs}})
    assert status == 201
    return dict(body["status"])


def test_everything_is_allowed_until_denied(api):
    assert review(api, "delete", "resourceslices", "resource.k8s.io")["allowed"] is True
    resource = client.ResourceV1Api(api)
    resource.create_resource_slice(slice_body())
    resource.delete_resource_slice("slice-a")


def test_a_denied_verb_is_refused_with_rbacs_words_and_reviewed_as_denied(server, api):
    server.access.deny("delete", "resourceslices", "resource.k8s.io")
    resource = client.ResourceV1Api(api)
    resource.create_resource_slice(slice_body())  # other verbs still work
    with pytest.raises(ApiException) as caught:
        resource.delete_resource_slice("slice-a")
    assert caught.value.status == 403
    status = json.loads(caught.value.body)
    assert status["reason"] == "Forbidden"
    assert status["message"] == (
        'resourceslices.resource.k8s.io "slice-a" is forbidden: User'
        ' "system:serviceaccount:tessera-system:tessera" cannot delete resource "resourceslices"'
        ' in API group "resource.k8s.io" at the cluster scope'
    )
    assert review(api, "delete", "resourceslices", "resource.k8s.io")["allowed"] is False
    assert review(api, "create", "resourceslices", "resource.k8s.io")["allowed"] is True
    assert server.get_object("resourceslices", "slice-a") is not None
    server.access.allow_all()
    resource.delete_resource_slice("slice-a")


def test_list_watch_and_namespaced_get_map_to_their_verbs(server, api):
    server.access.deny("watch", "resourceslices", "resource.k8s.io")
    server.access.deny("get", "resourceclaims", "resource.k8s.io")
    resource = client.ResourceV1Api(api)
    resource.list_resource_slice()  # list is not watch
    with pytest.raises(ApiException) as caught:
        resource.list_resource_slice(watch=True, timeout_seconds=1)
    assert caught.value.status == 403
    with pytest.raises(ApiException) as caught:
        resource.read_namespaced_resource_claim("c", "default")
    assert caught.value.status == 403
    assert 'in the namespace "default"' in json.loads(caught.value.body)["message"]


def test_a_wildcard_denies_every_verb_of_a_core_resource(server, api):
    server.access.deny("*", "nodes")
    assert review(api, "get", "nodes")["allowed"] is False
    assert review(api, "list", "nodes")["allowed"] is False
    assert review(api, "get", "pods")["allowed"] is True
    with pytest.raises(ApiException) as caught:
        client.CoreV1Api(api).read_node("n")
    assert caught.value.status == 403


def test_self_subject_review_names_the_user(api):
    status, body = post(api, "/apis/authentication.k8s.io/v1/selfsubjectreviews", {})
    assert status == 201
    assert body["status"]["userInfo"]["username"] == "system:serviceaccount:tessera-system:tessera"


def test_a_review_that_asks_nothing_is_invalid(api):
    status, body = post(api, SSAR, {"spec": {}})
    assert status == 422
    assert body["reason"] == "Invalid"


def test_the_cli_deny_rule_parses_verb_resource_and_group():
    assert access_rule("delete:resourceslices.resource.k8s.io") == Rule(
        "delete", "resourceslices", "resource.k8s.io"
    )
    assert access_rule("get:nodes") == Rule("get", "nodes", "")
    for bad in ("nodes", ":nodes", "get:"):
        with pytest.raises(ValueError, match="VERB:RESOURCE"):
            access_rule(bad)
