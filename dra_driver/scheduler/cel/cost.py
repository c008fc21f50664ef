"""The worst-case cost estimate of an expression, in the units and manner of cel-go's estimator,
refused above the apiserver's limit at compile time (``estimated_cost``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dra_driver.scheduler.cel.syntax import MACROS, Node
from dra_driver.scheduler.cel.values import (
    MAX_ATTRIBUTES,
    MAX_DOMAIN_CHARS,
    MAX_DRIVER_CHARS,
    MAX_ID_CHARS,
    MAX_LIST_VALUES,
    MAX_VALUE_CHARS,
)

_UNBOUNDED = 2**64 - 1  # cel-go's estimate for a size nothing bounds

# cel-go cost factors (cel-go common/cost.go), used the way k8s' library/cost.go uses them.
_TRAVERSAL = 0.1  # StringTraversalCostFactor
_REGEX = 0.25  # RegexStringLengthCostFactor
_LIST_CREATE = 10  # ListCreateBaseCost
_MAP_CREATE = 30  # MapCreateBaseCost
_OBJECT_CREATE = 40  # StructCreateBaseCost


@dataclass(frozen=True)
class _Type:
    """What the estimator knows of a value: what it is (for device values) and its size bound."""

    kind: str  # device attrs attrdomain caps capdomain quantity string list map other
    size: int = _UNBOUNDED


_DEVICE_FIELDS = {
    "driver": _Type("string", MAX_DRIVER_CHARS),
    "attributes": _Type("attrs", MAX_ATTRIBUTES),
    "capacity": _Type("caps", MAX_ATTRIBUTES),
    "allowMultipleAllocations": _Type("other", 1),
}
_MEMBER_OF = {
    "attrs": _Type("attrdomain", MAX_ATTRIBUTES),
    "attrdomain": _Type("attrvalue", max(MAX_VALUE_CHARS, MAX_LIST_VALUES)),
    "caps": _Type("capdomain", MAX_ATTRIBUTES),
    "capdomain": _Type("quantity", 1),
}
_KEY_OF = {
    "attrs": _Type("string", MAX_DOMAIN_CHARS),
    "caps": _Type("string", MAX_DOMAIN_CHARS),
    "attrdomain": _Type("string", MAX_ID_CHARS),
    "capdomain": _Type("string", MAX_ID_CHARS),
    "attrvalue": _Type("other", MAX_VALUE_CHARS),
}
_OTHER = _Type("other")


def _ceil(x: float) -> int:
    return math.ceil(x) if x < _UNBOUNDED else _UNBOUNDED


def _lit_type(value: Any) -> _Type:
    if isinstance(value, str | bytes):
        return _Type("string", len(value))
    return _Type("other", 1)


def estimate(node: Node, scope: Mapping[str, _Type]) -> tuple[int, _Type]:
    """Worst-case cost and the value's type, in the units and manner of cel-go's estimator
    (checker/cost.go) with the k8s library costs (apiserver pkg/cel/library/cost.go) and the
    device size bounds of dynamic-resource-allocation cel/compile.go (sizeEstimator)."""
    kind = node.kind
    if kind == "lit":
        return 0, _lit_type(node.value)
    if kind == "ident":
        if node.name in scope:
            return 1, scope[node.name]
        return 1, _Type("device", 1) if node.name == "device" else _OTHER
    if kind in ("select", "index"):
        assert node.target is not None
        cost, t = estimate(node.target, scope)
        cost += 1
        if kind == "index":
            cost += estimate(node.args[0], scope)[0]
        if t.kind == "device" and kind == "select":
            return cost, _DEVICE_FIELDS.get(node.name, _OTHER)
        return cost, _MEMBER_OF.get(t.kind, _OTHER)
    if kind == "list":
        cost = _LIST_CREATE + sum(estimate(a, scope)[0] for a in node.args)
        return cost, _Type("list", len(node.args))
    if kind == "map":
        return _MAP_CREATE + sum(estimate(a, scope)[0] for a in node.args), _Type(
            "map", len(node.args) // 2
        )
    if kind == "object":
        return _OBJECT_CREATE + sum(estimate(a, scope)[0] for a in node.args), _OTHER
    if kind == "op":
        return _estimate_op(node, scope)
    return _estimate_call(node, scope)


def _estimate_op(node: Node, scope: Mapping[str, _Type]) -> tuple[int, _Type]:
    parts = [estimate(a, scope) for a in node.args]
    cost = sum(c for c, _ in parts)
    op = node.name
    if op in ("&&", "||"):
        return cost, _Type("other", 1)
    if op == "?:":
        (c0, _), (c1, t1), (c2, t2) = parts
        return c0 + max(c1, c2), t1 if t1.size >= t2.size else t2
    if op in ("!", "-"):
        return cost + 1, parts[0][1]
    left, right = parts[0][1], parts[-1][1]
    if op in ("==", "!=", "<", "<=", ">", ">=") and "string" in (left.kind, right.kind):
        return cost + _ceil(min(left.size, right.size) * _TRAVERSAL), _Type("other", 1)
    if op == "in":
        if right.kind in ("list", "attrvalue"):
            return cost + right.size, _Type("other", 1)
        return cost + 1, _Type("other", 1)
    if op == "+" and left.kind == right.kind and left.kind in ("string", "list"):
        size = min(left.size + right.size, _UNBOUNDED)
        extra = _ceil(size * _TRAVERSAL) if left.kind == "string" else 1
        return cost + extra, _Type(left.kind, size)
    return cost + 1, _Type("other", 1)


def _estimate_call(node: Node, scope: Mapping[str, _Type]) -> tuple[int, _Type]:
    name = node.name
    if name in MACROS and node.target is not None:
        return _estimate_comprehension(node, scope)
    target = estimate(node.target, scope) if node.target is not None else None
    args = [estimate(a, scope) for a in node.args]
    cost = (target[0] if target else 0) + sum(c for c, _ in args)
    # the string a function works on: the receiver, else the first argument
    subject = target[1] if target else (args[0][1] if args else _OTHER)
    size = subject.size
    if name in ("lowerAscii", "upperAscii", "substring", "trim"):
        return cost + _ceil(size * _TRAVERSAL), _Type("string", size)
    if name in ("replace", "split"):
        result = _Type("list", size) if name == "split" else _Type("string", _UNBOUNDED)
        return cost + _ceil(size * 2 * _TRAVERSAL), result
    if name == "join":
        return cost + _ceil(size * MAX_VALUE_CHARS * _TRAVERSAL), _Type("string", _UNBOUNDED)
    if name in ("find", "findAll", "matches"):
        pattern = args[-1][1].size if args else _UNBOUNDED
        str_cost = _ceil((1 + size) * _TRAVERSAL)
        regex_cost = _ceil(pattern * _REGEX)
        result = _Type("list" if name == "findAll" else "string", size)
        return cost + min(str_cost * regex_cost, _UNBOUNDED), result
    if name in ("quantity", "isQuantity", "semver", "isSemver"):
        result = _Type("quantity", 1) if name == "quantity" else _Type("other", 1)
        return cost + _ceil(size * _TRAVERSAL), result
    if name in ("isSorted", "sum", "max", "min", "indexOf", "lastIndexOf", "includes"):
        if subject.kind == "string":
            return cost + _ceil(size * _TRAVERSAL), _Type("other", 1)
        bound = MAX_LIST_VALUES if name == "includes" else size
        return cost + bound, _Type("other", 1)
    if name in ("contains", "startsWith", "endsWith"):
        return cost + _ceil(size * _TRAVERSAL), _Type("other", 1)
    if name in (
        "distinct",
        "sort",
        "reverse",
        "flatten",
        "slice",
        "sets.contains",
        "sets.equivalent",
        "sets.intersects",
    ):
        n = size
        other = args[0][1].size if args else 1
        quadratic = name in ("distinct", "sets.contains", "sets.equivalent", "sets.intersects")
        return cost + min(n * (other if quadratic else 1), _UNBOUNDED), _Type("list", n)
    if name == "lists.range":
        return cost + 1, _Type("list", _UNBOUNDED)
    if name == "string":
        return cost + 1, _Type("string", _UNBOUNDED)
    return cost + 1, _Type("other", 1)


def _estimate_comprehension(node: Node, scope: Mapping[str, _Type]) -> tuple[int, _Type]:
    """cel-go expands each macro into a fold: range cost + size x (condition + step) + result.
    The per-iteration costs are those of the expansions (parser/macro.go): all: condition
    ``@not_strictly_false(accu)`` 2, step ``accu && p`` 1 + p; exists: condition
    ``@not_strictly_false(!accu)`` 3, step ``accu || p`` 1 + p; exists_one: step ``p ? accu + 1
    : accu`` p + 2, result ``accu == 1`` 2; map: step ``accu + [e]`` e + 12; filter: step
    ``p ? accu + [x] : accu`` p + 13."""
    assert node.target is not None
    range_cost, range_type = estimate(node.target, scope)
    n = range_type.size
    element = _KEY_OF.get(
        range_type.kind,
        _Type("other", MAX_VALUE_CHARS if range_type.kind == "attrvalue" else _UNBOUNDED),
    )
    inner = {**scope, node.args[0].name: element}
    body = [estimate(a, inner)[0] for a in node.args[1:]]
    name = node.name
    if name == "all":
        per, result, out = 2 + 1 + body[0], 1, _Type("other", 1)
    elif name == "exists":
        per, result, out = 3 + 1 + body[0], 1, _Type("other", 1)
    elif name == "exists_one":
        per, result, out = body[0] + 2, 2, _Type("other", 1)
    elif name == "map":
        per, result, out = sum(body) + 12 + (1 if len(body) == 2 else 0), 1, _Type("list", n)
    else:
        per, result, out = body[0] + 13, 1, _Type("list", n)
    return min(range_cost + n * per + result, _UNBOUNDED), out
