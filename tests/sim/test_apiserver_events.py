"""core/v1 Events in the API-server emulator, driven by the real ``kubernetes`` client: create,
get, list by field selectors (as kubectl asks), strategic merge PATCH, 415 for a patch type the
server does not know, and the namespace rule of legacy Events."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.sim.apiserver import ApiServer
from tests.apiclient import api_client as client_for


def node_event(name: str, namespace: str = "default", **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": namespace},
        "involvedObject": {"kind": "Node", "apiVersion": "v1", "name": "node-a", "uid": "node-a"},
        "type": "Warning",
        "reason": "GpuUnhealthy",
        "message": "GPU 1 (GPU-1111) is unhealthy: xid-79",
        "source": {"component": "gpu.tessera.dev", "host": "node-a"},
        "reportingComponent": "gpu.tessera.dev",
        "reportingInstance": "node-a",
        "count": 1,
        "firstTimestamp": "2026-05-28T20:26:40Z",
        "lastTimestamp": "2026-05-28T20:26:40Z",
        **extra,
    }


@pytest.fixture
def core(server: ApiServer) -> Iterator[client.CoreV1Api]:
    with client_for(server, retries=False) as api_client:
        yield client.CoreV1Api(api_client)


def test_create_get_and_list_by_what_kubectl_selects(server, core):
    core.create_namespaced_event("default", node_event("node-a.1"))
    pod_event = node_event("web.1")
    pod_event["involvedObject"] = {"kind": "Pod", "name": "web", "namespace": "default"}
    core.create_namespaced_event("default", pod_event)
    got = core.read_namespaced_event("node-a.1", "default")
    assert got.involved_object.kind == "Node" and got.count == 1
    selected = core.list_event_for_all_namespaces(
        field_selector="involvedObject.kind=Node,involvedObject.name=node-a,"
        "involvedObject.namespace=,involvedObject.uid=node-a"
    )
    assert [e.metadata.name for e in selected.items] == ["node-a.1"]
    by_source = core.list_event_for_all_namespaces(field_selector="source=gpu.tessera.dev")
    assert len(by_source.items) == 2  # "source" selects source.component, as the server does
    assert core.list_event_for_all_namespaces(field_selector="source=kubelet").items == []
    assert server.rejected == []


def test_a_strategic_merge_patch_counts_the_event(server, core):
    core.create_namespaced_event("default", node_event("node-a.1"))
    patch = {"count": 2, "lastTimestamp": "2026-05-28T20:30:00Z", "message": "again"}
    patched = core.patch_namespaced_event("node-a.1", "default", patch)  # strategic merge
    assert (patched.count, patched.message, patched.reason) == (2, "again", "GpuUnhealthy")
    stored = server.get_object("events", "node-a.1", "default")
    assert stored is not None and stored["lastTimestamp"] == "2026-05-28T20:30:00Z"


def test_a_patch_type_the_server_does_not_know_is_415(server, core):
    core.create_namespaced_event("default", node_event("node-a.1"))
    resp = urllib3.request(
        "PATCH",
        f"{server.url}/api/v1/namespaces/default/events/node-a.1",
        body=json.dumps({"count": 2}),
        headers={"Content-Type": "application/x-unknown-patch+json"},
    )
    assert resp.status == 415
    assert resp.json()["reason"] == "UnsupportedMediaType"
    stored = server.get_object("events", "node-a.1", "default")
    assert stored is not None and stored["count"] == 1


@pytest.mark.parametrize(
    ("namespace", "involved_ns", "ok"),
    [
        ("default", "", True),  # a cluster-scoped object's Events live in default
        ("kube-system", "", False),
        ("kube-system", "kube-system", True),
        ("default", "kube-system", False),
    ],
)
def test_a_legacy_event_lives_in_its_objects_namespace(server, core, namespace, involved_ns, ok):
    body = node_event("e.1", namespace)
    if involved_ns:
        body["involvedObject"]["namespace"] = involved_ns
    if ok:
        core.create_namespaced_event(namespace, body)
        return
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_event(namespace, body)
    assert exc.value.status == 422
    assert "involvedObject.namespace" in json.loads(exc.value.body)["message"]
    assert [r.resource for r in server.rejected] == ["events"]
