"""Generated inputs for ``explain``: claims, DeviceClasses, ResourceSlices and allocated claims
built from what the driver really publishes (hypothesis strategies).

``Base`` is one simulated node's slices (``build_slices`` over the simulator's inventory, as
``tessera slices --simulate`` prints them); ``Catalogue`` is every attribute and capacity those
slices carry, with their types and values, so the selectors, constraints and capacity requests
name what a user would name. ``cases(base)`` draws one ``Case``: a subset of the node's devices
(some tainted, some held by another claim), a claim of one to three requests (``exactly`` or
``firstAvailable``; counts, ``All``, selectors over the catalogue, capacity requests,
tolerations, admin access), constraints, and, often, one malformed part (a field replaced by a
value of any JSON type, or removed).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from tests.json_values import json_paths
from tests.json_values import json_values as json_values_of

DRIVER = "gpu.tessera.dev"
CLASS_NAMES = (
    "gpu.tessera.dev",
    "mig.gpu.tessera.dev",
    "shared-gpu.tessera.dev",
    "hopper.gpu.tessera.dev",
    "ampere.gpu.tessera.dev",
    "ada.gpu.tessera.dev",
    "vfio.gpu.tessera.dev",
    "vgpu.gpu.tessera.dev",
    "no-such-class",
)
EFFECTS = ("NoSchedule", "NoExecute", "None")
TAINT_KEYS = ("example.com/broken", "gpu.tessera.dev/xid", "maintenance")
REQUEST_NAMES = ("r0", "r1", "r2")
SUB_NAMES = ("s0", "s1", "s2")
QUANTITIES = ("0", "1", "500m", "1Gi", "8Gi", "10Gi", "40Gi", "1e3", "81559Mi", "1Ti", "2")
EDGE_QUANTITIES = ("-1Gi", "1e400", "0.000000001", "9223372036854775808", "1.5Ki", "", "Gi", 7)
"""Out of range, too precise, no number, not a string: a clear error, or (1.5Ki) a value."""
EDGE_COUNTS = (0, -1, 33, 2**31, 2**63, "2", 2.0, True)
"""Counts the API refuses or a claim cannot hold."""
EDGE_ATTRIBUTES = ("bare", "gpu.tessera.dev/", "/uuid", "a/b/c", "gpu.tessera.dev/nosuch", "")

json_values = json_values_of(text=12, keys=8, items=3, leaves=8)


@dataclass(frozen=True)
class Base:
    """One simulated node's published slices (``label``: model and policy, for messages)."""

    label: str
    slices: tuple[dict[str, Any], ...]

    def __repr__(self) -> str:  # short, as Nodes'
        return f"Base({self.label})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def devices(self) -> list[tuple[int, int]]:
        """(slice index, device index) of every device."""
        return [
            (i, j)
            for i, s in enumerate(self.slices)
            for j, _ in enumerate(s["spec"].get("devices") or ())
        ]


@dataclass
class Catalogue:
    """What the devices publish: attribute -> (type, values); capacity -> values."""

    attributes: dict[str, tuple[str, list[Any]]] = field(default_factory=dict)
    capacities: dict[str, list[str]] = field(default_factory=dict)

    @staticmethod
    def of(bases: Sequence[Base]) -> Catalogue:
        out = Catalogue()
        for base in bases:
            for s in base.slices:
                for dev in s["spec"].get("devices") or ():
                    for name, typed in (dev.get("attributes") or {}).items():
                        ((kind, value),) = typed.items()
                        values = out.attributes.setdefault(name, (kind, []))[1]
                        if value not in values and len(values) < 12:
                            values.append(value)
                    for name, cap in (dev.get("capacity") or {}).items():
                        values_ = out.capacities.setdefault(name, [])
                        if cap["value"] not in values_ and len(values_) < 12:
                            values_.append(cap["value"])
        for _, values in out.attributes.values():
            values.sort(key=repr)
        for values_ in out.capacities.values():
            values_.sort()
        return out


