"""A small evaluator for the part of Kubernetes' CEL that the examples' device selectors use.

Not a CEL implementation: it knows literals (strings, integers, true/false), ``device`` with its
``driver``, ``attributes``, ``capacity`` and ``allowMultipleAllocations``, member and index
access, ``in`` on a map, ``!``, ``&&``, ``||``, comparisons, parentheses, and the functions
``quantity()``, ``semver()``, ``startsWith``, ``endsWith``, ``contains``, ``compareTo``,
``isGreaterThan`` and ``isLessThan``. Anything else is a ``CelError``, so an example written with
more of the language fails its test instead of passing unchecked.

A device's attributes and capacities are grouped by domain, as the scheduler shows them to CEL
(KEP-4381, "CEL": ``device.attributes["gpu.tessera.dev"].productName``); bare names are in the
driver's domain. Reading an attribute the device lacks is an error, as it is in Kubernetes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dra_driver.devices import AdvertisedDevice
from dra_driver.quantity import Quantity, parse_quantity


class CelError(Exception):
    pass


class _RuntimeError(CelError):
    """An error while evaluating (a missing key, a wrong type), as opposed to a parse error."""


@dataclass(frozen=True, order=True)
class Semver:
    parts: tuple[int, int, int]

    @classmethod
    def parse(cls, text: str) -> Semver:
        m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\+.*)?", text)
        if not m:
            raise CelError(f"semver({text!r}): not a semantic version")
        return cls((int(m[1]), int(m[2]), int(m[3])))


def device_view(d: AdvertisedDevice, driver: str) -> dict[str, Any]:
    """``device`` as a selector sees it."""
    attributes: dict[str, dict[str, Any]] = {}
    for name, value in d.attributes:
        domain, _, bare = name.rpartition("/")
        ((kind, raw),) = value.items()
        attributes.setdefault(domain or driver, {})[bare] = (
            Semver.parse(str(raw)) if kind == "version" else raw
        )
    capacity = {driver: {name: parse_quantity(q) for name, q in d.capacity}}
    return {
        "driver": driver,
        "attributes": attributes,
        "capacity": capacity,
        "allowMultipleAllocations": d.allow_multiple_allocations,
    }


_TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<int>\d+)
    | (?P<op>&&|\|\||==|!=|>=|<=|[<>!().\[\],])
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE,
)


def _tokens(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise CelError(f"cannot read {text[pos : pos + 20]!r}")
        pos = m.end()
        if m["str"] is not None:
            out.append(("lit", m["str"][1:-1].encode().decode("unicode_escape")))
        elif m["int"] is not None:
            out.append(("lit", int(m["int"])))
        elif m["op"] is not None:
            out.append(("op", m["op"]))
        elif m["name"] in ("true", "false"):
            out.append(("lit", m["name"] == "true"))
        elif m["name"] == "in":
            out.append(("op", "in"))
        else:
            out.append(("name", m["name"]))
    return out


def _compare(a: Any, b: Any) -> int:
    if type(a) is not type(b) and not (isinstance(a, int) and isinstance(b, int)):
        raise _RuntimeError(f"cannot compare {type(a).__name__} with {type(b).__name__}")
    return (a > b) - (a < b)


def _method(target: Any, name: str, args: list[Any]) -> Any:
    if isinstance(target, str) and name in ("startsWith", "endsWith", "contains") and args:
        (arg,) = args
        return {"startsWith": target.startswith, "endsWith": target.endswith}.get(
            name, target.__contains__
        )(arg)
    if isinstance(target, (Quantity, Semver)) and name == "compareTo":
        (arg,) = args
        return _compare(target, arg)
    if isinstance(target, Semver) and name in ("isGreaterThan", "isLessThan"):
        (arg,) = args
        return _compare(target, arg) == (1 if name == "isGreaterThan" else -1)
    raise _RuntimeError(f"method {name}() on {type(target).__name__} is not supported")


_FUNCTIONS = {"quantity": parse_quantity, "semver": Semver.parse}
_RELATIONS = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">=": lambda a, b: _compare(a, b) >= 0,
    "<=": lambda a, b: _compare(a, b) <= 0,
    ">": lambda a, b: _compare(a, b) > 0,
    "<": lambda a, b: _compare(a, b) < 0,
}


Node = Callable[[dict[str, Any]], Any]
"""A parsed expression: evaluates itself on ``device``."""


class _Parser:
    """Recursive descent into closures over ``device``. ``&&`` and ``||`` follow CEL: false
    (true) when either side is, even if the other side is an error; an error otherwise."""

    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.pos = 0

    def peek(self) -> tuple[str, Any] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, kind: str, value: Any = None) -> Any:
        tok = self.peek()
        if tok is None or tok[0] != kind or (value is not None and tok[1] != value):
            raise CelError(f"expected {value or kind}, got {tok}")
        self.pos += 1
        return tok[1]

    def at(self, value: str) -> bool:
        tok = self.peek()
        return tok is not None and tok[0] == "op" and tok[1] == value

    def parse(self) -> Node:
        node = self.or_()
        if self.peek() is not None:
            raise CelError(f"unexpected {self.peek()}")
        return node

    def or_(self) -> Node:
        node = self.and_()
        while self.at("||"):
            self.pos += 1
            node = _logical(node, self.and_(), True)
        return node

    def and_(self) -> Node:
        node = self.relation()
        while self.at("&&"):
            self.pos += 1
            node = _logical(node, self.relation(), False)
        return node

    def relation(self) -> Node:
        left = self.unary()
        tok = self.peek()
        if tok is None or tok[0] != "op" or not (tok[1] in _RELATIONS or tok[1] == "in"):
            return left
        self.pos += 1
        right = self.unary()
        if tok[1] == "in":
            return lambda d: _contains(right(d), left(d))
        relation = _RELATIONS[tok[1]]
        return lambda d: relation(left(d), right(d))

    def unary(self) -> Node:
        if self.at("!"):
            self.pos += 1
            inner = self.unary()
            return lambda d: not _boolean(inner(d))
        return self.member()

    def args(self) -> list[Node]:
        self.take("op", "(")
        out = []
        while not self.at(")"):
            out.append(self.or_())
            if not self.at(")"):
                self.take("op", ",")
        self.take("op", ")")
        return out

    def member(self) -> Node:
        node = self.primary()
        while True:
            if self.at("."):
                self.pos += 1
                name = self.take("name")
                if self.at("("):
                    node = _call_method(node, name, self.args())
                else:
                    node = _select(node, lambda d, name=name: name)
            elif self.at("["):
                self.pos += 1
                key = self.or_()
                self.take("op", "]")
                node = _select(node, key)
            else:
                return node

    def primary(self) -> Node:
        tok = self.peek()
        if tok is None:
            raise CelError("unexpected end")
        if tok[0] == "lit":
            self.pos += 1
            value = tok[1]
            return lambda d: value
        if tok == ("op", "("):
            self.pos += 1
            node = self.or_()
            self.take("op", ")")
            return node
        name = self.take("name")
        if name == "device":
            return lambda d: d
        if name in _FUNCTIONS and self.at("("):
            (arg,) = self.args()
            function = _FUNCTIONS[name]
            return lambda d: function(arg(d))
        raise CelError(f"unknown name {name!r}")


def _logical(left: Node, right: Node, is_or: bool) -> Node:
    def node(d: dict[str, Any]) -> bool:
        values: list[bool | _RuntimeError] = []
        for side in (left, right):
            try:
                values.append(_boolean(side(d)))
            except _RuntimeError as exc:
                values.append(exc)
        if is_or in values:
            return is_or
        for v in values:
            if isinstance(v, _RuntimeError):
                raise v
        return not is_or

    return node


def _call_method(target: Node, name: str, args: list[Node]) -> Node:
    return lambda d: _method(target(d), name, [a(d) for a in args])


def _select(target: Node, key: Node) -> Node:
    return lambda d: _field(target(d), key(d))


def _contains(container: Any, key: Any) -> bool:
    if not isinstance(container, dict):
        raise _RuntimeError("`in` is supported on maps only")
    return key in container


def _field(value: Any, key: Any) -> Any:
    if not isinstance(value, dict):
        raise _RuntimeError(f"cannot select {key!r} from {type(value).__name__}")
    if key not in value:
        raise _RuntimeError(f"no such key: {key!r}")
    return value[key]


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _RuntimeError(f"expected a boolean, got {value!r}")
    return value


def evaluate(expression: str, device: dict[str, Any]) -> bool:
    """The selector's verdict on one device (CelError for what this subset cannot evaluate,
    and for a runtime error such as a missing attribute)."""
    return _boolean(_Parser(expression).parse()(device))
