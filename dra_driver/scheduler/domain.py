"""The allocator's domain types, parsed from resource.k8s.io/v1 API dicts.

Everything the search needs is checked here, once: a malformed field raises ``InputError`` with
its path (``spec.devices.requests[1].exactly.count: must be >= 1, got 0``). Field names, defaults
and limits are those of k8s.io/api ``resource/v1/types.go`` (ResourceClaimSpec, DeviceRequest,
ExactDeviceRequest, DeviceSubRequest, DeviceConstraint, DeviceToleration, ResourceSlice, Device,
CounterSet, DeviceCapacity, CapacityRequestPolicy, AllocationResult).

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

import enum
import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dra_driver.errors import QuantityError
from dra_driver.quantity import Quantity, parse_quantity

MAX_RESULTS = 32
"""resourceapi.AllocationResultsMaxSize: the most devices one claim's allocation may hold."""

ATTRIBUTE_TYPES = ("string", "int", "bool", "version")
"""The value fields of a DeviceAttribute; exactly one is set."""

_ATTRIBUTE_TYPE_SET = frozenset(ATTRIBUTE_TYPES)
AttributeValue = tuple[str, object]
"""An attribute's type and value: ``("string", "clique-0")``, ``("int", 3)``; equal only when
both are (matchAttribute compares type and value, constraint.go)."""


class InputError(ValueError):
    """Malformed input: ``path`` is the offending field (``spec.devices.requests[0].name``),
    ``message`` what is wrong with it, the value and what is allowed."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class Mode(enum.Enum):
    EXACT_COUNT = "ExactCount"
    ALL = "All"


# -- small readers ---------------------------------------------------------------------------


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _mapping(value: object, path: str, *, optional: bool = False) -> Mapping[str, Any]:
    if type(value) is dict:  # the common case, without the ABC check's cost
        return value
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        raise InputError(path, f"must be an object, got {_show(value)}")
    return value


def _list(value: object, path: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise InputError(path, f"must be a list, got {_show(value)}")
    return value


def _string(value: object, path: str, *, required: bool = True) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value):
        raise InputError(path, f"must be a non-empty string, got {_show(value)}")
    return value


def _bool(value: object, path: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InputError(path, f"must be true or false, got {_show(value)}")
    return value


def _int(value: object, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(path, f"must be an integer, got {_show(value)}")
    return value


class QuantityReader:
    """Parses quantities, each distinct text once per call (slices repeat ``"1"``, ``"0"``)."""

    def __init__(self) -> None:
        self._cache: dict[str, Quantity] = {}

    def __call__(self, value: object, path: str) -> Quantity:
        text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(text, str):
            raise InputError(path, f"must be a quantity (e.g. 4Gi), got {_show(value)}")
        q = self._cache.get(text)
        if q is None:
            try:
                q = parse_quantity(text)
            except QuantityError as e:
                raise InputError(path, str(e)) from None
            self._cache[text] = q
        return q


# -- device classes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SelectorSpec:
    expression: str
    path: str
    """Where the expression is written, for errors (``spec.selectors[0].cel.expression``)."""


@dataclass(frozen=True)
class DeviceClass:
    name: str
    selectors: tuple[SelectorSpec, ...]
    config: tuple[Mapping[str, Any], ...] = ()
    """spec.config entries, copied into the allocation (they do not affect the choice)."""


def _selectors(value: object, path: str) -> tuple[SelectorSpec, ...]:
    out = []
    for i, item in enumerate(_list(value, path)):
        p = f"{path}[{i}]"
        cel = _mapping(_mapping(item, p).get("cel"), f"{p}.cel")
        out.append(SelectorSpec(_string(cel.get("expression"), f"{p}.cel.expression"), p))
    return tuple(out)


def parse_classes(classes: Sequence[Mapping[str, Any]]) -> dict[str, DeviceClass]:
    out: dict[str, DeviceClass] = {}
    for i, obj in enumerate(classes):
        base = f"deviceClasses[{i}]"
        obj = _mapping(obj, base)
        name = _string(
            _mapping(obj.get("metadata"), f"{base}.metadata").get("name"), f"{base}.metadata.name"
        )
        base = f"DeviceClass {name}"
        if name in out:
            raise InputError(f"{base}.metadata.name", f"DeviceClass {name!r} is given twice")
        spec = _mapping(obj.get("spec"), f"{base}.spec", optional=True)
        config = tuple(
            _mapping(c, f"{base}.spec.config[{j}]")
            for j, c in enumerate(_list(spec.get("config"), f"{base}.spec.config"))
        )
        out[name] = DeviceClass(
            name, _selectors(spec.get("selectors"), f"{base}.spec.selectors"), config
        )
    return out


# -- claims -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Toleration:
    key: str
    operator: str  # "Equal" or "Exists"
    value: str
    effect: str  # "" (any), "NoSchedule", "NoExecute", "None"

    def tolerates(self, taint: Taint) -> bool:
        """resourceclaim.ToleratesTaint (k8s.io/dynamic-resource-allocation
        ``resourceclaim/devicetoleration.go``)."""
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        if self.operator == "Exists":
            return True
        return self.value == taint.value

    def __str__(self) -> str:
        op = "exists" if self.operator == "Exists" else f"={self.value}"
        return f"{self.key or '*'}{op}:{self.effect or '*'}"


@dataclass(frozen=True)
class Request:
    """One request to allocate: an ``exactly`` request or one subrequest of ``firstAvailable``."""

    name: str
    parent: str | None
    """The request a subrequest belongs to; None for ``exactly``."""
    class_name: str
    selectors: tuple[SelectorSpec, ...]
    mode: Mode
    count: int
    admin_access: bool
    tolerations: tuple[Toleration, ...]
    capacity: Mapping[str, Quantity]
    path: str

    @property
    def full_name(self) -> str:
        """The result's ``request``: ``req`` or ``req/sub``."""
        return f"{self.parent}/{self.name}" if self.parent else self.name

    @property
    def base_name(self) -> str:
        return self.parent or self.name