@dataclass(frozen=True)
class Nodes:
    """The simulated nodes' slices, and what their devices publish."""

    bases: tuple[Base, ...]
    catalogue: Catalogue

    def __repr__(self) -> str:
        return f"Nodes({', '.join(b.label for b in self.bases)})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """How hypothesis prints a failing case's arguments (it prints a dataclass field by
        field, not by its __repr__): short. With megabytes of slices in them, hypothesis 6.170
        reported its shrinking as "Inconsistent data generation" instead of the failure."""
        printer.text(repr(self))


@dataclass(frozen=True)
class Case:
    claim: dict[str, Any]
    classes: list[dict[str, Any]]
    slices: list[dict[str, Any]]
    allocated: list[dict[str, Any]]
    broken: str | None
    """Which input had a field replaced or removed (``claim``, ``slices``, ...), if any."""

    def __repr__(self) -> str:
        # the claim and allocated claims in full, the slices by their devices' names: short,
        # as Nodes'
        specs = [s.get("spec") for s in self.slices]
        devices = [
            d.get("name") if isinstance(d, dict) else d
            for spec in specs
            if isinstance(spec, dict) and isinstance(spec.get("devices"), list)
            for d in spec["devices"]
        ]
        return (
            f"Case(broken={self.broken!r}, claim={json.dumps(self.claim, default=repr)},"
            f" allocated={json.dumps(self.allocated, default=repr)}, devices={devices})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def documents(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(which, object) of every input, the claim first."""
        yield "claim", self.claim
        yield from (("classes", c) for c in self.classes)
        yield from (("slices", s) for s in self.slices)
        yield from (("allocated", a) for a in self.allocated)


@st.composite
def _rarely(draw: st.DrawFn, common: st.SearchStrategy[Any], rare: Sequence[Any]) -> Any:
    """``common``, or in one draw of ten one of the ``rare`` values: most generated claims
    stay valid, so that their answers are checked too."""
    return draw(st.sampled_from(rare) if draw(st.integers(0, 9)) == 0 else common)


def _domain_and_name(qualified: str) -> tuple[str, str]:
    domain, _, name = qualified.rpartition("/")
    return (domain or DRIVER), name


def _literal(kind: str, value: Any) -> str:
    if kind == "string":
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if kind == "bool":
        return "true" if value else "false"
    if kind == "int":
        return str(int(value))
    return f'semver("{value}")'


@st.composite
def _attribute_selector(draw: st.DrawFn, cat: Catalogue) -> str:
    name = draw(st.sampled_from(sorted(cat.attributes)))
    kind, values = cat.attributes[name]
    domain, short = _domain_and_name(name)
    ref = f'device.attributes["{domain}"].{short}'
    # mostly a real value; sometimes any value of the type, or one of another type (a CEL
    # runtime error the answer must name, not a traceback)
    real = st.sampled_from(values) if values else st.just("x")
    other_kind = draw(st.sampled_from(("string", "int", "version", "bool")))
    if draw(st.integers(0, 9)) == 0:
        kind_, value = (
            other_kind,
            draw(
                {
                    "string": st.text(max_size=6),
                    "int": st.integers(-5, 2**40),
                    "version": st.sampled_from(("1.2.3", "12.0.0", "0.0.1-rc.1")),
                    "bool": st.booleans(),
                }[other_kind]
            ),
        )
    else:
        kind_, value = kind, draw(real)
    lit = _literal(kind_, value)
    if kind == "version":
        op = draw(
            st.sampled_from(
                (
                    f"{ref}.isGreaterThan({lit})",
                    f"{ref}.isLessThan({lit})",
                    f"{ref}.compareTo({lit}) >= 0",
                    f"{ref} == {lit}",
                )
            )
        )
    elif kind == "int":
        op = draw(st.sampled_from((f"{ref} == {lit}", f"{ref} >= {lit}", f"{ref} < {lit}")))
    elif kind == "string":
        op = draw(
            st.sampled_from(
                (
                    f"{ref} == {lit}",
                    f"{ref} != {lit}",
                    f"{ref}.startsWith({lit})",
                    f'{ref} in [{lit}, "other"]',
                    f"{ref}.lowerAscii().contains({lit})",
                )
            )
        )
    else:
        op = draw(st.sampled_from((f"{ref} == {lit}", ref)))
    if draw(st.booleans()):
        op = f'"{short}" in device.attributes["{domain}"] && {op}'
    return op


