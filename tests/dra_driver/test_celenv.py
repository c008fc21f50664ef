"""The CEL environment of DRA device selectors, pinned to what Kubernetes does.

Sources, cited per row: "compile_test" is k8s.io/dynamic-resource-allocation cel/compile_test.go
(TestCEL: expressions, devices, expected match/error and worst-case cost); "quantity_test" and
"semver_test" are k8s.io/apiserver pkg/cel/library/{quantity,semver}_test.go; "strings_test" is
cel-go ext/strings_test.go; "lists" is apiserver pkg/cel/library/lists.go's doc examples;
"compile.go" is dynamic-resource-allocation cel/compile.go (the behaviour, not a test).
"""

from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.scheduler.cel.selector import Verdict
from dra_driver.scheduler.celenv import (
    COST_LIMIT,
    MAX_EXPRESSION_CHARS,
    CelCompileError,
    CelEnvironment,
)

ROOT = Path(__file__).resolve().parents[2]
DRIVER = "dra.example.com"

DEVICES: dict[str, dict[str, Any]] = {
    "empty": {"driver": "", "attributes": {}, "capacity": {}},
    "example": {
        "driver": DRIVER,
        "attributes": {
            "bool": {"bool": True},
            "int": {"int": 1},
            "string": {"string": "fish"},
            "version": {"version": "1.0.0"},
            "services": {"string": "some_example_value"},
            "regex": {"string": "asymetric"},
            "name": {"string": "Straße"},
            "other.example.com/name": {"bool": True},
        },
        "capacity": {"quantity": {"value": "1Mi"}, "memory": {"value": "80Gi"}},
    },
    "shared": {"driver": DRIVER, "attributes": {}, "capacity": {}, "multi": True},
    "bad-version": {"driver": DRIVER, "attributes": {"v": {"version": "v1"}}, "capacity": {}},
    "bad-type": {"driver": DRIVER, "attributes": {"x": {"float": 1.5}}, "capacity": {}},
}

ERR, COMPILE = "error", "compile"
D = f'device.attributes["{DRIVER}"]'
C = f'device.capacity["{DRIVER}"]'

