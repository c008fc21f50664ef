"""The arithmetic of the 10,000-node model (``bench/scale_model.py``): bytes of a pool, the
metadata the API server adds, what one node's figures make at cluster scale, and which slices
NVIDIA's slice controller rewrites for a change. Pure functions, no I/O.

etcd: the API server stores built-in types such as ResourceSlices as protobuf by default
(kube-apiserver ``--storage-media-type``, default ``application/vnd.kubernetes.protobuf``:
kubernetes.io/docs/reference/command-line-tools-reference/kube-apiserver/), not as JSON: field
names of structs become one-byte tags, map keys (attribute and capacity names) stay strings.
The compact JSON of the stored object is what watchers receive in JSON and an upper bound of
the protobuf value; each key also costs its path (``/registry/resource.k8s.io/resourceslices/
<name>``) and etcd keeps old revisions until the API server compacts them (every 5 minutes by
default, ``--etcd-compaction-interval``), so a rewrite holds the space twice until then, and the
database file only shrinks on defragmentation. etcd's default space quota is 2 GiB
(``--quota-backend-bytes``; etcd.io/docs/latest/dev-guide/limit/, "Storage size limit"), with
8 GiB the suggested maximum; past the quota etcd raises NOSPACE and refuses writes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]

GIB = 1024**3
ETCD_QUOTA = 2 * GIB
"""etcd's default ``--quota-backend-bytes``."""
NODES = 10_000
KUBELET_LEASE_WRITES_PER_MIN = 6.0
"""The kubelet renews its node Lease every 10 s (a quarter of ``nodeLeaseDurationSeconds``, 40
s; kubernetes.io/docs/concepts/architecture/nodes/, "Node heartbeats"): not ours, the context
for our writes."""
CLUSTER_WATCHERS = ("kube-scheduler", "kube-controller-manager")
"""Watchers of every ResourceSlice: the scheduler's informer (allocation), and the controller
manager's (the device-taint eviction controller and the ResourceClaim controller's slice
tracker). Each slice written also reaches the publishing node's own watch (a field selector on
its node: one watcher per slice, not per cluster). A cluster autoscaler with DRA support, or any
exporter that watches slices, adds one more each."""


def compact(obj: Any) -> int:
    """Bytes of ``obj`` as compact JSON (what ``json.dumps`` with no spaces writes, UTF-8)."""
    return len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


def _fields(value: Any, atomic: bool = False) -> Obj:
    """FieldsV1 of ``value``: a struct's keys as ``f:<key>``; atomic lists (every list of a
    ResourceSlice's spec is ``+listType=atomic`` in k8s.io/api/resource/v1/types.go) and
    scalars as ``{}``."""
    if atomic or not isinstance(value, dict):
        return {}
    return {".": {}, **{f"f:{k}": _fields(v) for k, v in value.items()}}


def managed_fields(obj: Obj, manager: str) -> list[Obj]:
    """The ``managedFields`` entry the API server adds for a client's create or update (an
    ``Update`` operation owning every field the client set); the emulator does not add it, so
    it is constructed here: field paths under ``metadata`` (labels, ownerReferences keyed by
    uid) and ``spec`` (lists atomic)."""
    meta = obj.get("metadata", {})
    fields: Obj = {}
    if meta.get("labels"):
        fields["f:metadata"] = {"f:labels": _fields(meta["labels"])}
    if meta.get("ownerReferences"):
        refs = {
            "k:" + json.dumps({"uid": r.get("uid", "")}, separators=(",", ":")): _fields(r)
            for r in meta["ownerReferences"]
        }
        fields.setdefault("f:metadata", {})["f:ownerReferences"] = {".": {}, **refs}
    spec = obj.get("spec", {})
    fields["f:spec"] = {f"f:{k}": _fields(v, atomic=isinstance(v, list)) for k, v in spec.items()}
    return [
        {
            "manager": manager,
            "operation": "Update",
            "apiVersion": obj.get("apiVersion", "resource.k8s.io/v1"),
            "time": "2026-01-01T00:00:00Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": fields,
        }
    ]


def with_managed_fields(obj: Obj, manager: str) -> Obj:
    """``obj`` as the real API server stores it: with its managedFields."""
    meta = {**obj.get("metadata", {}), "managedFields": managed_fields(obj, manager)}
    return {**obj, "metadata": meta}


@dataclass(frozen=True)
class NodeFigures:
    """One node's measured figures for one layout."""

    stored_bytes: int
    """Compact JSON of the pool as stored, managedFields included."""
    change_writes: int
    """API writes of one device change (one GPU gone)."""
    change_bytes: int
    """Bytes of the slices that change rewrote (each goes to every watcher)."""
    restart_writes: int
    """API writes when the publisher starts again with the same devices."""
    restart_bytes: int
    stored_protobuf: int = 0
    """The pool as etcd holds it, estimated (:func:`protobuf_bytes`)."""
    taint_writes: int = 0
    """API writes when one GPU's devices are tainted (health; Tessera with --device-taints)."""
    taint_bytes: int = 0


@dataclass(frozen=True)
class ClusterFigures:
    etcd_bytes: int
    etcd_protobuf_bytes: int
    quota_share: float
    """``etcd_bytes`` / etcd's default quota."""
    change_watch_bytes: int
    """One device change delivered: to every cluster watcher, plus the node's own watch."""
    restart_watch_bytes: int
    taint_watch_bytes: int
    steady_writes_per_min: float
    churn_writes_per_min: float
    """Steady writes plus the writes of ``churn_per_node_hour`` device changes per node."""


