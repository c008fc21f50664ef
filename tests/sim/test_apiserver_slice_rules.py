"""The emulator refuses a ResourceSlice as the real API server of the version it reports does:
from 1.35 a slice holds ``devices`` or ``sharedCounters``, not both (Kubernetes
pkg/apis/resource/validation/validation.go, ``validateResourceSliceSpec``); 1.34 kept counter
sets beside the devices that consume them. Through the kubernetes client, over HTTP."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from agent.sim.apiserver import ApiServer
from tests.apiclient import api_client

DRIVER = "gpu.tessera.dev"
COUNTERS = [{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}]


def _slice(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
            "nodeName": "node-1",
            **spec,
        },
    }


def _device(consumes: bool) -> dict[str, Any]:
    device: dict[str, Any] = {"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}
    if consumes:
        counters = {"memory": {"value": "80Gi"}}
        device["consumesCounters"] = [{"counterSet": "gpu-0-counters", "counters": counters}]
    return device


def _create(server: ApiServer, body: dict[str, Any]) -> None:
    with api_client(server, retries=False) as api:
        client.ResourceV1Api(api).create_resource_slice(body=body, _preload_content=False)


@pytest.mark.parametrize("devices", [[_device(consumes=True)], []], ids=["a-device", "empty-list"])
def test_a_1_35_server_refuses_a_slice_with_devices_and_counter_sets(devices: Any) -> None:
    with ApiServer(kube_version="1.35.0") as server:
        body = _slice("both", devices=devices, sharedCounters=COUNTERS)
        with pytest.raises(ApiException) as refused:
            _create(server, body)
        assert refused.value.status == 422
        status = json.loads(refused.value.body)
        assert status["message"] == (
            'ResourceSlice.resource.k8s.io "both" is invalid: spec: Invalid value: "": only one'
            " of `sharedCounters` or `devices` is allowed"
        )
        assert status["details"]["causes"][0]["field"] == "spec"
        assert server.objects("resourceslices") == []
        assert [r.name for r in server.rejected] == ["both"]


def test_a_1_35_server_takes_the_counter_sets_and_the_devices_in_slices_of_their_own() -> None:
    with ApiServer(kube_version="1.35.0") as server:
        counters = _slice("counters", sharedCounters=COUNTERS)
        counters["spec"]["pool"]["resourceSliceCount"] = 2
        devices = _slice("devices", devices=[_device(consumes=True)])
        devices["spec"]["pool"]["resourceSliceCount"] = 2
        _create(server, counters)
        _create(server, devices)
        assert sorted(o["metadata"]["name"] for o in server.objects("resourceslices")) == [
            "counters",
            "devices",
        ]
        assert server.rejected == []


def test_a_1_34_server_takes_counter_sets_beside_the_devices_that_consume_them() -> None:
    with ApiServer(kube_version="1.34.0", validate_versions=("1.34.0",)) as server:
        _create(server, _slice("both", devices=[_device(consumes=True)], sharedCounters=COUNTERS))
        assert [o["metadata"]["name"] for o in server.objects("resourceslices")] == ["both"]
        assert server.rejected == []
