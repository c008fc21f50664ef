"""CustomResourceDefinitions in the API-server emulator: what a CRD serves, and each custom object
checked as the real API server checks it (k8s.io/apiextensions-apiserver).

A CRD written to ``apiextensions.k8s.io/v1`` ``customresourcedefinitions`` is served at once: the
store turns it into a :class:`~agent.sim.apiserver_types.ResourceType` (:func:`served_types`) and
then, as the real server's establishing controller does, writes its status (``NamesAccepted`` and
``Established`` True, ``acceptedNames``, ``storedVersions``). Deleting it stops serving it and
deletes its objects.

Every write of a custom object, in the real server's order:

1. decoding (:func:`decode`): unknown fields pruned (the HTTP layer answers 400 ``strict decoding
   error: unknown field "spec.x"`` first when the request asks ``fieldValidation=Strict``, as
   ``kubectl apply`` does, and a ``Warning`` header by default), then ``default`` s applied;
2. the structural schema's value validations (:mod:`~agent.sim.apiserver_crd_schema`);
3. when those pass, the ``x-kubernetes-validations`` CEL rules
   (:mod:`~agent.sim.apiserver_crd_rules`), ``oldSelf`` bound on updates.

A failure is 422 Invalid with one ``details.causes`` entry per field error, the message
``<Kind>.<group> "<name>" is invalid: <field>: <body>`` (several: ``[a, b]``), as
``errors.NewInvalid`` words it.

Left out (the emulator serves what Tessera's CRDs use): conversion between versions (only the
storage version is served), the scale subresource, ``x-kubernetes-embedded-resource``, ratcheting
of unchanged invalid values, and a plural served twice in different groups (refused, 422).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from agent.sim import apiserver_errors as err
from agent.sim.apiserver_crd_rules import compile_errors, evaluate_rules
from agent.sim.apiserver_crd_schema import FieldError, apply_defaults, invalid, prune, validate
from agent.sim.apiserver_types import ResourceType

Obj = dict[str, Any]

CRD_PLURAL = "customresourcedefinitions"


def storage_version(crd: Mapping[str, Any]) -> Mapping[str, Any]:
    versions = crd.get("spec", {}).get("versions") or []
    for version in versions:
        if version.get("storage"):
            return dict(version)
    return dict(versions[0]) if versions else {}


def version_schema(crd: Mapping[str, Any], version: str) -> Obj:
    """The ``openAPIV3Schema`` of one of ``crd``'s versions (KeyError when it has none)."""
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema: Obj = v["schema"]["openAPIV3Schema"]
            return schema
    raise KeyError(f"{crd['metadata']['name']} has no version {version!r}")