# (expression, device, expected): True / False / (ERR, fragment) / (COMPILE, fragment)
CASES: list[tuple[str, str, Any]] = [
    # compile_test "true", "false", "syntax-error", "type-error"
    ("true", "empty", True),
    ("false", "empty", False),
    ("?!", "empty", (COMPILE, "Syntax error")),
    ("1", "empty", (COMPILE, "must evaluate to bool")),
    # compile_test "runtime-error-lookup-identifier" / "-map": unknown domain is an empty map,
    # a missing name in it "no such key"
    (
        'device.attributes["no-such-domain"].noSuchAttr.isGreaterThan(quantity("0"))',
        "example",
        (ERR, "no such key: noSuchAttr"),
    ),
    (
        'device.attributes["no-such-domain"]["noSuchAttr"].isGreaterThan(quantity("0"))',
        "example",
        (ERR, "no such key: noSuchAttr"),
    ),
    # compile.go newStringInterfaceMapWithDefault: unknown domain -> empty map
    ('"x" in device.attributes["other.com"]', "example", False),
    ('size(device.capacity["other.com"]) == 0', "example", True),
    # compile_test "domain-check-negative"/"-positive"
    ('"no-such-domain" in device.attributes', "example", False),
    ('"other.example.com" in device.attributes', "example", True),
    # compile_test "empty-driver-name", "real-driver-name"
    ('device.driver == ""', "empty", True),
    (f'device.driver == "{DRIVER}"', "example", True),
    # compile_test "driver-name-qualifier(-map-lookup)", "qualified-attribute-name"
    (f"{D}.bool", "example", True),
    (f'{D}["bool"]', "example", True),
    ('device.attributes["other.example.com"].name', "example", True),
    # compile_test "int", "string", "version", "quantity", "check-positive", "check-negative"
    (f"{D}.int > 0", "example", True),
    (f'{D}.string == "fish"', "example", True),
    (f'{D}.version.isGreaterThan(semver("0.0.1"))', "example", True),
    (
        f'{D}.version.isGreaterThan(semver("v0.0.1", true)) && isSemver("v1.0.0", true)',
        "example",
        True,
    ),
    (f'{C}.quantity.isGreaterThan(quantity("1Ki"))', "example", True),
    (f'"quantity" in {C} && {C}.quantity.isGreaterThan(quantity("1Ki"))', "example", True),
    (f'!("name" in {C}) || {C}.name.isGreaterThan(quantity("1Ki"))', "empty", True),
    # compile_test "check_attribute_domains", "check_attribute_ids", "split_attribute",
    # "regexp_attribute"
    (f'device.attributes.exists_one(x, x == "{DRIVER}")', "example", True),
    (f'{D}.exists_one(x, x == "services")', "example", True),
    (f'{D}.services.split("example").size() >= 2', "example", True),
    (f'{D}.regex.matches("[^a]?sym")', "example", True),
    # compile_test "allow_multiple_allocations(_default)"
    ("device.allowMultipleAllocations == true", "shared", True),
    ("device.allowMultipleAllocations == false", "empty", True),
    # compile_test "list-result-type-causes-match-error": a non-bool result is an error
    (f"{D}.string", "example", (ERR, "must evaluate to bool, not string")),
    # compile_test "macro-exists-on-int": not iterable
    (f"{D}.int.exists(x, x > 0)", "example", (ERR, "no such overload")),
    # compile_test "includes-function-on-*-scalar-*"
    (f'{D}.string.includes("fish")', "example", True),
    (f"{D}.int.includes(2)", "example", False),
    (f'{D}.version.includes(semver("1.0.0"))', "example", True),
    # compile.go getAttributeValue: a device CEL cannot convert fails every selector
    ("true", "bad-version", (ERR, "attribute v: parse semantic version")),
    ("true", "bad-type", (ERR, "unsupported attribute value")),
    # quantity_test: equality is Quantity.Equal, comparisons, arithmetic, conversions
    ('quantity("1Gi") == quantity("1073741824")', "empty", True),
    ('quantity("1") == quantity("1000m")', "empty", True),
    ('quantity("200M").compareTo(quantity("0.2G")) == 0', "empty", True),
    ('quantity("50M").compareTo(quantity("50Mi")) == -1', "empty", True),
    ('quantity("150Mi").isGreaterThan(quantity("100Mi"))', "empty", True),
    ('quantity("50M").isLessThan(quantity("100M"))', "empty", True),
    ('quantity("50k").add(quantity("20k")) == quantity("70k")', "empty", True),
    ('quantity("50k").add(20) == quantity("50020")', "empty", True),
    ('quantity("50k").sub(20000) == quantity("30k")', "empty", True),
    ('quantity("50k").add(20).sub(quantity("100k")).sub(-50000) == quantity("20")', "empty", True),
    ('quantity("50k").asInteger() == 50000', "empty", True),
    ('quantity("50k").sub(20000).asApproximateFloat() == 30000.0', "empty", True),
    ('quantity("50000000G").isInteger()', "empty", True),
    ('quantity("9999999999999999999999999999999999999G").isInteger()', "empty", False),
    (
        'quantity("9999999999999999999999999999999999999G").asInteger() == 0',
        "empty",
        (ERR, "cannot convert value to integer"),
    ),
    ('quantity("-1").sign() == -1 && quantity("0").sign() == 0', "empty", True),
    ('isQuantity("1.3Gi") && !isQuantity("200K") && !isQuantity("Mi")', "empty", True),
    ('quantity("200K") == quantity("1")', "empty", (ERR, "not a quantity")),
    (f'{C}.memory.compareTo(quantity("40Gi")) >= 0', "example", True),
    # quantity.go has no ordering operators: < on quantities is no such overload
    ('quantity("1") < quantity("2")', "empty", (ERR, "no such overload")),
    # semver_test: parse, isSemver, normalisation, accessors, comparisons
    (
        'semver("1.2.3").major() == 1 && semver("1.2.3").minor() == 2 && '
        'semver("1.2.3").patch() == 3',
        "empty",
        True,
    ),
    ('isSemver("1.2.3-beta.1+build.1")', "empty", True),
    (
        '!isSemver("") && !isSemver("v1.0.0") && !isSemver("01.01.01") && !isSemver("1.1")',
        "empty",
        True,
    ),
    (
        'isSemver("v1.0.0", true) && isSemver("01.01.01", true) && isSemver("1", true)',
        "empty",
        True,
    ),
    ('semver("v1.0") == semver("1.0.0")', "empty", (ERR, "No Major.Minor.Patch")),
    ('semver("01.01.01", true) == semver("1.1.1")', "empty", True),
    ('semver("1.2.3").compareTo(semver("2.0.0")) == -1', "empty", True),
    ('semver("1.2.3").compareTo(semver("0.1.2")) == 1', "empty", True),
    ('semver("1.0.0-alpha").isLessThan(semver("1.0.0"))', "empty", True),  # semver.org 11
    ('semver("1.0.0-alpha.1").isLessThan(semver("1.0.0-alpha.beta"))', "empty", True),
    ('semver("1.0.0-rc.1").isGreaterThan(semver("1.0.0-beta.11"))', "empty", True),
    # blang/semver EQ: build metadata is ignored
    ('semver("1.2.3+a") == semver("1.2.3+b")', "empty", True),
    # strings_test (ext.Strings v2) and compile_test "split_attribute"
    ('"TacoCat".lowerAscii() == "tacocat" && "tacoCAT".upperAscii() == "TACOCAT"', "empty", True),
    ('"tacocat".charAt(3) == "o" && "tacocat".charAt(7) == ""', "empty", True),
    ('"tacocat".indexOf("a") == 1 && "tacocat".indexOf("a", 3) == 5', "empty", True),
    ('"tacocat".lastIndexOf("a") == 5 && "tacocat".lastIndexOf("at", 5) == 5', "empty", True),
    ('"hello hello".replace("he", "we", 1) == "wello hello"', "empty", True),
    (
        '"hello world".split(" ") == ["hello", "world"] && "a,b,c".split(",", 2) == ["a", "b,c"]',
        "empty",
        True,
    ),
    ('"tacocat".substring(4) == "cat" && "tacocat".substring(0, 4) == "taco"', "empty", True),
    ('" \\ttrim\\n ".trim() == "trim"', "empty", True),
    ('["x", "y"].join("-") == "x-y" && ["x", "y"].join() == "xy"', "empty", True),
    ('strings.quote("a\\nb") == "\\"a\\\\nb\\""', "empty", True),
    # code points, not bytes, in the extension functions (strings_test "charAt" on unicode)
    (f'{D}.name.charAt(4) == "ß" && {D}.name.substring(5) == "e"', "example", True),
    # lists (k8s library/lists.go) and ext.Lists v3, ext.Sets
    ("[1, 2, 3].isSorted() && [1, 2, 3].sum() == 6 && [1, 2, 3].min() == 1", "empty", True),
    (
        "[1, 2, 3].max() == 3 && [1, 2, 3].indexOf(2) == 1 && [1, 2, 1].lastIndexOf(1) == 2",
        "empty",
        True,
    ),
    ("[1, 2, 2, 3].distinct() == [1, 2, 3] && [[1], [2]].flatten() == [1, 2]", "empty", True),
    ("[3, 1, 2].sort() == [1, 2, 3] && [1, 2, 3].reverse() == [3, 2, 1]", "empty", True),
    ("[1, 2, 3, 4].slice(1, 3) == [2, 3] && lists.range(3) == [0, 1, 2]", "empty", True),
    ("sets.contains([1, 2, 3], [2, 3]) && sets.intersects([1], [1, 2])", "empty", True),
    ("sets.equivalent([1, 2], [2, 1, 1])", "empty", True),
    # k8s library/regex.go
    (
        '"abc 123".find("[0-9]+") == "123" && "123 abc 456".findAll("[0-9]+") == ["123", "456"]',
        "empty",
        True,
    ),
    # unsupported here, refused with a message saying so
    (f"cel.bind(dra, {D}, dra.bool)", "example", (COMPILE, "not supported by this evaluator")),
    ("[1, 2].all(i, v, v > 0)", "empty", (COMPILE, "two-variable comprehensions")),
    # cel-go checker: undeclared names are compile errors
    ("foo(1) == 1", "empty", (COMPILE, "undeclared reference to 'foo'")),
    ("x > 1", "empty", (COMPILE, "undeclared reference to 'x'")),
    # compile_test "expensive": worst-case cost over the limit
    (
        "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(x, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(y, "
        "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z2, "
        "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z4, "
        "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z5, int('1'.find('[0-9]*')) < 100)))))))",
        "empty",
        (COMPILE, f"estimated worst-case cost 85555551 exceeds the cost limit {COST_LIMIT}"),
    ),
]