@dataclass(frozen=True)
class RequestGroup:
    """A claim's request: one alternative for ``exactly``, the subrequests in order for
    ``firstAvailable``."""

    name: str
    alternatives: tuple[Request, ...]
    first_available: bool


@dataclass(frozen=True)
class Constraint:
    kind: str  # "matchAttribute" or "distinctAttribute"
    attribute: str
    """A fully qualified attribute name, ``domain/name``."""
    requests: frozenset[str]
    """The requests it applies to (``req`` or ``req/sub``); empty: all."""
    path: str

    def applies_to(self, request: Request) -> bool:
        """matchAttributeConstraint.matches (incubating/allocator_incubating.go): a subrequest
        is named by its parent or by ``parent/sub``."""
        if not self.requests:
            return True
        return request.base_name in self.requests or request.full_name in self.requests

    def __str__(self) -> str:
        return f"{self.kind} {self.attribute}"


@dataclass(frozen=True)
class Claim:
    namespace: str
    name: str
    uid: str
    requests: tuple[RequestGroup, ...]
    constraints: tuple[Constraint, ...]
    config: tuple[tuple[tuple[str, ...], Mapping[str, Any]], ...] = ()
    """spec.devices.config: (requests it names, the entry), copied into the allocation."""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


_V1BETA1_FIELDS = ("deviceClassName", "selectors", "allocationMode", "count", "adminAccess")


def _tolerations(value: object, path: str) -> tuple[Toleration, ...]:
    out = []
    for i, item in enumerate(_list(value, path)):
        p = f"{path}[{i}]"
        t = _mapping(item, p)
        op = t.get("operator") or "Equal"
        if op not in ("Equal", "Exists"):
            raise InputError(f"{p}.operator", f"must be Equal or Exists, got {_show(op)}")
        key = _string(t.get("key"), f"{p}.key", required=False)
        value_ = _string(t.get("value"), f"{p}.value", required=False)
        if op == "Exists" and value_:
            raise InputError(f"{p}.value", "must be empty when operator is Exists")
        if not key and op != "Exists":
            raise InputError(f"{p}.operator", "must be Exists when key is empty")
        effect = _string(t.get("effect"), f"{p}.effect", required=False)
        if effect not in ("", "NoSchedule", "NoExecute", "None"):
            raise InputError(
                f"{p}.effect", f"must be NoSchedule, NoExecute or None, got {effect!r}"
            )
        out.append(Toleration(key, op, value_, effect))
    return tuple(out)


