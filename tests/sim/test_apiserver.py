"""The API-server emulator, driven by the real ``kubernetes`` client over HTTP."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from agent.sim.apiserver import ApiServer
from tests.apiclient import api_client as client_for
from tests.fakeclock import FakeClock

DRIVER = "gpu.tessera.dev"
OTHER_DRIVER = "nic.example.com"
NS = "default"


def slice_body(
    name: str | None = "slice-a",
    node: str = "node-1",
    driver: str = DRIVER,
    labels: dict[str, str] | None = None,
    memory: str = "80Gi",
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name} if name else {}
    if labels:
        meta["labels"] = labels
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": driver,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "nodeName": node,
            "devices": [
                {
                    "name": "gpu-0",
                    "attributes": {"type": {"string": "gpu"}},
                    "capacity": {"memory": {"value": memory}},
                }
            ],
        },
    }


def claim_body(name: str = "claim-a") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]
            }
        },
    }


def allocation(device: str = "gpu-0") -> dict[str, Any]:
    return {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": DRIVER, "pool": "node-1", "device": device}
                ]
            }
        }
    }


def raw(resp: Any) -> Any:
    """The JSON of a ``_preload_content=False`` response (a urllib3 HTTPResponse), released."""
    try:
        return json.loads(resp.data)
    finally:
        resp.release_conn()


@pytest.fixture
def api(server: ApiServer, tmp_path: Path) -> Iterator[client.ApiClient]:
    """A client configured the way the agent does it: from a kubeconfig file."""
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(server.kubeconfig(tmp_path)), client_configuration=cfg)
    with client.ApiClient(cfg) as api_client:
        yield api_client


@pytest.fixture
def strict_api(server: ApiServer) -> Iterator[client.ApiClient]:
    """A client whose urllib3 retries nothing, so every fault reaches the caller."""
    with client_for(server, retries=False) as api_client:
        yield api_client


@pytest.fixture
def rapi(api: client.ApiClient) -> client.ResourceV1Api:
    return client.ResourceV1Api(api)


def collect(func: Any, until: str, **kwargs: Any) -> list[tuple[str, str]]:
    """(type, name) of the watch events of ``func`` up to the one about object ``until``."""
    seen = []
    with contextlib.closing(watch.Watch().stream(func, timeout_seconds=5, **kwargs)) as events:
        for event in events:
            seen.append((event["type"], event["raw_object"]["metadata"]["name"]))
            if seen[-1][1] == until:
                return seen
    raise AssertionError(f"no event about {until!r} in {seen}")


def status_of(exc: ApiException) -> dict[str, Any]:
    body = json.loads(exc.body)
    assert body["kind"] == "Status" and body["apiVersion"] == "v1"
    assert body["status"] == "Failure" and body["code"] == exc.status
    return body


# ---------------------------------------------------------------------------------- basics


def test_kubeconfig_and_discovery(server: ApiServer, api: client.ApiClient) -> None:
    assert api.configuration.host == server.url
    assert server.url.startswith("http://127.0.0.1:")
    assert client.VersionApi(api).get_code().git_version == "v1.35.0"
    groups = client.ApisApi(api).get_api_versions()
    assert "resource.k8s.io" in [g.name for g in groups.groups]
    assert client.CoreApi(api).get_api_versions().versions == ["v1"]
    resources = client.ResourceV1Api(api).get_api_resources()
    names = {r.name: r for r in resources.resources}
    assert not names["resourceslices"].namespaced
    assert names["resourceclaims"].namespaced
    assert "resourceclaims/status" in names
    core = {r.name for r in client.CoreV1Api(api).get_api_resources().resources}
    assert {"nodes", "namespaces", "namespaces/status"} <= core


def test_slice_crud_with_raw_dicts(server: ApiServer, rapi: client.ResourceV1Api) -> None:
    created = raw(rapi.create_resource_slice(body=slice_body(), _preload_content=False))
    meta = created["metadata"]
    assert created["kind"] == "ResourceSlice"
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert meta["resourceVersion"].isdigit() and meta["generation"] == 1
    got = raw(rapi.read_resource_slice("slice-a", _preload_content=False))
    assert got == created

    listed = raw(rapi.list_resource_slice(_preload_content=False))
    assert listed["kind"] == "ResourceSliceList"
    assert int(listed["metadata"]["resourceVersion"]) >= int(meta["resourceVersion"])
    assert [i["metadata"]["name"] for i in listed["items"]] == ["slice-a"]
    assert "kind" not in listed["items"][0]  # list items carry no kind, as from a real server

    changed = dict(got, spec=slice_body(memory="40Gi")["spec"])
    updated = raw(rapi.replace_resource_slice("slice-a", body=changed, _preload_content=False))
    assert int(updated["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert updated["metadata"]["generation"] == 2
    assert updated["metadata"]["uid"] == meta["uid"]
    assert updated["spec"]["devices"][0]["capacity"]["memory"]["value"] == "40Gi"

    deleted = raw(rapi.delete_resource_slice("slice-a", _preload_content=False))
    assert deleted["metadata"]["name"] == "slice-a"
    with pytest.raises(ApiException) as exc:
        rapi.read_resource_slice("slice-a")
    assert exc.value.status == 404
    assert server.objects("resourceslices") == []
    assert server.rejected == []


def test_typed_models_round_trip(server: ApiServer, rapi: client.ResourceV1Api) -> None:
    body = client.V1ResourceSlice(
        api_version="resource.k8s.io/v1",
        kind="ResourceSlice",
        metadata=client.V1ObjectMeta(name="typed"),
        spec=client.V1ResourceSliceSpec(
            driver=DRIVER,
            node_name="node-1",
            pool=client.V1ResourcePool(name="node-1", generation=1, resource_slice_count=1),
            devices=[
                client.V1Device(
                    name="gpu-0",
                    attributes={"type": client.V1DeviceAttribute(string="gpu")},
                    capacity={"memory": client.V1DeviceCapacity(value="80Gi")},
                )
            ],
        ),
    )
    created = rapi.create_resource_slice(body=body)
    assert isinstance(created, client.V1ResourceSlice)
    assert created.metadata.resource_version == str(server.resource_version)
    device = created.spec.devices[0]
    assert device.attributes["type"].string == "gpu"
    assert device.capacity["memory"].value == "80Gi"  # a Quantity stays a string
    # what went over the wire: camelCase, no None fields
    stored = server.objects("resourceslices")[0]
    assert stored["spec"]["nodeName"] == "node-1"
    assert stored["spec"]["devices"][0] == slice_body()["spec"]["devices"][0]

    listed = rapi.list_resource_slice(field_selector="spec.nodeName=node-1")
    assert isinstance(listed, client.V1ResourceSliceList)
    assert [s.metadata.name for s in listed.items] == ["typed"]
    created.spec.devices[0].capacity["memory"] = client.V1DeviceCapacity(value="40Gi")
    replaced = rapi.replace_resource_slice("typed", body=created)
    assert replaced.metadata.generation == 2
    assert server.rejected == []


def test_stale_update_conflicts(rapi: client.ResourceV1Api) -> None:
    first = raw(rapi.create_resource_slice(body=slice_body(), _preload_content=False))
    v1 = dict(first, spec=slice_body(memory="40Gi")["spec"])
    rapi.replace_resource_slice("slice-a", body=v1, _preload_content=False).release_conn()
    stale = dict(first, spec=slice_body(memory="20Gi")["spec"])
    with pytest.raises(ApiException) as exc:
        rapi.replace_resource_slice("slice-a", body=stale)
    assert exc.value.status == 409
    assert status_of(exc.value)["reason"] == "Conflict"
    # no resourceVersion in the body: an unconditional update
    del stale["metadata"]["resourceVersion"]
    out = raw(rapi.replace_resource_slice("slice-a", body=stale, _preload_content=False))
    assert out["spec"]["devices"][0]["capacity"]["memory"]["value"] == "20Gi"


def test_already_exists_not_found_and_bad_names(
    server: ApiServer, rapi: client.ResourceV1Api
) -> None:
    rapi.create_resource_slice(body=slice_body())
    with pytest.raises(ApiException) as exc:
        rapi.create_resource_slice(body=slice_body())
    assert exc.value.status == 409
    status = status_of(exc.value)
    assert status["reason"] == "AlreadyExists"
    assert status["message"] == 'resourceslices.resource.k8s.io "slice-a" already exists'

    for call in (
        lambda: rapi.read_resource_slice("nope"),
        lambda: rapi.delete_resource_slice("nope"),
        lambda: rapi.replace_resource_slice("nope", body=slice_body("nope")),
    ):
        with pytest.raises(ApiException) as exc:
            call()
        assert exc.value.status == 404
        assert status_of(exc.value)["reason"] == "NotFound"

    with pytest.raises(ApiException) as exc:
        rapi.create_resource_slice(body=slice_body(name=None))
    assert exc.value.status == 422
    assert status_of(exc.value)["reason"] == "Invalid"
    with pytest.raises(ApiException) as exc:
        rapi.create_resource_slice(body=slice_body(name="Not_A_Name"))
    assert exc.value.status == 422
    assert [r.name for r in server.rejected] == ["", "Not_A_Name"]


def test_generate_name(server: ApiServer, rapi: client.ResourceV1Api) -> None:
    body = slice_body(name=None)
    body["metadata"]["generateName"] = "node-1-gpu.tessera.dev-"
    names = [rapi.create_resource_slice(body=body).metadata.name for _ in range(3)]
    assert len(set(names)) == 3
    for name in names:
        prefix, suffix = name[:-5], name[-5:]
        assert prefix == "node-1-gpu.tessera.dev-"
        assert suffix.isalnum() and suffix.islower()
    with ApiServer() as again, client_for(again) as other:
        again_names = [
            client.ResourceV1Api(other).create_resource_slice(body=body).metadata.name
            for _ in range(3)
        ]
    assert again_names == names  # the same seed draws the same names


# ---------------------------------------------------------------------------------- selectors


def seed_four(server: ApiServer) -> None:
    for node in ("node-1", "node-2"):
        for driver in (DRIVER, OTHER_DRIVER):
            body = slice_body(f"{node}-{driver}", node, driver, labels={"node": node})
            server.put_object("resourceslices", body)


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("spec.nodeName=node-1", {"node-1-gpu.tessera.dev", "node-1-nic.example.com"}),
        ("spec.driver==nic.example.com", {"node-1-nic.example.com", "node-2-nic.example.com"}),
        ("spec.nodeName=node-2,spec.driver=gpu.tessera.dev", {"node-2-gpu.tessera.dev"}),
        ("spec.nodeName!=node-1,spec.driver!=gpu.tessera.dev", {"node-2-nic.example.com"}),
        ("metadata.name=node-1-gpu.tessera.dev", {"node-1-gpu.tessera.dev"}),
        ("spec.nodeName=node-3", set()),
    ],
)
def test_field_selectors(
    server: ApiServer, rapi: client.ResourceV1Api, selector: str, expected: set[str]
) -> None:
    seed_four(server)
    listed = rapi.list_resource_slice(field_selector=selector)
    assert {s.metadata.name for s in listed.items} == expected


@pytest.mark.parametrize("selector", ["spec.pool.name=node-1", "metadata.namespace=x", "spec"])
def test_unsupported_field_selector_is_400(
    server: ApiServer, rapi: client.ResourceV1Api, selector: str
) -> None:
    with pytest.raises(ApiException) as exc:
        rapi.list_resource_slice(field_selector=selector)
    assert exc.value.status == 400
    assert status_of(exc.value)["reason"] == "BadRequest"


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("node=node-1", {"n1"}),
        ("node!=node-1", {"n2", "none"}),
        ("node in (node-1,node-2)", {"n1", "n2"}),
        ("node notin (node-1)", {"n2", "none"}),
        ("node", {"n1", "n2"}),
        ("!node", {"none"}),
        ("node,tier=gold", {"n2"}),
    ],
)
def test_label_selectors(
    server: ApiServer, rapi: client.ResourceV1Api, selector: str, expected: set[str]
) -> None:
    server.put_object("resourceslices", slice_body("n1", labels={"node": "node-1"}))
    server.put_object("resourceslices", slice_body("n2", labels={"node": "node-2", "tier": "gold"}))
    server.put_object("resourceslices", slice_body("none"))
    listed = rapi.list_resource_slice(label_selector=selector)
    assert {s.metadata.name for s in listed.items} == expected


def test_pagination(server: ApiServer, rapi: client.ResourceV1Api) -> None:
    seed_four(server)
    page = rapi.list_resource_slice(limit=3)
    assert len(page.items) == 3 and page.metadata.remaining_item_count == 1
    rest = rapi.list_resource_slice(limit=3, _continue=page.metadata._continue)
    assert len(rest.items) == 1 and not rest.metadata._continue


# ---------------------------------------------------------------------------------- watch


def test_watch_replays_and_streams_selected_changes(
    server: ApiServer, rapi: client.ResourceV1Api
) -> None:
    server.put_object("resourceslices", slice_body("before"))
    rv = rapi.list_resource_slice().metadata.resource_version
    rapi.create_resource_slice(body=slice_body("mine"))
    rapi.create_resource_slice(body=slice_body("theirs", node="node-2"))
    mine = rapi.read_resource_slice("mine")
    mine.spec.devices[0].capacity["memory"] = client.V1DeviceCapacity(value="40Gi")
    rapi.replace_resource_slice("mine", body=mine)

    def later() -> None:  # a change made while the watch is open
        time.sleep(0.3)
        server.delete_object("resourceslices", "mine")
        server.delete_object("resourceslices", "theirs")

    changer = threading.Thread(target=later)
    changer.start()
    seen = []
    for event in watch.Watch().stream(
        rapi.list_resource_slice,
        field_selector="spec.nodeName=node-1",
        resource_version=rv,
        timeout_seconds=5,
    ):
        assert isinstance(event["object"], client.V1ResourceSlice)
        seen.append((event["type"], event["object"].metadata.name))
        if event["type"] == "DELETED":
            break
    changer.join()
    assert seen == [("ADDED", "mine"), ("MODIFIED", "mine"), ("DELETED", "mine")]


def test_watch_without_resource_version_starts_with_current_objects(
    server: ApiServer, rapi: client.ResourceV1Api
) -> None:
    seed_four(server)
    server.put_object("resourceslices", slice_body("zz-last"))  # initial events come by name
    assert collect(rapi.list_resource_slice, "zz-last", field_selector=f"spec.driver={DRIVER}") == [
        ("ADDED", "node-1-gpu.tessera.dev"),
        ("ADDED", "node-2-gpu.tessera.dev"),
        ("ADDED", "zz-last"),
    ]


def test_watch_sees_objects_enter_and_leave_the_selection(
    server: ApiServer, rapi: client.ResourceV1Api
) -> None:
    rv = str(server.resource_version)
    server.put_object("resourceslices", slice_body("s", labels={"team": "a"}))
    server.put_object("resourceslices", slice_body("t", labels={"team": "b"}))
    server.put_object("resourceslices", slice_body("s", labels={"team": "b"}))
    server.put_object("resourceslices", slice_body("s", labels={"team": "a"}))
    server.put_object("resourceslices", slice_body("end", labels={"team": "a"}))
    seen = collect(rapi.list_resource_slice, "end", label_selector="team=a", resource_version=rv)
    assert seen == [("ADDED", "s"), ("DELETED", "s"), ("ADDED", "s"), ("ADDED", "end")]


def test_watch_from_compacted_history_is_410() -> None:
    with ApiServer(history_size=3) as server, client_for(server) as api_client:
        rapi = client.ResourceV1Api(api_client)
        for i in range(6):
            rapi.create_resource_slice(body=slice_body(f"s{i}"))
        with pytest.raises(ApiException) as exc:
            list(
                watch.Watch().stream(
                    rapi.list_resource_slice, resource_version="1", timeout_seconds=1
                )
            )
        assert exc.value.status == 410
        # on the wire: 200 and one ERROR event with a Status, as the real watch cache does
        resp = rapi.list_resource_slice(watch=True, resource_version="1", _preload_content=False)
        try:
            assert resp.status == 200
            lines = resp.data.decode().splitlines()
        finally:
            resp.release_conn()
        event = json.loads(lines[0])
        assert len(lines) == 1 and event["type"] == "ERROR"
        assert event["object"]["kind"] == "Status" and event["object"]["code"] == 410
        assert event["object"]["reason"] == "Expired"
        # the recent past is still there; compact() drops it
        recent = str(server.resource_version - 1)
        seen = collect(rapi.list_resource_slice, "s5", resource_version=recent)
        assert seen == [("ADDED", "s5")]
        server.compact()
        with pytest.raises(ApiException) as exc:
            list(
                watch.Watch().stream(
                    rapi.list_resource_slice, resource_version=recent, timeout_seconds=1
                )
            )
        assert exc.value.status == 410


def _watch_in_thread(
    server: ApiServer, timeout_seconds: int
) -> tuple[queue.Queue, threading.Thread]:
    """Watch slices in a thread; every event's object name goes to the queue, then None."""
    events: queue.Queue = queue.Queue()
    # read now, not in the thread: what the caller writes next is then replayed to the watch
    # however late the thread opens it
    since = str(server.resource_version)

    def run() -> None:
        with client_for(server, retries=False) as api_client:
            rapi = client.ResourceV1Api(api_client)
            for e in watch.Watch().stream(
                rapi.list_resource_slice,
                resource_version=since,
                timeout_seconds=timeout_seconds,
            ):
                events.put(e["object"].metadata.name)
        events.put(None)

    thread = threading.Thread(target=run)
    thread.start()
    return events, thread


