"""The syntax tree of an expression, lowered from cel-python's lark parse tree
(``celpy.celparser.CELParser``): what the compile-time checks, the cost estimate and
``Verdict.seen`` walk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cel
import lark

MACROS = frozenset(("all", "exists", "exists_one", "map", "filter"))
_NAMESPACES = frozenset(("sets", "lists", "strings", "optional", "cel", "math", "base64"))


@dataclass(frozen=True)
class Node:
    kind: str  # lit ident select index call op list map object
    name: str = ""  # ident name, field, function or operator
    args: tuple[Node, ...] = ()
    target: Node | None = None  # receiver of a member call, operand of select/index
    value: Any = None  # literal value


_BINARY = {
    "relation_lt": "<",
    "relation_le": "<=",
    "relation_gt": ">",
    "relation_ge": ">=",
    "relation_eq": "==",
    "relation_ne": "!=",
    "relation_in": "in",
    "addition_add": "+",
    "addition_sub": "-",
    "multiplication_mul": "*",
    "multiplication_div": "/",
    "multiplication_mod": "%",
}


def _children(tree: lark.Tree[Any]) -> list[Any]:
    return [c for c in tree.children if c is not None]


def _exprs(tree: Any) -> tuple[Node, ...]:
    return tuple(lower(c) for c in _children(tree)) if tree is not None else ()


def _literal(token: lark.Token) -> Node:
    value = cel.evaluate(str(token))  # the Rust library's own reading of the literal
    return Node("lit", value=value)


def lower(tree: Any) -> Node:
    rule = tree.data
    kids = _children(tree)
    if rule in ("expr", "conditionalor", "conditionaland"):
        if len(kids) == 1:
            return lower(kids[0])
        if rule == "expr":
            return Node("op", "?:", tuple(lower(k) for k in kids))
        return Node(
            "op", "||" if rule == "conditionalor" else "&&", (lower(kids[0]), lower(kids[1]))
        )
    if rule in ("relation", "addition", "multiplication"):
        if len(kids) == 1:
            return lower(kids[0])
        left = kids[0]
        return Node("op", _BINARY[left.data], (lower(_children(left)[0]), lower(kids[1])))
    if rule == "unary":
        if len(kids) == 1:
            return lower(kids[0])
        return Node("op", "!" if kids[0].data == "unary_not" else "-", (lower(kids[1]),))
    if rule in ("member", "primary", "paren_expr"):
        return lower(kids[0])
    if rule == "member_dot":
        return Node("select", str(kids[1]), target=lower(kids[0]))
    if rule == "member_dot_arg":
        receiver = lower(kids[0])
        args = _exprs(kids[2]) if len(kids) > 2 else ()
        if receiver.kind == "ident" and receiver.name in _NAMESPACES:
            return Node("call", f"{receiver.name}.{kids[1]}", args)
        return Node("call", str(kids[1]), args, target=receiver)
    if rule == "member_index":
        return Node("index", args=(lower(kids[1]),), target=lower(kids[0]))
    if rule == "member_object":
        return Node(
            "object",
            args=tuple(lower(k) for k in _children(kids[1])[1::2]) if len(kids) > 1 else (),
        )
    if rule in ("ident_arg", "dot_ident_arg"):
        return Node("call", str(kids[0]), _exprs(kids[1]) if len(kids) > 1 else ())
    if rule in ("ident", "dot_ident"):
        return Node("ident", str(kids[0]))
    if rule == "literal":
        return _literal(kids[0])
    if rule == "list_lit":
        return Node("list", args=_exprs(kids[0]) if kids else ())
    if rule == "map_lit":
        return Node("map", args=_exprs(kids[0]) if kids else ())
    raise ValueError(f"unexpected syntax {rule}")