@pytest.fixture(scope="module")
def env() -> CelEnvironment:
    return CelEnvironment()


def _device(env: CelEnvironment, name: str) -> Any:
    spec = DEVICES[name]
    return env.device(
        spec["driver"], spec["attributes"], spec["capacity"], spec.get("multi", False)
    )


@pytest.mark.parametrize(("expression", "device", "expected"), CASES)
def test_selector(env: CelEnvironment, expression: str, device: str, expected: Any) -> None:
    if isinstance(expected, tuple) and expected[0] == COMPILE:
        with pytest.raises(CelCompileError) as caught:
            env.compile(expression)
        assert expected[1] in str(caught.value)
        assert caught.value.expression == expression
        return
    verdict = env.compile(expression).evaluate(_device(env, device))
    if isinstance(expected, tuple):
        assert verdict.matched is False
        assert verdict.error is not None and expected[1] in verdict.error, verdict
    else:
        assert verdict == Verdict(expected, None, verdict.seen), verdict


# compile_test expectCost: the estimate is cel-go's for these (its units and its bounds)
COSTS = [
    ('device.attributes["no-such-domain"].noSuchAttr.isGreaterThan(quantity("0"))', 6),
    ('"no-such-domain" in device.attributes', 3),
    ('device.driver == ""', 2),
    (f'device.driver == "{DRIVER}"', 4),
    (f"{D}.bool", 4),
    (f'{D}.string == "fish"', 5),
    (f'{D}.version.isGreaterThan(semver("v0.0.1", true)) && isSemver("v1.0.0", true)', 7),
    (f'!("name" in {C}) || {C}.name.isGreaterThan(quantity("1Ki"))', 11),
    (f"{D}.a && {D}.b && {D}.c", 12),
    (f'device.attributes.exists_one(x, x == "{DRIVER}")', 164),
    (f'{D}.exists_one(x, x == "services")', 133),
    (f'{D}.services.split("example").size() >= 2', 19),
    (f'{D}.services.matches("[^a]?sym")', 18),
    (f"{D}.name.exists(x, x > 0)", 5 + (3 + 3) * 64),
    (f'{D}.names.all(x, x != "")', 5 + (2 + 2) * 64),
    ("device.allowMultipleAllocations == true", 3),
]


