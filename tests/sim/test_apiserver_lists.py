"""List pages of the API-server emulator, joined from each object's JSON kept at its write:
what every write leaves is what the next list serves, page by page, over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client

from agent.sim.apiserver import ApiServer
from tests.apiclient import api_client
from tests.sim.test_apiserver import slice_body


@pytest.fixture
def rapi(server: ApiServer) -> Iterator[client.ResourceV1Api]:
    c = api_client(server, retries=False)
    yield client.ResourceV1Api(c)
    c.close()


def raw_list(server: ApiServer, query: str = "") -> dict[str, Any]:
    resp = urllib3.request("GET", f"{server.url}/apis/resource.k8s.io/v1/resourceslices{query}")
    assert resp.status == 200
    listed: dict[str, Any] = json.loads(resp.data)
    return listed


def test_lists_serve_each_write_and_only_the_store_changes_it(
    server: ApiServer, rapi: client.ResourceV1Api
) -> None:
    """A list page is joined from each object's JSON kept at its write: every write (seeding,
    update, delete) is what the next list serves, and changing what a write or a read handed
    back changes nothing stored."""
    put = server.put_object("resourceslices", slice_body("a"))
    server.put_object("resourceslices", slice_body("b"))
    put["spec"]["nodeName"] = "changed-by-the-caller"
    got = server.get_object("resourceslices", "b")
    assert got is not None
    got["spec"]["nodeName"] = "changed-by-the-caller"
    mine = rapi.read_resource_slice("a")
    capacity = mine.spec.devices[0].capacity if mine.spec.devices else None
    assert capacity is not None
    capacity["memory"] = client.V1DeviceCapacity(value="40Gi")
    rapi.replace_resource_slice("a", body=mine)
    rapi.delete_resource_slice("b")
    server.put_object("resourceslices", slice_body("c"))
    listed = raw_list(server)
    assert listed["kind"] == "ResourceSliceList" and listed["apiVersion"] == "resource.k8s.io/v1"
    assert listed["metadata"] == {"resourceVersion": str(server.resource_version)}
    assert [s["metadata"]["name"] for s in listed["items"]] == ["a", "c"]
    stored = [server.get_object("resourceslices", n) for n in ("a", "c")]
    assert listed["items"] == [
        {k: v for k, v in s.items() if k not in ("apiVersion", "kind")}
        for s in stored
        if s is not None
    ]
    assert listed["items"][0]["spec"]["nodeName"] == "node-1"
    assert listed["items"][0]["spec"]["devices"][0]["capacity"]["memory"] == {"value": "40Gi"}
    first = raw_list(server, "?limit=1")
    assert first["metadata"]["remainingItemCount"] == 1
    assert [s["metadata"]["name"] for s in first["items"]] == ["a"]
    token = first["metadata"]["continue"]
    rest = raw_list(server, f"?limit=1&continue={token}")
    assert rest["items"] == listed["items"][1:] and "continue" not in rest["metadata"]
