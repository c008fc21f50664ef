"""A custom resource checked against its CustomResourceDefinition's structural schema, as the
real API server does it (k8s.io/apiextensions-apiserver): unknown fields pruned (or reported),
``default`` s applied, then the OpenAPI v3 value validations, each failure a field error with the
real server's path and wording.

Where the words come from (upstream, read for this module; none of its code is copied):

* kube-openapi ``pkg/validation/validate`` names a node ``spec.items[0].name`` and words its
  checks ``<path> in body should match '<pattern>'``, ``... should be greater than or equal to
  <n>``, ``... must be of type <type>: "<actual>"``, ``... should be at least <n> chars long``;
* apiextensions-apiserver ``pkg/apiserver/validation/validation.go``
  (``kubeOpenAPIResultToFieldErrors``) turns them into ``field.Required`` (``Required value``),
  ``field.NotSupported`` (``Unsupported value: "x": supported values: "a", "b"``),
  ``field.TooLong`` (``Too long: may not be more than 63 bytes``), ``field.TooMany``
  (``Too many: 33: must have at most 32 items``), ``field.TypeInvalid`` and ``field.Invalid``
  (``Invalid value: <value>: <detail>``), rendered by apimachinery's ``field.Error.ErrorBody``;
* list types ``set`` and ``map`` refuse repeats: ``Duplicate value: <value>``.

Hand-written rather than through ``jsonschema`` because every message and path must read as the
real server's, which a generic validator's errors do not.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

Obj = dict[str, Any]

#: Kept at the root of every custom object whatever the schema says (the server owns them).
ROOT_FIELDS = ("apiVersion", "kind", "metadata")

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
}


@dataclass(frozen=True)
class FieldError:
    """One ``field.Error``: its path, its cause reason, and its ``ErrorBody``."""

    field: str
    reason: str  # FieldValueInvalid, FieldValueRequired, ...
    body: str

    def __str__(self) -> str:
        return f"{self.field}: {self.body}"


def go_value(value: Any) -> str:
    """A bad value as ``field.Error`` prints it: strings quoted, numbers and bools bare."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if value is None:
        return '"null"'
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError(path, "FieldValueInvalid", f"Invalid value: {go_value(value)}: {detail}")


