"""The one strict field reader: typed access to decoded JSON/YAML data, every problem named by
its field path.

Everything Tessera reads that someone else could have written is first turned into plain JSON
data within byte-level limits (:mod:`agent.decode.bounds`), then read field by field here: the
checkpoint, claims and their files, opaque parameters, the energy and fault files, answers of the
API server and the inputs of ``tessera explain``. A reader takes a value and the path it was
found at and returns it typed, or raises :class:`FieldError` whose text names the path, the
offending value and what is allowed::

    status.allocation.devices.results[0].request: missing
    spec.devices.requests[1].exactly.count: expected an integer, got a string: "2"
    spec.devices.requests[1].exactly.count: must be >= 1, got 0

Each caller turns a FieldError into its own layer's error (a corrupt checkpoint, a claim that
cannot be prepared, a malformed explain input). Unknown fields are the caller's choice: the
checkpoint and the kubelet's claim reads ignore them (a later build may add some, and the API
server has checked the claim), opaque parameters and ``explain``'s files refuse them
(:func:`check_known`, :func:`first_unknown`).

Why our own reader rather than msgspec or pydantic: the objects Tessera reads are Kubernetes
objects whose checks depend on each other (``count`` only with ``ExactCount``, a request name
used in constraints, quantities, CEL), which those libraries would only express as validators
around their models; their error texts ("Expected `int`, got `str` - at `$.spec[0]`") are less
precise than the messages users and tests rely on; and the agent's cold start (benchmarked, and
limited by ``tests/test_architecture.py``) would pay for importing them. The readers are small
functions over plain data: no import cost, no model classes to keep in step with the API.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SHOWN_CHARS = 60
"""Of a value put in an error message, at most this many characters are shown."""


class FieldError(ValueError):
    """A field of untrusted data is missing or wrong: ``path`` is the field
    (``spec.devices.requests[0].name``; empty: the object itself), ``message`` what is wrong,
    with the value and what is allowed. ``str()`` is ``path: message``."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``value`` as JSON writes it (strings quoted, control characters escaped), cut to about
    ``limit`` characters: an untrusted value in a message stays one short, printable line."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    except (ValueError, RecursionError):  # NaN, a cycle: never in decoded data
        text = repr(value)
    if not text.isprintable():
        text = json.dumps(value, default=repr)
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


def kind_of(value: object) -> str:
    """What ``value`` is, in the words of a message: ``an object``, ``a list``, ``null``..."""
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return f"a {type(value).__name__}"


def got(value: object) -> str:
    """``an integer: 5``, ``a string: "x"``, ``null``: what came instead."""
    return "null" if value is None else f"{kind_of(value)}: {shown(value)}"


def is_a(value: object) -> str:
    """``"50" is a string``: a value of the wrong kind, named (``null``)."""
    return "null" if value is None else f"{shown(value)} is {kind_of(value)}"


def expected(what: str, value: object, path: str) -> FieldError:
    """The error for a value of the wrong kind: ``path: expected <what>, got <kind>: <value>``
    (``missing`` when there is none)."""
    if value is None:
        return FieldError(path, "missing")
    return FieldError(path, f"expected {what}, got {got(value)}")


def at(path: str, name: str) -> str:
    """The path of field ``name`` of the object at ``path``."""
    return f"{path}.{name}" if path else name


def obj(value: object, path: str, *, optional: bool = False) -> Mapping[str, Any]:
    """An object (JSON's ``{}``); absent (None) is ``{}`` when ``optional``."""
    if type(value) is dict:  # the common case, without the ABC check's cost
        return value
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        raise expected("an object", value, path)
    return value


def items(value: object, path: str, *, required: bool = False) -> Sequence[Any]:
    """A list; absent (None) is an empty one, or ``missing`` when ``required``."""
    if value is None and not required:
        return ()
    if not isinstance(value, list | tuple):
        raise expected("a list", value, path)
    return value


def objects(value: object, path: str, *, required: bool = False) -> list[Mapping[str, Any]]:
    """A list of objects (absent: empty, or ``missing`` when ``required``)."""
    return [obj(v, f"{path}[{i}]") for i, v in enumerate(items(value, path, required=required))]


def text(value: object, path: str, *, nonempty: bool = False) -> str:
    """A string (``nonempty``: not ``""``); absent is ``missing``."""
    if not isinstance(value, str):
        raise expected("a non-empty string" if nonempty else "a string", value, path)
    if nonempty and not value:
        raise FieldError(path, 'expected a non-empty string, got ""')
    return value


def opt_text(value: object, path: str) -> str | None:
    """A string, or None when absent."""
    return None if value is None else text(value, path)


