"""Checking an object against a CustomResourceDefinition's version as the API server does, for
the tests of Tessera's CRDs: defaults applied first, then the OpenAPI schema (structural, with
unknown fields refused as ``kubectl apply``'s strict field validation refuses them), then every
``x-kubernetes-validations`` CEL rule with ``self`` bound to its node (evaluated with the
``cel`` package). Returns the violations as ``path: message`` lines (empty: accepted).

The API-server emulator will serve CRDs the same way (issue 22, item 9); until then this is a
test tool, not a claim of the API server's exact messages."""

from __future__ import annotations

import copy
from typing import Any

import cel
import jsonschema

Obj = dict[str, Any]


def version_schema(crd: Obj, version: str) -> Obj:
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema: Obj = v["schema"]["openAPIV3Schema"]
    return schema


def violations(crd: Obj, obj: Obj) -> list[str]:
    version = obj["apiVersion"].split("/", 1)[1]
    schema = version_schema(crd, version)
    obj = copy.deepcopy(obj)
    _default(schema, obj)
    found = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in jsonschema.Draft7Validator(_strict(schema)).iter_errors(obj)
    ]
    if not found:
        _rules(schema, obj, "", found)
    return found


def _strict(schema: Any) -> Any:
    """The schema as JSON Schema: extensions dropped, unknown fields refused."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _default(schema: Obj, value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default(schema["items"], item)


def _rules(schema: Obj, value: Any, path: str, found: list[str]) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        ctx = cel.Context()
        ctx.add_variable("self", value)
        try:
            ok = cel.evaluate(rule["rule"], ctx)
        except Exception as exc:
            found.append(f"{path or '<root>'}: {rule['rule']}: {exc}")
            continue
        if ok is not True:
            found.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                _rules(sub, value[name], f"{path}.{name}" if path else name, found)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _rules(schema["items"], item, f"{path}[{i}]", found)
