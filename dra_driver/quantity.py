"""Kubernetes resource quantities (``4Gi``, ``500m``, ``1.5e9``), parsed exactly.

The grammar and the values are those of ``resource.Quantity`` in k8s.io/apimachinery
(``pkg/api/resource/quantity.go``: the grammar in the ``Quantity`` doc comment, the value rules
in ``ParseQuantity``; the suffix table in ``suffix.go``)::

    <quantity>        ::= <signedNumber><suffix>
    <signedNumber>    ::= <number> | <sign><number>          <sign> ::= "+" | "-"
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei                  (powers of 1024)
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E     (powers of 1000)
    <decimalExponent> ::= "e" <signedNumber> | "E" <signedNumber>    (an integer: 1e3, 1E-3)

``1E`` is 10^18 (the suffix), ``1E3`` is 1000 (an exponent). Values as Kubernetes computes them:

- exact (integers and decimal fractions, never floats), except that a value finer than a
  nano (10^-9) is rounded *away from zero* to the next nano: ``0.9n`` is ``1n``, ``3.001n`` is
  ``4n`` ("if you want some resources, you should get some");
- a binarySI quantity is capped at 2^63-1 in magnitude (``9Ei`` is 2^63-1); decimal ones are not;
- a quantity remembers its *format* (binarySI, decimalSI, decimalExponent: the kind of suffix it
  was written with) for its canonical text (``str()``): the largest exponent of its format with
  an integer mantissa (``1.5Gi`` is ``1536Mi``, ``1000M`` is ``1G``, ``0.5`` is ``500m``);
  binarySI values below 1024 or not whole print as decimalSI (``0.5Ki`` is ``512``).

Where this module is stricter than upstream's parser, on purpose:

- the number must have a digit, as the grammar says (upstream's scanner reads digit-less text
  such as ``+``, ``.`` and ``Ki`` as zero);
- at most ``MAX_QUANTITY_CHARS`` characters and exponents within ±``MAX_EXPONENT``, so a hostile
  quantity costs a few microseconds (no 10^(10^9)); no Kubernetes resource comes near either;
- no surrounding whitespace (upstream trims it only when decoding JSON).

Why our own instead of ``kubernetes.utils.parse_quantity``: importing it loads the whole
kubernetes client package (0.15 to 0.3 s measured), which must stay out of standalone-mode
start-up. It also differs from Kubernetes: it reads whatever ``Decimal`` reads (``NaN``,
``Infinity``, ``1_000``, whitespace), rounds to 28 significant digits, and has neither the nano
rounding nor the binary cap. This module is general: the opaque config's memory limits use it,
and so can CEL's ``quantity(...)``.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from decimal import Decimal

from dra_driver.errors import QuantityError

MAX_QUANTITY_CHARS = 64
MAX_EXPONENT = 100
"""The largest exponent a quantity may write, either sign (``1e100``; suffixes stop at 10^18)."""
NANO = 10**9
BINARY_CAP = 2**63 - 1
"""Kubernetes caps binarySI quantities at this magnitude when it parses them."""
ALLOWED_FORMS = (
    "a number with an optional sign, decimal fraction and suffix: binary Ki Mi Gi Ti Pi Ei,"
    " decimal n u m k M G T P E, or an exponent e<integer> (e.g. 4Gi, 1.5G, 500m, 1e9)"
)


class Format(enum.Enum):
    """The kind of suffix a quantity was written with; its canonical text keeps it."""

    BINARY_SI = "BinarySI"
    DECIMAL_SI = "DecimalSI"
    DECIMAL_EXPONENT = "DecimalExponent"


_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_SUFFIX = {e: s for s, e in _DECIMAL.items()}
_BINARY_SUFFIX = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_PATTERN = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<bin>[KMGTPE]i)|[eE](?P<exp>[+-]?[0-9]+)|(?P<dec>[numkMGTPE]))?",
    re.ASCII,
)


@dataclass(frozen=True, eq=False)
class Quantity:
    """A parsed quantity: ``nanos`` is its value in units of 10^-9, exactly.

    Compared (``==``, ``<``, ``compare``) and hashed by value only, as ``Quantity.Cmp`` does:
    ``1Gi == 1024Mi`` and ``1k == 1000``, whatever their formats."""

    nanos: int
    format: Format = Format.DECIMAL_SI

    @classmethod
    def from_int(cls, value: int, fmt: Format = Format.BINARY_SI) -> Quantity:
        """An integer amount (bytes, say) in the given format: ``from_int(2**30)`` is ``1Gi``."""
        return cls(value * NANO, fmt)

    # -- values ------------------------------------------------------------------------------
    def value(self) -> int:
        """The value rounded up to an integer, away from zero (``Quantity.Value()``): how
        Kubernetes counts bytes, so ``1.5`` bytes is 2 and ``0.1`` is 1."""
        return _ceil_away(self.nanos, NANO)

    def milli_value(self) -> int:
        """The value in thousandths, rounded away from zero (``Quantity.MilliValue()``)."""
        return _ceil_away(self.nanos, NANO // 1000)

    def as_decimal(self) -> Decimal:
        """The exact value as a Decimal."""
        return Decimal(self.nanos).scaleb(-9)

    def sign(self) -> int:
        return (self.nanos > 0) - (self.nanos < 0)

    def is_integer(self) -> bool:
        return self.nanos % NANO == 0

    # -- comparison --------------------------------------------------------------------------
    def compare(self, other: Quantity) -> int:
        """-1, 0 or 1 as ``self`` is less than, equal to or greater than ``other``."""
        return (self.nanos > other.nanos) - (self.nanos < other.nanos)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Quantity) and self.nanos == other.nanos

    def __hash__(self) -> int:
        return hash(self.nanos)

    def __lt__(self, other: Quantity) -> bool:
        return self.nanos < other.nanos

    def __le__(self, other: Quantity) -> bool:
        return self.nanos <= other.nanos

    def __gt__(self, other: Quantity) -> bool:
        return self.nanos > other.nanos

    def __ge__(self, other: Quantity) -> bool:
        return self.nanos >= other.nanos

    # -- text --------------------------------------------------------------------------------
    def __str__(self) -> str:
        """The canonical text, as ``Quantity.String()`` writes it."""
        if self.nanos == 0:
            return "0"
        sign = "-" if self.nanos < 0 else ""
        magnitude = abs(self.nanos)
        fmt = self.format
        if fmt is Format.BINARY_SI:
            if magnitude < 1024 * NANO or magnitude % NANO:
                fmt = Format.DECIMAL_SI  # small or fractional: no rounding, no confusion
            else:
                whole, power = magnitude // NANO, 0
                while power < len(_BINARY_SUFFIX) - 1 and whole % 1024 == 0:
                    whole //= 1024
                    power += 1
                return f"{sign}{whole}{_BINARY_SUFFIX[power]}"
        digits = str(magnitude)
        mantissa = digits.rstrip("0")
        exponent = -9 + len(digits) - len(mantissa)
        mantissa += "0" * (exponent % 3)  # down to a multiple of 3, the mantissa stays whole
        exponent -= exponent % 3
        if fmt is Format.DECIMAL_SI and exponent in _DECIMAL_SUFFIX:
            suffix = _DECIMAL_SUFFIX[exponent]
        else:  # decimalExponent, or decimalSI past E (10^18), which has no suffix
            suffix = f"e{exponent}" if exponent else ""
        return f"{sign}{mantissa}{suffix}"

    def __repr__(self) -> str:
        return f"Quantity({str(self)!r})"


def _ceil_away(nanos: int, unit: int) -> int:
    whole, rest = divmod(abs(nanos), unit)
    whole += 1 if rest else 0
    return -whole if nanos < 0 else whole


def _error(text: object, problem: str) -> QuantityError:
    shown = json.dumps(text, ensure_ascii=False) if isinstance(text, str) else repr(text)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return QuantityError(f"{shown} is not a quantity: {problem}; allowed: {ALLOWED_FORMS}")


_NUMBER = re.compile(r"[+-]?[0-9]*(?:\.[0-9]*)?", re.ASCII)


def _why_not(text: str) -> str:
    """What is wrong with text the grammar does not match, in words."""
    if text != text.strip():
        return "whitespace around it"
    number = _NUMBER.match(text)
    end = number.end() if number else 0
    if not any(c in "0123456789" for c in text[:end]):
        return "the number has no digits" if text else "empty"
    return f"unknown suffix {text[end:]!r}"


def parse_quantity(text: str) -> Quantity:
    """Parse one quantity; QuantityError naming the text, the problem and the allowed forms."""
    if not isinstance(text, str):
        raise _error(text, f"expected a string, got a {type(text).__name__}")
    if len(text) > MAX_QUANTITY_CHARS:
        raise _error(text, f"{len(text)} characters, more than the {MAX_QUANTITY_CHARS} allowed")
    m = _PATTERN.fullmatch(text)
    if m is None or not (m["int"] or m["frac"]):
        raise _error(text, _why_not(text))
    frac = m["frac"] or ""
    mantissa = int(m["int"] + frac or "0")
    if m["bin"]:
        fmt, power10, power2 = Format.BINARY_SI, 0, _BINARY[m["bin"]]
    elif m["exp"] is not None:
        fmt, power10, power2 = Format.DECIMAL_EXPONENT, int(m["exp"]), 0
        if abs(power10) > MAX_EXPONENT:
            raise _error(text, f"the exponent is outside -{MAX_EXPONENT}..{MAX_EXPONENT}")
    else:
        fmt, power10, power2 = Format.DECIMAL_SI, _DECIMAL[m["dec"] or ""], 0
    # value = mantissa * 2^power2 * 10^(power10 - len(frac)); in nanos, rounded away from zero
    scale = 9 + power10 - len(frac)
    numerator = mantissa << power2
    if scale >= 0:
        nanos = numerator * 10**scale
    else:
        nanos, rest = divmod(numerator, 10**-scale)
        nanos += 1 if rest else 0
    if fmt is Format.BINARY_SI:
        nanos = min(nanos, BINARY_CAP * NANO)
        if 0 < nanos < NANO:
            fmt = Format.DECIMAL_SI  # upstream: a binary fraction below 1 is decimal
    if m["sign"] == "-":
        nanos = -nanos
    return Quantity(nanos, fmt)


def parse_bytes(text: str) -> int:
    """A quantity of bytes as an integer, rounded up (``1.5`` is 2, as Kubernetes rounds
    memory); QuantityError for text that is not a quantity or is negative."""
    q = parse_quantity(text)
    if q.nanos < 0:
        raise _error(text, "a number of bytes cannot be negative")
    return q.value()
