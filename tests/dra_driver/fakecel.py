"""A stand-in for dra_driver.scheduler.celenv in the allocator's tests: compile() maps a few
expression
strings to Python predicates over the device's API-form attributes (until the real CEL lands)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class FakeCompileError(ValueError):
    pass


@dataclass(frozen=True)
class Verdict:
    matched: bool
    error: str | None = None
    seen: tuple[tuple[str, str], ...] = ()


@dataclass
class View:
    driver: str
    attributes: Mapping[str, Mapping[str, Any]]
    capacity: Mapping[str, Mapping[str, Any]]
    allow_multiple: bool

    def attr(self, name: str) -> Any:
        raw = self.attributes.get(name)
        if raw is None:
            raise KeyError(name)
        return next(iter(raw.values()))


class Missing(Exception):
    pass


@dataclass
class FakeSelector:
    expression: str
    fn: Callable[[View], bool]
    reads: tuple[str, ...]
    calls: list[int]

    def evaluate(self, device: View) -> Verdict:
        self.calls[0] += 1
        seen = tuple(
            (
                f'device.attributes["{device.driver}"].{a}',
                str(next(iter(device.attributes[a].values())))
                if a in device.attributes
                else "<missing>",
            )
            for a in self.reads
        )
        try:
            return Verdict(bool(self.fn(device)), None, seen)
        except KeyError as e:
            return Verdict(False, f"no such key: {e.args[0]}", seen)


class FakeCel:
    """Expressions: ``attr == "v"`` / ``attr == 3`` (string/int compare, error if missing),
    ``has(attr)``, ``true``, ``multi``, or any registered with ``add``."""

    def __init__(self) -> None:
        self.known: dict[str, tuple[Callable[[View], bool], tuple[str, ...]]] = {}
        self.calls = [0]
        self.views = 0

    def add(self, expression: str, fn: Callable[[View], bool], reads: tuple[str, ...] = ()) -> None:
        self.known[expression] = (fn, reads)

    def compile(self, expression: str) -> FakeSelector:
        if expression in self.known:
            fn, reads = self.known[expression]
        elif expression == "true":
            fn, reads = (lambda d: True), ()
        elif expression == "multi":
            fn, reads = (lambda d: d.allow_multiple), ()
        elif expression.startswith("has(") and expression.endswith(")"):
            name = expression[4:-1]
            fn, reads = (lambda d, n=name: n in d.attributes), (name,)
        elif " == " in expression:
            name, value = expression.split(" == ", 1)
            want: Any = value[1:-1] if value.startswith('"') else int(value)
            fn, reads = (lambda d, n=name, w=want: d.attr(n) == w), (name,)
        else:
            raise FakeCompileError(f"cannot compile {expression!r}")
        return FakeSelector(expression, fn, reads, self.calls)

    def device(
        self,
        driver: str,
        attributes: Mapping[str, Mapping[str, Any]],
        capacity: Mapping[str, Mapping[str, Any]],
        allow_multiple_allocations: bool = False,
    ) -> View:
        self.views += 1
        return View(driver, attributes, capacity, allow_multiple_allocations)