def _request(
    obj: Mapping[str, Any],
    path: str,
    name: str,
    parent: str | None,
    q: QuantityReader,
    *,
    admin_allowed: bool,
) -> Request:
    class_name = _string(obj.get("deviceClassName"), f"{path}.deviceClassName")
    mode_text = obj.get("allocationMode") or "ExactCount"
    try:
        mode = Mode(mode_text)
    except ValueError:
        raise InputError(
            f"{path}.allocationMode", f"must be ExactCount or All, got {_show(mode_text)}"
        ) from None
    count = 1
    if mode is Mode.EXACT_COUNT:
        if obj.get("count") is not None:
            count = _int(obj.get("count"), f"{path}.count")
            if count < 1:
                raise InputError(f"{path}.count", f"must be >= 1, got {count}")
    elif obj.get("count") is not None:
        raise InputError(f"{path}.count", "must not be set when allocationMode is All")
    admin = False
    if "adminAccess" in obj:
        if not admin_allowed:
            raise InputError(f"{path}.adminAccess", "subrequests have no adminAccess field")
        admin = _bool(obj.get("adminAccess"), f"{path}.adminAccess")
    capacity: dict[str, Quantity] = {}
    cap = _mapping(obj.get("capacity"), f"{path}.capacity", optional=True)
    for cname, cvalue in _mapping(
        cap.get("requests"), f"{path}.capacity.requests", optional=True
    ).items():
        qty = q(cvalue, f"{path}.capacity.requests.{cname}")
        if qty.sign() < 0:
            raise InputError(
                f"{path}.capacity.requests.{cname}", f"must not be negative, got {qty}"
            )
        capacity[cname] = qty
    return Request(
        name=name,
        parent=parent,
        class_name=class_name,
        selectors=_selectors(obj.get("selectors"), f"{path}.selectors"),
        mode=mode,
        count=count,
        admin_access=admin,
        tolerations=_tolerations(obj.get("tolerations"), f"{path}.tolerations"),
        capacity=capacity,
        path=path,
    )


def parse_claim(claim: Mapping[str, Any], q: QuantityReader) -> Claim:
    claim = _mapping(claim, "")
    meta = _mapping(claim.get("metadata"), "metadata", optional=True)
    spec = _mapping(claim.get("spec"), "spec")
    devices = _mapping(spec.get("devices"), "spec.devices", optional=True)
    groups: list[RequestGroup] = []
    names: set[str] = set()
    for i, item in enumerate(_list(devices.get("requests"), "spec.devices.requests")):
        path = f"spec.devices.requests[{i}]"
        req = _mapping(item, path)
        name = _string(req.get("name"), f"{path}.name")
        if name in names:
            raise InputError(f"{path}.name", f"request name {name!r} is used twice")
        names.add(name)
        stale = [f for f in _V1BETA1_FIELDS if f in req]
        if stale:
            raise InputError(
                f"{path}.{stale[0]}",
                "is a v1beta1 field; in resource.k8s.io/v1 it goes under `exactly`",
            )
        exactly, first = req.get("exactly"), req.get("firstAvailable")
        if (exactly is None) == (first is None):
            raise InputError(path, "must set exactly one of `exactly` and `firstAvailable`")
        if exactly is not None:
            r = _request(
                _mapping(exactly, f"{path}.exactly"),
                f"{path}.exactly",
                name,
                None,
                q,
                admin_allowed=True,
            )
            groups.append(RequestGroup(name, (r,), False))
            continue
        subs = _list(first, f"{path}.firstAvailable")
        if not subs:
            raise InputError(f"{path}.firstAvailable", "must list at least one subrequest")
        alternatives = []
        sub_names: set[str] = set()
        for j, sub in enumerate(subs):
            sp = f"{path}.firstAvailable[{j}]"
            sub = _mapping(sub, sp)
            sname = _string(sub.get("name"), f"{sp}.name")
            if sname in sub_names:
                raise InputError(f"{sp}.name", f"subrequest name {sname!r} is used twice")
            sub_names.add(sname)
            alternatives.append(_request(sub, sp, sname, name, q, admin_allowed=False))
        groups.append(RequestGroup(name, tuple(alternatives), True))
    known = set(names) | {a.full_name for g in groups for a in g.alternatives if a.parent}
    constraints = []
    for i, item in enumerate(_list(devices.get("constraints"), "spec.devices.constraints")):
        path = f"spec.devices.constraints[{i}]"
        c = _mapping(item, path)
        kinds = [k for k in ("matchAttribute", "distinctAttribute") if c.get(k) is not None]
        if len(kinds) != 1:
            raise InputError(path, "must set exactly one of matchAttribute and distinctAttribute")
        attribute = _string(c.get(kinds[0]), f"{path}.{kinds[0]}")
        if "/" not in attribute.strip("/"):
            raise InputError(
                f"{path}.{kinds[0]}",
                f"must be a fully qualified attribute name (domain/name), got {attribute!r}",
            )
        requests = []
        for j, item_name in enumerate(_list(c.get("requests"), f"{path}.requests")):
            rname = _string(item_name, f"{path}.requests[{j}]")
            if rname not in known:
                raise InputError(
                    f"{path}.requests[{j}]",
                    f"no request {rname!r} in this claim (requests: {', '.join(sorted(known))})",
                )
            requests.append(rname)
        constraints.append(Constraint(kinds[0], attribute, frozenset(requests), path))
    config = []
    for i, item in enumerate(_list(devices.get("config"), "spec.devices.config")):
        path = f"spec.devices.config[{i}]"
        c = _mapping(item, path)
        names_ = tuple(
            _string(r, f"{path}.requests[{j}]")
            for j, r in enumerate(_list(c.get("requests"), f"{path}.requests"))
        )
        for j, rname in enumerate(names_):
            if rname not in known:
                raise InputError(f"{path}.requests[{j}]", f"no request {rname!r} in this claim")
        config.append((names_, c))
    return Claim(
        namespace=_string(meta.get("namespace"), "metadata.namespace", required=False),
        name=_string(meta.get("name"), "metadata.name", required=False) or "(unnamed)",
        uid=_string(meta.get("uid"), "metadata.uid", required=False),
        requests=tuple(groups),
        constraints=tuple(constraints),
        config=tuple(config),
    )


