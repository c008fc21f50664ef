"""The upstream Kubernetes OpenAPI schemas (kubernetes-validate's copies), parsed once.

``kubernetes_validate.validate`` reads and parses its version's whole definitions file on every
call (about three quarters of its 12 to 20 ms an object, measured with cProfile); the emulator
checks every write against two versions, and the tests check every object they see. A
:class:`Schemas` keeps one jsonschema validator per (version, apiVersion, kind), built on first
use from the library's own files and in the library's way (the newest schema version not newer
than the one asked, the strict variant that refuses unknown fields), and raises the library's
own errors, so a failure reads exactly as ``kubernetes_validate.validate``'s.

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
            resource = self._utils.Resource.from_contents
            registry = resource(definitions) @ (resource(schema) @ self._utils.Registry())
            validator = self._utils.jsonschema.validators.Draft202012Validator(
                schema, registry=registry
            )
            check: Callable[[Any], None] = validator.validate
            self._validators[key] = check
            return check
