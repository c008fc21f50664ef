"""The CEL environment the Kubernetes scheduler evaluates DRA device selectors in, for Python.

What the scheduler does (k8s.io/dynamic-resource-allocation ``cel/compile.go``): one variable,
``device``, with ``driver``, ``attributes``, ``capacity`` and ``allowMultipleAllocations``;
attributes and capacity are maps of domain to maps of name to value, where a bare name is in
the driver's domain and a qualified name splits at its first ``/`` (``parseQualifiedName``); an
unknown domain is an empty map (``newStringInterfaceMapWithDefault``), a missing name in a domain
is the runtime error ``no such key: NAME``; a result that is not a bool is an error; the
expression is type-checked and its worst-case cost estimated at compile time (the apiserver
refuses selectors over ``CELSelectorExpressionMaxCost``, 1,000,000) and longer than 10 Ki
characters (``CELSelectorExpressionMaxLength``). On top of the base environment of
k8s.io/apiserver ``pkg/cel/environment/base.go``: ``library.Quantity``, ``library.SemverLib(1)``,
``library.Regex``, ``library.Lists``, ``ext.Strings(2)``, ``ext.Sets``, ``ext.Lists(3)``,
``ext.TwoVarComprehensions``, ``ext.Bindings`` (DRA's own) and DRA's ``includes``.

How this module does it:

- **Evaluation**: the ``common-expression-language`` package (module ``cel``; the Rust ``cel``
  crate through PyO3), about 2 to 10 µs per evaluation when a device's CEL value is converted
  once (``DeviceView``) and each expression compiled once (``Selector``). The Kubernetes
  functions are Python functions registered in the ``cel.Context`` (``x.f(y)`` calls ``f(x, y)``);
  expressions are never rewritten.
- **Parsing for analysis**: ``cel-python``'s lark parser (``celpy.celparser.CELParser``) gives
  the syntax tree that the compile-time checks, the cost estimate and ``Verdict.seen`` walk.

Representation (the Rust library carries only plain CEL values, no custom types):

- a quantity is the map ``{"@quantity": D}`` where D is its exact value as a canonical decimal
  (``"1073741824"``, ``"0.5"``), so CEL's map equality is ``Quantity.Equal``:
  ``quantity("1Gi") == quantity("1073741824")`` and ``quantity("1") == quantity("1000m")``;
- a version is the map ``{"@semver": V}`` where V is the version without build metadata
  (``"1.2.3-rc.1"``), so equality is blang/semver's ``EQ``, which ignores build metadata;
- ``<``/``>`` on either are "no such overload", as in Kubernetes (use ``isLessThan`` & co).

Where this differs from the scheduler's cel-go (docs/explain.md "CEL environment" says the same):

- no static type checker: a type error the apiserver reports at compile time (``1 + "a"``,
  ``1 == 1.0``, which the Rust library evaluates as true) is a runtime error or a result here;
  only a non-bool literal or arithmetic result is refused at compile time;
- ``size()`` of a string counts UTF-8 bytes, not code points (a native function the library
  does not let us replace); the string extension functions count code points, as cel-go's do;
- not supported, refused at compile time with a message saying so: ``cel.bind`` (ext.Bindings),
  the two-variable comprehensions, the optional syntax ``x.?f``/``m[?k]``, ``sortBy``, and the
  format, IP, CIDR, URL and authz libraries;
- the cost is estimated statically in the spirit of cel-go's estimator (``estimated_cost``) and
  refused above the limit, but not metered during evaluation;
- an unknown domain is an empty map for the domains the expression names literally
  (``device.attributes["other.com"]``); one computed at run time is a ``no such key`` error;
- ``find``/``findAll`` use the RE2 bindings that come with cel-python (``re2``); ``matches`` is
  the Rust library's (the ``regex`` crate: RE2 syntax, linear time).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import cel
import lark
import re2  # type: ignore[import-untyped]
from celpy.celparser import CELParseError, CELParser

from dra_driver.errors import QuantityError
from dra_driver.quantity import NANO, parse_quantity

MAX_EXPRESSION_CHARS = 10_240  # resourceapi.CELSelectorExpressionMaxLength
COST_LIMIT = 1_000_000  # resourceapi.CELSelectorExpressionMaxCost

# Size bounds of a device (k8s.io/api resource/v1 types, used by cel/compile.go's estimator).
MAX_ATTRIBUTES = 32  # ResourceSliceMaxAttributesAndCapacitiesPerDevice
MAX_DOMAIN_CHARS = 63  # DeviceMaxDomainLength
MAX_ID_CHARS = 32  # DeviceMaxIDLength
MAX_DRIVER_CHARS = 63  # DriverNameMaxLength
MAX_VALUE_CHARS = 64  # DeviceAttributeMaxValueLength
MAX_LIST_VALUES = 48  # ResourceSliceMaxAttributeValuesPerDevice ('includes' refuses longer)

MISSING = "<missing>"
MEMO_ENTRIES = 65_536
"""Verdicts a selector remembers (by the values it read) before it starts over."""
QUANTITY_TAG = "@quantity"
SEMVER_TAG = "@semver"
_UNBOUNDED = 2**64 - 1  # cel-go's estimate for a size nothing bounds

# cel-go cost factors (cel-go common/cost.go), used the way k8s' library/cost.go uses them.
_TRAVERSAL = 0.1  # StringTraversalCostFactor
_REGEX = 0.25  # RegexStringLengthCostFactor
_LIST_CREATE = 10  # ListCreateBaseCost
_MAP_CREATE = 30  # MapCreateBaseCost
_OBJECT_CREATE = 40  # StructCreateBaseCost


class _DropFunctionFailures(logging.Filter):
    """The Rust library logs every exception a registered function raises at WARNING; ours
    raise on purpose (a missing attribute, a bad quantity) and the error reaches the caller
    in the Verdict, so those records are noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Python function ")


