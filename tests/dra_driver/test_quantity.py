"""Kubernetes quantities: values and canonical text as k8s.io/apimachinery computes them.

The tables are the examples of apimachinery's pkg/api/resource/quantity_test.go
(TestQuantityParse, TestQuantityString, TestQuantityParseEmit, TestNewSet, TestQuantityCmp,
TestQuantityRoundUp), with the exact values upstream expects. tests/test_fuzz_decoders.py feeds
the parser random text (only QuantityError comes out; canonical text parses back the same).
"""

import time
from decimal import Decimal

import pytest

from dra_driver.errors import QuantityError
from dra_driver.quantity import (
    MAX_EXPONENT,
    MAX_QUANTITY_CHARS,
    Format,
    Quantity,
    parse_bytes,
    parse_quantity,
)

B, D, X = Format.BINARY_SI, Format.DECIMAL_SI, Format.DECIMAL_EXPONENT

# (text, exact value, format) from TestQuantityParse
UPSTREAM_VALUES = [
    ("0", "0", D), ("0n", "0", D), ("0u", "0", D), ("0m", "0", D), ("0Ki", "0", B),
    ("0k", "0", D), ("0Mi", "0", B), ("0M", "0", D), ("0Gi", "0", B), ("0G", "0", D),
    ("0Ti", "0", B), ("0T", "0", D),
    ("1", "1", D),
    # binary suffixes
    ("1Ki", "1024", B), ("8Ki", str(8 * 1024), B), ("7Mi", str(7 * 2**20), B),
    ("6Gi", str(6 * 2**30), B), ("5Ti", str(5 * 2**40), B), ("4Pi", str(4 * 2**50), B),
    ("3Ei", str(3 * 2**60), B), ("10Ti", str(10 * 2**40), B), ("100Ti", str(100 * 2**40), B),
    # decimal suffixes
    ("5n", "5e-9", D), ("4u", "4e-6", D), ("3m", "3e-3", D), ("9", "9", D), ("8k", "8e3", D),
    ("50k", "5e4", D), ("7M", "7e6", D), ("6G", "6e9", D), ("5T", "5e12", D), ("40T", "4e13", D),
    ("300T", "3e14", D), ("2P", "2e15", D), ("1E", "1e18", D),
    # decimal exponents
    ("1E-3", "1e-3", X), ("1e3", "1e3", X), ("1E6", "1e6", X), ("1e9", "1e9", X),
    ("1E12", "1e12", X), ("1e15", "1e15", X), ("1E18", "1e18", X),
    # nonstandard but still parsable
    ("1e14", "1e14", X), ("1e13", "1e13", X), ("100.035k", "100035", D),
    # things that look like floating point
    ("0.001", "1e-3", D), ("0.0005k", "0.5", D), ("0.005", "5e-3", D), ("0.05", "5e-2", D),
    ("0.5", "0.5", D), ("0.00050k", "0.5", D), ("0.00500", "5e-3", D), ("0.05000", "5e-2", D),
    ("0.50000", "0.5", D), ("0.5e0", "0.5", X), ("0.5e-1", "5e-2", X), ("0.5e-2", "5e-3", X),
    ("10.035M", "10035e3", D),
    ("1.2e3", "12e2", X), ("1.3E+6", "13e5", X), ("1.40e9", "14e8", X), ("1.53E12", "153e10", X),
    ("1.6e15", "16e14", X), ("1.7E18", "17e17", X),
    ("9.01", "901e-2", D), ("8.1k", "81e2", D), ("7.123456M", "7123456", D),
    ("6.987654321G", "6987654321", D), ("5.444T", "5444e9", D), ("40.1T", "401e11", D),
    ("300.2T", "3002e11", D), ("2.5P", "25e14", D), ("1.01E", "101e16", D),
    # things that saturate or round (up, away from zero, to a nano; binary capped at 2^63-1)
    ("3.001n", "4e-9", D), ("1.1E-9", "2e-9", X), ("0.0000000001", "1e-9", D),
    ("0.0000000005", "1e-9", D), ("0.00000000050", "1e-9", D), ("0.5e-9", "1e-9", X),
    ("0.9n", "1e-9", D), ("0.00000012345", "124e-9", D), ("0.00000012354", "124e-9", D),
    ("9Ei", str(2**63 - 1), B), ("9223372036854775807Ki", str(2**63 - 1), B),
    ("12E", "12e18", D),
    # fractional binary
    ("100.035Ki", "10243584e-2", B), ("0.5Mi", str(2**19), B), ("0.05Gi", "536870912e-1", B),
    ("0.025Ti", "274877906944e-1", B),
    # things written by trolls
    ("0.000000000001Ki", "2e-9", D), (".001", "1e-3", D), (".0001k", "100e-3", D),
    ("1.", "1", D), ("1.G", "1e9", D),
]  # fmt: skip

