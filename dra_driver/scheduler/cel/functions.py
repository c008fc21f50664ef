"""The stateless CEL functions of the scheduler's environment, as Python functions for the Rust
library's context: ext.Strings version 2, k8s ``library.Lists``, ext.Lists version 3, ext.Sets,
k8s ``library.Regex`` (RE2), DRA's ``includes`` and cel-go's ``bool()``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import cel
import re2  # type: ignore[import-untyped]

from dra_driver.scheduler.cel.values import MAX_LIST_VALUES, no_overload, type_name


# ext.Strings version 2 (cel-go ext/strings.go; base.go enables StringsVersion(2)). Indexes and
# lengths are in code points, as Python's str counts them.
def _str(function: str, *args: Any) -> None:
    if not all(isinstance(a, str) for a in args):
        raise no_overload(function, *args)


def _int(function: str, *args: Any) -> None:
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
        raise no_overload(function, *args)


def _char_at(s: Any, i: Any) -> str:
    _str("charAt", s)
    _int("charAt", i)
    if i < 0 or i > len(s):
        raise IndexError(f"index out of range: {i}")
    return s[i] if i < len(s) else ""


def _index_of(target: Any, x: Any, offset: Any = 0) -> int:
    if isinstance(target, list):  # k8s library/lists.go
        for i, item in enumerate(target):
            if _cel_equal(item, x):
                return i
        return -1
    _str("indexOf", target, x)
    _int("indexOf", offset)
    if offset < 0 or offset > len(target):
        raise IndexError(f"index out of range: {offset}")
    return int(target.find(x, offset))


def _last_index_of(target: Any, x: Any, offset: Any = None) -> int:
    if isinstance(target, list):  # k8s library/lists.go
        for i in range(len(target) - 1, -1, -1):
            if _cel_equal(target[i], x):
                return i
        return -1
    _str("lastIndexOf", target, x)
    if offset is None:
        return int(target.rfind(x))
    _int("lastIndexOf", offset)
    if offset < 0 or offset > len(target):
        raise IndexError(f"index out of range: {offset}")
    return int(target.rfind(x, 0, offset + len(x)))


def _ascii_case(s: Any, upper: bool) -> str:
    _str("upperAscii" if upper else "lowerAscii", s)
    if upper:
        return "".join(chr(ord(c) - 32) if "a" <= c <= "z" else c for c in s)
    return "".join(chr(ord(c) + 32) if "A" <= c <= "Z" else c for c in s)


def _replace(s: Any, old: Any, new: Any, n: Any = -1) -> str:
    _str("replace", s, old, new)
    _int("replace", n)
    return str(s.replace(old, new) if n < 0 else s.replace(old, new, n))


def _split(s: Any, sep: Any, n: Any = -1) -> list[str]:
    _str("split", s, sep)
    _int("split", n)
    if n == 0:
        return []
    if sep == "":  # Go's strings.SplitN with an empty separator: code points
        chars = list(s)
        if n < 0 or n >= len(chars):
            return chars
        return [*chars[: n - 1], "".join(chars[n - 1 :])]
    return list(s.split(sep) if n < 0 else s.split(sep, n - 1))


def _substring(s: Any, start: Any, end: Any = None) -> str:
    _str("substring", s)
    end = len(s) if end is None else end
    _int("substring", start, end)
    if start < 0 or end > len(s) or start > end:
        raise IndexError(f"substring: range [{start}:{end}] out of range for length {len(s)}")
    return str(s[start:end])


def _trim(s: Any) -> str:
    _str("trim", s)
    return str(s.strip())


def _join(items: Any, sep: Any = "") -> str:
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise no_overload("join", items, sep)
    _str("join", sep)
    return str(sep.join(items))


def _quote(s: Any) -> str:
    _str("strings.quote", s)
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    escapes |= {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\v": "\\v"}
    return '"' + "".join(escapes.get(c, c) for c in s) + '"'


def _cel_equal(a: Any, b: Any) -> bool:
    """CEL equality on converted values: bools are not numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def _list(function: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise no_overload(function, value)
    return value


def _numbers(function: str, value: Any) -> list[Any]:
    items = _list(function, value)
    if not all(isinstance(i, int | float) and not isinstance(i, bool) for i in items):
        if all(isinstance(i, str) for i in items) and function in ("min", "max", "isSorted"):
            return items
        raise no_overload(function, value)
    return items


# k8s library/lists.go (Lists version 0: isSorted, sum, min, max, indexOf, lastIndexOf)
def _is_sorted(value: Any) -> bool:
    items = _numbers("isSorted", value)
    return all(a <= b for a, b in itertools.pairwise(items))


def _sum(value: Any) -> Any:
    return sum(_numbers("sum", value))


def _min_max(function: str, value: Any) -> Any:
    items = _numbers(function, value)
    if not items:
        raise ValueError(f"{function}(list) called on an empty list")
    return min(items) if function == "min" else max(items)


# ext.Lists version 3 (cel-go ext/lists.go): slice, flatten, distinct, reverse, sort,
# first, last, lists.range (sortBy is a macro: not supported)
def _slice(value: Any, start: Any, end: Any) -> list[Any]:
    items = _list("slice", value)
    _int("slice", start, end)
    if start < 0 or end < 0 or start > end or end > len(items):
        raise IndexError(f"cannot slice({start}, {end}) a list of length {len(items)}")
    return list(items[start:end])


def _flatten(value: Any, depth: Any = 1) -> list[Any]:
    _int("flatten", depth)
    if depth < 0:
        raise ValueError("level must be non-negative")
    items = _list("flatten", value)
    out: list[Any] = []
    for item in items:
        if isinstance(item, list) and depth > 0:
            out.extend(_flatten(item, depth - 1))
        else:
            out.append(item)
    return out


def _distinct(value: Any) -> list[Any]:
    out: list[Any] = []
    for item in _list("distinct", value):
        if not any(_cel_equal(item, seen) for seen in out):
            out.append(item)
    return out


def _reverse(value: Any) -> list[Any]:
    # strings' reverse() is StringsVersion(3), which Kubernetes does not enable
    return list(reversed(_list("reverse", value)))


def _sort(value: Any) -> list[Any]:
    return sorted(_numbers("sort", value) if value and not isinstance(value[0], str) else value)


def _first(value: Any) -> Any:
    items = _list("first", value)
    return cel.OptionalValue.of(items[0]) if items else cel.OptionalValue.none()


def _last(value: Any) -> Any:
    items = _list("last", value)
    return cel.OptionalValue.of(items[-1]) if items else cel.OptionalValue.none()


def _range(n: Any) -> list[int]:
    _int("lists.range", n)
    return list(range(n))


# ext.Sets (cel-go ext/sets.go)
def _sets_contains(a: Any, b: Any) -> bool:
    return all(any(_cel_equal(x, y) for y in _list("sets.contains", a)) for x in _list("", b))


def _sets_equivalent(a: Any, b: Any) -> bool:
    return _sets_contains(a, b) and _sets_contains(b, a)


def _sets_intersects(a: Any, b: Any) -> bool:
    return any(any(_cel_equal(x, y) for y in _list("sets.intersects", a)) for x in _list("", b))


# k8s library/regex.go (RE2 through the bindings cel-python brings)
def _find(s: Any, pattern: Any) -> str:
    _str("find", s, pattern)
    m = re2.search(pattern, s)
    return m.group(0) if m else ""


def _find_all(s: Any, pattern: Any, n: Any = -1) -> list[str]:
    _str("findAll", s, pattern)
    _int("findAll", n)
    if n == 0:
        return []
    found = [m.group(0) for m in re2.finditer(pattern, s)]
    return found if n < 0 else found[:n]


# DRA's includes (cel/compile.go includesFunc): scalar or list, lists up to 48 values
def _includes(target: Any, x: Any) -> bool:
    if isinstance(target, list):
        if len(target) > MAX_LIST_VALUES:
            raise ValueError(
                f"'includes' function cannot be applied to lists longer than {MAX_LIST_VALUES}"
                " values"
            )
        return any(_cel_equal(item, x) for item in target)
    return _cel_equal(target, x)


def _bool(value: Any) -> bool:
    """cel-go's bool() conversion (the Rust library has none)."""
    if isinstance(value, bool):
        return value
    table = {"1": True, "t": True, "true": True, "TRUE": True, "True": True}
    table |= {"0": False, "f": False, "false": False, "FALSE": False, "False": False}
    if isinstance(value, str) and value in table:
        return table[value]
    raise ValueError(f"type conversion error from {type_name(value)} {value!r} to bool")


STATELESS: dict[str, Callable[..., Any]] = {
    "charAt": _char_at,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "lowerAscii": lambda s: _ascii_case(s, upper=False),
    "upperAscii": lambda s: _ascii_case(s, upper=True),
    "replace": _replace,
    "split": _split,
    "substring": _substring,
    "trim": _trim,
    "join": _join,
    "strings.quote": _quote,
    "isSorted": _is_sorted,
    "sum": _sum,
    "min": lambda v: _min_max("min", v),
    "max": lambda v: _min_max("max", v),
    "slice": _slice,
    "flatten": _flatten,
    "distinct": _distinct,
    "reverse": _reverse,
    "sort": _sort,
    "first": _first,
    "last": _last,
    "lists.range": _range,
    "sets.contains": _sets_contains,
    "sets.equivalent": _sets_equivalent,
    "sets.intersects": _sets_intersects,
    "find": _find,
    "findAll": _find_all,
    "includes": _includes,
    "bool": _bool,
}