def cluster(
    node: NodeFigures,
    steady_writes_per_node_min: float,
    *,
    nodes: int = NODES,
    churn_per_node_hour: float = 1.0,
    watchers: int = len(CLUSTER_WATCHERS),
) -> ClusterFigures:
    """One node's figures at ``nodes`` nodes."""
    etcd = node.stored_bytes * nodes
    churn = steady_writes_per_node_min + node.change_writes * churn_per_node_hour / 60
    return ClusterFigures(
        etcd_bytes=etcd,
        etcd_protobuf_bytes=node.stored_protobuf * nodes,
        quota_share=etcd / ETCD_QUOTA,
        change_watch_bytes=node.change_bytes * (watchers + 1),
        restart_watch_bytes=node.restart_bytes * (watchers + 1),
        taint_watch_bytes=node.taint_bytes * (watchers + 1),
        steady_writes_per_min=steady_writes_per_node_min * nodes,
        churn_writes_per_min=churn * nodes,
    )


@dataclass(frozen=True)
class Sync:
    """What NVIDIA's slice controller writes to go from one pool to another."""

    updates: int
    creates: int
    deletes: int
    written: tuple[int, ...]
    """Indexes (in the new pool) of the slices updated or created."""

    @property
    def writes(self) -> int:
        return self.updates + self.creates + self.deletes


def nvidia_sync(old: Sequence[Obj], new: Sequence[Obj]) -> Sync:
    """The writes of ``syncPool`` (k8s.io/dynamic-resource-allocation/resourceslice/
    resourceslicecontroller.go) from slice contents ``old`` (published, matched by index) to
    ``new``: slices past the new count are deleted; the generation is kept when no slice is
    added and at most one changed (then only that one is updated), else bumped and every
    remaining slice updated, new ones created. Our own code, from its rules."""
    matched = min(len(old), len(new))
    # a new slice count is in every slice's pool (resourceSliceCount): all of them change
    changed = [i for i in range(matched) if old[i] != new[i] or len(old) != len(new)]
    creates = len(new) - matched
    deletes = len(old) - matched
    bump = creates > 0 or len(changed) > 1
    updated = list(range(matched)) if bump else changed
    return Sync(len(updated), creates, deletes, (*updated, *range(matched, len(new))))


# -- protobuf, estimated ------------------------------------------------------------------------

MAP_FIELDS = frozenset({"labels", "annotations", "attributes", "capacity", "counters"})
"""The ResourceSlice's JSON objects that are protobuf maps (entries: key string, value message);
every other object is a message whose field names become tags."""
TIME_FIELDS = frozenset({"creationTimestamp", "time"})
ETCD_PREFIX = "/registry/resource.k8s.io/resourceslices/"


def _varint(n: int) -> int:
    """Bytes of ``n`` as a protobuf varint (negative int64: ten)."""
    if n < 0:
        return 10
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _framed(payload: int) -> int:
    """A length-delimited field: its tag (one byte: every field number of these types is under
    16), the length, the payload."""
    return 1 + _varint(payload) + payload


def _payload(key: str, value: Any) -> int:
    """Bytes of ``value``'s encoding, without its tag (for framed values: without the length)."""
    if key in TIME_FIELDS:  # metav1.Time: a message {seconds: varint}; 2026 needs 5 bytes
        return 1 + 5
    if key == "fieldsV1":  # a message {raw bytes: the JSON}
        return _framed(compact(value))
    if isinstance(value, str):
        raw = len(value.encode())
        return _framed(raw) if key == "value" else raw  # Quantity: a message {string}
    if isinstance(value, dict):
        return sum(_field(k, v) for k, v in value.items())
    raise TypeError(f"{key}: {value!r} is not a framed value")


def _field(key: str, value: Any) -> int:
    """Bytes of one field, tag included; a list is a repeated field (a tag per element)."""
    if isinstance(value, list):
        return sum(_field(key, v) for v in value)
    if isinstance(value, bool):
        return 2
    if isinstance(value, int):
        return 1 + _varint(value)
    if isinstance(value, dict) and key in MAP_FIELDS:  # a repeated entry {1: key, 2: value}
        return sum(_framed(_framed(len(k.encode())) + _field("", v)) for k, v in value.items())
    return _framed(_payload(key, value))


def protobuf_bytes(obj: Obj) -> int:
    """An estimate of ``obj`` as the API server stores it in etcd (``application/
    vnd.kubernetes.protobuf``: the magic ``k8s\\0``, then a ``runtime.Unknown`` holding the
    type, the object's protobuf and two empty strings), plus its etcd key. Built from the
    encoding rules (tags, varints, length prefixes; maps as repeated key/value entries;
    Quantity a message of one string; the apimachinery generated.proto files), not by an
    encoder: no protobuf encoder of these types is among our dependencies. A taint's ``value``
    would be counted as a Quantity (two bytes too many); slices in steady state have none."""
    type_meta = _framed(len(obj.get("apiVersion", ""))) + _framed(len(obj.get("kind", "")))
    body = sum(_field(k, v) for k, v in obj.items() if k not in ("apiVersion", "kind"))
    envelope = 4 + _framed(type_meta) + _framed(body) + 2 + 2
    return envelope + len(ETCD_PREFIX) + len(obj.get("metadata", {}).get("name", ""))
