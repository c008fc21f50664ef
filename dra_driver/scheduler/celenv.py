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

Where each part lives (the package ``dra_driver.scheduler.cel``, one module per question):
``values`` (quantities and versions as CEL values, type names, device size bounds), ``semver``
(blang/semver parsing), ``functions`` (the stateless Kubernetes and ext functions), ``library``
(the quantity and semver functions and the function table), ``syntax`` (the lowered parse tree),
``checks`` (the compile-time checks), ``cost`` (the cost estimate), ``references`` (the device
values an expression reads), ``conversion`` (a device's CEL value) and ``selector`` (``Selector``,
``DeviceView``, ``Verdict``: evaluation and its memo). This module is the environment: the
compile limits, ``CelCompileError``, ``CelEnvironment`` and the filter on the Rust library's
``cel`` logger, installed once when this module is first imported (every evaluation goes through
a ``CelEnvironment``, so it is in place before the first one).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import cel
import lark
from celpy.celparser import CELParseError, CELParser

from dra_driver.scheduler.cel.checks import NATIVE, check, result_kind
from dra_driver.scheduler.cel.conversion import DeviceConverter
from dra_driver.scheduler.cel.cost import estimate
from dra_driver.scheduler.cel.grammar import CachedCelParser
from dra_driver.scheduler.cel.library import Library
from dra_driver.scheduler.cel.references import references
from dra_driver.scheduler.cel.selector import DeviceView, Selector
from dra_driver.scheduler.cel.syntax import lower

MAX_EXPRESSION_CHARS = 10_240  # resourceapi.CELSelectorExpressionMaxLength
COST_LIMIT = 1_000_000  # resourceapi.CELSelectorExpressionMaxCost


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


class CelEnvironment:
    """Compiles selectors (cached by text) and converts devices for them."""

    def __init__(self, cost_limit: int = COST_LIMIT, parser_cache: Path | None = None) -> None:
        """``parser_cache``: a directory where the CEL grammar's parser is kept between runs
        (:mod:`dra_driver.scheduler.cel.grammar`: 0.3 s a run saved); None builds celpy's
        parser, once a process."""
        self.cost_limit = cost_limit
        self._library = Library()
        self._functions = self._library.functions()
        self._known = frozenset(self._functions) | NATIVE
        self._parser = CELParser() if parser_cache is None else CachedCelParser(parser_cache)
        self._compiled: dict[str, Selector] = {}
        self._converter = DeviceConverter()

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
            return self._analyse(expression, program)
        except RecursionError:
            # the analysis walks the syntax tree recursively; cel-go's parser refuses nesting
            # deeper than its recursion limit too (but balances && and || chains, so a chain
            # of several hundred terms compiles there): docs/explain.md "CEL environment"
            raise CelCompileError(
                expression,
                "nested too deeply to analyse (a chain of hundreds of operators, or operators"
                " nested hundreds deep): split it into several selectors",
            ) from None

    def _analyse(self, expression: str, program: Any) -> Selector:
        try:
            tree = lower(self._parser.parse(expression))
        except (CELParseError, lark.exceptions.LarkError) as err:
            raise CelCompileError(expression, f"compilation failed: {err}") from None
        try:
            check(tree, frozenset(), self._known)
        except ValueError as err:
            raise CelCompileError(expression, str(err)) from None
        kind = result_kind(tree)
        if kind is not None:
            raise CelCompileError(expression, f"must evaluate to bool, not {kind}")
        cost = estimate(tree, {})[0]
        if cost > self.cost_limit:
            raise CelCompileError(
                expression,
                f"estimated worst-case cost {cost} exceeds the cost limit {self.cost_limit}"
                " (the bound of what it iterates over times the cost of each iteration; the"
                " apiserver refuses it too)",
            )
        refs: dict[str, tuple[str, ...]] = {}
        domains: set[tuple[str, str]] = set()
        closed = references(tree, refs, domains)
        memo = tuple(dict.fromkeys(refs.values())) if closed else None
        selector = Selector(expression, program, cost, refs, domains, memo)
        self._compiled[expression] = selector
        return selector

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
        return DeviceView(raw, self._converter, self._functions)


def _parse_message(text: str) -> str:
    """The Rust parser's message without the echo of the whole expression."""
    text = re.sub(r"^Failed to parse expression '.*?': ", "", text, flags=re.S)
    return text.strip()
