"""Which nodes look the same to the claims being explained: read once, grouped, one evaluated.

A cluster's nodes are mostly alike: the same model publishes the same devices, attributes,
capacity and counters, and differs only in what names the node (node name, pool name, slice
names, the pool's generation) and in attributes that identify a device (UUIDs, PCI bus IDs).
The allocator's answer for a node depends only on what its claims read, so nodes whose slices
are equal once everything the claims cannot read is set aside get the same answer, up to those
names: ``explain`` evaluates the first node of each group and renames the answer for the others
(:mod:`dra_driver.scheduler.relabel`).

What the claims read (:func:`reads_of`): every attribute name a request's selector, its class's
selectors (the memo keys of :class:`~dra_driver.scheduler.cel.selector.Selector`, ``reads``) or
a constraint (``matchAttribute``, ``distinctAttribute``) names. A selector that reads the device
some other way (a comprehension over its attributes, a computed key) reads everything: nothing
is set aside then. An attribute no claim reads is set aside only as far as its value goes: its
name and type stay in the shape (a selector's ``in`` test and CEL's conversion of the device,
which fails on a value of no known type or a bad version, see them; a version attribute is kept
whole). CEL sees no node, pool or slice name at all.

Exact, not approximate: a node stands alone (evaluated on its own slices, as without grouping)
unless every slice it sees is its own (``spec.nodeName``, no per-device node selection, no
allNodes or nodeSelector slice applies to it), each of its pools is complete, of one generation
and held by no other node, and no allocated claim holds a device of its pools. The shape of each
slice is a digest of its spec with the names above dropped and the unread values blanked
(orjson encodes it; blake2b digests it): equal digests, equal slices for the claims.

Memory stays bounded while slices are read page by page: :class:`SliceIndex` keeps each slice's
bytes (orjson, re-encoded: decoded again only for the nodes evaluated) and a small record, never
the decoded pages.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from dra_driver.scheduler.domain import (
    InputError,
    QuantityReader,
    parse_claim,
    parse_classes,
)
from dra_driver.scheduler.node_reach import node_slices

if TYPE_CHECKING:  # imported by the caller when it evaluates: the CEL libraries are slow to load
    from dra_driver.scheduler.celenv import CelEnvironment

SIMPLE_TYPES = frozenset(("string", "int", "bool"))
"""Attribute types whose value never makes the device's CEL conversion fail."""
MAX_KEY_SETS = 4096
"""Sets of attribute names a Shaper remembers before it starts over."""


@dataclass(frozen=True)
class Reads:
    """The attribute names the claims (and their classes) read; ``everything`` when one
    selector reads the device as a whole."""

    names: frozenset[str] = frozenset()
    everything: bool = False

    def blanks(self, key: str) -> bool:
        """Whether attribute ``key`` (bare or ``domain/name``) is read by nobody. Names are
        compared without their domain: an attribute read in any domain is kept in all."""
        return not self.everything and key.rpartition("/")[2] not in self.names


EVERYTHING = Reads(everything=True)


def reads_of(
    claims: Iterable[Mapping[str, Any]], classes: Sequence[Mapping[str, Any]], cel: CelEnvironment
) -> Reads:
    """What ``claims`` read of a device. Malformed claims or classes, or a selector that does
    not compile, read everything (nothing is grouped; ``explain`` then reports the error)."""
    names: set[str] = set()
    try:
        parsed_classes = parse_classes(classes)
        for obj in claims:
            claim = parse_claim(obj, QuantityReader())
            names.update(c.attribute.rpartition("/")[2] for c in claim.constraints)
            for group in claim.requests:
                for req in group.alternatives:
                    cls = parsed_classes.get(req.class_name)
                    specs = (*(cls.selectors if cls else ()), *req.selectors)
                    for spec in specs:
                        reads = cel.compile(spec.expression).reads
                        if reads is None:
                            return EVERYTHING
                        names.update(k[-1] for k in reads if "attributes" in k[:2])
    except ValueError:  # InputError, CelCompileError
        return EVERYTHING
    return Reads(frozenset(names))