@st.composite
def _capacity_selector(draw: st.DrawFn, cat: Catalogue) -> str:
    name = draw(st.sampled_from(sorted(cat.capacities)))
    ref = f'device.capacity["{DRIVER}"].{name}'
    value = draw(st.sampled_from(cat.capacities[name]) | st.sampled_from(QUANTITIES))
    q = f'quantity("{value}")'
    return draw(
        st.sampled_from(
            (
                f"{ref}.compareTo({q}) >= 0",
                f"{ref}.isGreaterThan({q})",
                f"{ref}.isLessThan({q})",
                f"{ref} == {q}",
                f"{ref}.asInteger() > 0",
            )
        )
    )


EDGE_EXPRESSIONS = (
    "1 +",  # does not compile: malformed input
    '"not a bool"',
    "(" * 300 + "true" + ")" * 300,  # deep nesting
    "[" * 100 + "1" + "]" * 100 + ".size() > 0",
    "true" + " && true" * 1200,  # long, just under the 10 Ki limit
    "true" + " || false" * 1200,  # over it
    'device.attributes["gpu.tessera.dev"].uuid.matches("(")',  # a bad regex: a runtime error
    'quantity("1Gi").isGreaterThan(quantity("x"))',  # a bad quantity: a runtime error
    'semver("x") == semver("1.0.0")',
)


def selectors(cat: Catalogue) -> st.SearchStrategy[str]:
    common = st.one_of(
        _attribute_selector(cat),
        _capacity_selector(cat),
        st.sampled_from(
            (
                "true",
                f'device.driver == "{DRIVER}"',
                "device.allowMultipleAllocations",
                f'device.attributes["{DRIVER}"].nosuch == 1',
                'device.attributes["other.example.com"].size() == 0',
            )
        ),
    )
    return _rarely(common, EDGE_EXPRESSIONS)


@st.composite
def _tolerations(draw: st.DrawFn) -> list[dict[str, str]]:
    out = []
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(("Equal", "Exists")))
        t: dict[str, str] = {"operator": op}
        if op == "Equal" or draw(st.booleans()):
            t["key"] = draw(st.sampled_from(TAINT_KEYS))
        if op == "Equal":
            t["value"] = draw(st.sampled_from(("", "true", "1")))
        if draw(st.booleans()):
            t["effect"] = draw(st.sampled_from(EFFECTS))
        out.append(t)
    return out


@st.composite
def _request_body(draw: st.DrawFn, cat: Catalogue, *, sub: bool) -> dict[str, Any]:
    # the whole-GPU class half of the time: most nodes have GPUs it selects
    cls = draw(st.sampled_from(CLASS_NAMES[:1] * len(CLASS_NAMES) + CLASS_NAMES))
    body: dict[str, Any] = {"deviceClassName": cls}
    if draw(st.integers(0, 4)) == 0:
        body["allocationMode"] = "All"
    else:
        count = draw(_rarely(st.none() | st.integers(1, 4), EDGE_COUNTS))
        if count is not None:
            body["count"] = count
    sels = draw(st.lists(selectors(cat), max_size=draw(st.sampled_from((0, 1, 1, 2)))))
    if sels:
        body["selectors"] = [{"cel": {"expression": e}} for e in sels]
    if draw(st.integers(0, 2)) == 0:
        cap = draw(st.sampled_from(sorted(cat.capacities)))
        body["capacity"] = {
            "requests": {
                cap: draw(
                    _rarely(
                        st.sampled_from(cat.capacities[cap] + list(QUANTITIES)), EDGE_QUANTITIES
                    )
                )
            }
        }
    tolerations = draw(_tolerations())
    if tolerations:
        body["tolerations"] = tolerations
    if not sub and draw(st.integers(0, 5)) == 0:
        body["adminAccess"] = True
    return body


@st.composite
def claims(draw: st.DrawFn, cat: Catalogue) -> dict[str, Any]:
    # mostly one request, so that a good share of the claims fit
    names = REQUEST_NAMES[: draw(st.sampled_from((1, 1, 1, 2, 3)))]
    requests: list[dict[str, Any]] = []
    known: list[str] = []
    for name in names:
        known.append(name)
        if draw(st.booleans()):
            requests.append({"name": name, "exactly": draw(_request_body(cat, sub=False))})
            continue
        subs = []
        for sname in SUB_NAMES[: draw(st.integers(1, 3))]:
            subs.append({"name": sname, **draw(_request_body(cat, sub=True))})
            known.append(f"{name}/{sname}")
        requests.append({"name": name, "firstAvailable": subs})
    constraints = []
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(("matchAttribute", "distinctAttribute")))
        attr = draw(_rarely(st.sampled_from(sorted(cat.attributes)), EDGE_ATTRIBUTES))
        qualified = attr if "/" in attr or attr in EDGE_ATTRIBUTES else f"{DRIVER}/{attr}"
        c: dict[str, Any] = {kind: qualified}
        if draw(st.booleans()):
            c["requests"] = draw(st.lists(st.sampled_from(known), min_size=1, unique=True))
        constraints.append(c)
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "fuzzed", "namespace": "default", "uid": "uid-fuzzed"},
        "spec": {"devices": devices},
    }


