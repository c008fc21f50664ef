"""The ``x-kubernetes-validations`` CEL rules of a CustomResourceDefinition's schema, evaluated as
the real API server does (k8s.io/apiextensions-apiserver ``pkg/apiserver/schema/cel``):

* each rule runs with ``self`` bound to the node that carries it (every item of a list, every
  value of a map); a rule that names ``oldSelf`` is a transition rule and runs only on an update
  where the old object has a value at the same place (found through object fields, map values
  and ``map`` list items with the same keys);
* a failed rule is ``field.Invalid(<path>, "<schema type>", <message>)``: its
  ``messageExpression`` when that evaluates to a non-empty string, else its ``message``, else
  ``failed rule: <rule>``; ``fieldPath`` moves the path, ``reason`` changes the cause
  (FieldValueForbidden, FieldValueRequired, FieldValueDuplicate);
* a rule that cannot be evaluated (a missing field that is not guarded by ``has()``) is a field
  error too, carrying the evaluator's words.

Evaluated with the ``cel`` package (common-expression-language, the Rust cel-interpreter).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import cel

from agent.sim.apiserver_crd_schema import FieldError, child

_OLD_SELF = re.compile(r"\boldSelf\b")
_FIELD_PATH = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\['([^']*)'\]|\[(\d+)\]")

_REASONS = {
    "FieldValueInvalid": "Invalid value",
    "FieldValueForbidden": "Forbidden",
    "FieldValueRequired": "Required value",
    "FieldValueDuplicate": "Duplicate value",
}


def evaluate_rules(
    schema: Mapping[str, Any], value: Any, old: Any, path: str = "", *, has_old: bool
) -> list[FieldError]:
    """Every failed rule of ``schema`` (and its nodes') for ``value``; ``old`` is the value
    at the same place before the update (``has_old``: there was one)."""
    return list(_rules(schema, value, old, path, has_old))


def compile_errors(schema: Mapping[str, Any], path: str) -> Iterator[tuple[str, str, str]]:
    """(path, rule, why) for every rule of ``schema`` (and its nodes') that does not parse: the
    real server refuses such a CRD (``compilation failed``); type errors it would also catch are
    left to evaluation, which reports them per object."""
    for i, rule in enumerate(schema.get("x-kubernetes-validations") or ()):
        try:
            cel.compile(str(rule.get("rule", "")))
        except ValueError as exc:
            yield f"{path}.x-kubernetes-validations[{i}].rule", str(rule.get("rule")), str(exc)
    for name, sub in (schema.get("properties") or {}).items():
        yield from compile_errors(sub, f"{path}.properties[{name}]")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from compile_errors(schema[key], f"{path}.{key}")


def _schema_type(schema: Mapping[str, Any]) -> str:
    return str(schema.get("type") or ("object" if "properties" in schema else ""))


def _moved(path: str, field_path: str) -> str:
    out = path
    for name, quoted, index in _FIELD_PATH.findall(field_path or ""):
        out = f"{out}[{index}]" if index else child(out, name or quoted)
    return out


def _message(rule: Mapping[str, Any], ctx: cel.Context) -> str:
    expression = rule.get("messageExpression")
    if expression:
        try:
            said = cel.evaluate(str(expression), ctx)
        except Exception:  # the real server falls back to message (and logs why)
            said = None
        if isinstance(said, str) and said.strip():
            return said.strip()
    return str(rule.get("message") or f"failed rule: {rule['rule']}")


def _one(
    rule: Mapping[str, Any],
    schema: Mapping[str, Any],
    value: Any,
    old: Any,
    path: str,
    has_old: bool,
) -> FieldError | None:
    text = str(rule["rule"])
    transition = bool(_OLD_SELF.search(text))
    if transition and not has_old:
        return None
    ctx = cel.Context()
    ctx.add_variable("self", value)
    if transition:
        ctx.add_variable("oldSelf", old)
    where = _moved(path, str(rule.get("fieldPath") or "")) or "<nil>"
    kind = _schema_type(schema)
    try:
        ok = cel.evaluate(text, ctx)
    except Exception as exc:  # no such key, a type mismatch: the rule cannot hold
        said = f"no such key: {exc.args[0]}" if isinstance(exc, KeyError) else str(exc)
        body = f'Invalid value: "{kind}": rule evaluation error: {text}: {said}'
        return FieldError(where, "FieldValueInvalid", body)
    if ok is True:
        return None
    message = _message(rule, ctx)
    reason = str(rule.get("reason") or "FieldValueInvalid")
    word = _REASONS.get(reason, "Invalid value")
    if reason in ("FieldValueForbidden", "FieldValueRequired"):
        return FieldError(where, reason, f"{word}: {message}")
    return FieldError(where, reason, f'{word}: "{kind}": {message}')


def _rules(
    schema: Mapping[str, Any], value: Any, old: Any, path: str, has_old: bool
) -> Iterator[FieldError]:
    if value is None:
        return
    for rule in schema.get("x-kubernetes-validations") or ():
        failed = _one(rule, schema, value, old, path, has_old)
        if failed is not None:
            yield failed
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        old_map = old if has_old and isinstance(old, dict) else {}
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from _rules(sub, item, old_map.get(key), child(path, key), key in old_map)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = schema["items"]
        keys = schema.get("x-kubernetes-list-map-keys") or []
        by_key: dict[str, Any] = {}
        if has_old and isinstance(old, list) and schema.get("x-kubernetes-list-type") == "map":
            for item in old:
                if isinstance(item, dict):
                    by_key[repr([item.get(k) for k in keys])] = item
        for i, item in enumerate(value):
            ident = repr([item.get(k) for k in keys]) if isinstance(item, dict) else ""
            found = ident in by_key
            yield from _rules(items, item, by_key.get(ident), f"{path}[{i}]", found)
