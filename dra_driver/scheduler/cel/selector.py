"""A compiled selector and the devices it evaluates: the memo of verdicts by the values an
expression reads, the Rust context per device, and the runtime errors in the scheduler's words."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import cel

from dra_driver.errors import QuantityError
from dra_driver.scheduler.cel.conversion import Converted, DeviceConverter
from dra_driver.scheduler.cel.values import render, show, type_name

MISSING = "<missing>"
MEMO_ENTRIES = 65_536
"""Verdicts a selector remembers (by the values it read) before it starts over."""


@dataclass(frozen=True)
class Verdict:
    """What one selector said about one device."""

    matched: bool  # False whenever error is set
    error: str | None = None
    seen: tuple[tuple[str, str], ...] = ()  # (path as written, value rendered) or "<missing>"


class DeviceView:
    """One device as CEL sees it, converted at most once and reused by every selector.

    Lazy: a selector whose verdict is already known for the values it reads (the memo in
    :class:`Selector`) needs only those values rendered; the whole CEL value and the Rust
    context are built on the first evaluation that needs them."""

    __slots__ = ("_check", "_contexts", "_convert", "_converted", "_functions", "_raw")

    def __init__(
        self,
        raw: tuple[str, Mapping[str, Mapping[str, Any]], Mapping[str, Mapping[str, Any]], bool],
        converter: DeviceConverter,
        functions: dict[str, Callable[..., Any]],
    ) -> None:
        self._check = converter
        self._raw = raw
        self._convert = converter.convert
        self._converted: Converted | None = None
        self._functions = functions
        self._contexts: dict[tuple[frozenset[str], frozenset[str]], Any] = {}

    def _get(self) -> Converted:
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
        if field == "capacity":
            # CEL sees a capacity as its quantity alone (cel/compile.go: device.capacity maps a
            # name to a resource.Quantity); its requestPolicy is not part of the key.
            return frozen(_quantity_of(qualified)), frozen(_quantity_of(bare))
        return frozen(qualified), frozen(bare)

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


def _quantity_of(capacity: Any) -> Any:
    """A capacity entry's ``value`` (anything else, as it is, for the key to tell apart)."""
    return capacity.get("value") if isinstance(capacity, Mapping) else capacity


def frozen(value: Any) -> Hashable:
    """A JSON value (what a ResourceSlice holds: maps, lists, strings, numbers, bools, null) as a
    hashable memo key that is equal exactly when the values are: maps and lists become tuples,
    and every scalar keeps its type beside it, since Python hashes 1, 1.0 and True alike while
    CEL tells them apart. Written here because no library in our dependencies freezes JSON."""
    if isinstance(value, Mapping):
        return ("map", tuple(sorted((str(k), frozen(v)) for k, v in value.items())))
    if isinstance(value, list | tuple):
        return ("list", tuple(frozen(v) for v in value))
    if value is None or isinstance(value, str | int | float | bool):
        return (type(value).__name__, value)
    return ("repr", repr(value))  # not JSON: never equal to a JSON value, still hashable


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

    @property
    def reads(self) -> tuple[tuple[str, ...], ...] | None:
        """The device values every verdict is a function of (the memo's keys:
        ``("attributes", domain, name)``, ``("capacity", domain, name)``, ``("in", field,
        domain, name)``, ``("driver",)``, ``("allowMultipleAllocations",)``), or None when the
        expression reads the device some other way (a whole map, a computed key)."""
        return self._memo_keys

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
            False, f"must evaluate to bool, not {type_name(result)} ({show(result)})", seen
        )

    def _seen(self, device: DeviceView) -> tuple[tuple[str, str], ...]:
        rendered = device._rendered
        return tuple(
            (
                path,
                render(device._raw_value(key)) if key[0] == "in" else rendered.get(key, MISSING),
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