logging.getLogger("cel").addFilter(_DropFunctionFailures())


class CelCompileError(ValueError):
    """An expression the environment refuses: ``.expression``, ``.reason``."""

    def __init__(self, expression: str, reason: str) -> None:
        shown = expression if len(expression) <= 200 else expression[:197] + "..."
        super().__init__(f"CEL expression {json.dumps(shown)}: {reason}")
        self.expression = expression
        self.reason = reason


@dataclass(frozen=True)
class Verdict:
    """What one selector said about one device."""

    matched: bool  # False whenever error is set
    error: str | None = None
    seen: tuple[tuple[str, str], ...] = ()  # (path as written, value rendered) or "<missing>"


# -- quantities and versions as CEL values ----------------------------------------------------


def _decimal_text(nanos: int) -> str:
    """The canonical exact decimal of a value in nanos: ``1073741824``, ``0.5``, ``-0.001``."""
    sign = "-" if nanos < 0 else ""
    whole, frac = divmod(abs(nanos), NANO)
    if not frac:
        return f"{sign}{whole}"
    return f"{sign}{whole}.{str(frac).rjust(9, '0').rstrip('0')}"


def _quantity_value(nanos: int) -> dict[str, str]:
    return {QUANTITY_TAG: _decimal_text(nanos)}


@dataclass(frozen=True)
class _Semver:
    major: int
    minor: int
    patch: int
    pre: tuple[int | str, ...]

    def text(self) -> str:
        core = f"{self.major}.{self.minor}.{self.patch}"
        return core + ("-" + ".".join(str(p) for p in self.pre) if self.pre else "")

    def compare(self, other: _Semver) -> int:
        """blang/semver ``Version.Compare``: numbers, then a release above its pre-releases,
        then pre-release identifiers pairwise (numeric below alphanumeric), shorter first."""
        a, b = (self.major, self.minor, self.patch), (other.major, other.minor, other.patch)
        if a != b:
            return 1 if a > b else -1
        if not self.pre or not other.pre:
            return (not self.pre) - (not other.pre)
        for x, y in zip(self.pre, other.pre, strict=False):
            if x == y:
                continue
            if isinstance(x, int) and isinstance(y, int):
                return 1 if x > y else -1
            if isinstance(x, int) or isinstance(y, int):
                return -1 if isinstance(x, int) else 1
            return 1 if str(x) > str(y) else -1
        return (len(self.pre) > len(other.pre)) - (len(self.pre) < len(other.pre))


_DIGITS = frozenset("0123456789")
_ALNUM = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-")


def parse_semver(text: str) -> _Semver:
    """blang/semver v4 ``Parse`` (strict semver 2.0.0); ValueError in its words otherwise."""
    if not text:
        raise ValueError("Version string empty")
    parts = text.split(".", 2)
    if len(parts) != 3:
        raise ValueError("No Major.Minor.Patch elements found")
    numbers: list[int] = []
    patch = parts[2]
    build: list[str] = []
    pre: list[str] = []
    if "+" in patch:
        patch, _, meta = patch.partition("+")
        build = meta.split(".")
    if "-" in patch:
        patch, _, release = patch.partition("-")
        pre = release.split(".")
    for what, digits in (("major", parts[0]), ("minor", parts[1]), ("patch", patch)):
        if not set(digits) <= _DIGITS:
            raise ValueError(f"Invalid character(s) found in {what} number {digits!r}")
        if len(digits) > 1 and digits[0] == "0":
            raise ValueError(
                f"{what.capitalize()} number must not contain leading zeroes {digits!r}"
            )
        if not digits or int(digits) >= 2**64:
            raise ValueError(f"invalid {what} number {digits!r}")
        numbers.append(int(digits))
    identifiers: list[int | str] = []
    for ident in pre:
        if not ident:
            raise ValueError("Prerelease is empty")
        if set(ident) <= _DIGITS:
            if len(ident) > 1 and ident[0] == "0":
                raise ValueError(
                    f"Numeric PreRelease version must not contain leading zeroes {ident!r}"
                )
            identifiers.append(int(ident))
        elif set(ident) <= _ALNUM:
            identifiers.append(ident)
        else:
            raise ValueError(f"Invalid character(s) found in prerelease {ident!r}")
    for meta in build:
        if not meta:
            raise ValueError("Build meta data is empty")
        if not set(meta) <= _ALNUM:
            raise ValueError(f"Invalid character(s) found in build meta data {meta!r}")
    return _Semver(numbers[0], numbers[1], numbers[2], tuple(identifiers))


