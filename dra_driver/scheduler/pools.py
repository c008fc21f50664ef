"""ResourceSlices and allocated claims as the allocator reads them, parsed from
resource.k8s.io/v1 API dicts (the claims' side is :mod:`dra_driver.scheduler.domain`).

A malformed field raises ``InputError`` (:class:`agent.decode.fields.FieldError`) with its path
(``ResourceSlice s.spec.pool.resourceSliceCount: must be >= 1, got 0``). Field names, defaults and
limits are those of k8s.io/api ``resource/v1/types.go`` (ResourceSlice, Device, CounterSet,
DeviceCapacity, CapacityRequestPolicy, AllocationResult).

Pools follow k8s.io/dynamic-resource-allocation ``structured/internal/incubating/
pools_incubating.go`` (GatherPools, addSlice, buildPool): slices are grouped by (driver, pool);
only the newest generation counts; a pool with fewer slices of that generation than
``resourceSliceCount`` is incomplete and nothing is allocated from it; duplicate device names,
duplicate counter sets and consumed counters that no counter set defines make a pool invalid.
Pools are ordered by driver then name, slices by name, devices as listed (the first-fit order).

Allocated claims follow kubernetes ``pkg/scheduler/framework/plugins/dynamicresources/
allocateddevices.go`` (foreachAllocatedDevice): a result with ``adminAccess`` is not an
allocation; one with a ``shareID`` is a share of a device that allows multiple allocations (its
``consumedCapacity`` adds up per device); any other result takes the whole device.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.decode import fields
from dra_driver.errors import QuantityError
from dra_driver.quantity import Quantity, parse_quantity
from dra_driver.scheduler import slice_layout
from dra_driver.scheduler.versions import (
    CONSUMABLE_CAPACITY,
    DEVICE_TAINTS,
    PARTITIONABLE_DEVICES,
    Scheduler,
)

ATTRIBUTE_TYPES = ("string", "int", "bool", "version")
"""The value fields of a DeviceAttribute; exactly one is set."""

AttributeValue = tuple[str, object]
"""An attribute's type and value: ``("string", "clique-0")``, ``("int", 3)``; equal only when
both are (matchAttribute compares type and value, constraint.go)."""


InputError = fields.FieldError
"""Malformed input: ``path`` is the offending field (``spec.devices.requests[0].name``),
``message`` what is wrong with it, the value and what is allowed."""


class QuantityReader:
    """Parses quantities, each distinct text once per call (slices repeat ``"1"``, ``"0"``)."""

    def __init__(self) -> None:
        self._cache: dict[str, Quantity] = {}

    def __call__(self, value: object, path: str) -> Quantity:
        text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(text, str):
            raise fields.expected("a quantity (e.g. 4Gi)", value, path)
        q = self._cache.get(text)
        if q is None:
            try:
                q = parse_quantity(text)
            except QuantityError as e:
                raise InputError(path, str(e)) from None
            self._cache[text] = q
        return q


# -- resource slices --------------------------------------------------------------------------


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str
    any_effect_blocks: bool = False
    """1.34: every taint must be tolerated, whatever its effect (allTaintsTolerated)."""

    def blocks(self) -> bool:
        """Only NoSchedule and NoExecute keep a device from being allocated; None and unknown
        effects are ignored (1.35: taintPreventsAllocation, incubating/allocator_incubating.go);
        in 1.34 every taint does (``any_effect_blocks``)."""
        return self.any_effect_blocks or self.effect in ("NoSchedule", "NoExecute")

    def __str__(self) -> str:
        return (
            f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"
        )


@dataclass(frozen=True)
class RequestPolicy:
    """CapacityRequestPolicy: ``default``, ``validValues`` (ascending) or ``validRange``."""

    default: Quantity | None
    valid_values: tuple[Quantity, ...]
    range_min: Quantity | None
    range_max: Quantity | None
    range_step: Quantity | None
    has_range: bool


@dataclass(frozen=True)
class Capacity:
    value: Quantity
    policy: RequestPolicy | None


@dataclass(frozen=True)
class CounterUse:
    counter_set: str
    counters: Mapping[str, Quantity]


@dataclass(eq=False)
class Device:
    """One device of a ResourceSlice. ``index`` is its position in ``Node.devices``."""

    index: int
    driver: str
    pool: str
    slice_name: str
    name: str
    raw_attributes: Mapping[str, Mapping[str, Any]]
    raw_capacity: Mapping[str, Mapping[str, Any]]
    raw_consumes: Sequence[Any]
    quantities: QuantityReader
    allow_multiple: bool
    taints: tuple[Taint, ...]
    path: str
    pool_index: int = -1
    node_name: str = ""
    """The slice's spec.nodeName (empty for allNodes or nodeSelector slices)."""
    counter_slice: str = ""
    """Whose counter sets the device draws on: "" its pool's (1.35), else its own slice's
    (1.34, checkAvailableCounters)."""
    unallocatable: str | None = None
    """Why the modelled scheduler never allocates this device, whatever the claim (a device
    that consumes counters with DRAPartitionableDevices off); None when it may."""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)

    # Counters are parsed when first needed: most devices of a node never pass the selectors,
    # and a node has thousands of them (a malformed one still raises InputError with its path,
    # when the allocator looks at that device). Capacity is parsed with the slice.
    @functools.cached_property
    def capacity(self) -> Mapping[str, Capacity]:
        q, out = self.quantities, {}
        for cname, cap in self.raw_capacity.items():
            cp = f"{self.path}.capacity.{cname}"
            cap = fields.obj(cap, cp)
            out[cname] = Capacity(
                q(cap.get("value"), f"{cp}.value"),
                _policy(cap.get("requestPolicy"), f"{cp}.requestPolicy", q),
            )
        return out

    @functools.cached_property
    def consumes(self) -> tuple[CounterUse, ...]:
        q, out = self.quantities, []
        for i, use in enumerate(self.raw_consumes):
            up = f"{self.path}.consumesCounters[{i}]"
            use = fields.obj(use, up)
            counters = {
                cname: q(
                    fields.obj(c, f"{up}.counters.{cname}").get("value"),
                    f"{up}.counters.{cname}.value",
                )
                for cname, c in fields.obj(use.get("counters"), f"{up}.counters").items()
            }
            out.append(
                CounterUse(
                    fields.text(use.get("counterSet"), f"{up}.counterSet", nonempty=True), counters
                )
            )
        return tuple(out)

    def counter_refs(self) -> list[tuple[str, list[str]]]:
        """(counter set, counter names) this device consumes, without parsing the amounts."""
        out = []
        for i, use in enumerate(self.raw_consumes):
            up = f"{self.path}.consumesCounters[{i}]"
            use = fields.obj(use, up)
            names = list(fields.obj(use.get("counters"), f"{up}.counters"))
            out.append(
                (fields.text(use.get("counterSet"), f"{up}.counterSet", nonempty=True), names)
            )
        return out

    def attribute(self, qualified: str) -> AttributeValue | None:
        """lookupAttribute (incubating/allocator_incubating.go): the fully qualified name as
        written, else, when its domain is the driver's, the bare name."""
        raw = self.raw_attributes.get(qualified)
        if raw is None:
            domain, _, bare = qualified.partition("/")
            if domain != self.driver:
                return None
            raw = self.raw_attributes.get(bare)
            if raw is None:
                return None
        for t in ATTRIBUTE_TYPES:
            if t in raw:
                return (t, raw[t])
        return None


