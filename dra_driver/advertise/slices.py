"""DeviceModel -> the ResourceSlice objects of the node's pool (plain dicts, as stored).

One pool per node (pool name = node name), ``resourceSliceCount`` = the number of slices built,
all slices carry the same ``generation``. An empty model still yields one slice with no devices
(an empty pool is not "no pool").

Layouts:

``1.35`` (default)
    Counter sets go first, in counters-only slices of at most 8 sets; then device slices of at most
    64 devices when any device consumes counters or has taints, else 128.
``1.34``
    A device may only consume counter sets of its own slice, and a slice holds at most 32 counters
    in all its sets: each GPU's counter set shares a slice with the devices consuming it (at most
    128 and 1024 consumed counters: the limit of 64 devices for a slice whose devices consume
    counters came with 1.35; a GPU's vGPU devices can pass 64); devices without counters follow,
    128 per slice (1.34 has no lower limit for devices with taints; at most 4 taints per device,
    and we set one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from dra_driver.advertise.slice_limits import (
    LAYOUTS,
    MAX_COUNTER_SETS,
    MAX_DEVICE_COUNTERS_PER_SLICE,
    MAX_DEVICES,
    MAX_DEVICES_WITH_TAINTS_OR_COUNTERS,
    parse_quantity,
)
from dra_driver.device_model import AdvertisedDevice, CounterSet, DeviceModel

API_VERSION = "resource.k8s.io/v1"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "tessera"
MAX_NAME_LENGTH = 253


@dataclass(frozen=True)
class SlicePolicy:
    driver_name: str
    node_name: str
    node_uid: str | None = None
    """ownerReference to the Node when known (the slices go away with the Node)."""
    layout: str = "1.35"
    """``1.35`` or ``1.34``."""


def slice_name(policy: SlicePolicy, index: int) -> str:
    """``<node>-<driver with dots as dashes>-<hash>-<index>``, at most 253 characters.

    The short hash of (node, driver) keeps names of different node/driver pairs apart even when
    their dashed forms coincide (node ``a`` + driver ``gpu.x.dev`` vs node ``a-gpu`` + ``x.dev``);
    a node name too long to fit is cut (the hash still covers the full name)."""
    digest = hashlib.sha256(f"{policy.node_name}\0{policy.driver_name}".encode()).hexdigest()[:8]
    suffix = f"-{policy.driver_name.replace('.', '-')}-{digest}-{index}"
    node = policy.node_name
    if len(node) + len(suffix) > MAX_NAME_LENGTH:
        node = node[: MAX_NAME_LENGTH - len(suffix)].rstrip(".-")
    return node + suffix


Chunk = tuple[tuple[CounterSet, ...] | None, tuple[AdvertisedDevice, ...] | None]


def _chunks(items: Sequence[Any], size: int) -> list[tuple[Any, ...]]:
    return [tuple(items[i : i + size]) for i in range(0, len(items), size)]


def _layout_135(model: DeviceModel) -> list[Chunk]:
    out: list[Chunk] = [(sets, None) for sets in _chunks(model.counter_sets, MAX_COUNTER_SETS)]
    limited = any(d.consumes_counters or d.taints for d in model.devices)
    size = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if limited else MAX_DEVICES
    out += [(None, devs) for devs in _gpu_chunks(model.devices, size)]
    return out


def _gpu_chunks(devices: Sequence[AdvertisedDevice], size: int) -> list[tuple[Any, ...]]:
    """``devices`` in order, in chunks of at most ``size``, a GPU's devices kept in one chunk
    where they fit in one: a change to one GPU (a health taint on its devices, its MIG layout)
    then changes one slice, which the publisher writes in place at the same generation
    (``publisher.plan_changes``), instead of two, which move the whole pool to a new one.
    dgx-a100 in dynamic MIG mode: 4 slices of 50 (two GPUs each) instead of 64, 64, 64, 8.
    Never more slices than plain chunks of ``size``: where keeping GPUs whole would take more
    (GPUs of 33 devices in slices of 64), the plain chunks are kept."""
    plain = _chunks(devices, size)
    groups: list[list[AdvertisedDevice]] = []
    for dev in devices:
        if groups and groups[-1][0].gpu_minor == dev.gpu_minor:
            groups[-1].append(dev)
        else:
            groups.append([dev])
    out: list[tuple[Any, ...]] = []
    current: list[AdvertisedDevice] = []
    for group in groups:
        if len(current) + len(group) > size and current:
            out.append(tuple(current))
            current = []
        current += group
        while len(current) > size:  # a GPU with more devices than a slice holds: split it
            out.append(tuple(current[:size]))
            current = current[size:]
    if current:
        out.append(tuple(current))
    return out if len(out) <= len(plain) else plain


def _layout_134(model: DeviceModel) -> list[Chunk]:
    by_set: dict[str, list[AdvertisedDevice]] = {cs.name: [] for cs in model.counter_sets}
    plain: list[AdvertisedDevice] = []
    for dev in model.devices:
        if not dev.consumes_counters:
            plain.append(dev)
            continue
        if len(dev.consumes_counters) > 1:
            raise ValueError(f"device {dev.name}: 1.34 layout needs one counter set per device")
        set_name = dev.consumes_counters[0][0]
        if set_name not in by_set:
            raise ValueError(f"device {dev.name}: counter set {set_name} is not in the model")
        by_set[set_name].append(dev)
    out: list[Chunk] = []
    for cs in model.counter_sets:
        consumers = by_set[cs.name]
        if len(consumers) > MAX_DEVICES:
            raise ValueError(
                f"counter set {cs.name}: {len(consumers)} consuming devices do not fit one 1.34"
                f" slice ({MAX_DEVICES} at most); publish with --kube-layout 1.35, where they"
                " may span slices"
            )
        consumed = sum(len(c) for d in consumers for _, c in d.consumes_counters)
        if consumed > MAX_DEVICE_COUNTERS_PER_SLICE:
            raise ValueError(
                f"counter set {cs.name}: its devices consume {consumed} counters, more than one"
                f" 1.34 slice holds ({MAX_DEVICE_COUNTERS_PER_SLICE}); publish with"
                " --kube-layout 1.35"
            )
        out.append(((cs,), tuple(consumers)))
    out += [(None, devs) for devs in _chunks(plain, MAX_DEVICES)]
    return out


def build_slices(model: DeviceModel, policy: SlicePolicy, generation: int) -> list[dict[str, Any]]:
    """All slices of the node's pool at ``generation``, in a deterministic order."""
    if policy.layout not in LAYOUTS:
        raise ValueError(f"layout {policy.layout!r}: expected one of {', '.join(LAYOUTS)}")
    if generation < 0:
        raise ValueError(f"generation {generation} must be >= 0")
    chunks = _layout_134(model) if policy.layout == "1.34" else _layout_135(model)
    if not chunks:
        chunks = [(None, ())]
    metadata_extra: dict[str, Any] = {"labels": {MANAGED_BY_LABEL: MANAGED_BY}}
    if policy.node_uid:
        metadata_extra["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "name": policy.node_name,
                "uid": policy.node_uid,
                "controller": True,
            }
        ]
    slices = []
    for index, (sets, devices) in enumerate(chunks):
        spec: dict[str, Any] = {
            "driver": policy.driver_name,
            "nodeName": policy.node_name,
            "pool": {
                "name": policy.node_name,
                "generation": generation,
                "resourceSliceCount": len(chunks),
            },
        }
        if devices is not None:
            spec["devices"] = [d.api() for d in devices]
        if sets is not None:
            spec["sharedCounters"] = [cs.api() for cs in sets]
        slices.append(
            {
                "apiVersion": API_VERSION,
                "kind": "ResourceSlice",
                "metadata": {"name": slice_name(policy, index), **metadata_extra},
                "spec": spec,
            }
        )
    return slices


