"""The OpenAPI v3 documents of the API-server emulator, the ones ``kubectl`` downloads.

What kubectl does with them (kubectl 1.27+, k8s.io/cli-runtime ``pkg/resource/query_param_
verifier_v3.go``, ``pkg/cmd/util/factory_client_access.go`` ``Validator``): before ``apply`` or
``create`` with validation on (the default ``--validate=strict``), it reads ``GET /openapi/v3``
(an index: ``paths`` -> ``{"serverRelativeURL": "/openapi/v3/apis/<group>/<version>?hash=..."}``)
and the document of the object's group-version, and looks there for a PATCH operation whose
``x-kubernetes-group-version-kind`` is the object's with a ``fieldValidation`` query parameter. If
it finds one, the server validates (kubectl sends ``fieldValidation=Strict``); for a custom
resource whose group-version has no document it checks the Namespace's instead. Only when
``/openapi/v3`` is missing does it fall back to ``/openapi/v2`` (protobuf), which the emulator
does not serve: every kubectl this project supports reads v3.

The documents are built from what the emulator serves: the built-in resources' schemas are the
upstream definitions kubernetes-validate carries (of the emulator's Kubernetes version; their
``x-kubernetes-patch-*`` extensions drive kubectl's strategic merge patches), a CRD's is its
version's ``openAPIV3Schema`` under the real server's name (``dev.tessera.v1alpha1.GpuBudget``
for ``tessera.dev/v1alpha1`` ``GpuBudget``). Each document's ``hash`` changes with its content,
so kubectl's cache follows a new CRD.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent.sim.apiserver_checks import schema_validator
from agent.sim.apiserver_schemas import Schemas
from agent.sim.apiserver_types import ResourceType

Obj = dict[str, Any]

_META = "io.k8s.apimachinery.pkg.apis.meta.v1"
_QUERY = {
    "dryRun": "When present, modifications are not persisted (All).",
    "fieldManager": "The name of the actor making the change.",
    "fieldValidation": "Ignore, Warn or Strict: what to do with unknown or duplicate fields.",
}


def gv_path(rt: ResourceType) -> str:
    """``api/v1`` or ``apis/<group>/<version>``: the index key of ``rt``'s document."""
    return rt.prefix.lstrip("/")


def crd_schema_name(rt: ResourceType) -> str:
    """``dev.tessera.v1alpha1.GpuBudget``: how the real server names a CRD's schema."""
    return ".".join([*reversed(rt.group.split(".")), rt.version, rt.kind])