class Shaper:
    """Computes slice shapes for one ``Reads``; remembers, per set of attribute names, which
    ones are blanked (a node's devices share a few such sets)."""

    def __init__(self, reads: Reads) -> None:
        self.reads = reads
        self._blanked: dict[tuple[str, ...], tuple[str, ...]] = {}

    def _device(self, device: Any) -> Any:
        attributes = device.get("attributes") if type(device) is dict else None
        if type(attributes) is not dict:
            return device
        keys = tuple(attributes)
        blank = self._blanked.get(keys)
        if blank is None:
            if len(self._blanked) >= MAX_KEY_SETS:
                self._blanked.clear()
            blank = self._blanked[keys] = tuple(k for k in keys if self.reads.blanks(k))
        if not blank:
            return device
        shaped = dict(attributes)
        for key in blank:
            value = shaped[key]
            if type(value) is dict and len(value) == 1:
                kind = next(iter(value))
                if kind in SIMPLE_TYPES:
                    shaped[key] = kind  # the type, not the value
        return {**device, "attributes": shaped}

    def digest(self, spec: Mapping[str, Any]) -> bytes:
        """The digest of a slice's spec as the claims see it (names dropped, unread values
        blanked); equal digests, equal devices, counters and capacity for the claims."""
        pool = spec.get("pool")
        shape = {k: v for k, v in spec.items() if k not in ("nodeName", "pool", "devices")}
        if isinstance(pool, dict):
            shape["pool"] = {k: v for k, v in pool.items() if k not in ("name", "generation")}
        devices = spec.get("devices")
        shape["devices"] = [self._device(d) for d in devices] if type(devices) is list else devices
        try:
            data = orjson.dumps(shape)
        except (orjson.JSONEncodeError, TypeError):  # an integer beyond 64 bits, from YAML
            data = json.dumps(shape, default=str).encode()
        return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(frozen=True)
class SliceRecord:
    """One slice as read: its bytes, its shape, and the names the shape leaves out."""

    raw: bytes
    shape: bytes
    name: str
    driver: str
    pool: str
    generation: Any
    node: str | None
    """spec.nodeName, when the slice is the node's own (None: allNodes, nodeSelector or
    per-device node selection; such slices are matched per node, ``node_reach.node_slices``)."""
    node_names: tuple[str, ...] = ()
    """The node names it names (spec.nodeName or its devices' nodeName)."""


def _encode(obj: Mapping[str, Any]) -> bytes:
    try:
        return orjson.dumps(obj)
    except (orjson.JSONEncodeError, TypeError):  # integers beyond 64 bits, from YAML files
        return json.dumps(obj).encode()


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        value: dict[str, Any] = orjson.loads(raw)
    except orjson.JSONDecodeError:  # written by json.dumps: integers beyond 64 bits
        value = json.loads(raw)
    return value


