"""Leases, labelled Namespaces and the Pod eviction subresource of the API-server emulator, driven
by the real ``kubernetes`` client over HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.sim.apiserver import ApiServer
from tests.apiclient import api_client as client_for
from tests.fakeclock import FakeClock
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

NS = "default"


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


def checked(obj: dict[str, Any]) -> dict[str, Any]:
    for version in VERSIONS:
        validate_k8s(obj, version)
    return obj


def as_dict(api: Any, model: Any, kind: str, api_version: str) -> dict[str, Any]:
    out: dict[str, Any] = api.sanitize_for_serialization(model)
    return checked({"apiVersion": api_version, "kind": kind, **out})


def pod(name: str, node: str | None = "node-1", grace: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "busybox"}]}
    if node:
        spec["nodeName"] = node
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return checked(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS},
            "spec": spec,
        }
    )


def eviction(name: str, **delete_options: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": NS},
    }
    if delete_options:
        body["deleteOptions"] = delete_options
    return checked(body)


def evict(api: Any, name: str, body: dict[str, Any]) -> Any:
    return client.CoreV1Api(api).create_namespaced_pod_eviction(name, NS, body)


def status_of(exc: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.value.body)
    return body


# ------------------------------------------------------------------------------------- leases


def lease(name: str = "tessera-budgets", holder: str = "a") -> dict[str, Any]:
    return checked(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": "kube-system"},
            "spec": {
                "holderIdentity": holder,
                "leaseDurationSeconds": 15,
                "renewTime": "2027-01-15T08:00:00.000000Z",
            },
        }
    )


def test_a_lease_is_taken_over_only_from_the_version_read(api: Any) -> None:
    """Leader election's safety: two candidates that read the same Lease cannot both win — the
    second write carries a stale resourceVersion and is 409 (the store's update check)."""
    leases = client.CoordinationV1Api(api)
    made = leases.create_namespaced_lease("kube-system", lease())
    seen = as_dict(api, made, "Lease", "coordination.k8s.io/v1")
    first = seen | {"spec": seen["spec"] | {"holderIdentity": "b"}}
    won = leases.replace_namespaced_lease("tessera-budgets", "kube-system", first)
    assert won.spec.holder_identity == "b"
    second = seen | {"spec": seen["spec"] | {"holderIdentity": "c"}}
    with pytest.raises(ApiException) as exc:
        leases.replace_namespaced_lease("tessera-budgets", "kube-system", second)
    assert exc.value.status == 409
    assert status_of(exc)["reason"] == "Conflict"
    got = leases.read_namespaced_lease("tessera-budgets", "kube-system")
    assert got.spec.holder_identity == "b"
    listed = leases.list_lease_for_all_namespaces()
    assert [item.metadata.name for item in listed.items] == ["tessera-budgets"]


# ------------------------------------------------------------------------------------- namespaces


def test_namespaces_are_selected_by_labels_and_read_by_name(api: Any, server: ApiServer) -> None:
    core = client.CoreV1Api(api)
    for name, labels in (("team-a", {"org": "research"}), ("team-b", {"org": "ops"})):
        body = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": labels},
        }
        core.create_namespace(checked(body))
    picked = core.list_namespace(label_selector="org=research")
    assert [n.metadata.name for n in picked.items] == ["team-a"]
    assert [n.metadata.name for n in core.list_namespace(label_selector="org").items] == [
        "team-a",
        "team-b",
    ]
    assert [n.metadata.name for n in core.list_namespace(label_selector="org!=ops").items] == [
        "default",
        "kube-node-lease",
        "kube-public",
        "kube-system",
        "team-a",
    ]
    found = server.get_object("namespaces", "team-a")  # what the admission code reads
    assert found is not None and found["metadata"]["labels"] == {"org": "research"}


# ------------------------------------------------------------------------------------- eviction