@pytest.mark.parametrize(("expression", "cost"), COSTS)
def test_cost_estimate_is_kubernetes(env: CelEnvironment, expression: str, cost: int) -> None:
    assert env.compile(expression).estimated_cost == cost


def test_cost_limit_is_the_callers() -> None:
    expression = "[1, 2, 3].all(x, x > 0)"  # 10 + 3 * (2 + 1 + 2) + 1 = 26
    assert CelEnvironment().compile(expression).estimated_cost == 26
    with pytest.raises(
        CelCompileError, match="estimated worst-case cost 26 exceeds the cost limit 25"
    ):
        CelEnvironment(cost_limit=25).compile(expression)


def test_length_limit(env: CelEnvironment) -> None:
    # resourceapi.CELSelectorExpressionMaxLength: 10 Ki characters
    longest = "true" + " " * (MAX_EXPRESSION_CHARS - 4)
    assert env.compile(longest).evaluate(_device(env, "empty")).matched
    with pytest.raises(CelCompileError, match="10241 characters, more than the 10240 allowed"):
        env.compile(longest + " ")


def test_syntax_error_names_the_position(env: CelEnvironment) -> None:
    with pytest.raises(CelCompileError, match=r"1:9"):
        env.compile("device. == 1")


def test_seen_lists_the_values_the_expression_refers_to(env: CelEnvironment) -> None:
    selector = env.compile(
        f'device.driver == "{DRIVER}" && {D}.int > 0 && {D}["string"] == "fish" && '
        f'{C}.memory.isGreaterThan(quantity("1Gi")) && {D}.version.major() == 1 && '
        f'device.attributes["other.com"].x == 1'
    )
    verdict = selector.evaluate(_device(env, "example"))
    assert verdict.seen == (
        ("device.driver", f'"{DRIVER}"'),
        (f"{D}.int", "1"),
        (f'{D}["string"]', '"fish"'),
        (f"{C}.memory", "80Gi"),
        (f"{D}.version", "1.0.0"),
        ('device.attributes["other.com"].x', "<missing>"),
    )
    assert (
        verdict.error
        == 'no such key: x (device.attributes["other.com"].x is not set on this device)'
    )