def _openapi3(node: Any) -> Any:
    """A kubernetes-validate definition as OpenAPI 3: ``$defs`` references moved under
    ``components/schemas`` and JSON Schema's ``["string", "null"]`` types made single."""
    if isinstance(node, list):
        return [_openapi3(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: Obj = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            out[key] = value.replace("#/$defs/", "#/components/schemas/")
        elif key == "type" and isinstance(value, list):
            kinds = [t for t in value if t != "null"]
            out[key] = kinds[0] if len(kinds) == 1 else kinds
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _openapi3(sub) for name, sub in value.items()}
        else:
            out[key] = _openapi3(value)
    return out


def _reachable(defs: Mapping[str, Any], roots: Sequence[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    todo = [r for r in roots if r in defs]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found[name] = defs[name]
        stack: list[Any] = [defs[name]]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith("#/$defs/"):
                    todo.append(ref.removeprefix("#/$defs/"))
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return found


def _operation(rt: ResourceType, action: str, ref: str, params: Sequence[str]) -> Obj:
    gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}
    op: Obj = {
        "operationId": f"{action}{rt.kind}",
        "parameters": [
            {"name": p, "in": "query", "description": _QUERY[p], "schema": {"type": "string"}}
            for p in params
        ],
        "responses": {
            "200": {
                "description": "OK",
                "content": {"application/json": {"schema": {"$ref": ref}}},
            }
        },
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": gvk,
    }
    if action in ("put", "post"):
        op["requestBody"] = {"content": {"*/*": {"schema": {"$ref": ref}}}, "required": True}
    if action == "patch":
        kinds = ["application/json-patch+json", "application/merge-patch+json"]
        if not rt.crd:
            kinds.append("application/strategic-merge-patch+json")
        patch = {"schema": {"$ref": f"#/components/schemas/{_META}.Patch"}}
        op["requestBody"] = {"content": dict.fromkeys(kinds, patch), "required": True}
    return op


def _paths(rt: ResourceType, ref: str) -> Obj:
    ns = "/namespaces/{namespace}" if rt.namespaced else ""
    base = f"{rt.prefix}{ns}/{rt.plural}"
    write = ("dryRun", "fieldManager", "fieldValidation")
    item = {
        "get": _operation(rt, "get", ref, ()),
        "put": _operation(rt, "put", ref, write),
        "patch": _operation(rt, "patch", ref, write),
        "delete": _operation(rt, "delete", ref, ("dryRun",)),
    }
    out: Obj = {
        base: {"get": _operation(rt, "list", ref, ()), "post": _operation(rt, "post", ref, write)},
        f"{base}/{{name}}": item,
    }
    if rt.status:
        out[f"{base}/{{name}}/status"] = {k: item[k] for k in ("get", "put", "patch")}
    return out


class OpenApi:
    """Builds (and caches, by what is served) the ``/openapi/v3`` documents."""

    def __init__(self, kube_version: str) -> None:
        self._kube_version = kube_version
        self._lock = threading.Lock()
        self._schemas: Schemas | None = None
        self._by_gvk: dict[tuple[str, str, str], str] = {}
        self._cache: dict[str, tuple[str, bytes]] = {}  # gv path -> (content key, document)

    def _definitions(self) -> dict[str, Any]:
        if self._schemas is None:
            self._schemas = Schemas(schema_validator())
        defs = self._schemas.definitions(self._kube_version)
        if not self._by_gvk:
            for name, schema in defs.items():
                for gvk in schema.get("x-kubernetes-group-version-kind") or ():
                    key = (gvk.get("group", ""), gvk.get("version", ""), gvk.get("kind", ""))
                    self._by_gvk.setdefault(key, name)
        return defs

    def document(self, types: Sequence[ResourceType], path: str) -> bytes | None:
        """The document of group-version ``path`` (``apis/<group>/<version>``), None if none."""
        served = [t for t in types if gv_path(t) == path]
        if not served:
            return None
        key = json.dumps(
            [[t.plural, t.kind, t.namespaced, t.status, t.crd, t.schema] for t in served],
            sort_keys=True,
        )
        with self._lock:
            cached = self._cache.get(path)
            if cached is not None and cached[0] == key:
                return cached[1]
            data = json.dumps(self._build(served), separators=(",", ":")).encode()
            self._cache[path] = (key, data)
            return data

    def answer(self, types: Iterable[ResourceType], path: str) -> bytes | None:
        """The body of ``GET <path>`` (``/openapi/v3`` or a document under it), None: 404."""
        known = list(types)
        if path.rstrip("/") == "/openapi/v3":
            return json.dumps(self.index(known), separators=(",", ":")).encode()
        return self.document(known, path.removeprefix("/openapi/v3/").strip("/"))

    def index(self, types: Sequence[ResourceType]) -> Obj:
        """``GET /openapi/v3``: every served group-version and its document's URL."""
        paths: Obj = {}
        for path in sorted({gv_path(t) for t in types}):
            data = self.document(types, path) or b""
            digest = hashlib.sha512(data).hexdigest()[:32].upper()
            paths[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest}"}
        return {"paths": paths}

    def _build(self, served: Sequence[ResourceType]) -> Obj:
        defs = self._definitions()
        paths: Obj = {}
        roots = [f"{_META}.{name}" for name in ("Patch", "Status", "DeleteOptions", "ObjectMeta")]
        custom: Obj = {}
        for rt in served:
            if rt.crd:
                name = crd_schema_name(rt)
                schema = dict(rt.schema or {})
                props = dict(schema.get("properties") or {})
                props["metadata"] = {"$ref": f"#/$defs/{_META}.ObjectMeta"}
                schema["properties"] = props
                gvk = {"group": rt.group, "version": rt.version, "kind": rt.kind}
                schema["x-kubernetes-group-version-kind"] = [gvk]
                custom[name] = schema
            else:
                name = self._by_gvk.get((rt.group, rt.version, rt.kind), "")
                roots.append(name)
            paths.update(_paths(rt, f"#/components/schemas/{name}"))
        components = {**_reachable(defs, roots), **custom}
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": f"v{self._kube_version}"},
            "paths": paths,
            "components": {"schemas": _openapi3(components)},
        }
