"""The 10,000-node arithmetic (bench/scale_math.py) on hand-made slices, with exact numbers:
pool bytes, managedFields, one node's figures at cluster scale, and the writes of NVIDIA's slice
controller (its syncPool rules) for a change."""

from __future__ import annotations

from agent.sim.apiserver import RequestRecord
from bench.common import pool_bytes
from bench.scale_daemon import DaemonWrites, writes_by_resource
from bench.scale_math import (
    ETCD_QUOTA,
    NodeFigures,
    cluster,
    managed_fields,
    nvidia_sync,
    protobuf_bytes,
    with_managed_fields,
)


def test_pool_bytes_are_the_compact_json_of_every_slice() -> None:
    assert pool_bytes([{"a": 1}, {"b": "x"}]) == len('{"a":1}') + len('{"b":"x"}') == 16
    assert pool_bytes([{"n": "é"}]) == len('{"n":"é"}'.encode()) == 10  # UTF-8 bytes
    assert pool_bytes([]) == 0


def test_managed_fields_own_what_the_client_set_with_atomic_lists() -> None:
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {
            "name": "s",
            "labels": {"a": "b"},
            "ownerReferences": [{"kind": "Node", "uid": "u1"}],
        },
        "spec": {"driver": "d", "pool": {"name": "p"}, "devices": [{"name": "x"}]},
    }
    (entry,) = managed_fields(obj, "tessera")
    assert entry["manager"] == "tessera" and entry["operation"] == "Update"
    assert entry["fieldsV1"] == {
        "f:metadata": {
            "f:labels": {".": {}, "f:a": {}},
            "f:ownerReferences": {'k:{"uid":"u1"}': {".": {}, "f:kind": {}, "f:uid": {}}, ".": {}},
        },
        "f:spec": {"f:driver": {}, "f:pool": {".": {}, "f:name": {}}, "f:devices": {}},
    }
    stored = with_managed_fields(obj, "tessera")
    assert stored["metadata"]["managedFields"] == [entry] and "managedFields" not in obj["metadata"]


def test_one_nodes_figures_at_cluster_scale() -> None:
    node = NodeFigures(
        stored_bytes=100,
        change_writes=2,
        change_bytes=50,
        restart_writes=3,
        restart_bytes=70,
        stored_protobuf=80,
        taint_writes=1,
        taint_bytes=20,
    )
    c = cluster(node, 1.0, nodes=10, churn_per_node_hour=6, watchers=2)
    assert (c.etcd_bytes, c.etcd_protobuf_bytes) == (1000, 800)
    assert c.quota_share == 1000 / ETCD_QUOTA
    assert c.change_watch_bytes == 150  # two cluster watchers and the node's own watch
    assert (c.restart_watch_bytes, c.taint_watch_bytes) == (210, 60)
    assert c.steady_writes_per_min == 10
    assert c.churn_writes_per_min == 12  # (1 + 2 writes x 6 changes / 60 min) x 10 nodes


def test_nvidia_sync_rewrites_one_slice_or_bumps_the_generation() -> None:
    a, b, c = {"devices": [1]}, {"devices": [2]}, {"devices": [3]}
    same = nvidia_sync([a, b, c], [a, b, c])
    assert (same.writes, same.written) == (0, ())
    one = nvidia_sync([a, b, c], [a, {"devices": [9]}, c])
    assert (one.updates, one.creates, one.deletes, one.written) == (1, 0, 0, (1,))
    two = nvidia_sync([a, b, c], [{"devices": [8]}, {"devices": [9]}, c])
    assert (two.updates, two.written) == (3, (0, 1, 2))  # generation bumped: all of them
    fewer = nvidia_sync([a, b, c], [a, b])  # the count in every slice's pool changes
    assert (fewer.updates, fewer.deletes, fewer.writes) == (2, 1, 3)
    more = nvidia_sync([a, b], [a, b, c])
    assert (more.updates, more.creates, more.written) == (2, 1, (0, 1, 2))


def test_the_protobuf_estimate_follows_the_encoding_rules_byte_for_byte() -> None:
    obj = {
        "apiVersion": "v1",
        "kind": "K",
        "metadata": {"name": "ab"},
        "spec": {"n": 5, "capacity": {"m": {"value": "14"}}},
    }
    type_meta = (1 + 1 + 2) + (1 + 1 + 1)  # apiVersion, kind: tag, length, bytes
    metadata = 1 + 1 + (1 + 1 + 2)  # a message holding name
    capacity = 1 + 1 + (1 + 1 + 2)  # DeviceCapacity {value: Quantity {string: "14"}}
    entry = 1 + 1 + ((1 + 1 + 1) + (1 + 1 + capacity))  # map entry {1: "m", 2: capacity}
    spec = 1 + 1 + ((1 + 1) + entry)  # n: tag + varint; capacity: one tag per entry
    body = metadata + spec
    envelope = 4 + (1 + 1 + type_meta) + (1 + 1 + body) + 2 + 2
    key = len("/registry/resource.k8s.io/resourceslices/ab")
    assert protobuf_bytes(obj) == envelope + key == 85


def test_steady_writes_are_counted_per_report_written() -> None:
    writes = DaemonWrites(
        start={},
        steady={"PUT gpuusagereports": 3, "POST events": 1},
        stop={},
        restart={},
        interval_s=1.0,
        window_s=4.0,  # four intervals, three reports: the drift is not a write saved
    )
    assert writes.steady_per_interval() == 4 / 3
    records = [
        RequestRecord("PUT", "/apis/tessera.dev/v1alpha1/gpuusagereports/n", "", 200),
        RequestRecord("POST", "/apis/resource.k8s.io/v1/resourceslices", "", 201),
        RequestRecord("GET", "/apis/resource.k8s.io/v1/resourceslices", "", 200),
        RequestRecord("PUT", "/apis/tessera.dev/v1alpha1/gpuusagereports/n", "", 200),
    ]
    assert writes_by_resource(records) == {
        "POST resourceslices": 1,
        "PUT gpuusagereports": 2,
    }  # reads are not writes