@dataclass
class SliceIndex:
    """Every slice read, as records; fed one slice at a time (``add``), pages discarded."""

    reads: Reads
    records: list[SliceRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._shaper = Shaper(self.reads)

    def add(self, obj: Mapping[str, Any]) -> None:
        spec = obj.get("spec")
        spec = spec if isinstance(spec, dict) else {}
        meta = obj.get("metadata")
        pool = spec.get("pool")
        pool = pool if isinstance(pool, dict) else {}
        per_device = bool(spec.get("perDeviceNodeSelection"))
        node = spec.get("nodeName") if isinstance(spec.get("nodeName"), str) else None
        names = [node] if node else []
        if per_device:
            names += [
                d["nodeName"]
                for d in spec.get("devices") or ()
                if isinstance(d, dict) and isinstance(d.get("nodeName"), str)
            ]
        self.records.append(
            SliceRecord(
                raw=_encode(obj),
                shape=self._shaper.digest(spec),
                name=str((meta or {}).get("name", "")) if isinstance(meta, dict) else "",
                driver=str(spec.get("driver", "")),
                pool=str(pool.get("name", "")),
                generation=pool.get("generation", 0),
                node=None if per_device else node,
                node_names=tuple(names),
            )
        )

    def for_node(self, name: str) -> list[SliceRecord]:
        """The slices that may apply to node ``name``, in the order read: its own, every slice
        not tied to one node, and every slice of a pool among those (a counter slice goes
        with its pool); ``node_reach.node_slices`` then picks exactly."""
        near = [r for r in self.records if r.node == name or r.node is None]
        pools = {(r.driver, r.pool) for r in near}
        return [
            r
            for r in self.records
            if r.node == name or r.node is None or (r.driver, r.pool) in pools
        ]

    def node_names(self) -> list[str]:
        """The node names the slices name, sorted (``node_reach.slice_nodes``)."""
        return sorted({n for r in self.records for n in r.node_names})

    def slices(self, records: Iterable[SliceRecord] | None = None) -> list[dict[str, Any]]:
        """The slices as read (of ``records``, or all), decoded again."""
        return [_decode(r.raw) for r in (self.records if records is None else records)]


@dataclass(frozen=True)
class PoolLabel:
    driver: str
    name: str
    generation: Any
    slices: tuple[str, ...]
    """Slice names, sorted (the order of the pool's devices)."""


@dataclass(frozen=True)
class NodeLabel:
    """The names a node's answer carries that its group's shape leaves out."""

    node: str
    pools: tuple[PoolLabel, ...]
    """In the allocator's order: by driver, then pool name."""


@dataclass
class Group:
    """Nodes with one answer up to their names; ``members[0]`` is evaluated. ``labels`` is
    empty for a node that stands alone."""

    members: list[str]
    labels: dict[str, NodeLabel] = field(default_factory=dict)


def _held_pools(allocated: Sequence[Mapping[str, Any]]) -> set[tuple[Any, Any]]:
    """(driver, pool) of every device an allocated claim holds (its results, as written)."""
    held: set[tuple[Any, Any]] = set()
    for claim in allocated:
        status = claim.get("status")
        allocation = status.get("allocation") if isinstance(status, dict) else None
        devices = allocation.get("devices") if isinstance(allocation, dict) else None
        results = devices.get("results") if isinstance(devices, dict) else None
        for r in results if isinstance(results, list) else ():
            if isinstance(r, dict):
                held.add((r.get("driver"), r.get("pool")))
    return held


def plan(
    index: SliceIndex,
    names: Sequence[str],
    nodes: Mapping[str, Mapping[str, Any]],
    allocated: Sequence[Mapping[str, Any]],
) -> list[Group]:
    """The groups of ``names`` (in the order of their first member), each node in one."""
    shared = [r for r in index.records if r.node is None]
    shared_slices = index.slices(shared)
    by_pool: dict[tuple[str, str], list[SliceRecord]] = {}
    own: dict[str, list[SliceRecord]] = {}
    for r in index.records:
        by_pool.setdefault((r.driver, r.pool), []).append(r)
        if r.node is not None:
            own.setdefault(r.node, []).append(r)
    held = _held_pools(allocated)
    groups: dict[Any, Group] = {}
    for name in names:
        key, label = _fingerprint(name, own.get(name, []), by_pool, held)
        if key is not None and shared_slices:
            node = nodes.get(name, {"metadata": {"name": name}})
            if node_slices(shared_slices, node):
                key = None
        group = groups.setdefault(key if key is not None else ("alone", name), Group([]))
        group.members.append(name)
        if key is not None and label is not None:
            group.labels[name] = label
    return list(groups.values())


def _fingerprint(
    name: str,
    records: list[SliceRecord],
    by_pool: Mapping[tuple[str, str], list[SliceRecord]],
    held: set[tuple[Any, Any]],
) -> tuple[Any, NodeLabel | None]:
    """The node's group key and labels, or (None, None) when it must stand alone."""
    if not records:
        return None, None
    pools = sorted({(r.driver, r.pool) for r in records})
    key: list[Any] = []
    labels = []
    for pool in pools:
        members = by_pool[pool]
        if pool in held or any(r.node != name for r in members):
            return None, None
        generations = {json.dumps(r.generation) for r in members}
        if len(generations) != 1:
            return None, None
        ordered = sorted(members, key=lambda r: r.name)
        slice_names = tuple(r.name for r in ordered)
        if "" in slice_names or len(set(slice_names)) != len(slice_names):
            return None, None
        key.append((pool[0], tuple(r.shape for r in ordered)))
        labels.append(PoolLabel(pool[0], pool[1], members[0].generation, slice_names))
    return tuple(key), NodeLabel(name, tuple(labels))


__all__ = [
    "EVERYTHING",
    "Group",
    "InputError",
    "NodeLabel",
    "PoolLabel",
    "Reads",
    "Shaper",
    "SliceIndex",
    "SliceRecord",
    "plan",
    "reads_of",
]