def child(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_of(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object"):
        if isinstance(value, _TYPES[name]) and not (name == "integer" and isinstance(value, bool)):
            return name
    return "null"


def _is_type(value: Any, wanted: str) -> bool:
    if isinstance(value, bool):
        return wanted == "boolean"
    if wanted == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES.get(wanted, (object,)))


# ------------------------------------------------------------------------------ pruning, defaults


def prune(schema: Mapping[str, Any], value: Any, path: str = "", root: bool = True) -> list[str]:
    """Drop from ``value`` (in place) every field its schema does not know; their paths.

    ``x-kubernetes-preserve-unknown-fields`` keeps them (below it, known fields are still
    descended); at the root, apiVersion, kind and metadata always stay."""
    dropped: list[str] = []
    if isinstance(value, dict) and (schema.get("type") == "object" or "properties" in schema):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep = schema.get("x-kubernetes-preserve-unknown-fields") is True
        for name in list(value):
            sub = props.get(name)
            if root and name in ROOT_FIELDS:
                continue
            if sub is None and isinstance(extra, dict):
                sub = extra
            if sub is None:
                if not keep and extra is not True:
                    dropped.append(child(path, name))
                    del value[name]
                continue
            dropped += prune(sub, value[name], child(path, name), False)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            dropped += prune(schema["items"], item, f"{path}[{i}]", False)
    return dropped


def apply_defaults(schema: Mapping[str, Any], value: Any) -> None:
    """Fill in (in place) every absent field whose schema has a ``default``, outside in."""
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                if name not in (schema.get("properties") or {}):
                    apply_defaults(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(schema["items"], item)


# ------------------------------------------------------------------------------ validation


def _date_time(value: str) -> bool:
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return False
    return "T" in value or "t" in value


def _scalar(schema: Mapping[str, Any], value: Any, path: str) -> Iterator[FieldError]:
    name = path or "<nil>"
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(json.dumps(v) for v in schema["enum"])
        body = f"Unsupported value: {go_value(value)}: supported values: {allowed}"
        yield FieldError(path, "FieldValueNotSupported", body)
    if isinstance(value, str):
        if "maxLength" in schema and len(value.encode()) > schema["maxLength"]:
            n = schema["maxLength"]
            body = f"Too long: may not be more than {n} byte{'' if n == 1 else 's'}"
            yield FieldError(path, "FieldValueTooLong", body)
        if "minLength" in schema and len(value) < schema["minLength"]:
            n = schema["minLength"]
            yield invalid(path, value, f"{name} in body should be at least {n} chars long")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            yield invalid(path, value, f"{name} in body should match '{schema['pattern']}'")
        if schema.get("format") == "date-time" and not _date_time(value):
            yield invalid(path, value, f'{name} in body must be of type date-time: "{value}"')
    if isinstance(value, int | float) and not isinstance(value, bool):
        for key, exclusive, word in (
            ("minimum", "exclusiveMinimum", "greater"),
            ("maximum", "exclusiveMaximum", "less"),
        ):
            if key not in schema:
                continue
            bound, strict = schema[key], bool(schema.get(exclusive))
            low = word == "greater"
            bad = (
                (value <= bound if strict else value < bound)
                if low
                else (value >= bound if strict else value > bound)
            )
            if bad:
                than = f"{word} than" if strict else f"{word} than or equal to"
                yield invalid(path, value, f"{name} in body should be {than} {bound}")


def validate(schema: Mapping[str, Any], value: Any, path: str = "") -> list[FieldError]:
    """Every failure of ``value`` against the structural ``schema``, outside in."""
    return list(_walk(schema, value, path))


def _walk(schema: Mapping[str, Any], value: Any, path: str) -> Iterator[FieldError]:
    name = path or "<nil>"
    if value is None:
        if not schema.get("nullable") and "type" in schema:
            yield FieldError(
                path,
                "FieldValueTypeInvalid",
                f'Invalid value: "null": {name} in body must be of type {schema["type"]}: "null"',
            )
        return
    wanted = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not (_is_type(value, "integer") or isinstance(value, str)):
            actual = _type_of(value)
            body = f'Invalid value: "{actual}": {name} in body must be of type integer,string:'
            yield FieldError(path, "FieldValueTypeInvalid", f'{body} "{actual}"')
            return
    elif wanted and not _is_type(value, wanted):
        actual = _type_of(value)
        body = f'Invalid value: "{actual}": {name} in body must be of type {wanted}: "{actual}"'
        yield FieldError(path, "FieldValueTypeInvalid", body)
        return
    yield from _scalar(schema, value, path)
    if isinstance(value, dict):
        yield from _object(schema, value, path)
    elif isinstance(value, list):
        yield from _array(schema, value, path)


def _object(schema: Mapping[str, Any], value: Obj, path: str) -> Iterator[FieldError]:
    for required in schema.get("required") or ():
        if required not in value:
            yield FieldError(child(path, required), "FieldValueRequired", "Required value")
    for key, word in (("maxProperties", "most"), ("minProperties", "least")):
        if key in schema:
            n, have = schema[key], len(value)
            if (have > n) if word == "most" else (have < n):
                if word == "most":
                    body = f"Too many: {have}: must have at most {n} item{'' if n == 1 else 's'}"
                    yield FieldError(path, "FieldValueTooMany", body)
                else:
                    detail = f"{path or '<nil>'} in body should have at least {n} properties"
                    yield FieldError(path, "FieldValueInvalid", f"Invalid value: {have}: {detail}")
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    for key, item in value.items():
        sub = props.get(key)
        if sub is None and isinstance(extra, dict):
            sub = extra
        if sub is not None:
            yield from _walk(sub, item, child(path, key))


def _array(schema: Mapping[str, Any], value: list[Any], path: str) -> Iterator[FieldError]:
    name = path or "<nil>"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        n = schema["maxItems"]
        body = f"Too many: {len(value)}: must have at most {n} item{'' if n == 1 else 's'}"
        yield FieldError(path, "FieldValueTooMany", body)
    if "minItems" in schema and len(value) < schema["minItems"]:
        n = schema["minItems"]
        yield invalid(path, value, f"{name} in body should have at least {n} items")
    items = schema.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(value):
            yield from _walk(items, item, f"{path}[{i}]")
    list_type = schema.get("x-kubernetes-list-type")
    keys = schema.get("x-kubernetes-list-map-keys") or []
    if list_type in ("set", "map"):
        seen: list[Any] = []
        for i, item in enumerate(value):
            if list_type == "map" and isinstance(item, dict):
                ident: Any = {k: item.get(k) for k in keys}
            else:
                ident = item
            if ident in seen:
                body = f"Duplicate value: {go_value(ident)}"
                yield FieldError(f"{path}[{i}]", "FieldValueDuplicate", body)
            seen.append(ident)