def test_watch_ends_at_timeout_seconds() -> None:
    """Open until timeoutSeconds has passed on the server's clock, then ended by the server."""
    clock = FakeClock()
    with ApiServer(monotonic=clock) as server:
        events, thread = _watch_in_thread(server, timeout_seconds=30)
        server.put_object("resourceslices", slice_body("early"))
        assert events.get(timeout=30) == "early"  # the watch is open
        clock.t += 29.0
        server.put_object("resourceslices", slice_body("late"))
        assert events.get(timeout=30) == "late"  # 29 s on: still open
        clock.t += 2.0
        assert events.get(timeout=30) is None  # past 30 s: the server ended the stream
        thread.join(30)
        assert not thread.is_alive()


def test_bookmarks_and_initial_events() -> None:
    with ApiServer(bookmark_interval=0.2) as server, client_for(server) as api_client:
        server.put_object("resourceslices", slice_body())
        resp = client.ResourceV1Api(api_client).list_resource_slice(
            watch=True,
            allow_watch_bookmarks=True,
            send_initial_events=True,
            resource_version_match="NotOlderThan",
            timeout_seconds=1,
            _preload_content=False,
        )
        try:
            lines = resp.data.decode().splitlines()
        finally:
            resp.release_conn()
    events = [json.loads(line) for line in lines]
    assert [e["type"] for e in events[:2]] == ["ADDED", "BOOKMARK"]
    end = events[1]["object"]["metadata"]
    assert end["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert end["resourceVersion"] == events[0]["object"]["metadata"]["resourceVersion"]
    periodic = events[2:]
    assert periodic and {e["type"] for e in periodic} == {"BOOKMARK"}
    assert all(e["object"]["kind"] == "ResourceSlice" for e in periodic)


def test_stop_ends_open_watches_cleanly() -> None:
    server = ApiServer().start()
    try:
        events, thread = _watch_in_thread(server, timeout_seconds=600)
        server.put_object("resourceslices", slice_body("seen"))
        assert events.get(timeout=30) == "seen"  # the watch is open
        server.stop()
        assert events.get(timeout=30) is None  # it ended without an error
        thread.join(30)
        assert not thread.is_alive()
    finally:
        server.stop()


# ---------------------------------------------------------------------------------- faults


@pytest.mark.parametrize("kind", ["409", "429", "500", "503"])
def test_error_faults(server: ApiServer, strict_api: client.ApiClient, kind: str) -> None:
    rapi = client.ResourceV1Api(strict_api)
    server.faults.add("POST", r"/resourceslices$", kind)
    with pytest.raises(ApiException) as exc:
        rapi.create_resource_slice(body=slice_body())
    assert exc.value.status == int(kind)
    status_of(exc.value)
    if kind == "429":
        assert exc.value.headers["Retry-After"] == "1"
    assert server.objects("resourceslices") == []
    rapi.create_resource_slice(body=slice_body())  # the fault is used up
    assert [r.status for r in server.requests] == [int(kind), 201]
    assert len(server.faults) == 0


def test_drop_fault_is_a_connection_error(server: ApiServer, api: client.ApiClient) -> None:
    rapi = client.ResourceV1Api(api)
    server.faults.add("POST", "resourceslices", "drop")
    with pytest.raises(urllib3.exceptions.ProtocolError):
        rapi.create_resource_slice(body=slice_body())
    rapi.create_resource_slice(body=slice_body())
    assert [(r.method, r.status) for r in server.requests] == [("POST", 0), ("POST", 201)]


def test_get_faults_need_retries_off(server: ApiServer, strict_api: client.ApiClient) -> None:
    rapi = client.ResourceV1Api(strict_api)
    server.faults.add("GET", "resourceslices", "drop")
    with pytest.raises(urllib3.exceptions.ProtocolError):
        rapi.list_resource_slice()
    server.faults.add(None, None, "slow:0.5")
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        rapi.list_resource_slice(_request_timeout=0.1)
    assert rapi.list_resource_slice().items == []


def test_default_client_retries_429_on_get(server: ApiServer, api: client.ApiClient) -> None:
    """urllib3's default Retry honours Retry-After on GET/PUT/DELETE: the caller sees success."""
    server.faults.add("GET", "resourceslices", "429")
    assert client.ResourceV1Api(api).list_resource_slice().items == []
    assert [r.status for r in server.requests] == [429, 200]


def test_fault_matching(server: ApiServer) -> None:
    with pytest.raises(ValueError):
        server.faults.add(None, None, "404")
    fault = server.faults.add("PUT", "nodes", "500", times=2, query_regex="dryRun")
    assert fault.matches("PUT", "/api/v1/nodes/n1", "dryRun=All")
    assert not fault.matches("PUT", "/api/v1/nodes/n1", "")
    assert not fault.matches("GET", "/api/v1/nodes/n1", "dryRun=All")
    assert server.faults.take("PUT", "/api/v1/nodes/n1", "dryRun=All") is fault
    assert server.faults.take("PUT", "/api/v1/nodes/n1", "dryRun=All") is fault
    assert server.faults.take("PUT", "/api/v1/nodes/n1", "dryRun=All") is None


@pytest.mark.parametrize(
    ("kind", "header", "details"),
    [("429", "1", {"retryAfterSeconds": 1}), ("429:7", "7", {"retryAfterSeconds": 7}),
     ("503:2", "2", {"retryAfterSeconds": 2}), ("500:soon", "soon", None), ("503", None, None)],
)  # fmt: skip
def test_error_faults_carry_the_retry_after_they_are_given(
    server: ApiServer, strict_api: client.ApiClient, kind: str, header: str | None, details: Any
) -> None:
    server.faults.add("GET", "nodes", kind)
    with pytest.raises(ApiException) as exc:
        client.CoreV1Api(strict_api).list_node()
    assert exc.value.status == int(kind.split(":")[0])
    assert exc.value.headers.get("Retry-After") == header
    assert status_of(exc.value).get("details") == details


@pytest.mark.parametrize("kind", ["429:", "429:a b", "409:5", "404:1", "slow:x"])
def test_a_retry_after_is_only_for_429_and_5xx_and_one_word(server: ApiServer, kind: str) -> None:
    with pytest.raises(ValueError):
        server.faults.add(None, None, kind)


def test_the_request_log_stamps_each_request_when_it_arrived() -> None:
    clock = FakeClock()
    with ApiServer(monotonic=clock) as server, client_for(server, retries=False) as api_client:
        core = client.CoreV1Api(api_client)
        core.list_node()
        clock.t += 2.5
        server.faults.add("GET", "nodes", "429")
        with pytest.raises(ApiException):
            core.list_node()
    assert [(r.status, r.at) for r in server.requests] == [(200, 1000.0), (429, 1002.5)]
    assert not server.requests[0].watch


def _raw_watch_in_thread(
    server: ApiServer, received: bytearray | None = None
) -> tuple[queue.Queue[str], threading.Thread]:
    """Watch slices in a thread; once open, how the stream ended goes to the queue: "ended
    cleanly", or the name of the error the client saw. What it received goes to ``received``."""
    outcome: queue.Queue[str] = queue.Queue()
    seen = len([r for r in server.requests if r.watch])
    data = bytearray() if received is None else received

    def run() -> None:
        with client_for(server, retries=False) as api_client:
            resp = client.ResourceV1Api(api_client).list_resource_slice(
                watch=True, timeout_seconds=600, _preload_content=False
            )
            try:
                for chunk in resp.stream(64):
                    data.extend(chunk)
                outcome.put("ended cleanly")
            except urllib3.exceptions.HTTPError as exc:
                outcome.put(type(exc).__name__)
            finally:
                resp.release_conn()

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while len([r for r in server.requests if r.watch]) == seen:  # until the watch is open
        assert time.monotonic() < deadline, "the watch did not open"
        time.sleep(0.01)
    return outcome, thread


def test_an_outage_answers_everything_until_it_ends_and_cuts_open_watches(
    server: ApiServer, strict_api: client.ApiClient
) -> None:
    rapi = client.ResourceV1Api(strict_api)
    armed = server.faults.add("POST", "resourceslices", "500")
    outcome, thread = _raw_watch_in_thread(server)
    server.faults.start_outage("503")
    assert server.faults.outage == "503"
    thread.join(30)  # the open watch was cut, not ended: the client sees the stream broken
    assert not thread.is_alive() and outcome.get_nowait() != "ended cleanly"
    for call in (rapi.list_resource_slice, client.CoreV1Api(strict_api).list_namespace):
        with pytest.raises(ApiException) as exc:
            call()
        assert exc.value.status == 503
    assert server.faults.pending() == [armed]  # an outage does not use up armed faults
    server.faults.end_outage()
    assert server.faults.outage is None
    assert rapi.list_resource_slice().items == []
    assert [r.status for r in server.requests] == [200, 503, 503, 200]


def test_an_outage_of_dropped_connections(server: ApiServer, strict_api: client.ApiClient) -> None:
    server.faults.start_outage("drop")
    with pytest.raises(urllib3.exceptions.ProtocolError):
        client.CoreV1Api(strict_api).list_node()
    server.faults.clear()  # ends the outage too
    assert client.CoreV1Api(strict_api).list_node().items == []
    assert [r.status for r in server.requests] == [0, 200]


def test_cut_watches_ends_open_streams_mid_stream_and_new_ones_stay_open(
    server: ApiServer,
) -> None:
    received = bytearray()
    outcome, thread = _raw_watch_in_thread(server, received)
    server.faults.cut_watches()
    server.put_object("resourceslices", slice_body("made-after-the-cut"))
    thread.join(30)
    assert not thread.is_alive() and outcome.get_nowait() != "ended cleanly"
    assert b"made-after-the-cut" not in received  # the cut stream sends nothing newer
    events, after = _watch_in_thread(server, timeout_seconds=600)
    server.put_object("resourceslices", slice_body("after-the-cut"))
    assert events.get(timeout=30) == "after-the-cut"
    server.stop()  # ends the new one cleanly
    after.join(30)
    assert not after.is_alive()


def test_stop_ends_a_watch_cleanly_unlike_a_cut(server: ApiServer) -> None:
    outcome, thread = _raw_watch_in_thread(server)
    server.stop()
    thread.join(30)
    assert outcome.get_nowait() == "ended cleanly"


# ---------------------------------------------------------------------------------- validation


def test_unknown_fields_are_422_and_recorded(
    server: ApiServer, api: client.ApiClient, rapi: client.ResourceV1Api
) -> None:
    body = slice_body()
    body["spec"]["devices"][0]["bogus"] = True
    # the typed API methods validate even dict bodies against their models (extra="forbid") ...
    with pytest.raises(pydantic.ValidationError):
        rapi.create_resource_slice(body=body)
    assert len(server.requests) == 0
    # ... so send it raw
    resp = api.call_api("POST", server.url + "/apis/resource.k8s.io/v1/resourceslices", body=body)
    assert resp.status == 422
    status = json.loads(resp.read())
    assert status["reason"] == "Invalid" and "bogus" in status["message"]
    assert status["details"]["causes"][0]["field"] == "spec.devices[0]"
    assert server.objects("resourceslices") == []
    (rejection,) = server.rejected
    assert rejection.resource == "resourceslices" and rejection.name == "slice-a"
    assert rejection.version == "1.34.0" and "bogus" in rejection.message


def test_fields_newer_than_the_cluster_are_422(
    server: ApiServer, rapi: client.ResourceV1Api
) -> None:
    """The 1.37 client models know fields the 1.34/1.35 schemas (and API servers) do not."""
    good = rapi.create_resource_slice(body=slice_body())
    newer = rapi.read_resource_slice("slice-a")
    newer.spec.devices[0].attributes["models"] = client.V1DeviceAttribute(strings=["a", "b"])
    with pytest.raises(ApiException) as exc:
        rapi.replace_resource_slice("slice-a", body=newer)
    assert exc.value.status == 422
    assert "strings" in status_of(exc.value)["message"]
    assert [(r.method, r.version) for r in server.rejected] == [("PUT", "1.34.0")]
    current = rapi.read_resource_slice("slice-a")
    assert current.metadata.resource_version == good.metadata.resource_version


def test_noop_update_changes_nothing(server: ApiServer, rapi: client.ResourceV1Api) -> None:
    created = raw(rapi.create_resource_slice(body=slice_body(), _preload_content=False))
    rv = server.resource_version
    again = raw(rapi.replace_resource_slice("slice-a", body=created, _preload_content=False))
    assert again == created and server.resource_version == rv


# ---------------------------------------------------------------------------------- claims


def test_claim_status_subresource(server: ApiServer, api: client.ApiClient) -> None:
    rapi = client.ResourceV1Api(api)
    body = claim_body()
    body["status"] = allocation()
    created = raw(rapi.create_namespaced_resource_claim(NS, body=body, _preload_content=False))
    assert "status" not in created  # create drops the status

    # a normal update ignores status: nothing changes
    with_status = dict(created, status=allocation())
    same = raw(
        rapi.replace_namespaced_resource_claim(
            "claim-a", NS, body=with_status, _preload_content=False
        )
    )
    assert same == created

    # /status changes only status
    changed_spec = json.loads(json.dumps(with_status))
    changed_spec["spec"]["devices"]["requests"][0]["name"] = "other"
    out = raw(
        rapi.replace_namespaced_resource_claim_status(
            "claim-a", NS, body=changed_spec, _preload_content=False
        )
    )
    assert out["status"] == allocation()
    assert out["spec"] == created["spec"]
    assert int(out["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])

    # typed read of an allocated claim
    claim = rapi.read_namespaced_resource_claim("claim-a", NS)
    assert claim.status.allocation.devices.results[0].device == "gpu-0"

    # a stale status update conflicts; spec is immutable
    stale = dict(out, status=allocation("gpu-1"))
    stale["metadata"] = dict(
        out["metadata"], resourceVersion=created["metadata"]["resourceVersion"]
    )
    with pytest.raises(ApiException) as exc:
        rapi.replace_namespaced_resource_claim_status("claim-a", NS, body=stale)
    assert exc.value.status == 409
    changed_spec["metadata"] = out["metadata"]
    with pytest.raises(ApiException) as exc:
        rapi.replace_namespaced_resource_claim("claim-a", NS, body=changed_spec)
    assert exc.value.status == 422

    # status.devices only for allocated devices (driver, pool, device, shareID), each once,
    # its data at most 10 Ki (validation.go validateDeviceStatus)
    def device_status(device: str, data: Any = None) -> dict[str, Any]:
        current = raw(rapi.read_namespaced_resource_claim("claim-a", NS, _preload_content=False))
        entry: dict[str, Any] = {"driver": DRIVER, "pool": "node-1", "device": device}
        if data is not None:
            entry["data"] = data
        current["status"]["devices"] = [entry]
        return current

    ok = raw(
        rapi.replace_namespaced_resource_claim_status(
            "claim-a", NS, body=device_status("gpu-0", {"kind": "X"}), _preload_content=False
        )
    )
    assert ok["status"]["devices"][0]["data"] == {"kind": "X"}
    for body, says in (
        (device_status("gpu-1"), "must be an allocated device in the claim"),
        (device_status("gpu-0", {"x": "y" * 10240}), "may not be more than 10240 bytes"),
    ):
        with pytest.raises(ApiException) as exc:
            rapi.replace_namespaced_resource_claim_status("claim-a", NS, body=body)
        assert exc.value.status == 422 and says in status_of(exc.value)["message"]
    twice = device_status("gpu-0")
    twice["status"]["devices"] *= 2
    with pytest.raises(ApiException) as exc:
        rapi.replace_namespaced_resource_claim_status("claim-a", NS, body=twice)
    assert "Duplicate value" in status_of(exc.value)["message"]

    # the namespace must exist; the path and body namespaces must agree
    with pytest.raises(ApiException) as exc:
        rapi.create_namespaced_resource_claim(
            "nope", body=dict(claim_body(), metadata={"name": "c"})
        )
    assert exc.value.status == 404
    with pytest.raises(ApiException) as exc:
        rapi.create_namespaced_resource_claim("kube-system", body=claim_body("c"))
    assert exc.value.status == 400
    # the spec change, then the three device statuses
    assert [r.name for r in server.rejected] == ["claim-a"] * 4


def test_patch_and_delete_collection(server: ApiServer, rapi: client.ResourceV1Api) -> None:
    seed_four(server)
    # a dict body goes out as a strategic merge patch
    patched = rapi.patch_resource_slice(
        "node-1-gpu.tessera.dev", body={"metadata": {"labels": {"x": "y"}}}
    )
    assert patched.metadata.labels == {"node": "node-1", "x": "y"}
    # a list body is a JSON patch
    ops = [{"op": "replace", "path": "/spec/devices/0/name", "value": "gpu-9"}]
    patched = rapi.patch_resource_slice("node-1-gpu.tessera.dev", body=ops)
    assert patched.spec.devices[0].name == "gpu-9"
    assert patched.metadata.generation == 2
    gone = rapi.delete_collection_resource_slice(field_selector="spec.nodeName=node-1")
    assert gone is not None
    left = {s["metadata"]["name"] for s in server.objects("resourceslices")}
    assert left == {"node-2-gpu.tessera.dev", "node-2-nic.example.com"}


def test_finalizers_delay_deletion(server: ApiServer, rapi: client.ResourceV1Api) -> None:
    body = slice_body()
    body["metadata"]["finalizers"] = ["tessera.dev/keep"]
    rapi.create_resource_slice(body=body)
    resp = rapi.delete_resource_slice("slice-a", _preload_content=False)
    assert resp.status == 202
    pending = raw(resp)
    assert pending["metadata"]["deletionTimestamp"]
    pending["metadata"]["finalizers"] = []
    rapi.replace_resource_slice("slice-a", body=pending)
    assert server.objects("resourceslices") == []


# ---------------------------------------------------------------------------------- core, log


def test_nodes_and_namespaces(server: ApiServer, api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    assert {"default", "kube-system"} <= {n.metadata.name for n in core.list_namespace().items}
    core.create_node(body={"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}})
    core.create_node(body={"metadata": {"name": "node-2"}, "spec": {"unschedulable": True}})
    assert [
        n.metadata.name for n in core.list_node(field_selector="metadata.name=node-1").items
    ] == ["node-1"]
    unschedulable = core.list_node(field_selector="spec.unschedulable=true").items
    assert [n.metadata.name for n in unschedulable] == ["node-2"]
    core.create_namespace(body={"metadata": {"name": "gpu-jobs"}})
    assert core.read_namespace("gpu-jobs").status.phase == "Active"
    rapi = client.ResourceV1Api(api)
    rapi.create_namespaced_resource_claim(
        "gpu-jobs", body=dict(claim_body(), metadata={"name": "c"})
    )
    assert len(server.objects("resourceclaims", namespace="gpu-jobs")) == 1
    core.delete_namespace("gpu-jobs")
    assert server.objects("resourceclaims") == []
    with pytest.raises(ApiException) as exc:
        core.read_node("node-3")
    assert exc.value.status == 404
    assert status_of(exc.value)["message"] == 'nodes "node-3" not found'


def test_writes_and_request_log(server: ApiServer, rapi: client.ResourceV1Api) -> None:
    server.clear_log()
    rapi.create_resource_slice(body=slice_body("a"))
    rapi.create_resource_slice(body=slice_body("b"))
    a = rapi.read_resource_slice("a")
    rapi.replace_resource_slice("a", body=a)
    rapi.delete_resource_slice("b")
    rapi.list_resource_slice(field_selector="spec.driver=x")
    assert server.writes() == 4
    assert server.writes("resourceslices") == 4
    assert server.writes("nodes") == 0
    methods = [(r.method, r.status) for r in server.requests]
    assert methods == [
        ("POST", 201), ("POST", 201), ("GET", 200), ("PUT", 200), ("DELETE", 200), ("GET", 200)
    ]  # fmt: skip
    assert server.requests[-1].params == {"fieldSelector": "spec.driver=x"}
    server.clear_log()
    assert len(server.requests) == 0 and server.writes() == 0


def test_direct_access_emits_events(server: ApiServer) -> None:
    rv = server.resource_version
    stored = server.put_object("resourceslices", slice_body())
    assert stored["metadata"]["resourceVersion"] == str(rv + 1)
    stored["spec"]["driver"] = "changed"  # a copy: the store is untouched
    assert server.objects("resourceslices")[0]["spec"]["driver"] == DRIVER
    assert server.get_object("resourceslices", "slice-a") is not None
    assert server.delete_object("resourceslices", "slice-a") is not None
    assert server.delete_object("resourceslices", "slice-a") is None
    server.put_object("resourceslices", slice_body("end"))
    with client_for(server) as api_client:
        func = client.ResourceV1Api(api_client).list_resource_slice
        seen = collect(func, "end", resource_version=str(rv))
    assert seen == [("ADDED", "slice-a"), ("DELETED", "slice-a"), ("ADDED", "end")]
    with pytest.raises(ValueError):
        server.objects("pods.v2")


def test_restart_keeps_state_and_port() -> None:
    server = ApiServer()
    with server:
        server.put_object("resourceslices", slice_body())
        url = server.url
    assert not server.running
    with server, client_for(server) as api_client:
        assert server.url == url
        names = [
            s.metadata.name for s in client.ResourceV1Api(api_client).list_resource_slice().items
        ]
        assert names == ["slice-a"]


def test_unknown_paths_and_methods(server: ApiServer, strict_api: client.ApiClient) -> None:
    def call(method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        resp = strict_api.call_api(method, server.url + path, body=body)
        return resp.status, resp.read()

    for path in ("/apis/resource.k8s.io/v1/widgets", "/apis/example.com/v1/things", "/nope"):
        status, data = call("GET", path)
        assert status == 404 and json.loads(data)["reason"] == "NotFound"
    status, data = call("PUT", "/apis/resource.k8s.io/v1/resourceslices", body={})
    assert status == 405 and json.loads(data)["reason"] == "MethodNotAllowed"
    assert call("GET", "/healthz") == (200, b"ok")


def test_concurrent_writers_get_distinct_versions(server: ApiServer) -> None:
    versions: list[str] = []
    lock = threading.Lock()

    def writer(i: int) -> None:
        with client_for(server) as api_client:
            rapi = client.ResourceV1Api(api_client)
            for j in range(5):
                rv = rapi.create_resource_slice(
                    body=slice_body(f"s-{i}-{j}")
                ).metadata.resource_version
                with lock:
                    versions.append(rv)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(versions)) == 20
    assert len(server.objects("resourceslices")) == 20