def _normalized(value: Any) -> Any:
    """Drop what the API server omits (None, empty lists and maps) and compare Quantities by
    value, so a stored object (``"1k"``) equals the one we built (``"1000"``)."""
    if isinstance(value, Mapping):
        if set(value) == {"value"}:
            q = parse_quantity(value["value"])
            if q is not None:
                return {"value": Decimal(q).normalize()}
        out = {k: _normalized(v) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not None and v != {} and v != []}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


def _owned(obj: Mapping[str, Any]) -> Any:
    metadata = obj.get("metadata") or {}
    spec = dict(obj.get("spec") or {})
    pool = dict(spec.get("pool") or {})
    pool.pop("generation", None)
    spec["pool"] = pool
    owner_fields = ("apiVersion", "kind", "name", "uid", "controller")
    owners = [
        {k: o.get(k) for k in owner_fields if o.get(k) is not None}
        for o in metadata.get("ownerReferences") or []
    ]
    return _normalized(
        {
            "name": metadata.get("name"),
            "labels": metadata.get("labels") or {},
            "ownerReferences": owners,
            "spec": spec,
        }
    )


def spec_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two slices agree on what we own: metadata name, labels and ownerReferences, and the
    spec apart from ``pool.generation``; server-set metadata is ignored."""
    return bool(_owned(a) == _owned(b))