def _normalize_semver(text: str) -> str:
    """k8s library/semverlib.go ``normalizeAndParse``: drop a leading "v", strip leading
    zeros, fill a missing minor and patch with 0."""
    parts = text.removeprefix("v").split(".", 2)
    for i, part in enumerate(parts):
        if len(part) > 1:
            part = part.lstrip("0")
            if not part or part[0] not in _DIGITS:
                part = "0" + part
            parts[i] = part
    if len(parts) < 3:
        if "+" in parts[-1] or "-" in parts[-1]:
            raise ValueError("short version cannot contain PreRelease/Build meta data")
        parts += ["0"] * (3 - len(parts))
    return ".".join(parts)


def _semver_value(version: _Semver) -> dict[str, str]:
    return {SEMVER_TAG: version.text()}


# -- the function library -----------------------------------------------------------------------


def _type_name(value: Any) -> str:
    if isinstance(value, dict):
        if QUANTITY_TAG in value:
            return "quantity"
        if SEMVER_TAG in value:
            return "semver"
        return "map"
    names = {bool: "bool", int: "int", float: "double", str: "string", bytes: "bytes"}
    return names.get(type(value), "list" if isinstance(value, list) else type(value).__name__)


def _no_overload(function: str, *args: Any) -> TypeError:
    kinds = ", ".join(_type_name(a) for a in args)
    return TypeError(f"no such overload: {function}({kinds})")


class _Library:
    """The Kubernetes functions, as Python functions for the Rust library's context. Holds the
    parse caches of one environment (quantities and versions are parsed once per text)."""

    def __init__(self) -> None:
        self._nanos: dict[str, int] = {}
        self._versions: dict[str, _Semver] = {}

    # quantities: k8s.io/apiserver pkg/cel/library/quantity.go
    def nanos(self, value: Any, function: str, *args: Any) -> int:
        text = value.get(QUANTITY_TAG) if isinstance(value, dict) else None
        if not isinstance(text, str):
            raise _no_overload(function, *args)
        cached = self._nanos.get(text)
        if cached is None:
            cached = int(Decimal(text).scaleb(9))
            self._nanos[text] = cached
        return cached

    def version(self, value: Any, function: str, *args: Any) -> _Semver:
        text = value.get(SEMVER_TAG) if isinstance(value, dict) else None
        if not isinstance(text, str):
            raise _no_overload(function, *args)
        cached = self._versions.get(text)
        if cached is None:
            cached = parse_semver(text)
            self._versions[text] = cached
        return cached

    def quantity(self, text: Any) -> dict[str, str]:
        if not isinstance(text, str):
            raise _no_overload("quantity", text)
        try:
            return _quantity_value(parse_quantity(text).nanos)
        except QuantityError as err:
            raise ValueError(str(err)) from None

    def is_quantity(self, text: Any) -> bool:
        if not isinstance(text, str):
            raise _no_overload("isQuantity", text)
        try:
            parse_quantity(text)
        except QuantityError:
            return False
        return True

    def semver(self, text: Any, normalize: Any = False) -> dict[str, str]:
        if not isinstance(text, str) or not isinstance(normalize, bool):
            raise _no_overload("semver", text, normalize)
        return _semver_value(parse_semver(_normalize_semver(text) if normalize else text))

    def is_semver(self, text: Any, normalize: Any = False) -> bool:
        try:
            self.semver(text, normalize)
        except TypeError:
            raise
        except ValueError:
            return False
        return True

    def _compare(self, function: str, a: Any, b: Any) -> int:
        if isinstance(a, dict) and QUANTITY_TAG in a:
            x, y = self.nanos(a, function, a, b), self.nanos(b, function, a, b)
            return (x > y) - (x < y)
        return self.version(a, function, a, b).compare(self.version(b, function, a, b))

    def is_greater_than(self, a: Any, b: Any) -> bool:
        return self._compare("isGreaterThan", a, b) == 1

    def is_less_than(self, a: Any, b: Any) -> bool:
        return self._compare("isLessThan", a, b) == -1

    def compare_to(self, a: Any, b: Any) -> int:
        return self._compare("compareTo", a, b)

    def _operand(self, function: str, a: Any, b: Any) -> int:
        if isinstance(b, int) and not isinstance(b, bool):
            return b * NANO  # resource.NewQuantity(b, DecimalExponent)
        return self.nanos(b, function, a, b)

    def add(self, a: Any, b: Any) -> dict[str, str]:
        return _quantity_value(self.nanos(a, "add", a, b) + self._operand("add", a, b))

    def sub(self, a: Any, b: Any) -> dict[str, str]:
        return _quantity_value(self.nanos(a, "sub", a, b) - self._operand("sub", a, b))

    def as_integer(self, a: Any) -> int:
        nanos = self.nanos(a, "asInteger", a)
        if nanos % NANO or not -(2**63) <= nanos // NANO < 2**63:
            raise ValueError("cannot convert value to integer")
        return nanos // NANO

    def is_integer(self, a: Any) -> bool:
        nanos = self.nanos(a, "isInteger", a)
        return not nanos % NANO and -(2**63) <= nanos // NANO < 2**63

    def as_approximate_float(self, a: Any) -> float:
        return self.nanos(a, "asApproximateFloat", a) / NANO

    def sign(self, a: Any) -> int:
        nanos = self.nanos(a, "sign", a)
        return (nanos > 0) - (nanos < 0)

    def major(self, a: Any) -> int:
        return self.version(a, "major", a).major

    def minor(self, a: Any) -> int:
        return self.version(a, "minor", a).minor

    def patch(self, a: Any) -> int:
        return self.version(a, "patch", a).patch

    def functions(self) -> dict[str, Callable[..., Any]]:
        return {
            "quantity": self.quantity,
            "isQuantity": self.is_quantity,
            "semver": self.semver,
            "isSemver": self.is_semver,
            "isGreaterThan": self.is_greater_than,
            "isLessThan": self.is_less_than,
            "compareTo": self.compare_to,
            "add": self.add,
            "sub": self.sub,
            "asInteger": self.as_integer,
            "isInteger": self.is_integer,
            "asApproximateFloat": self.as_approximate_float,
            "sign": self.sign,
            "major": self.major,
            "minor": self.minor,
            "patch": self.patch,
            **_STATELESS,
        }