def test_seen_says_whether_a_name_tested_with_in_is_there(env: CelEnvironment) -> None:
    """'"nvlinkClique" in device.attributes[...]' false is often the whole reason."""
    selector = env.compile(f'"int" in {D} && "clique" in {D} && "name" in {C}')
    verdict = selector.evaluate(_device(env, "example"))
    assert verdict.seen == (
        (f'"int" in {D}', "true"),
        (f'"clique" in {D}', "false"),
        (f'"name" in {C}', "false"),
    )
    assert not verdict.matched


def test_compile_is_cached_by_text(env: CelEnvironment) -> None:
    assert env.compile("true && true") is env.compile("true && true")


def test_one_device_view_serves_many_selectors(env: CelEnvironment) -> None:
    device = _device(env, "example")
    selectors = [env.compile(f'"{d}" in device.attributes["{d}"]') for d in ("a.com", "b.com")]
    assert [s.evaluate(device).matched for s in selectors] == [False, False]
    assert env.compile(f"{D}.bool").evaluate(device).matched


def _selectors(document: Any) -> list[str]:
    found: list[str] = []
    if isinstance(document, dict):
        cel = document.get("cel")
        if isinstance(cel, dict) and isinstance(cel.get("expression"), str):
            found.append(cel["expression"])
        for value in document.values():
            found += _selectors(value)
    elif isinstance(document, list):
        for value in document:
            found += _selectors(value)
    return found


SHIPPED = sorted(
    {
        (path.name, expression)
        for path in [
            ROOT / "deploy/daemonset/deviceclasses.yaml",
            *(ROOT / "deploy/daemonset/examples").glob("*.yaml"),
        ]
        for document in yaml.safe_load_all(path.read_text())
        for expression in _selectors(document)
    }
)


def test_shipped_selectors_were_found() -> None:
    files = {name for name, _ in SHIPPED}
    assert "deviceclasses.yaml" in files and len(files) >= 5


@pytest.mark.parametrize(("path", "expression"), SHIPPED)
def test_every_shipped_selector_compiles(env: CelEnvironment, path: str, expression: str) -> None:
    selector = env.compile(expression)
    assert selector.estimated_cost <= COST_LIMIT
    # and evaluates to a bool or a reported missing-attribute error on a device of another kind
    verdict = selector.evaluate(_device(env, "example"))
    assert verdict.error is None or "no such key" in verdict.error, verdict


def test_a_failing_function_is_reported_not_logged(env: CelEnvironment, caplog) -> None:
    # the Rust library logs each exception of a registered function; ours are verdicts
    verdict = env.compile('quantity("bogus") == quantity("1")').evaluate(_device(env, "empty"))
    assert verdict.error is not None and '"bogus" is not a quantity' in verdict.error
    assert not [r for r in caplog.records if r.name.startswith("cel")]