UPSTREAM_INVALID = [
    "1.1.M", "1+1.0M", "0.1mi", "0.1am", "aoeu", ".5i", "1i", "-3.01e-", " 1", "1 ", "",
]  # fmt: skip

# (value made from text, canonical text) from TestQuantityString and TestQuantityParseEmit
UPSTREAM_CANONICAL = [
    ("1024Mi", "1Gi"), ("307200Ki", "300Mi"), ("6Ki", "6Ki"), ("1025024Mi", "1001Gi"),
    ("1024Gi", "1Ti"), ("5000m", "5"), ("0.5", "500m"), ("1000M", "1G"), ("0.001T", "1G"),
    ("1000u", "1m"), ("80m", "80m"), ("1.08", "1080m"), ("1080000000n", "1080m"),
    ("300M", "300M"), ("1T", "1T"), ("1E", "1E"), ("1000E", "1e21"), ("5000E", "5e21"),
    ("1000000E", "1e24"), ("1234567M", "1234567M"), ("1234567m", "1234567m"), ("3k", "3k"),
    ("1025", "1025"), ("0", "0"), ("00", "0"), (".001e12", "1e9"), ("0.001e0", "1e-3"),
    ("1000e-12", "1e-9"), ("80e-3", "80e-3"), ("300e6", "300e6"), ("1e12", "1e12"),
    ("1e3", "1e3"), ("3e3", "3e3"), ("1n", "1n"), ("80n", "80n"), ("1080n", "1080n"),
    ("1u", "1u"), ("80u", "80u"), ("1080u", "1080u"),
    ("1Ki", "1Ki"), ("1Mi", "1Mi"), ("1Gi", "1Gi"), (".001Ki", "1024m"), (".000001Ki", "1024u"),
    (".000000001Ki", "1024n"), (".000000000001Ki", "2n"),
    # binary values print as decimal below 1024 or when not whole; the cap has no binary form
    ("0.5Ki", "512"), ("100.035Ki", "102435840m"), ("9Ei", "9223372036854775807"),
]  # fmt: skip


def _nanos(value: str) -> int:
    nanos = Decimal(value).scaleb(9)
    assert nanos == nanos.to_integral_value()
    return int(nanos)


@pytest.mark.parametrize(("text", "value", "fmt"), UPSTREAM_VALUES)
def test_upstream_values_and_formats(text, value, fmt):
    q = parse_quantity(text)
    assert (q.nanos, q.format) == (_nanos(value), fmt)
    assert q.as_decimal() == Decimal(value)
    negative, positive = parse_quantity("-" + text), parse_quantity("+" + text)
    assert (negative.nanos, negative.format) == (-_nanos(value), fmt)
    assert (positive.nanos, positive.format) == (_nanos(value), fmt)


@pytest.mark.parametrize("text", UPSTREAM_INVALID)
def test_upstream_invalid_quantities(text):
    with pytest.raises(QuantityError):
        parse_quantity(text)


@pytest.mark.parametrize(("text", "canonical"), UPSTREAM_CANONICAL)
def test_canonical_text(text, canonical):
    assert str(parse_quantity(text)) == canonical
    if canonical != "0":
        assert str(parse_quantity("-" + text)) == "-" + canonical
    again = parse_quantity(canonical)
    assert str(again) == canonical and again == parse_quantity(text)


@pytest.mark.parametrize(
    ("value", "fmt", "text"),
    [(1, D, "1"), (1000, D, "1k"), (1234000, D, "1234k"), (1024, B, "1Ki"), (1000000, X, "1e6"),
     (2**20, B, "1Mi"), (2**30, B, "1Gi"), (0, B, "0"), (-(2**30), B, "-1Gi")],
)  # fmt: skip
def test_from_int(value, fmt, text):
    q = Quantity.from_int(value, fmt)
    assert str(q) == text and q.value() == value and q == parse_quantity(text)


