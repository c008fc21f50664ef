"""The allocator's domain types, parsed from resource.k8s.io/v1 API dicts: device classes and
the claims to allocate (ResourceSlices and allocated claims: :mod:`dra_driver.scheduler.pools`,
whose names are re-exported here for the allocator).

Everything the search needs is checked here, once, with the one field reader
(:mod:`agent.decode.fields`): a malformed field raises ``InputError`` with its path
(``spec.devices.requests[1].exactly.count: must be >= 1, got 0``). Field names, defaults and
limits are those of k8s.io/api ``resource/v1/types.go`` (ResourceClaimSpec, DeviceRequest,
ExactDeviceRequest, DeviceSubRequest, DeviceConstraint, DeviceToleration). Unknown fields are
not this module's business: ``explain`` refuses them in its files
(:mod:`dra_driver.scheduler.shapes`), the API server in a cluster.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.decode import fields
from dra_driver.quantity import Quantity
from dra_driver.scheduler.allocated import Allocated, parse_allocated
from dra_driver.scheduler.pools import (
    ATTRIBUTE_TYPES,
    AttributeValue,
    Capacity,
    CounterUse,
    Device,
    InputError,
    Node,
    Pool,
    QuantityReader,
    RequestPolicy,
    Taint,
    parse_slices,
)

__all__ = [
    "ATTRIBUTE_TYPES",
    "MAX_RESULTS",
    "Allocated",
    "AttributeValue",
    "Capacity",
    "Claim",
    "Constraint",
    "CounterUse",
    "Device",
    "DeviceClass",
    "InputError",
    "Mode",
    "Node",
    "Pool",
    "QuantityReader",
    "Request",
    "RequestGroup",
    "RequestPolicy",
    "SelectorSpec",
    "Taint",
    "Toleration",
    "parse_allocated",
    "parse_claim",
    "parse_classes",
    "parse_slices",
]

MAX_RESULTS = 32
"""resourceapi.AllocationResultsMaxSize: the most devices one claim's allocation may hold."""


class Mode(enum.Enum):
    EXACT_COUNT = "ExactCount"
    ALL = "All"


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
    for i, item in enumerate(fields.items(value, path)):
        p = f"{path}[{i}]"
        cel = fields.obj(fields.obj(item, p).get("cel"), f"{p}.cel")
        out.append(
            SelectorSpec(
                fields.text(cel.get("expression"), f"{p}.cel.expression", nonempty=True), p
            )
        )
    return tuple(out)