# -- resource slices --------------------------------------------------------------------------


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str

    def blocks(self) -> bool:
        """Only NoSchedule and NoExecute keep a device from being allocated; None and unknown
        effects are ignored (taintPreventsAllocation, incubating/allocator_incubating.go)."""
        return self.effect in ("NoSchedule", "NoExecute")

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
            cap = _mapping(cap, cp)
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
            use = _mapping(use, up)
            counters = {
                cname: q(
                    _mapping(c, f"{up}.counters.{cname}").get("value"),
                    f"{up}.counters.{cname}.value",
                )
                for cname, c in _mapping(use.get("counters"), f"{up}.counters").items()
            }
            out.append(CounterUse(_string(use.get("counterSet"), f"{up}.counterSet"), counters))
        return tuple(out)

    def counter_refs(self) -> list[tuple[str, list[str]]]:
        """(counter set, counter names) this device consumes, without parsing the amounts."""
        out = []
        for i, use in enumerate(self.raw_consumes):
            up = f"{self.path}.consumesCounters[{i}]"
            use = _mapping(use, up)
            names = list(_mapping(use.get("counters"), f"{up}.counters"))
            out.append((_string(use.get("counterSet"), f"{up}.counterSet"), names))
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
    """Counter set -> counter -> value, from the slices' sharedCounters."""
    stale_slices: int = 0
    """Slices of an older generation, ignored."""
    problem: str | None = None
    """Why nothing can be allocated from this pool (incomplete, invalid); None when usable."""
    incomplete: bool = False

    @property
    def ref(self) -> str:
        return f"{self.driver}/{self.name}"


def _attributes(value: object, path: str) -> Mapping[str, Mapping[str, Any]]:
    attrs = _mapping(value, path, optional=True)
    for name, attr in attrs.items():
        if type(attr) is dict and len(attr) == 1 and next(iter(attr)) in _ATTRIBUTE_TYPE_SET:
            continue
        if not isinstance(attr, Mapping):
            raise InputError(f"{path}.{name}", f"must be an object, got {_show(attr)}")
        set_ = [t for t in ATTRIBUTE_TYPES if t in attr]
        if len(set_) != 1 or len(attr) != 1:
            raise InputError(
                f"{path}.{name}", f"must set exactly one of {', '.join(ATTRIBUTE_TYPES)}"
            )
    return attrs