# ext.Strings version 2 (cel-go ext/strings.go; base.go enables StringsVersion(2)). Indexes and
# lengths are in code points, as Python's str counts them.
def _str(function: str, *args: Any) -> None:
    if not all(isinstance(a, str) for a in args):
        raise _no_overload(function, *args)


def _int(function: str, *args: Any) -> None:
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
        raise _no_overload(function, *args)


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
        raise _no_overload("join", items, sep)
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
        raise _no_overload(function, value)
    return value


def _numbers(function: str, value: Any) -> list[Any]:
    items = _list(function, value)
    if not all(isinstance(i, int | float) and not isinstance(i, bool) for i in items):
        if all(isinstance(i, str) for i in items) and function in ("min", "max", "isSorted"):
            return items
        raise _no_overload(function, value)
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
    raise ValueError(f"type conversion error from {_type_name(value)} {value!r} to bool")


_STATELESS: dict[str, Callable[..., Any]] = {
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

# The Rust library's own functions (the CEL standard definitions), for the compile-time check
# of unknown names.
_NATIVE = frozenset(
    [
        *("size", "int", "uint", "double", "string", "bytes", "timestamp", "duration"),
        *("dyn", "type", "has", "contains", "startsWith", "endsWith", "matches"),
        *("getFullYear", "getMonth", "getDate", "getDayOfMonth", "getDayOfWeek"),
        *("getDayOfYear", "getHours", "getMinutes", "getSeconds", "getMilliseconds"),
        *("optional.of", "optional.none", "optional.ofNonZeroValue"),
        *("hasValue", "value", "orValue", "or"),
    ]
)
_MACROS = frozenset(("all", "exists", "exists_one", "map", "filter"))
_NAMESPACES = frozenset(("sets", "lists", "strings", "optional", "cel", "math", "base64"))
_UNSUPPORTED = {
    "cel.bind": "cel.bind (ext.Bindings) is not supported by this evaluator (the Rust CEL "
    "library has no such macro); write the attribute path out in full",
    "sortBy": "sortBy (a macro of ext.Lists) is not supported by this evaluator",
    "transformList": "two-variable comprehensions are not supported by this evaluator",
    "transformMap": "two-variable comprehensions are not supported by this evaluator",
    "transformMapEntry": "two-variable comprehensions are not supported by this evaluator",
    "existsOne": "two-variable comprehensions are not supported by this evaluator",
}


# -- the syntax tree (lowered from cel-python's lark tree) --------------------------------------


@dataclass(frozen=True)
class _Node:
    kind: str  # lit ident select index call op list map object
    name: str = ""  # ident name, field, function or operator
    args: tuple[_Node, ...] = ()
    target: _Node | None = None  # receiver of a member call, operand of select/index
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


def _exprs(tree: Any) -> tuple[_Node, ...]:
    return tuple(_lower(c) for c in _children(tree)) if tree is not None else ()


def _literal(token: lark.Token) -> _Node:
    value = cel.evaluate(str(token))  # the Rust library's own reading of the literal
    return _Node("lit", value=value)


def _lower(tree: Any) -> _Node:
    rule = tree.data
    kids = _children(tree)
    if rule in ("expr", "conditionalor", "conditionaland"):
        if len(kids) == 1:
            return _lower(kids[0])
        if rule == "expr":
            return _Node("op", "?:", tuple(_lower(k) for k in kids))
        return _Node(
            "op", "||" if rule == "conditionalor" else "&&", (_lower(kids[0]), _lower(kids[1]))
        )
    if rule in ("relation", "addition", "multiplication"):
        if len(kids) == 1:
            return _lower(kids[0])
        left = kids[0]
        return _Node("op", _BINARY[left.data], (_lower(_children(left)[0]), _lower(kids[1])))
    if rule == "unary":
        if len(kids) == 1:
            return _lower(kids[0])
        return _Node("op", "!" if kids[0].data == "unary_not" else "-", (_lower(kids[1]),))
    if rule in ("member", "primary", "paren_expr"):
        return _lower(kids[0])
    if rule == "member_dot":
        return _Node("select", str(kids[1]), target=_lower(kids[0]))
    if rule == "member_dot_arg":
        receiver = _lower(kids[0])
        args = _exprs(kids[2]) if len(kids) > 2 else ()
        if receiver.kind == "ident" and receiver.name in _NAMESPACES:
            return _Node("call", f"{receiver.name}.{kids[1]}", args)
        return _Node("call", str(kids[1]), args, target=receiver)
    if rule == "member_index":
        return _Node("index", args=(_lower(kids[1]),), target=_lower(kids[0]))
    if rule == "member_object":
        return _Node(
            "object",
            args=tuple(_lower(k) for k in _children(kids[1])[1::2]) if len(kids) > 1 else (),
        )
    if rule in ("ident_arg", "dot_ident_arg"):
        return _Node("call", str(kids[0]), _exprs(kids[1]) if len(kids) > 1 else ())
    if rule in ("ident", "dot_ident"):
        return _Node("ident", str(kids[0]))
    if rule == "literal":
        return _literal(kids[0])
    if rule == "list_lit":
        return _Node("list", args=_exprs(kids[0]) if kids else ())
    if rule == "map_lit":
        return _Node("map", args=_exprs(kids[0]) if kids else ())
    raise ValueError(f"unexpected syntax {rule}")


# -- compile-time checks ------------------------------------------------------------------------


def _check(node: _Node, scope: frozenset[str], known: frozenset[str]) -> None:
    """Refuse what the evaluator cannot do as Kubernetes does, and undeclared names."""
    if node.kind == "ident" and node.name not in scope and node.name != "device":
        raise ValueError(f"undeclared reference to '{node.name}'")
    if node.kind == "call":
        name = node.name
        if name in _UNSUPPORTED:
            raise ValueError(_UNSUPPORTED[name])
        if name in _MACROS and node.target is not None:
            if len(node.args) == 3 and name in ("all", "exists", "exists_one"):
                raise ValueError("two-variable comprehensions are not supported by this evaluator")
            if not node.args or node.args[0].kind != "ident":
                raise ValueError(f"{name}() needs a variable name as its first argument")
            _check(node.target, scope, known)
            inner = scope | {node.args[0].name}
            for arg in node.args[1:]:
                _check(arg, inner, known)
            return
        if name == "has":
            if len(node.args) != 1 or node.args[0].kind != "select":
                raise ValueError("has() needs a field selection as its argument, like has(m.f)")
        elif name not in known:
            raise ValueError(f"undeclared reference to '{name}'")
    for child in (node.target, *node.args):
        if child is not None:
            _check(child, scope, known)


def _result_kind(node: _Node) -> str | None:
    """The type of a result known without a type checker to be no bool, else None."""
    if node.kind == "lit" and not isinstance(node.value, bool):
        return _type_name(node.value) if node.value is not None else "null_type"
    if node.kind in ("list", "map"):
        return node.kind
    if node.kind == "op" and node.name in ("+", "-", "*", "/", "%"):
        return "a number, string or list"
    return None


# -- the cost estimate --------------------------------------------------------------------------


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


def _estimate(node: _Node, scope: Mapping[str, _Type]) -> tuple[int, _Type]:
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
        cost, t = _estimate(node.target, scope)
        cost += 1
        if kind == "index":
            cost += _estimate(node.args[0], scope)[0]
        if t.kind == "device" and kind == "select":
            return cost, _DEVICE_FIELDS.get(node.name, _OTHER)
        return cost, _MEMBER_OF.get(t.kind, _OTHER)
    if kind == "list":
        cost = _LIST_CREATE + sum(_estimate(a, scope)[0] for a in node.args)
        return cost, _Type("list", len(node.args))
    if kind == "map":
        return _MAP_CREATE + sum(_estimate(a, scope)[0] for a in node.args), _Type(
            "map", len(node.args) // 2
        )
    if kind == "object":
        return _OBJECT_CREATE + sum(_estimate(a, scope)[0] for a in node.args), _OTHER
    if kind == "op":
        return _estimate_op(node, scope)
    return _estimate_call(node, scope)


def _estimate_op(node: _Node, scope: Mapping[str, _Type]) -> tuple[int, _Type]:
    parts = [_estimate(a, scope) for a in node.args]
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


def _estimate_call(node: _Node, scope: Mapping[str, _Type]) -> tuple[int, _Type]:
    name = node.name
    if name in _MACROS and node.target is not None:
        return _estimate_comprehension(node, scope)
    target = _estimate(node.target, scope) if node.target is not None else None
    args = [_estimate(a, scope) for a in node.args]
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


def _estimate_comprehension(node: _Node, scope: Mapping[str, _Type]) -> tuple[int, _Type]:
    """cel-go expands each macro into a fold: range cost + size x (condition + step) + result.
    The per-iteration costs are those of the expansions (parser/macro.go): all: condition
    ``@not_strictly_false(accu)`` 2, step ``accu && p`` 1 + p; exists: condition
    ``@not_strictly_false(!accu)`` 3, step ``accu || p`` 1 + p; exists_one: step ``p ? accu + 1
    : accu`` p + 2, result ``accu == 1`` 2; map: step ``accu + [e]`` e + 12; filter: step
    ``p ? accu + [x] : accu`` p + 13."""
    assert node.target is not None
    range_cost, range_type = _estimate(node.target, scope)
    n = range_type.size
    element = _KEY_OF.get(
        range_type.kind,
        _Type("other", MAX_VALUE_CHARS if range_type.kind == "attrvalue" else _UNBOUNDED),
    )
    inner = {**scope, node.args[0].name: element}
    body = [_estimate(a, inner)[0] for a in node.args[1:]]
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


# -- what an expression refers to ---------------------------------------------------------------


def _string_key(node: _Node) -> str | None:
    return node.value if node.kind == "lit" and isinstance(node.value, str) else None


def _device_field(node: _Node | None) -> str | None:
    """``attributes``/``capacity``/``driver``/... when node is ``device.<field>``."""
    if node is None or node.kind != "select" or node.target is None:
        return None
    return node.name if node.target.kind == "ident" and node.target.name == "device" else None


def _domain_of(node: _Node | None) -> tuple[str, str] | None:
    """(field, domain) when node is ``device.attributes["d"]`` or ``device.capacity["d"]``."""
    if node is not None and node.kind == "index" and node.target is not None:
        field = _device_field(node.target)
        domain = _string_key(node.args[0])
        if field in ("attributes", "capacity") and domain is not None:
            return field, domain
    return None


def _references(
    node: _Node, out: dict[str, tuple[str, ...]], domains: set[tuple[str, str]]
) -> bool:
    """The device values node refers to: path as written -> lookup key. True when node reads
    the device only through such literal paths (``device.driver``, ``device.attributes["d"].x``,
    ``device.capacity["d"]["x"]``, ``"x" in device.attributes["d"]``): its result is then a
    function of the values at those keys alone. Any other use of ``device`` (a whole map passed
    to a function, a comprehension over it, a computed key) answers False."""
    literal = False
    if node.kind == "op" and node.name == "in" and len(node.args) == 2:
        key, tested = _string_key(node.args[0]), _domain_of(node.args[1])
        if key is not None and tested is not None:
            written = f"{json.dumps(key)} in device.{tested[0]}[{json.dumps(tested[1])}]"
            out.setdefault(written, ("in", *tested, key))
            literal = True
    if node.kind in ("select", "index"):
        field = _device_field(node)
        if field in ("driver", "allowMultipleAllocations"):
            out.setdefault(f"device.{field}", (field,))
            literal = True
        domain = _domain_of(node)
        if domain is not None:
            domains.add(domain)
        outer = _domain_of(node.target)
        name = node.name if node.kind == "select" else _string_key(node.args[0])
        if outer is not None and name is not None:
            field, dom = outer
            written = f"device.{field}[{json.dumps(dom)}]"
            written += f".{name}" if node.kind == "select" else f"[{json.dumps(name)}]"
            out.setdefault(written, (field, dom, name))
            literal = True
    closed = not (node.kind == "ident" and node.name == "device")
    for child in (node.target, *node.args):
        if child is not None:
            closed = _references(child, out, domains) and closed  # every child is walked
    # a literal path's own parts (device, device.attributes) are read only through it
    return literal or closed


# -- devices, selectors, the environment --------------------------------------------------------


def _render(value: Any) -> str:
    """A value as CEL writes it: strings quoted, bools lower case."""
    return json.dumps(value) if isinstance(value, str | bool) else str(value)


class DeviceView:
    """One device as CEL sees it, converted at most once and reused by every selector.

    Lazy: a selector whose verdict is already known for the values it reads (the memo in
    :class:`Selector`) needs only those values rendered; the whole CEL value and the Rust
    context are built on the first evaluation that needs them."""

    __slots__ = ("_check", "_contexts", "_convert", "_converted", "_functions", "_raw")

    def __init__(
        self,
        raw: tuple[str, Mapping[str, Mapping[str, Any]], Mapping[str, Mapping[str, Any]], bool],
        convert: Callable[..., _Converted],
        functions: dict[str, Callable[..., Any]],
        check: CelEnvironment,
    ) -> None:
        self._check = check
        self._raw = raw
        self._convert = convert
        self._converted: _Converted | None = None
        self._functions = functions
        self._contexts: dict[tuple[frozenset[str], frozenset[str]], Any] = {}

    def _get(self) -> _Converted:
        if self._converted is None:
            self._converted = self._convert(*self._raw)
        return self._converted

    @property
    def _rendered(self) -> dict[tuple[str, ...], str]:
        return self._get().rendered

    @property
    def _error(self) -> str | None:
        return self._get().error

    @property
    def _value(self) -> dict[str, Any]:
        return self._get().value

    def _invalid(self) -> bool:
        """Whether a value of the device cannot be converted (checked without converting the
        rest: versions and quantities are parsed once per distinct text)."""
        if self._converted is not None:
            return self._converted.error is not None
        _, attributes, capacity, _ = self._raw
        try:
            for attribute in attributes.values():
                if "version" in attribute:
                    self._check.version(attribute["version"])
                elif not ("string" in attribute or "int" in attribute or "bool" in attribute):
                    return self._get().error is not None
            for cap in capacity.values():
                self._check.quantity(cap.get("value"))
        except (ValueError, QuantityError):
            return self._get().error is not None
        return False

    def _raw_value(self, key: tuple[str, ...]) -> Any:
        """What the device holds at a selector's memo key, hashable, straight from the API
        form: a name is looked up both qualified and bare, as the conversion files either."""
        driver, attributes, capacity, multi = self._raw
        if key[0] == "driver":
            return driver
        if key[0] == "allowMultipleAllocations":
            return multi
        if key[0] == "in":
            _, field, domain, name = key
        else:
            field, domain, name = key
        source = attributes if field == "attributes" else capacity
        qualified = source.get(f"{domain}/{name}")
        bare = source.get(name) if domain == driver else None
        if key[0] == "in":
            return qualified is not None or bare is not None
        return (
            None if qualified is None else tuple(qualified.items()),
            None if bare is None else tuple(bare.items()),
        )

    def _context(self, attr_domains: frozenset[str], cap_domains: frozenset[str]) -> Any:
        """The Rust context, with an empty map for each named domain the device lacks (the
        scheduler's map answers every unknown domain with an empty map)."""
        converted = self._get()
        key = (attr_domains - converted.attr_domains, cap_domains - converted.cap_domains)
        ctx = self._contexts.get(key)
        if ctx is None:
            value = converted.value
            if key[0] or key[1]:
                value = dict(value)
                value["attributes"] = {**value["attributes"], **{d: {} for d in key[0]}}
                value["capacity"] = {**value["capacity"], **{d: {} for d in key[1]}}
            ctx = cel.Context(variables={"device": value}, functions=self._functions)
            self._contexts[key] = ctx
        return ctx


@dataclass(frozen=True)
class _Converted:
    """A device's CEL value, each value as CEL writes it (for ``Verdict.seen`` and the memo),
    and the first value the scheduler could not convert."""

    value: dict[str, Any]
    rendered: dict[tuple[str, ...], str]
    error: str | None
    attr_domains: frozenset[str]
    cap_domains: frozenset[str]


_KEY_ERROR = re.compile(r"^'(.*)'$")
_FUNCTION_ERROR = re.compile(r"Python function call failed: \w+: (.*)\. Check function", re.S)


class Selector:
    """One compiled expression."""

    def __init__(
        self,
        expression: str,
        program: Any,
        estimated_cost: int,
        refs: dict[str, tuple[str, ...]],
        domains: set[tuple[str, str]],
        memo_keys: tuple[tuple[str, ...], ...] | None = None,
    ) -> None:
        self.expression = expression
        self.estimated_cost = estimated_cost
        self._program = program
        self._refs = tuple(refs.items())
        self._attr_domains = frozenset(d for f, d in domains if f == "attributes")
        self._cap_domains = frozenset(d for f, d in domains if f == "capacity")
        self._memo_keys = memo_keys
        self._memo: dict[tuple[Any, ...], Verdict] = {}

    def evaluate(self, device: DeviceView) -> Verdict:
        if device._invalid():
            seen = self._seen(device)
            return Verdict(False, device._error, seen)
        # Devices that agree on every value the expression reads get the same verdict (the
        # expression is a function of those values): one evaluation per distinct tuple. Most
        # devices of a node, and the same devices on every node of a model, share them.
        memo_key: tuple[Any, ...] | None = None
        if self._memo_keys is not None:
            memo_key = tuple(device._raw_value(k) for k in self._memo_keys)
            hit = self._memo.get(memo_key)
            if hit is not None:
                return hit
        verdict = self._evaluate(device)
        if memo_key is not None:
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()
            self._memo[memo_key] = verdict
        return verdict

    def _evaluate(self, device: DeviceView) -> Verdict:
        seen = self._seen(device)
        ctx = device._context(self._attr_domains, self._cap_domains)
        try:
            result = self._program.execute(ctx)
        except Exception as err:  # the Rust library's errors: KeyError, TypeError, ...
            return Verdict(False, self._explain(err, seen), seen)
        if result is True:
            return Verdict(True, None, seen)
        if result is False:
            return Verdict(False, None, seen)
        return Verdict(
            False, f"must evaluate to bool, not {_type_name(result)} ({_show(result)})", seen
        )

    def _seen(self, device: DeviceView) -> tuple[tuple[str, str], ...]:
        rendered = device._rendered
        return tuple(
            (
                path,
                _render(device._raw_value(key)) if key[0] == "in" else rendered.get(key, MISSING),
            )
            for path, key in self._refs
        )

    def _explain(self, err: Exception, seen: tuple[tuple[str, str], ...]) -> str:
        text = str(err)
        if isinstance(err, KeyError):
            m = _KEY_ERROR.match(text)
            key = m.group(1) if m else text
            missing = [
                p
                for p, v in seen
                if v == MISSING and (p.endswith(f".{key}") or p.endswith(f"[{json.dumps(key)}]"))
            ]
            where = f" ({missing[0]} is not set on this device)" if missing else ""
            return f"no such key: {key}{where}"
        m = _FUNCTION_ERROR.search(text)
        if m:
            return m.group(1)
        if text.startswith("No such overload"):
            return "no such overload: the operation is not defined for the operand types"
        return text.split(". Check ", 1)[0]


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


class CelEnvironment:
    """Compiles selectors (cached by text) and converts devices for them."""

    def __init__(self, cost_limit: int = COST_LIMIT) -> None:
        self.cost_limit = cost_limit
        self._library = _Library()
        self._functions = self._library.functions()
        self._known = frozenset(self._functions) | _NATIVE
        self._parser = CELParser()
        self._compiled: dict[str, Selector] = {}
        self._versions: dict[str, dict[str, str]] = {}
        self._quantities: dict[str, dict[str, str]] = {}

    def compile(self, expression: str) -> Selector:
        """A Selector; CelCompileError for an expression the scheduler would refuse (or this
        evaluator cannot evaluate as the scheduler does), saying why."""
        cached = self._compiled.get(expression)
        if cached is not None:
            return cached
        if len(expression) > MAX_EXPRESSION_CHARS:
            raise CelCompileError(
                expression,
                f"{len(expression)} characters, more than the {MAX_EXPRESSION_CHARS} allowed",
            )
        try:
            program = cel.compile(expression)
        except ValueError as err:
            raise CelCompileError(
                expression, "compilation failed: " + _parse_message(str(err))
            ) from None
        try:
            tree = _lower(self._parser.parse(expression))
        except (CELParseError, lark.exceptions.LarkError) as err:
            raise CelCompileError(expression, f"compilation failed: {err}") from None
        try:
            _check(tree, frozenset(), self._known)
        except ValueError as err:
            raise CelCompileError(expression, str(err)) from None
        kind = _result_kind(tree)
        if kind is not None:
            raise CelCompileError(expression, f"must evaluate to bool, not {kind}")
        cost = _estimate(tree, {})[0]
        if cost > self.cost_limit:
            raise CelCompileError(
                expression,
                f"estimated worst-case cost {cost} exceeds the cost limit {self.cost_limit}"
                " (the bound of what it iterates over times the cost of each iteration; the"
                " apiserver refuses it too)",
            )
        refs: dict[str, tuple[str, ...]] = {}
        domains: set[tuple[str, str]] = set()
        closed = _references(tree, refs, domains)
        memo = tuple(dict.fromkeys(refs.values())) if closed else None
        selector = Selector(expression, program, cost, refs, domains, memo)
        self._compiled[expression] = selector
        return selector

    def _convert(
        self,
        driver: str,
        attributes: Mapping[str, Mapping[str, Any]],
        capacity: Mapping[str, Mapping[str, Any]],
        allow_multiple_allocations: bool = False,
    ) -> _Converted:
        attrs: dict[str, dict[str, Any]] = {}
        caps: dict[str, dict[str, Any]] = {}
        rendered: dict[tuple[str, ...], str] = {
            ("driver",): _render(driver),
            ("allowMultipleAllocations",): _render(allow_multiple_allocations),
        }
        error: str | None = None
        for name, attribute in attributes.items():
            domain, ident = name.split("/", 1) if "/" in name else (driver, name)
            value: Any
            if "int" in attribute:
                value = shown = attribute["int"]
            elif "bool" in attribute:
                value = shown = attribute["bool"]
            elif "string" in attribute:
                value = shown = attribute["string"]
            elif "version" in attribute:
                shown = attribute["version"]
                try:
                    value = self.version(shown)
                except ValueError as err:
                    error = error or f"attribute {name}: parse semantic version: {err}"
                    continue
            else:
                error = error or (
                    f"attribute {name}: unsupported attribute value {_show(dict(attribute))};"
                    " allowed: one of int, bool, string, version"
                )
                continue
            attrs.setdefault(domain, {})[ident] = value
            rendered[("attributes", domain, ident)] = (
                str(shown) if "version" in attribute else _render(shown)
            )
        for name, cap in capacity.items():
            domain, ident = name.split("/", 1) if "/" in name else (driver, name)
            text = cap.get("value")
            try:
                caps.setdefault(domain, {})[ident] = self.quantity(text)
            except QuantityError as err:
                error = error or f"capacity {name}: {err}"
                continue
            rendered[("capacity", domain, ident)] = str(text)
        value = {
            "driver": driver,
            "allowMultipleAllocations": allow_multiple_allocations,
            "attributes": attrs,
            "capacity": caps,
        }
        return _Converted(value, rendered, error, frozenset(attrs), frozenset(caps))

    def version(self, text: str) -> dict[str, str]:
        """A version attribute's CEL value, converted once per distinct text."""
        value = self._versions.get(text)
        if value is None:
            value = self._versions[text] = _semver_value(parse_semver(text))
        return value

    def quantity(self, text: Any) -> dict[str, str]:
        """A capacity's CEL value, converted once per distinct text."""
        value = self._quantities.get(text)
        if value is None:
            value = _quantity_value(parse_quantity(text).nanos)
            if isinstance(text, str):
                self._quantities[text] = value
        return value

    def device(
        self,
        driver: str,
        attributes: Mapping[str, Mapping[str, Any]],
        capacity: Mapping[str, Mapping[str, Any]],
        allow_multiple_allocations: bool = False,
    ) -> DeviceView:
        """A device in resource.k8s.io/v1 form (as in a ResourceSlice) as CEL sees it. A value
        the scheduler could not convert (no known type, a version that is no semver) makes
        every evaluation an error naming it, as DeviceMatches fails in cel/compile.go. Nothing
        is converted until a selector evaluates the device."""
        raw = (driver, attributes, capacity, allow_multiple_allocations)
        return DeviceView(raw, self._convert, self._functions, self)


def _parse_message(text: str) -> str:
    """The Rust parser's message without the echo of the whole expression."""
    text = re.sub(r"^Failed to parse expression '.*?': ", "", text, flags=re.S)
    return text.strip()