def parse_classes(classes: Sequence[Mapping[str, Any]]) -> dict[str, DeviceClass]:
    out: dict[str, DeviceClass] = {}
    for i, obj in enumerate(classes):
        base = f"deviceClasses[{i}]"
        obj = fields.obj(obj, base)
        name = fields.text(
            fields.obj(obj.get("metadata"), f"{base}.metadata").get("name"),
            f"{base}.metadata.name",
            nonempty=True,
        )
        base = f"DeviceClass {name}"
        if name in out:
            raise InputError(f"{base}.metadata.name", f"DeviceClass {name!r} is given twice")
        spec = fields.obj(obj.get("spec"), f"{base}.spec", optional=True)
        config = tuple(
            fields.obj(c, f"{base}.spec.config[{j}]")
            for j, c in enumerate(fields.items(spec.get("config"), f"{base}.spec.config"))
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
    for i, item in enumerate(fields.items(value, path)):
        p = f"{path}[{i}]"
        t = fields.obj(item, p)
        op = t.get("operator") or "Equal"
        if op not in ("Equal", "Exists"):
            raise InputError(f"{p}.operator", f"must be Equal or Exists, got {fields.shown(op)}")
        key = fields.opt_text(t.get("key"), f"{p}.key") or ""
        value_ = fields.opt_text(t.get("value"), f"{p}.value") or ""
        if op == "Exists" and value_:
            raise InputError(f"{p}.value", "must be empty when operator is Exists")
        if not key and op != "Exists":
            raise InputError(f"{p}.operator", "must be Exists when key is empty")
        effect = fields.opt_text(t.get("effect"), f"{p}.effect") or ""
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
    class_name = fields.text(obj.get("deviceClassName"), f"{path}.deviceClassName", nonempty=True)
    mode_text = obj.get("allocationMode") or "ExactCount"
    try:
        mode = Mode(mode_text)
    except ValueError:
        raise InputError(
            f"{path}.allocationMode", f"must be ExactCount or All, got {fields.shown(mode_text)}"
        ) from None
    count = 1
    if mode is Mode.EXACT_COUNT:
        if obj.get("count") is not None:
            count = fields.integer(obj.get("count"), f"{path}.count")
            if count < 1:
                raise InputError(f"{path}.count", f"must be >= 1, got {count}")
    elif obj.get("count") is not None:
        raise InputError(f"{path}.count", "must not be set when allocationMode is All")
    admin = False
    if "adminAccess" in obj:
        if not admin_allowed:
            raise InputError(f"{path}.adminAccess", "subrequests have no adminAccess field")
        admin = fields.flag(obj.get("adminAccess"), f"{path}.adminAccess")
    capacity: dict[str, Quantity] = {}
    cap = fields.obj(obj.get("capacity"), f"{path}.capacity", optional=True)
    for cname, cvalue in fields.obj(
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
    claim = fields.obj(claim, "")
    meta = fields.obj(claim.get("metadata"), "metadata", optional=True)
    spec = fields.obj(claim.get("spec"), "spec")
    devices = fields.obj(spec.get("devices"), "spec.devices", optional=True)
    groups: list[RequestGroup] = []
    names: set[str] = set()
    for i, item in enumerate(fields.items(devices.get("requests"), "spec.devices.requests")):
        path = f"spec.devices.requests[{i}]"
        req = fields.obj(item, path)
        name = fields.text(req.get("name"), f"{path}.name", nonempty=True)
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
                fields.obj(exactly, f"{path}.exactly"),
                f"{path}.exactly",
                name,
                None,
                q,
                admin_allowed=True,
            )
            groups.append(RequestGroup(name, (r,), False))
            continue
        subs = fields.items(first, f"{path}.firstAvailable")
        if not subs:
            raise InputError(f"{path}.firstAvailable", "must list at least one subrequest")
        alternatives = []
        sub_names: set[str] = set()
        for j, sub in enumerate(subs):
            sp = f"{path}.firstAvailable[{j}]"
            sub = fields.obj(sub, sp)
            sname = fields.text(sub.get("name"), f"{sp}.name", nonempty=True)
            if sname in sub_names:
                raise InputError(f"{sp}.name", f"subrequest name {sname!r} is used twice")
            sub_names.add(sname)
            alternatives.append(_request(sub, sp, sname, name, q, admin_allowed=False))
        groups.append(RequestGroup(name, tuple(alternatives), True))
    known = set(names) | {a.full_name for g in groups for a in g.alternatives if a.parent}
    constraints = []
    for i, item in enumerate(fields.items(devices.get("constraints"), "spec.devices.constraints")):
        path = f"spec.devices.constraints[{i}]"
        c = fields.obj(item, path)
        kinds = [k for k in ("matchAttribute", "distinctAttribute") if c.get(k) is not None]
        if len(kinds) != 1:
            raise InputError(path, "must set exactly one of matchAttribute and distinctAttribute")
        attribute = fields.text(c.get(kinds[0]), f"{path}.{kinds[0]}", nonempty=True)
        if "/" not in attribute.strip("/"):
            raise InputError(
                f"{path}.{kinds[0]}",
                f"must be a fully qualified attribute name (domain/name), got {attribute!r}",
            )
        requests = []
        for j, item_name in enumerate(fields.items(c.get("requests"), f"{path}.requests")):
            rname = fields.text(item_name, f"{path}.requests[{j}]", nonempty=True)
            if rname not in known:
                raise InputError(
                    f"{path}.requests[{j}]",
                    f"no request {rname!r} in this claim (requests: {', '.join(sorted(known))})",
                )
            requests.append(rname)
        constraints.append(Constraint(kinds[0], attribute, frozenset(requests), path))
    config = []
    for i, item in enumerate(fields.items(devices.get("config"), "spec.devices.config")):
        path = f"spec.devices.config[{i}]"
        c = fields.obj(item, path)
        names_ = tuple(
            fields.text(r, f"{path}.requests[{j}]", nonempty=True)
            for j, r in enumerate(fields.items(c.get("requests"), f"{path}.requests"))
        )
        for j, rname in enumerate(names_):
            if rname not in known:
                raise InputError(f"{path}.requests[{j}]", f"no request {rname!r} in this claim")
        config.append((names_, c))
    return Claim(
        namespace=(fields.opt_text(meta.get("namespace"), "metadata.namespace") or ""),
        name=(fields.opt_text(meta.get("name"), "metadata.name") or "") or "(unnamed)",
        uid=(fields.opt_text(meta.get("uid"), "metadata.uid") or ""),
        requests=tuple(groups),
        constraints=tuple(constraints),
        config=tuple(config),
    )
