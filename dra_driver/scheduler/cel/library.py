"""The Kubernetes quantity and semver functions (k8s.io/apiserver ``pkg/cel/library``
``quantity.go`` and ``semverlib.go``) with the parse caches of one environment, and the whole
function table registered in the Rust library's context."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

from dra_driver.errors import QuantityError
from dra_driver.quantity import NANO, parse_quantity
from dra_driver.scheduler.cel.functions import STATELESS
from dra_driver.scheduler.cel.semver import Semver, normalize_semver, parse_semver
from dra_driver.scheduler.cel.values import (
    QUANTITY_TAG,
    SEMVER_TAG,
    no_overload,
    quantity_value,
    semver_value,
)


class Library:
    """The Kubernetes functions, as Python functions for the Rust library's context. Holds the
    parse caches of one environment (quantities and versions are parsed once per text)."""

    def __init__(self) -> None:
        self._nanos: dict[str, int] = {}
        self._versions: dict[str, Semver] = {}

    # quantities: k8s.io/apiserver pkg/cel/library/quantity.go
    def nanos(self, value: Any, function: str, *args: Any) -> int:
        text = value.get(QUANTITY_TAG) if isinstance(value, dict) else None
        if not isinstance(text, str):
            raise no_overload(function, *args)
        cached = self._nanos.get(text)
        if cached is None:
            cached = int(Decimal(text).scaleb(9))
            self._nanos[text] = cached
        return cached

    def version(self, value: Any, function: str, *args: Any) -> Semver:
        text = value.get(SEMVER_TAG) if isinstance(value, dict) else None
        if not isinstance(text, str):
            raise no_overload(function, *args)
        cached = self._versions.get(text)
        if cached is None:
            cached = parse_semver(text)
            self._versions[text] = cached
        return cached

    def quantity(self, text: Any) -> dict[str, str]:
        if not isinstance(text, str):
            raise no_overload("quantity", text)
        try:
            return quantity_value(parse_quantity(text).nanos)
        except QuantityError as err:
            raise ValueError(str(err)) from None

    def is_quantity(self, text: Any) -> bool:
        if not isinstance(text, str):
            raise no_overload("isQuantity", text)
        try:
            parse_quantity(text)
        except QuantityError:
            return False
        return True

    def semver(self, text: Any, normalize: Any = False) -> dict[str, str]:
        if not isinstance(text, str) or not isinstance(normalize, bool):
            raise no_overload("semver", text, normalize)
        return semver_value(parse_semver(normalize_semver(text) if normalize else text))

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
        return quantity_value(self.nanos(a, "add", a, b) + self._operand("add", a, b))

    def sub(self, a: Any, b: Any) -> dict[str, str]:
        return quantity_value(self.nanos(a, "sub", a, b) - self._operand("sub", a, b))

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
            **STATELESS,
        }