@dataclass
class Pool:
    driver: str
    name: str
    generation: int
    slice_count: int
    slices: list[str]
    """Names of this generation's slices that were given."""
    devices: list[Device] = field(default_factory=list)
    counters: dict[str, dict[str, Quantity]] = field(default_factory=dict)
    """Counter set -> counter -> value, from the slices' sharedCounters (1.35: the pool's)."""
    slice_counters: dict[str, dict[str, dict[str, Quantity]]] = field(default_factory=dict)
    """1.34: slice name -> its own counter sets (a device draws on its slice's only)."""
    stale_slices: int = 0
    """Slices of an older generation, ignored."""
    problem: str | None = None
    """Why nothing can be allocated from this pool (incomplete, invalid); None when usable."""
    incomplete: bool = False

    @property
    def ref(self) -> str:
        return f"{self.driver}/{self.name}"


_VALUE_TYPES = {"string": str, "int": int, "bool": bool, "version": str}
"""DeviceAttribute's values (k8s.io/api resource/v1 types.go): *string, *int64, *bool, *string."""
_INT64 = range(-(2**63), 2**63)


def _attributes(value: object, path: str) -> Mapping[str, Mapping[str, Any]]:
    attrs = fields.obj(value, path, optional=True)
    for name, attr in attrs.items():
        if type(attr) is dict and len(attr) == 1:
            ((kind, v),) = attr.items()
            if type(v) is _VALUE_TYPES.get(kind) and (type(v) is not int or v in _INT64):
                continue  # the common case, checked without building a message
        if not isinstance(attr, Mapping):
            raise InputError(f"{path}.{name}", f"expected an object, got {fields.got(attr)}")
        set_ = [t for t in ATTRIBUTE_TYPES if t in attr]
        if len(set_) != 1 or len(attr) != 1:
            raise InputError(
                f"{path}.{name}", f"must set exactly one of {', '.join(ATTRIBUTE_TYPES)}"
            )
        kind, p = set_[0], f"{path}.{name}.{set_[0]}"  # a value the apiserver would refuse:
        if kind == "int":
            fields.integer(attr[kind], p, low=_INT64.start, high=_INT64.stop - 1)
        elif kind == "bool":
            fields.flag(attr[kind], p, default=None)
        else:
            fields.text(attr[kind], p)
    return attrs


