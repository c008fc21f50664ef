"""Compile-time checks: what the evaluator cannot do as Kubernetes does, undeclared names, and
results known without a type checker not to be bool."""

from __future__ import annotations

from dra_driver.scheduler.cel.syntax import MACROS, Node
from dra_driver.scheduler.cel.values import type_name

# The Rust library's own functions (the CEL standard definitions), for the compile-time check
# of unknown names.
NATIVE = frozenset(
    [
        *("size", "int", "uint", "double", "string", "bytes", "timestamp", "duration"),
        *("dyn", "type", "has", "contains", "startsWith", "endsWith", "matches"),
        *("getFullYear", "getMonth", "getDate", "getDayOfMonth", "getDayOfWeek"),
        *("getDayOfYear", "getHours", "getMinutes", "getSeconds", "getMilliseconds"),
        *("optional.of", "optional.none", "optional.ofNonZeroValue"),
        *("hasValue", "value", "orValue", "or"),
    ]
)
_UNSUPPORTED = {
    "cel.bind": "cel.bind (ext.Bindings) is not supported by this evaluator (the Rust CEL "
    "library has no such macro); write the attribute path out in full",
    "sortBy": "sortBy (a macro of ext.Lists) is not supported by this evaluator",
    "transformList": "two-variable comprehensions are not supported by this evaluator",
    "transformMap": "two-variable comprehensions are not supported by this evaluator",
    "transformMapEntry": "two-variable comprehensions are not supported by this evaluator",
    "existsOne": "two-variable comprehensions are not supported by this evaluator",
}


def check(node: Node, scope: frozenset[str], known: frozenset[str]) -> None:
    """Refuse what the evaluator cannot do as Kubernetes does, and undeclared names."""
    if node.kind == "ident" and node.name not in scope and node.name != "device":
        raise ValueError(f"undeclared reference to '{node.name}'")
    if node.kind == "call":
        name = node.name
        if name in _UNSUPPORTED:
            raise ValueError(_UNSUPPORTED[name])
        if name in MACROS and node.target is not None:
            if len(node.args) == 3 and name in ("all", "exists", "exists_one"):
                raise ValueError("two-variable comprehensions are not supported by this evaluator")
            if not node.args or node.args[0].kind != "ident":
                raise ValueError(f"{name}() needs a variable name as its first argument")
            check(node.target, scope, known)
            inner = scope | {node.args[0].name}
            for arg in node.args[1:]:
                check(arg, inner, known)
            return
        if name == "has":
            if len(node.args) != 1 or node.args[0].kind != "select":
                raise ValueError("has() needs a field selection as its argument, like has(m.f)")
        elif name not in known:
            raise ValueError(f"undeclared reference to '{name}'")
    for child in (node.target, *node.args):
        if child is not None:
            check(child, scope, known)


def result_kind(node: Node) -> str | None:
    """The type of a result known without a type checker to be no bool, else None."""
    if node.kind == "lit" and not isinstance(node.value, bool):
        return type_name(node.value) if node.value is not None else "null_type"
    if node.kind in ("list", "map"):
        return node.kind
    if node.kind == "op" and node.name in ("+", "-", "*", "/", "%"):
        return "a number, string or list"
    return None
