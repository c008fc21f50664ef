"""The upstream schemas with their references resolved once (agent/sim/apiserver_schemas.py)
refuse and accept exactly what kubernetes-validate's own ``validate`` does."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from agent.sim.apiserver_schemas import Schemas, inline_refs

SLICE: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceSlice",
    "metadata": {"name": "node-a-gpu.tessera.dev-x"},
    "spec": {
        "driver": "gpu.tessera.dev",
        "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
        "nodeName": "node-a",
        "devices": [{"name": "gpu-0", "attributes": {"index": {"int": 0}}}],
    },
}
# a CRD's schema is JSONSchemaProps, a recursive definition: a cycle once inlined
CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "things.example.com"},
    "spec": {
        "group": "example.com",
        "names": {"plural": "things", "kind": "Thing"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "properties": {"n": {"type": "integer"}}}
                        },
                    }
                },
            }
        ],
    },
}


def _set(path: tuple[Any, ...], value: Any):
    def change(obj: dict[str, Any]) -> None:
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value

    return change


CASES = [
    (SLICE, None),
    (SLICE, _set(("spec", "devices", 0, "bogus"), 1)),
    (SLICE, _set(("spec", "pool", "generation"), "one")),
    (SLICE, _set(("spec", "devices", 0, "attributes", "index", "int"), "zero")),
    (CRD, None),
    (
        CRD,
        _set(
            ("spec", "versions", 0, "schema", "openAPIV3Schema", "properties", "spec", "bogus"),
            True,
        ),
    ),
]


def _outcome(check: Any, obj: dict[str, Any], version: str) -> tuple[str, ...] | None:
    try:
        check(obj, version)
    except kubernetes_validate.ValidationError as exc:
        return (str(exc.message), *map(str, exc.path))
    return None


@pytest.mark.parametrize("version", ["1.34.0", "1.35.0"])
@pytest.mark.parametrize(("base", "change"), CASES)
def test_the_kept_validators_answer_as_the_library_does(base, change, version):
    obj = copy.deepcopy(base)
    if change is not None:
        change(obj)
    ours = _outcome(Schemas(kubernetes_validate).validate, obj, version)
    theirs = _outcome(lambda o, v: kubernetes_validate.validate(o, v, strict=True), obj, version)
    assert ours == theirs
    assert (ours is None) == (change is None)


def test_a_reference_with_a_constraint_beside_it_is_refused_not_dropped():
    defs = {"Name": {"type": "string"}}
    assert inline_refs({"$ref": "#/$defs/Name", "description": "x"}, defs) == {"type": "string"}
    with pytest.raises(ValueError, match="maxLength"):
        inline_refs({"$ref": "#/$defs/Name", "maxLength": 3}, defs)
    with pytest.raises(ValueError, match="Missing"):
        inline_refs({"$ref": "#/$defs/Missing"}, defs)