def _policy(value: object, path: str, q: QuantityReader) -> RequestPolicy | None:
    if value is None:
        return None
    p = _mapping(value, path)
    default = q(p["default"], f"{path}.default") if p.get("default") is not None else None
    values = tuple(
        q(v, f"{path}.validValues[{i}]") for i, v in enumerate(_list(p.get("validValues"), path))
    )
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise InputError(f"{path}.validValues", "must be in ascending order without duplicates")
    rng = p.get("validRange")
    lo = hi = step = None
    if rng is not None:
        r = _mapping(rng, f"{path}.validRange")
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
) -> Device:
    d = _mapping(obj, path)
    name = _string(d.get("name"), f"{path}.name")
    raw_capacity = _mapping(d.get("capacity"), f"{path}.capacity", optional=True)
    taints = []
    for i, t in enumerate(_list(d.get("taints"), f"{path}.taints")):
        tp = f"{path}.taints[{i}]"
        t = _mapping(t, tp)
        taints.append(
            Taint(
                _string(t.get("key"), f"{tp}.key"),
                _string(t.get("value"), f"{tp}.value", required=False),
                _string(t.get("effect"), f"{tp}.effect"),
            )
        )
    return Device(
        index=index,
        driver=driver,
        pool=pool,
        slice_name=slice_name,
        name=name,
        raw_attributes=_attributes(d.get("attributes"), f"{path}.attributes"),
        raw_capacity=raw_capacity,
        raw_consumes=_list(d.get("consumesCounters"), f"{path}.consumesCounters"),
        quantities=q,
        allow_multiple=_bool(d.get("allowMultipleAllocations"), f"{path}.allowMultipleAllocations"),
        taints=tuple(taints),
        path=path,
    )


@dataclass
class Node:
    """The pools a node sees, in first-fit order, and their devices (``devices[i].index == i``;
    devices of pools with a problem are kept, for the explanation, but never allocated)."""

    pools: list[Pool]
    devices: list[Device]
    by_key: dict[tuple[str, str, str], Device]


def parse_slices(slices: Sequence[Mapping[str, Any]], q: QuantityReader) -> Node:
    by_pool: dict[tuple[str, str], list[tuple[Mapping[str, Any], str, int, int]]] = {}
    stale: dict[tuple[str, str], int] = {}
    for i, obj in enumerate(slices):
        base = f"resourceSlices[{i}]"
        obj = _mapping(obj, base)
        meta = _mapping(obj.get("metadata"), f"{base}.metadata", optional=True)
        sname = _string(meta.get("name"), f"{base}.metadata.name", required=False) or f"#{i}"
        base = f"ResourceSlice {sname}"
        spec = _mapping(obj.get("spec"), f"{base}.spec")
        driver = _string(spec.get("driver"), f"{base}.spec.driver")
        pool_spec = _mapping(spec.get("pool"), f"{base}.spec.pool")
        pname = _string(pool_spec.get("name"), f"{base}.spec.pool.name")
        gen = _int(pool_spec.get("generation", 0), f"{base}.spec.pool.generation")
        count = _int(pool_spec.get("resourceSliceCount"), f"{base}.spec.pool.resourceSliceCount")
        if count < 1:
            raise InputError(f"{base}.spec.pool.resourceSliceCount", f"must be >= 1, got {count}")
        key = (driver, pname)
        have = by_pool.setdefault(key, [])
        # addSlice: an older generation is out-dated, a newer one replaces all before it.
        if have and gen < have[0][2]:
            stale[key] = stale.get(key, 0) + 1
            continue
        if have and gen > have[0][2]:
            stale[key] = stale.get(key, 0) + len(have)
            have.clear()
        have.append((spec, sname, gen, count))
    pools: list[Pool] = []
    devices: list[Device] = []
    for driver, pname in sorted(by_pool):
        entries = sorted(by_pool[(driver, pname)], key=lambda e: e[1])
        gen, count = entries[0][2], entries[0][3]
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
        if len(entries) != count:
            pool.incomplete = True
            pool.problem = (
                f"pool {pool.ref} is incomplete: {len(entries)} of {count} slices of generation"
                f" {gen} (the driver is updating it; nothing is allocated from it meanwhile)"
            )
        names: set[str] = set()
        for spec, sname, _, _ in entries:
            base = f"ResourceSlice {sname}.spec"
            for j, cs in enumerate(_list(spec.get("sharedCounters"), f"{base}.sharedCounters")):
                cp = f"{base}.sharedCounters[{j}]"
                cs = _mapping(cs, cp)
                cs_name = _string(cs.get("name"), f"{cp}.name")
                counters = {
                    n: q(_mapping(c, f"{cp}.counters.{n}").get("value"), f"{cp}.counters.{n}.value")
                    for n, c in _mapping(cs.get("counters"), f"{cp}.counters").items()
                }
                if cs_name in pool.counters and pool.problem is None:
                    pool.problem = f"pool {pool.ref} is invalid: duplicate counter set {cs_name}"
                pool.counters[cs_name] = counters
            for j, raw in enumerate(_list(spec.get("devices"), f"{base}.devices")):
                dev = _device(raw, f"{base}.devices[{j}]", driver, pname, sname, q, len(devices))
                dev.pool_index = pool_index
                _ = dev.capacity  # the CEL view reads it: a malformed value is an InputError
                dev.node_name = spec.get("nodeName") or ""
                if dev.name in names and pool.problem is None:
                    pool.problem = f"pool {pool.ref} is invalid: duplicate device name {dev.name}"
                names.add(dev.name)
                pool.devices.append(dev)
                devices.append(dev)
        if pool.problem is None:
            for dev in pool.devices:
                for counter_set, counter_names in dev.counter_refs():
                    defined = pool.counters.get(counter_set)
                    missing = (
                        f"counter set {counter_set}"
                        if defined is None
                        else next(
                            (
                                f"counter {n} in counter set {counter_set}"
                                for n in counter_names
                                if n not in defined
                            ),
                            None,
                        )
                    )
                    if missing:
                        pool.problem = (
                            f"pool {pool.ref} is invalid: device {dev.name} consumes {missing},"
                            " which no slice of the pool defines"
                        )
                        break
                if pool.problem:
                    break
    by_key: dict[tuple[str, str, str], Device] = {}
    for dev in devices:
        by_key.setdefault(dev.key, dev)
    return Node(pools, devices, by_key)


