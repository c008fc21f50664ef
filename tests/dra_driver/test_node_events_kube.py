"""The Node event recorder's kube sink against the API-server emulator over real HTTP, through
the production client: every Event written validates (1.34 and 1.35), counts are PATCHes of one
Event, kubectl finds them, and refusals are counted, never raised."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.sim.apiserver import ApiServer
from dra_driver.cluster.kube import KubeClient
from dra_driver.cluster.node_events import (
    NORMAL,
    WARNING,
    KubeEventSink,
    NodeEventRecorder,
    gpu_health,
)
from tests.fakeclock import FakeClock
from tests.k8sschema import validate as validate_k8s

NODE = "node-a"
VERSIONS = ("1.34.0", "1.35.0")


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with ApiServer() as s:
        s.put_object("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield s


@pytest.fixture
def kube(server: ApiServer, tmp_path: Path) -> Iterator[KubeClient]:
    client = KubeClient.from_config(server.kubeconfig(tmp_path))
    yield client
    client.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_780_000_000.0)


@pytest.fixture
def recorder(server: ApiServer, kube: KubeClient, clock: FakeClock) -> NodeEventRecorder:
    uid = server.get_object("nodes", NODE)["metadata"]["uid"]
    return NodeEventRecorder(
        KubeEventSink(kube),
        NODE,
        "gpu.tessera.dev",
        logging.getLogger("test.node-events"),
        node_uid=lambda: uid,
        clock=clock,
        retry_delays=(0.0,),
    )


def events(server: ApiServer) -> list[dict[str, Any]]:
    found = server.objects("events")
    for e in found:  # every Event as stored passes the upstream schemas
        for version in VERSIONS:
            validate_k8s(e, version)
    return found


def writes(server: ApiServer) -> list[str]:
    return [r.method for r in server.requests if r.resource == "events" and r.method != "GET"]


def test_an_event_is_created_on_the_node_as_the_kubelet_writes_one(server, recorder, clock):
    recorder.record(*gpu_health(1, "GPU-1111", False, "xid-79"))
    recorder.drain()
    (e,) = events(server)
    node = server.get_object("nodes", NODE)
    assert e["metadata"]["namespace"] == "default"
    assert e["metadata"]["name"] == f"{NODE}.{int(clock.now * 1e9):x}"
    assert e["involvedObject"] == {
        "kind": "Node",
        "apiVersion": "v1",
        "name": NODE,
        "uid": node["metadata"]["uid"],
    }
    assert (e["type"], e["reason"], e["count"]) == (WARNING, "GpuUnhealthy", 1)
    assert e["message"] == "GPU 1 (GPU-1111) is unhealthy: xid-79"
    assert e["source"] == {"component": "gpu.tessera.dev", "host": NODE}
    assert (e["reportingComponent"], e["reportingInstance"]) == ("gpu.tessera.dev", NODE)
    assert e["firstTimestamp"] == e["lastTimestamp"] == "2026-05-28T20:26:40Z"
    assert server.rejected == [] and recorder.stats.recorded == 1


def test_the_same_event_again_patches_count_and_last_timestamp(server, recorder, clock):
    for _ in range(3):
        recorder.record(*gpu_health(1, "GPU-1111", False, "xid-79"))
        clock.now += 30
    recorder.drain()
    (e,) = events(server)
    assert e["count"] == 3
    assert (e["firstTimestamp"], e["lastTimestamp"]) == (
        "2026-05-28T20:26:40Z",
        "2026-05-28T20:27:40Z",
    )
    assert writes(server) == ["POST", "PATCH", "PATCH"]
    assert server.rejected == []


def test_kubectl_finds_the_events_of_the_node(server, recorder, kube):
    recorder.record(*gpu_health(1, "GPU-1111", False, "xid-79"))
    recorder.record(*gpu_health(1, "GPU-1111", True, "it answers again"))
    recorder.drain()
    uid = server.get_object("nodes", NODE)["metadata"]["uid"]
    # kubectl describe node: every namespace, by name, namespace "", kind and uid
    described = kube.request(
        "GET",
        "/api/v1/events",
        {
            "fieldSelector": f"involvedObject.name={NODE},involvedObject.namespace=,"
            f"involvedObject.kind=Node,involvedObject.uid={uid}"
        },
    )
    assert [e["reason"] for e in described["items"]] == ["GpuUnhealthy", "GpuHealthy"]
    warnings = kube.request(
        "GET",
        "/api/v1/events",
        {"fieldSelector": "involvedObject.kind=Node,type=Warning,source=gpu.tessera.dev"},
    )
    assert [e["type"] for e in warnings["items"]] == [WARNING]


def test_an_expired_event_is_created_again(server, recorder):
    recorder.record(NORMAL, "GpuHealthy", "GPU 1 (GPU-1111) is healthy again")
    recorder.drain()
    (first,) = events(server)
    server.delete_object("events", first["metadata"]["name"], "default")  # --event-ttl passed
    recorder.record(NORMAL, "GpuHealthy", "GPU 1 (GPU-1111) is healthy again")
    recorder.drain()
    (again,) = events(server)
    assert again["metadata"]["name"] == first["metadata"]["name"] and again["count"] == 2
    assert writes(server) == ["POST", "PATCH", "POST"]
    assert recorder.stats.recorded == 2 and recorder.stats.failed == 0


def test_without_rbac_for_events_nothing_is_raised_and_failures_are_counted(
    server, recorder, caplog
):
    server.access.deny("create", "events")
    with caplog.at_level(logging.WARNING, "test.node-events"):
        for gpu in range(3):
            assert recorder.record(*gpu_health(gpu, f"GPU-{gpu}", False, "xid-79"))
        recorder.drain()
    assert events(server) == [] and recorder.stats.failed == 3
    (logged,) = [r for r in caplog.records if r.getMessage() == "could not write a node event"]
    assert logged.fields["status"] == 403  # type: ignore[attr-defined]


def test_a_server_error_is_retried_and_the_event_written(server, recorder):
    server.faults.add("POST", r"/events$", "503")
    recorder.record(*gpu_health(1, "GPU-1111", False, "xid-79"))
    recorder.drain()
    assert len(events(server)) == 1 and recorder.stats.failed == 0
    assert writes(server) == ["POST", "POST"]


def test_a_flapping_gpu_makes_two_events_with_growing_counts(server, recorder, clock):
    for _ in range(20):
        recorder.record(*gpu_health(1, "GPU-1111", False, "xid-79"))
        clock.now += 1
        recorder.record(*gpu_health(1, "GPU-1111", True, "it answers again"))
        clock.now += 1
    recorder.drain()
    stored = {e["reason"]: e["count"] for e in events(server)}
    assert stored == {"GpuUnhealthy": 20, "GpuHealthy": 20}
    assert writes(server).count("POST") == 2 and server.rejected == []