@pytest.mark.parametrize(
    ("a", "b", "expect"),
    [("0", "0", 0), ("100m", "50m", 1), ("50m", "100m", -1), ("10000T", "100Gi", 1),
     ("1Gi", "1024Mi", 0), ("1k", "1e3", 0), ("-1", "1m", -1), ("1E", "1Ei", -1)],
)  # fmt: skip
def test_comparison_is_by_value_whatever_the_format(a, b, expect):
    x, y = parse_quantity(a), parse_quantity(b)
    assert x.compare(y) == expect and y.compare(x) == -expect
    assert (x == y, x < y, x > y, x <= y, x >= y) == (
        expect == 0, expect < 0, expect > 0, expect <= 0, expect >= 0
    )  # fmt: skip
    if expect == 0:
        assert hash(x) == hash(y) and len({x, y}) == 1
    assert x != a  # a quantity never equals its text


@pytest.mark.parametrize(
    ("text", "value", "milli"),
    [("9.01", 10, 9010), ("-9.01", -10, -9010), ("1.5", 2, 1500), ("0.0001", 1, 1),
     ("100m", 1, 100), ("4Gi", 4 * 2**30, 4 * 2**30 * 1000), ("0", 0, 0), ("1n", 1, 1)],
)  # fmt: skip
def test_integer_values_round_up_away_from_zero(text, value, milli):
    q = parse_quantity(text)
    assert (q.value(), q.milli_value()) == (value, milli)
    assert q.is_integer() == (q.value() * 10**9 == q.nanos)
    assert q.sign() == (value > 0) - (value < 0)


def test_bytes_round_up_and_refuse_negatives():
    assert parse_bytes("4Gi") == 4 * 2**30
    assert parse_bytes("1.5") == 2
    assert parse_bytes("100m") == 1
    assert parse_bytes("1.5Gi") == 1610612736
    assert parse_bytes("0") == 0
    with pytest.raises(QuantityError, match='"-1Gi" is not a quantity: a number of bytes cannot'):
        parse_bytes("-1Gi")


@pytest.mark.parametrize(
    ("text", "problem"),
    [("", "empty"), ("4GB", "unknown suffix 'GB'"), ("1 ", "whitespace around it"),
     ("Ki", "the number has no digits"), (".", "the number has no digits"),
     ("+", "the number has no digits"), ("-.", "the number has no digits"),
     ("1e", "unknown suffix 'e'"), ("1e1.5", "unknown suffix 'e1.5'"), ("1kk", "unknown suffix"),
     ("1K", "unknown suffix 'K'"), ("1ki", "unknown suffix 'ki'"), ("0x10", "unknown suffix"),
     ("\u0661", "the number has no digits"), ("1" * 65, "65 characters, more than the 64 allowed"),
     ("1e101", "the exponent is outside -100..100"),
     ("1e-101", "the exponent is outside -100..100")],
)  # fmt: skip
def test_errors_name_the_text_the_problem_and_the_allowed_forms(text, problem):
    with pytest.raises(QuantityError) as e:
        parse_quantity(text)
    message = str(e.value)
    shown = text if len(text) < 60 else text[:40]
    assert f'"{shown}' in message and problem in message
    assert "allowed: " in message and "Ki Mi Gi" in message and "e<integer>" in message


def test_stricter_than_upstream_where_it_reads_text_without_digits_as_zero():
    """Upstream's scanner parses "+", "." and "Ki" as 0; the grammar (and this parser) does not."""
    for text in ("+", "-", ".", "-.", "Ki", "k", "E"):
        with pytest.raises(QuantityError):
            parse_quantity(text)


def test_not_a_string():
    with pytest.raises(QuantityError, match="expected a string, got a int"):
        parse_quantity(5)  # type: ignore[arg-type]


def test_limits_are_at_the_edge():
    assert parse_quantity("1" * MAX_QUANTITY_CHARS).value() == int("1" * MAX_QUANTITY_CHARS)
    assert parse_quantity(f"1e{MAX_EXPONENT}").value() == 10**MAX_EXPONENT
    assert parse_quantity(f"1e-{MAX_EXPONENT}").nanos == 1  # rounded up to a nano


def test_a_hostile_quantity_costs_microseconds():
    worst = [
        "9" * 60 + "e100",
        "0." + "0" * 54 + "1e-100",
        "-" + "9" * 59 + "Ei",
        "." + "7" * 59 + "e-99",
        "1" + "0" * 58 + "e+100",
    ]
    start = time.perf_counter()
    for _ in range(200):
        for text in worst:
            str(parse_quantity(text))
    per_call = (time.perf_counter() - start) / (200 * len(worst))
    assert per_call < 500e-6  # a few microseconds each; the bound allows a loaded machine