@st.composite
def node_slices(draw: st.DrawFn, base: Base) -> list[dict[str, Any]]:
    """``base``'s slices with a subset of its devices (all of a small node, sometimes), some
    of them tainted."""
    every = base.devices()
    if len(every) <= 40 and draw(st.integers(0, 2)) > 0:
        keep = set(every)
    else:
        keep = set(draw(st.lists(st.sampled_from(every), min_size=1, max_size=12, unique=True)))
    out = []
    for i, s in enumerate(base.slices):
        # copied, but only the devices kept: a dynamic MIG node publishes hundreds
        devs = [
            copy.deepcopy(d) for j, d in enumerate(s["spec"].get("devices") or ()) if (i, j) in keep
        ]
        for d in devs:
            if draw(st.integers(0, 5)) == 0:
                d["taints"] = [
                    {
                        "key": draw(st.sampled_from(TAINT_KEYS)),
                        "value": draw(st.sampled_from(("", "true"))),
                        "effect": draw(st.sampled_from(EFFECTS)),
                    }
                ]
        spec = {k: copy.deepcopy(v) for k, v in s["spec"].items() if k != "devices"}
        if devs:
            spec["devices"] = devs
        out.append({**copy.deepcopy({k: v for k, v in s.items() if k != "spec"}), "spec": spec})
    return out


@st.composite
def allocated(draw: st.DrawFn, slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Nothing, or one other claim that holds some of the devices (a share of a device that
    allows multiple allocations, the whole device otherwise)."""
    devs = [(s["spec"], d) for s in slices for d in s["spec"].get("devices") or ()]
    if not devs or draw(st.booleans()):
        return []
    results = []
    for i, (spec, d) in enumerate(draw(st.lists(st.sampled_from(devs), min_size=1, max_size=3))):
        r: dict[str, Any] = {
            "request": "held",
            "driver": spec["driver"],
            "pool": spec["pool"]["name"],
            "device": d["name"],
        }
        if d.get("allowMultipleAllocations"):
            r["shareID"] = f"00000000-0000-4000-8000-{i:012d}"
            r["consumedCapacity"] = {"memory": draw(st.sampled_from(("1Gi", "8Gi", "40Gi")))}
        results.append(r)
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "other", "namespace": "default", "uid": "uid-other"},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": results}}},
        }
    ]


@st.composite
def _broken(draw: st.DrawFn, obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with the value at one path (not the root) replaced by any JSON value, or, in a
    mapping, removed."""
    obj = copy.deepcopy(obj)
    paths = [p for p in json_paths(obj) if p]
    if not paths:
        return obj
    path = draw(st.sampled_from(paths))
    parent = obj
    for step in path[:-1]:
        parent = parent[step]
    if isinstance(parent, dict) and draw(st.integers(0, 3)) == 0:
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(json_values)
    return obj


@st.composite
def cases(draw: st.DrawFn, base: Base, cat: Catalogue, classes: list[dict[str, Any]]) -> Case:
    slices = draw(node_slices(base))
    held = draw(allocated(slices))
    claim = draw(claims(cat))
    classes = copy.deepcopy(classes)
    broken = draw(st.sampled_from((None, None, "claim", "classes", "slices", "allocated")))
    if broken == "claim":
        claim = draw(_broken(claim))
    elif broken == "classes":
        i = draw(st.integers(0, len(classes) - 1))
        classes[i] = draw(_broken(classes[i]))
    elif broken == "slices":
        i = draw(st.integers(0, len(slices) - 1))
        slices[i] = draw(_broken(slices[i]))
    elif broken == "allocated" and held:
        held[0] = draw(_broken(held[0]))
    return Case(claim, classes, slices, held, broken)