# -- the memo: devices that agree on what an expression reads share one evaluation -------------
MEMO_DEVICES = [n for n in DEVICES] + ["example-other-string", "example-qualified"]
DEVICES["example-other-string"] = {
    **DEVICES["example"],
    "attributes": {**DEVICES["example"]["attributes"], "string": {"string": "cat"}},
}
DEVICES["example-qualified"] = {  # the same values, written with the driver's domain
    **DEVICES["example"],
    "attributes": {f"{DRIVER}/{k}" if "/" not in k else k: v
                   for k, v in DEVICES["example"]["attributes"].items()},
}  # fmt: skip
# A memory-share GPU as the driver publishes it (--sharing memory-shares): its capacity carries a
# requestPolicy (maps and a list), which CEL never sees (cel/compile.go's device.capacity is name
# -> quantity) but the memo key is built from; issue 26's traceback was this device.
MEMO_DEVICES += ["shared-range", "shared-values"]
DEVICES["shared-range"] = {
    **DEVICES["example"],
    "multi": True,
    "capacity": {
        **DEVICES["example"]["capacity"],
        "memory": {
            "value": "80Gi",
            "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}},
        },
    },
}
DEVICES["shared-values"] = {
    **DEVICES["shared-range"],
    "capacity": {
        **DEVICES["example"]["capacity"],
        "memory": {"value": "80Gi", "requestPolicy": {"validValues": ["8Gi", "16Gi", "80Gi"]}},
    },
}


@pytest.mark.parametrize(
    "expression",
    sorted({e for e, _, x in CASES if not (isinstance(x, tuple) and x[0] == COMPILE)}),
)
def test_a_remembered_verdict_is_the_one_evaluation_gives(expression: str) -> None:
    """Every device, evaluated after every other device has filled the selector's memo, gets
    what a fresh environment answers for it alone."""
    warm = CelEnvironment()
    selector = warm.compile(expression)
    for name in MEMO_DEVICES:
        selector.evaluate(_device(warm, name))
    for name in MEMO_DEVICES:
        fresh = CelEnvironment()
        expected = fresh.compile(expression).evaluate(_device(fresh, name))
        assert selector.evaluate(_device(warm, name)) == expected, (expression, name)


def test_devices_that_agree_on_what_is_read_share_one_evaluation(env: CelEnvironment) -> None:
    selector = env.compile(f'{D}.string == "fish" && "int" in {D}')
    a = env.device(DRIVER, {"string": {"string": "fish"}, "int": {"int": 1}, "x": {"int": 1}}, {})
    b = env.device(DRIVER, {"string": {"string": "fish"}, "int": {"int": 2}, "x": {"int": 2}}, {})
    assert selector.evaluate(a).matched and selector.evaluate(b).matched
    assert b._converted is None  # answered from the memo: b was never converted
    c = env.device(DRIVER, {"string": {"string": "fish"}, "x": {"int": 2}}, {})
    assert not selector.evaluate(c).matched  # "int" is absent: another key, evaluated


def test_an_unconvertible_device_is_an_error_even_when_its_values_were_seen(
    env: CelEnvironment,
) -> None:
    selector = env.compile(f'{D}.string == "fish"')
    good = env.device(DRIVER, {"string": {"string": "fish"}}, {})
    bad = env.device(DRIVER, {"string": {"string": "fish"}, "v": {"version": "v1"}}, {})
    assert selector.evaluate(good).matched
    verdict = selector.evaluate(bad)
    assert not verdict.matched and verdict.error and "parse semantic version" in verdict.error


def test_a_capacity_with_a_request_policy_is_remembered_by_what_cel_sees(
    env: CelEnvironment,
) -> None:
    """The memo key of a capacity is its quantity (all cel/compile.go gives CEL): a request
    policy, with its maps and lists, neither breaks the memo nor splits it."""
    selector = env.compile(f'{C}.memory.compareTo(quantity("40Gi")) >= 0')
    ranged = _device(env, "shared-range")
    assert selector.evaluate(ranged).matched
    listed = _device(env, "shared-values")
    assert selector.evaluate(listed).matched
    assert listed._converted is None  # the same quantity: answered from the memo
    smaller = env.device(DRIVER, {}, {"memory": {"value": "20Gi", "requestPolicy": {}}}, True)
    assert not selector.evaluate(smaller).matched


def test_memo_keys_tell_apart_values_python_calls_equal(env: CelEnvironment) -> None:
    """1, 1.0 and True hash alike in Python; CEL tells them apart (no cross-type equality), so
    the memo must too."""
    selector = env.compile(f"{D}.x == 1")
    assert selector.evaluate(env.device(DRIVER, {"x": {"int": 1}}, {})).matched
    verdict = selector.evaluate(env.device(DRIVER, {"x": {"bool": True}}, {}))
    assert not verdict.matched