# -- allocated claims --------------------------------------------------------------------------


@dataclass
class Allocated:
    """What other claims hold: whole devices (owner text per device key), shares of devices
    that allow multiple allocations (consumed capacity added up per device key)."""

    owners: dict[tuple[str, str, str], str] = field(default_factory=dict)
    shared: dict[tuple[str, str, str], dict[str, Quantity]] = field(default_factory=dict)
    share_owners: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)

    def holds(self, key: tuple[str, str, str]) -> bool:
        """internal.IsDeviceAllocated (structured/internal/allocatedstate.go): whole or shared."""
        return key in self.owners or key in self.shared


def parse_allocated(
    claims: Sequence[Mapping[str, Any]],
    in_use: Iterable[tuple[str, str, str]],
    q: QuantityReader,
) -> Allocated:
    out = Allocated()
    for i, obj in enumerate(claims):
        base = f"allocated[{i}]"
        obj = _mapping(obj, base)
        meta = _mapping(obj.get("metadata"), f"{base}.metadata", optional=True)
        ns = _string(meta.get("namespace"), f"{base}.metadata.namespace", required=False)
        name = _string(meta.get("name"), f"{base}.metadata.name", required=False) or f"#{i}"
        owner = f"claim {ns}/{name}" if ns else f"claim {name}"
        status = _mapping(obj.get("status"), f"{base}.status", optional=True)
        allocation = status.get("allocation")
        if allocation is None:
            continue  # not allocated: holds nothing
        base = f"{owner}: status.allocation"
        devices = _mapping(
            _mapping(allocation, base).get("devices"), f"{base}.devices", optional=True
        )
        for j, r in enumerate(_list(devices.get("results"), f"{base}.devices.results")):
            rp = f"{base}.devices.results[{j}]"
            r = _mapping(r, rp)
            key = (
                _string(r.get("driver"), f"{rp}.driver"),
                _string(r.get("pool"), f"{rp}.pool"),
                _string(r.get("device"), f"{rp}.device"),
            )
            if _bool(r.get("adminAccess"), f"{rp}.adminAccess"):
                continue  # "Is not considered as allocated" (foreachAllocatedDevice)
            if r.get("shareID") is not None:
                _string(r.get("shareID"), f"{rp}.shareID")
                total = out.shared.setdefault(key, {})
                consumed = _mapping(
                    r.get("consumedCapacity"), f"{rp}.consumedCapacity", optional=True
                )
                for cname, value in consumed.items():
                    qty = q(value, f"{rp}.consumedCapacity.{cname}")
                    prev = total.get(cname)
                    total[cname] = (
                        qty if prev is None else Quantity(prev.nanos + qty.nanos, qty.format)
                    )
                out.share_owners.setdefault(key, []).append(owner)
                continue
            out.owners.setdefault(key, owner)
    for i, item in enumerate(in_use):
        if not (
            isinstance(item, tuple | list)
            and len(item) == 3
            and all(isinstance(x, str) for x in item)
        ):
            raise InputError(f"in_use[{i}]", f"must be (driver, pool, device), got {_show(item)}")
        key = (item[0], item[1], item[2])
        out.owners.setdefault(key, "in use on the node")
    return out