def _policy(value: object, path: str, q: QuantityReader) -> RequestPolicy | None:
    if value is None:
        return None
    p = fields.obj(value, path)
    default = q(p["default"], f"{path}.default") if p.get("default") is not None else None
    values = tuple(
        q(v, f"{path}.validValues[{i}]")
        for i, v in enumerate(fields.items(p.get("validValues"), path))
    )
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise InputError(f"{path}.validValues", "must be in ascending order without duplicates")
    rng = p.get("validRange")
    lo = hi = step = None
    if rng is not None:
        r = fields.obj(rng, f"{path}.validRange")
        if r.get("min") is None:
            raise InputError(f"{path}.validRange.min", "is required")
        lo = q(r["min"], f"{path}.validRange.min")
        hi = q(r["max"], f"{path}.validRange.max") if r.get("max") is not None else None
        step = q(r["step"], f"{path}.validRange.step") if r.get("step") is not None else None
        if step is not None and step.value() <= 0:
            raise InputError(f"{path}.validRange.step", f"must be positive, got {step}")
    if values and rng is not None:
        raise InputError(path, "must not set both validValues and validRange")
    return RequestPolicy(default, values, lo, hi, step, rng is not None)


def _device(
    obj: object,
    path: str,
    driver: str,
    pool: str,
    slice_name: str,
    q: QuantityReader,
    index: int,
    scheduler: Scheduler,
) -> Device:
    """One device as ``scheduler`` reads it (taints, shared allocation, counters)."""
    d = fields.obj(obj, path)
    name = fields.text(d.get("name"), f"{path}.name", nonempty=True)
    raw_capacity = fields.obj(d.get("capacity"), f"{path}.capacity", optional=True)
    taints = []
    for i, t in enumerate(fields.items(d.get("taints"), f"{path}.taints")):
        tp = f"{path}.taints[{i}]"
        t = fields.obj(t, tp)
        taints.append(
            Taint(
                fields.text(t.get("key"), f"{tp}.key", nonempty=True),
                (fields.opt_text(t.get("value"), f"{tp}.value") or ""),
                fields.text(t.get("effect"), f"{tp}.effect", nonempty=True),
                scheduler.every_taint_blocks,
            )
        )
    if not scheduler.enabled(DEVICE_TAINTS):
        taints = []  # allocateDevice checks taints only with DRADeviceTaints on
    consumes = fields.items(d.get("consumesCounters"), f"{path}.consumesCounters")
    unallocatable = None
    if consumes and not scheduler.enabled(PARTITIONABLE_DEVICES):
        unallocatable = (
            f"consumes counters, and with {PARTITIONABLE_DEVICES} off the Kubernetes"
            f" {scheduler.version} scheduler never allocates such a device"
        )
    multiple = fields.flag(d.get("allowMultipleAllocations"), f"{path}.allowMultipleAllocations")
    return Device(
        index=index,
        driver=driver,
        pool=pool,
        slice_name=slice_name,
        name=name,
        raw_attributes=_attributes(d.get("attributes"), f"{path}.attributes"),
        raw_capacity=raw_capacity,
        raw_consumes=consumes,
        quantities=q,
        # without DRAConsumableCapacity the incubating allocator knows no shared devices: every
        # device is allocated whole
        allow_multiple=multiple and scheduler.enabled(CONSUMABLE_CAPACITY),
        taints=tuple(taints),
        path=path,
        counter_slice=slice_name if scheduler.counters_per_slice else "",
        unallocatable=unallocatable,
    )