def texts(value: object, path: str, *, required: bool = False) -> tuple[str, ...]:
    """A list of strings (absent: empty, or ``missing`` when ``required``)."""
    return tuple(
        text(v, f"{path}[{i}]") for i, v in enumerate(items(value, path, required=required))
    )


def integer(value: object, path: str, *, low: int | None = None, high: int | None = None) -> int:
    """An integer (not a boolean), within ``low``..``high`` where given."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise expected("an integer", value, path)
    if low is not None and value < low:
        raise FieldError(path, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise FieldError(path, f"must be <= {high}, got {value}")
    return value


def opt_integer(value: object, path: str) -> int | None:
    """An integer, or None when absent."""
    return None if value is None else integer(value, path)


def number(value: object, path: str, *, low: float | None = None) -> float:
    """A finite number (an integer or a float, not a boolean), at least ``low`` where given."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise expected("a number", value, path)
    if low is not None and value < low:
        raise FieldError(path, f"must be >= {low:g}, got {shown(value)}")
    return float(value)


def flag(value: object, path: str, *, default: bool | None = False) -> bool:
    """true or false; absent is ``default`` (None: absent is not allowed)."""
    if value is None and default is not None:
        return default
    if not isinstance(value, bool):
        raise FieldError(path, f"expected true or false, got {got(value)}")
    return value


def one_of(value: object, path: str, allowed: Sequence[str]) -> str:
    """One of the strings ``allowed``."""
    if not isinstance(value, str) or value not in allowed:
        if value is None:
            raise FieldError(path, f"missing; allowed: {', '.join(allowed)}")
        raise FieldError(path, f"{shown(value)} is not allowed; allowed: {', '.join(allowed)}")
    return value


# -- unknown fields -----------------------------------------------------------------------------


def field_name(key: object) -> str:
    """A field name as written (``turbo``); a key YAML made a number or null, or one with
    characters that do not print, as JSON (``1``, ``"a\\u001e"``)."""
    name = key if isinstance(key, str) and key.isprintable() else shown(key)
    return name if len(name) <= SHOWN_CHARS else name[: SHOWN_CHARS - 3] + "..."


class UnknownField(FieldError):
    """An object has fields its type does not define: ``path`` is the object, ``names`` the
    unknown fields (as written), ``allowed`` the fields it may have, ``hint`` why a name is
    wrong when known (a field of an older API version)."""

    def __init__(
        self, path: str, names: Sequence[str], allowed: Collection[str], hint: str = ""
    ) -> None:
        self.names = tuple(names)
        self.allowed = tuple(allowed)
        self.hint = hint
        super().__init__(
            path, f"unknown field(s) {', '.join(self.names)}; allowed: {', '.join(self.allowed)}"
        )

    @property
    def field(self) -> str:
        """The first unknown field's own path (``spec.devices.requests[0].selector``)."""
        return at(self.path, self.names[0])


def check_known(value: Mapping[Any, Any], path: str, allowed: Collection[str]) -> None:
    """Raise UnknownField when ``value`` has a field not in ``allowed``."""
    unknown = sorted(field_name(k) for k in value if k not in allowed)
    if unknown:
        raise UnknownField(path, unknown, allowed)


@dataclass(frozen=True)
class Shape:
    """The fields an object type defines, for :func:`first_unknown`: ``fields`` maps each field
    to the shape of its value (None: any value, not looked into); ``each`` is the shape of every
    value of a map (``labels``, ``attributes``) instead; ``hints`` says why a name some writers
    use is wrong. A list field has the shape of its items."""

    fields: Mapping[str, Shape | None] | None = None
    each: Shape | None = None
    hints: Mapping[str, str] | None = None


def first_unknown(value: object, shape: Shape, path: str = "") -> UnknownField | None:
    """The first field of ``value`` (depth first, in the order written) that ``shape`` does not
    define, or None. Values of the wrong kind are not this check's business (the readers above
    say what is wrong with them)."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = first_unknown(item, shape, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if not isinstance(value, Mapping):
        return None
    for key, child in value.items():
        if shape.each is not None:
            sub: Shape | None = shape.each
        elif shape.fields is None:
            return None
        elif key not in shape.fields:
            hint = (shape.hints or {}).get(key, "") if isinstance(key, str) else ""
            return UnknownField(path, [field_name(key)], sorted(shape.fields), hint)
        else:
            sub = shape.fields[key]
        if sub is not None:
            found = first_unknown(child, sub, at(path, field_name(key)))
            if found is not None:
                return found
    return None