def served_types(crd: Mapping[str, Any]) -> list[ResourceType]:
    """The resources a CRD serves: its storage version, when that is served."""
    spec, version = crd["spec"], storage_version(crd)
    if not version or not version.get("served", True):
        return []
    names = spec["names"]
    return [
        ResourceType(
            names["plural"],
            names["kind"],
            spec["group"],
            version["name"],
            namespaced=spec.get("scope") == "Namespaced",
            status="status" in (version.get("subresources") or {}),
            generation=True,
            short_names=tuple(names.get("shortNames") or ()),
            crd=str(crd["metadata"]["name"]),
            schema=(version.get("schema") or {}).get("openAPIV3Schema")
            or {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            columns=tuple(version.get("additionalPrinterColumns") or ()),
        )
    ]


def definition_errors(crd: Mapping[str, Any], served: Sequence[ResourceType]) -> list[FieldError]:
    """What the real server refuses in a CRD beyond its OpenAPI schema (the parts a test trips
    over): its name, one storage version, and a plural the emulator already serves."""
    spec, name = crd.get("spec") or {}, str(crd["metadata"].get("name", ""))
    names = spec.get("names") or {}
    found: list[FieldError] = []
    want = f"{names.get('plural', '')}.{spec.get('group', '')}"
    if name != want:
        found.append(invalid("metadata.name", name, 'must be spec.names.plural+"."+spec.group'))
    for i, version in enumerate(spec.get("versions") or ()):
        schema = (version.get("schema") or {}).get("openAPIV3Schema") or {}
        where = f"spec.versions[{i}].schema.openAPIV3Schema"
        for at, rule, why in compile_errors(schema, where):
            found.append(invalid(at, rule, f"compilation failed: {why}"))
    storage = [v for v in spec.get("versions") or () if v.get("storage")]
    if len(storage) != 1:
        found.append(
            invalid(
                "spec.versions",
                spec.get("versions"),
                "must have exactly one version marked as storage version",
            )
        )
    for rt in served:
        if rt.plural == names.get("plural") and rt.crd != name:
            found.append(
                invalid(
                    "spec.names.plural",
                    rt.plural,
                    f"the emulator already serves {rt.plural} ({rt.api_version}); it keys"
                    " resources by plural, so two groups cannot share one",
                )
            )
    return found


def established_status(crd: Mapping[str, Any], now: str) -> Obj | None:
    """The status the real server's controllers give a new CRD, or None when it has it."""
    status = crd.get("status") or {}
    if any(c.get("type") == "Established" for c in status.get("conditions") or ()):
        return None
    names = dict(crd["spec"]["names"])
    names.setdefault("singular", names["kind"].lower())
    names.setdefault("listKind", f"{names['kind']}List")
    return {
        "conditions": [
            {
                "type": "NamesAccepted",
                "status": "True",
                "lastTransitionTime": now,
                "reason": "NoConflicts",
                "message": "no conflicts found",
            },
            {
                "type": "Established",
                "status": "True",
                "lastTransitionTime": now,
                "reason": "InitialNamesAccepted",
                "message": "the initial names have been accepted",
            },
        ],
        "acceptedNames": names,
        "storedVersions": [storage_version(crd).get("name", "")],
    }


def unknown_fields(rt: ResourceType, body: Any) -> list[str]:
    """The paths of ``body``'s fields that ``rt``'s schema does not know (nothing changed)."""
    if rt.schema is None or not isinstance(body, dict):
        return []
    return prune(rt.schema, copy.deepcopy(body))


def field_validation(rt: ResourceType, body: Any, directive: str) -> dict[str, str]:
    """What the real server does with ``body``'s unknown fields under ``fieldValidation``
    (k8s.io/apiserver handlers: a strict decoding error is 400 with ``Strict``; ``Warn``, the
    default, answers a ``Warning`` header per field; ``Ignore`` says nothing). The headers."""
    if directive not in ("", "Ignore", "Warn", "Strict"):
        raise err.bad_request(
            f'fieldValidation must be one of "Ignore", "Warn" or "Strict", not "{directive}"'
        )
    unknown = [] if directive == "Ignore" else unknown_fields(rt, body)
    if not unknown:
        return {}
    said = [f'unknown field "{path}"' for path in unknown]
    if directive == "Strict":
        raise err.bad_request(f"strict decoding error: {', '.join(said)}")
    return {"Warning": ", ".join('299 - "' + s.replace('"', '\\"') + '"' for s in said)}


def custom_write(
    rt: ResourceType, method: str, content_type: str, body: Any, directive: str
) -> dict[str, str]:
    """A write of a custom resource, before the store sees it: 415 for a strategic merge patch
    (the real server has no patch strategy for one), then :func:`field_validation` of the body
    (of a merge patch too; a JSON patch names no fields). The headers of the answer."""
    if not rt.crd or method not in ("POST", "PUT", "PATCH"):
        return {}
    if method == "PATCH" and "strategic-merge-patch" in content_type:
        raise err.ApiError(
            415,
            "UnsupportedMediaType",
            "the body of the request was in an unknown format - accepted media types include:"
            " application/json-patch+json, application/merge-patch+json",
        )
    if method == "PATCH" and "merge-patch" not in content_type:
        return {}
    return field_validation(rt, body, directive)


def decode(rt: ResourceType, obj: Obj) -> None:
    """Prune unknown fields from ``obj`` and apply the schema's defaults (in place)."""
    if rt.schema is None:
        return
    prune(rt.schema, obj)
    apply_defaults(rt.schema, obj)


def check(
    rt: ResourceType, obj: Mapping[str, Any], old: Mapping[str, Any] | None
) -> list[FieldError]:
    """Every field error of a custom object (its decoded form) against ``rt``'s schema and rules;
    ``old`` is the stored object on an update."""
    if rt.schema is None:
        return []
    schema = dict(rt.schema)
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    body = {k: v for k, v in obj.items() if k != "metadata"}
    found = validate({**schema, "properties": props}, body)
    if found:
        return found
    # a root rule may read metadata.name and metadata.generateName, nothing else of metadata
    meta = {k: v for k, v in obj["metadata"].items() if k in ("name", "generateName")}
    old_meta = {k: v for k, v in (old or {}).get("metadata", {}).items() if k in meta}
    old_body = None if old is None else {**old, "metadata": old_meta}
    rules = {**schema, "properties": {**props, "metadata": {"type": "object"}}}
    return evaluate_rules(rules, {**body, "metadata": meta}, old_body, has_old=old is not None)


def violations(
    crd: Mapping[str, Any], obj: Mapping[str, Any], old: Mapping[str, Any] | None = None
) -> list[str]:
    """``path: message`` for every way the real server refuses ``obj`` (empty: accepted): its
    unknown fields as strict field validation reports them, then :func:`check` after
    :func:`decode`. For tests of a CRD's manifests without a server."""
    version = str(obj["apiVersion"]).split("/", 1)[1]
    names = crd["spec"]["names"]
    rt = ResourceType(
        names["plural"],
        names["kind"],
        crd["spec"]["group"],
        version,
        crd=str(crd["metadata"]["name"]),
        schema=version_schema(crd, version),
    )
    found = [f'unknown field "{path}"' for path in unknown_fields(rt, obj)]
    decoded = copy.deepcopy(dict(obj))
    decode(rt, decoded)
    return found + [str(e) for e in check(rt, decoded, old)]