def test_evicting_a_scheduled_pod_starts_its_graceful_termination(
    api: Any, server: ApiServer
) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(NS, pod("train", grace=45))
    resp = api.call_api(
        "POST",
        f"{server.url}/api/v1/namespaces/{NS}/pods/train/eviction",
        header_params={"Content-Type": "application/json"},
        body=eviction("train"),
    )
    assert resp.status == 201
    assert json.loads(resp.read()) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "code": 201,
    }
    as_dict(api, core.read_namespaced_pod("train", NS), "Pod", "v1")
    got = server.get_object("pods", "train", NS)
    assert got is not None
    # deletionTimestamp is when the grace ends: now (the fake clock) + 45 s
    assert got["metadata"]["deletionTimestamp"] == "2027-01-15T08:00:45Z"
    assert got["metadata"]["deletionGracePeriodSeconds"] == 45
    (record,) = server.evictions
    assert (record.namespace, record.pod, record.grace) == (NS, "train", 45)
    assert not record.already_terminating
    # the kubelet, its containers stopped, deletes it with grace 0
    core.delete_namespaced_pod("train", NS, grace_period_seconds=0)
    assert server.get_object("pods", "train", NS) is None


def test_an_eviction_grace_overrides_the_pods_and_only_ever_shortens_it(
    api: Any, server: ApiServer
) -> None:
    client.CoreV1Api(api).create_namespaced_pod(NS, pod("train"))
    evict(api, "train", eviction("train", gracePeriodSeconds=10))
    evict(api, "train", eviction("train", gracePeriodSeconds=60))  # longer: kept at 10
    got = server.get_object("pods", "train", NS)
    assert got is not None and got["metadata"]["deletionGracePeriodSeconds"] == 10
    assert [(r.grace, r.already_terminating) for r in server.evictions] == [
        (10, False),
        (10, True),
    ]


def test_a_pod_without_a_node_is_deleted_at_once_and_the_default_grace_is_30s(
    api: Any, server: ApiServer
) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(NS, pod("pending", node=None))
    core.create_namespaced_pod(NS, pod("running"))
    evict(api, "pending", eviction("pending"))
    evict(api, "running", eviction("running"))
    assert server.get_object("pods", "pending", NS) is None
    running = server.get_object("pods", "running", NS)
    assert running is not None and running["metadata"]["deletionGracePeriodSeconds"] == 30
    assert [(r.pod, r.grace) for r in server.evictions] == [("pending", 0), ("running", 30)]


def test_a_bad_eviction_is_refused_as_the_real_server_refuses_it(
    api: Any, server: ApiServer
) -> None:
    core = client.CoreV1Api(api)
    with pytest.raises(ApiException) as exc:
        evict(api, "ghost", eviction("ghost"))
    assert exc.value.status == 404
    assert status_of(exc)["message"] == 'pods "ghost" not found'
    core.create_namespaced_pod(NS, pod("train"))
    with pytest.raises(ApiException) as exc:
        evict(api, "train", eviction("other"))
    assert exc.value.status == 400
    assert status_of(exc)["message"] == "name in URL does not match name in Eviction object"
    wrong_type = eviction("train") | {"deleteOptions": {"gracePeriodSeconds": "soon"}}
    resp = api.call_api(
        "POST",
        f"{server.url}/api/v1/namespaces/{NS}/pods/train/eviction",
        header_params={"Content-Type": "application/json"},
        body=wrong_type,
    )
    assert resp.status == 422  # checked against the upstream Eviction schema
    assert json.loads(resp.read())["details"]["causes"][0]["field"] == (
        "deleteOptions.gracePeriodSeconds"
    )
    stale = eviction("train", preconditions={"uid": "not-the-pods"})
    with pytest.raises(ApiException) as exc:
        evict(api, "train", stale)
    assert exc.value.status == 409
    assert server.evictions == []
    got = server.get_object("pods", "train", NS)
    assert got is not None and "deletionTimestamp" not in got["metadata"]
