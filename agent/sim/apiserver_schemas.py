"""The upstream Kubernetes OpenAPI schemas (kubernetes-validate's copies), parsed once.

``kubernetes_validate.validate`` reads and parses its version's whole definitions file on every
call (about three quarters of its 12 to 20 ms an object, measured with cProfile); the emulator
checks every write against two versions, and the tests check every object they see. A
:class:`Schemas` keeps one jsonschema validator per (version, apiVersion, kind), built on first
use from the library's own files and in the library's way (the newest schema version not newer
than the one asked, the strict variant that refuses unknown fields), and raises the library's
own errors, so a failure reads exactly as ``kubernetes_validate.validate``'s.

Each schema's ``$ref`` s are resolved once, when its validator is built (:func:`inline_refs`):
resolving them through a ``referencing`` registry on every use was two thirds of each check's time
(cProfile of ``tests/dra_driver/test_slices.py``).

The library is passed in (the emulator imports it lazily: it is a tool's dependency, the
``apiserver`` extra, not the agent's).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

_API_GROUP = re.compile(r"^([^./]*)(?:\.[^/]*)?/")
"""``rbac.authorization.k8s.io/v1`` -> ``rbac-v1`` (the library's file names)."""


class Schemas:
    """Strict validators for Kubernetes objects of a version, each built once (thread-safe)."""

    def __init__(self, library: ModuleType) -> None:
        self._kv = library
        self._utils = library.utils
        self._versions: list[str] = self._utils.all_versions()
        self._lock = threading.Lock()
        self._definitions: dict[str, Any] = {}
        self._validators: dict[tuple[str, str, str], Callable[[Any], None]] = {}

    def validate(self, obj: Mapping[str, Any], version: str) -> str:
        """Check ``obj`` against the strict schema of Kubernetes ``version`` (``1.35`` or
        ``1.35.0``); the schema version used. Raises ``kubernetes_validate.ValidationError`` (its
        ``path``, ``message`` and ``version``), ``SchemaNotFoundError`` for a kind the version
        lacks, ``VersionNotSupportedError`` for a version newer than the library's."""
        schema_version = self._schema_version(version)
        api_version, kind = str(obj["apiVersion"]), str(obj["kind"])
        validate = self._validator(schema_version, api_version, kind, version)
        try:
            validate(dict(obj))
        except self._kv.ValidationError:
            raise
        except self._utils.jsonschema.ValidationError as exc:
            version_used = self._utils.major_minor(schema_version)
            raise self._kv.ValidationError(exc, version=version_used) from None
        return str(self._utils.major_minor(schema_version))

    def definitions(self, version: str) -> dict[str, Any]:
        """The upstream definitions (``$defs``, by OpenAPI name such as
        ``io.k8s.api.core.v1.Pod``; their ``$ref`` s are ``#/$defs/NAME``) of Kubernetes
        ``version``, as the API server publishes them (not the strict variant)."""
        schema_dir = f"kubernetes-json-schema/v{self._schema_version(version)}-local"
        with self._lock:
            found = self._definitions.get(schema_dir)
            if found is None:
                found = self._utils.schema_contents(f"{schema_dir}/_definitions.json", version)
                self._definitions[schema_dir] = found
        defs: dict[str, Any] = found["$defs"]
        return defs

    def _schema_version(self, version: str) -> str:
        wanted = self._utils.major_minor(version.removeprefix("v"))
        if wanted > self._utils.major_minor(self._versions[-1]):
            raise self._utils.VersionNotSupportedError(version=wanted)
        older = [v for v in self._versions if self._utils.major_minor(v) <= wanted]
        return older[-1]

    def _validator(
        self, schema_version: str, api_version: str, kind: str, asked: str
    ) -> Callable[[Any], None]:
        key = (schema_version, api_version, kind)
        with self._lock:
            found = self._validators.get(key)
            if found is not None:
                return found
            schema_dir = f"kubernetes-json-schema/v{schema_version}-local-strict"
            group = _API_GROUP.sub(r"\1-", api_version)
            try:
                schema = self._utils.schema_contents(
                    f"{schema_dir}/{kind.lower()}-{group}.json", asked
                )
            except FileNotFoundError:
                raise self._kv.SchemaNotFoundError(
                    version=self._utils.major_minor(asked), kind=kind, api_version=api_version
                ) from None
            definitions = self._definitions.get(schema_dir)
            if definitions is None:
                definitions = self._utils.schema_contents(f"{schema_dir}/_definitions.json", asked)
                self._definitions[schema_dir] = definitions
            validator = self._utils.jsonschema.validators.Draft202012Validator(
                inline_refs(schema, definitions["$defs"])
            )
            check: Callable[[Any], None] = validator.validate
            self._validators[key] = check
            return check


def inline_refs(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` with every ``{"$ref": ".../_definitions.json#/$defs/NAME", ...}`` replaced by
    the definition NAME itself, each definition made once and shared (a recursive one, such as
    JSONSchemaProps, becomes a cycle: a validator descends only as deep as the object does).

    The upstream schemas put only annotations (``description``, ``x-kubernetes-*``) beside a
    ``$ref``, which validation ignores; anything else beside one, or a ``$ref`` outside
    ``$defs``, raises ValueError rather than be validated differently."""
    made: dict[str, dict[str, Any]] = {}

    def resolve(node: Any) -> Any:
        if isinstance(node, list):
            return [resolve(v) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if not isinstance(ref, str):  # a property may be named "$ref" (JSONSchemaProps)
            return {k: resolve(v) for k, v in node.items()}
        beside = [k for k in node if k not in ("$ref", "description") and not k.startswith("x-")]
        _, sep, name = ref.partition("#/$defs/")
        if beside or not sep or name not in defs:
            raise ValueError(f"cannot inline $ref {ref!r} (beside it: {beside})")
        if name not in made:
            made[name] = {}  # filled below; a reference to it from inside shares the object
            made[name].update(resolve(defs[name]))
        return made[name]

    inlined: dict[str, Any] = resolve(schema)
    return inlined