@dataclass
class Node:
    """The pools a node sees, in first-fit order, and their devices (``devices[i].index == i``;
    devices of pools with a problem are kept, for the explanation, but never allocated)."""

    pools: list[Pool]
    devices: list[Device]
    by_key: dict[tuple[str, str, str], Device]
    ignored: list[str] = field(default_factory=list)
    """Slices, or slices' devices, the modelled scheduler does not read, and why
    (:mod:`dra_driver.scheduler.slice_layout`)."""


def parse_slices(
    slices: Sequence[Mapping[str, Any]], q: QuantityReader, scheduler: Scheduler | None = None
) -> Node:
    """One node's slices as ``scheduler`` (default: the newest version, :class:`Scheduler`
    ``.of()``) gathers them into pools."""
    scheduler = scheduler or Scheduler.of()
    partitionable = scheduler.enabled(PARTITIONABLE_DEVICES)
    by_pool, stale = slice_layout.group(slices, scheduler)
    pools: list[Pool] = []
    devices: list[Device] = []
    ignored: list[str] = []
    for driver, pname in sorted(by_pool):
        entries = sorted(by_pool[(driver, pname)], key=lambda e: e[1])
        gen, count = entries[0][2], entries[0][3]
        counted = slice_layout.counted(entries, scheduler)
        pool = Pool(
            driver,
            pname,
            gen,
            count,
            [e[1] for e in entries],
            stale_slices=stale.get((driver, pname), 0),
        )
        pool_index = len(pools)
        pools.append(pool)
        if len(counted) != count:
            pool.incomplete = True
            pool.problem = (
                f"pool {pool.ref} is incomplete: {len(counted)} of {count} slices of"
                f" generation {gen} (the driver is updating it; nothing is allocated from it"
                " meanwhile)"
            )
        names: set[str] = set()
        for spec, sname, _, _, skip in entries:
            if skip is not None:
                ignored.append(skip)
                continue
            base = f"ResourceSlice {sname}.spec"
            if partitionable:
                sets, twice = slice_layout.counter_sets(spec, base, q)
                into = pool.counters
                if scheduler.counters_per_slice:
                    into = pool.slice_counters.setdefault(sname, {})
                for cs_name, counters in sets:
                    if (cs_name in into or twice) and pool.problem is None:
                        pool.problem = (
                            f"pool {pool.ref} is invalid: duplicate counter set {twice or cs_name}"
                        )
                    into[cs_name] = counters
            why = slice_layout.devices_ignored(spec, sname, scheduler)
            if why is not None:
                ignored.append(why)
                continue
            for j, raw in enumerate(fields.items(spec.get("devices"), f"{base}.devices")):
                dev = _device(
                    raw, f"{base}.devices[{j}]", driver, pname, sname, q, len(devices), scheduler
                )
                dev.pool_index = pool_index
                _ = dev.capacity  # the CEL view reads it: a malformed value is an InputError
                dev.node_name = spec.get("nodeName") or ""
                if dev.name in names and pool.problem is None:
                    pool.problem = f"pool {pool.ref} is invalid: duplicate device name {dev.name}"
                names.add(dev.name)
                pool.devices.append(dev)
                devices.append(dev)
        if pool.problem is None and partitionable and not scheduler.counters_per_slice:
            pool.problem = slice_layout.invalid_consumption(pool.ref, pool.devices, pool.counters)
    by_key: dict[tuple[str, str, str], Device] = {}
    for dev in devices:
        by_key.setdefault(dev.key, dev)
    return Node(pools, devices, by_key, ignored)
