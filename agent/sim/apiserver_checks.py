"""Checks of objects written to the API-server emulator: body shape, JSON schemas, the few
semantic rules a client can trip over (Events' namespaces, a claim's device status, a 1.35
slice's devices beside its counter sets), a custom object's CRD, then validating
admission (:class:`WriteChecks`, which records every 422 it answers)."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from agent.errors import TesseraError
from agent.sim import apiserver_errors as err
from agent.sim.apiserver_admission import Admission
from agent.sim.apiserver_crd import CRD_PLURAL, check, decode, definition_errors
from agent.sim.apiserver_errors import ApiError
from agent.sim.apiserver_json import copy_json
from agent.sim.apiserver_schemas import Schemas
from agent.sim.apiserver_types import ResourceType

Obj = dict[str, Any]


@dataclass(frozen=True)
class Rejection:
    """A write answered 422 Invalid (``version``: the schema version it failed, if any)."""

    method: str
    resource: str
    name: str
    message: str
    version: str | None
    object: Obj


def k8s_path(path: Sequence[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def prepare_body(rt: ResourceType, namespace: str | None, body: Any) -> Obj:
    """A copy of ``body`` with apiVersion/kind/namespace checked and set."""
    if not isinstance(body, dict):
        raise err.bad_request("the body of the request must be a JSON object")
    api_version, kind = body.get("apiVersion") or rt.api_version, body.get("kind") or rt.kind
    if api_version != rt.api_version:
        raise err.bad_request(
            f"the API version in the data ({api_version}) does not match the expected API"
            f" version ({rt.api_version})"
        )
    if kind != rt.kind:
        raise err.bad_request(
            f"the kind in the data ({kind}) does not match the expected kind ({rt.kind})"
        )
    rest = {k: copy_json(v) for k, v in body.items() if k not in ("apiVersion", "kind")}
    obj: Obj = {"apiVersion": rt.api_version, "kind": rt.kind, **rest}
    meta = obj.setdefault("metadata", {})
    if not isinstance(meta, dict):
        raise err.bad_request("metadata must be a JSON object")
    if rt.namespaced:
        if namespace and meta.get("namespace") not in (None, "", namespace):
            raise err.bad_request(
                "the namespace of the provided object does not match the namespace sent on"
                " the request"
            )
        meta["namespace"] = namespace or meta.get("namespace") or ""
        if not meta["namespace"]:
            raise err.bad_request("the namespace of the object is not set")
    else:
        meta.pop("namespace", None)
    decode(rt, obj)  # a custom resource: unknown fields pruned, defaults applied
    return obj


def schema_validator() -> ModuleType:
    """kubernetes-validate, the upstream OpenAPI schemas the emulator checks writes against. It is
    a tool's dependency, not the agent's (the ``apiserver`` extra): a missing one is one clear
    error when the emulator is built, never a failed request."""
    try:
        import kubernetes_validate
    except ImportError as exc:
        raise TesseraError(
            "the API-server emulator checks every write against the Kubernetes schemas with"
            " kubernetes-validate, which is not installed: pip install 'tessera[apiserver]'"
        ) from exc
    module: ModuleType = kubernetes_validate  # untyped library: Any to mypy
    return module


def schema_failure(
    schemas: Schemas, rt: ResourceType, obj: Obj, versions: Sequence[str]
) -> tuple[str, ApiError] | None:
    """(version, 422 error) for the first Kubernetes version whose schema rejects ``obj``.

    Strict: an unknown field is a failure. A kind the schemas of a version lack is skipped.
    """
    kubernetes_validate = schema_validator()
    for version in versions:
        try:
            schemas.validate(obj, version)
        except kubernetes_validate.SchemaNotFoundError:
            continue
        except kubernetes_validate.ValidationError as exc:
            name = str(obj["metadata"].get("name", ""))
            message = f"{exc.message} (Kubernetes {exc.version} schema)"
            return version, err.invalid(rt, name, k8s_path(exc.path), "FieldValueInvalid", message)
    return None


def event_failure(rt: ResourceType, obj: Obj) -> ApiError | None:
    """The API server's legacy rule for a core/v1 Event without ``eventTime`` (as client-go's
    recorder writes them): it lives in its object's namespace, and an Event about a
    cluster-scoped object (no ``involvedObject.namespace``) in ``default`` (Kubernetes
    pkg/apis/core/validation/events.go, ``legacyValidateEvent``). None when it holds, or for
    anything but core Events."""
    if rt.group or rt.kind != "Event" or obj.get("eventTime"):
        return None
    namespace = obj["metadata"].get("namespace", "")
    involved = obj.get("involvedObject")
    object_ns = str(involved.get("namespace") or "") if isinstance(involved, dict) else ""
    agrees = namespace == object_ns if object_ns else namespace in ("", "default")
    if agrees:
        return None
    name = str(obj["metadata"].get("name", ""))
    message = f'Invalid value: "{object_ns}": does not match event.namespace'
    return err.invalid(rt, name, "involvedObject.namespace", "FieldValueInvalid", message)


DEVICE_STATUS_DATA_MAX = 10 * 1024
"""``AllocatedDeviceStatusDataMaxLength``: the most bytes of one ``status.devices[].data``."""


def claim_status_failure(rt: ResourceType, obj: Obj) -> ApiError | None:
    """422 for a ResourceClaim whose ``status.devices`` the real server refuses beyond the
    schema (Kubernetes pkg/apis/resource/validation/validation.go, ``validateDeviceStatus``):
    an entry for a device not in ``status.allocation.devices.results`` (driver, pool, device
    and shareID: "must be an allocated device in the claim"; so no entry without an
    allocation), the same device twice, or ``data`` over 10 Ki of JSON. None otherwise."""
    if rt.group != "resource.k8s.io" or rt.kind != "ResourceClaim":
        return None
    status = obj.get("status") or {}
    entries = status.get("devices") or []
    if not isinstance(status, dict) or not isinstance(entries, list) or not entries:
        return None
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []

    def device_id(d: Any) -> str:
        base = f"{d.get('driver')}/{d.get('pool')}/{d.get('device')}"
        return base if d.get("shareID") is None else f"{base}/{d['shareID']}"

    allocated = {device_id(r) for r in results if isinstance(r, dict)}
    seen: set[str] = set()
    found: list[tuple[str, str, str]] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            continue
        at, key = f"status.devices[{i}]", device_id(entry)
        if key not in allocated:
            why = f'Invalid value: "{key}": must be an allocated device in the claim'
            found.append((at, "FieldValueInvalid", why))
        if key in seen:
            found.append((at, "FieldValueDuplicate", f'Duplicate value: "{key}"'))
        seen.add(key)
        if "data" in entry:
            size = len(json.dumps(entry["data"], separators=(",", ":")))
            if size > DEVICE_STATUS_DATA_MAX:
                why = f"Too long: may not be more than {DEVICE_STATUS_DATA_MAX} bytes"
                found.append((f"{at}.data", "FieldValueTooLong", why))
    if not found:
        return None
    return err.invalid_fields(rt, str(obj["metadata"].get("name", "")), found)


SLICE_EXCLUSIVE_SINCE = (1, 35)
"""The first version whose ResourceSlice holds ``devices`` or ``sharedCounters``, not both (1.34
kept a slice's counter sets beside the devices that consume them)."""


def slice_failure(rt: ResourceType, obj: Obj, version: tuple[int, int]) -> ApiError | None:
    """422 for a ResourceSlice with both ``devices`` and ``sharedCounters`` on a server of 1.35 or
    later (Kubernetes pkg/apis/resource/validation/validation.go, ``validateResourceSliceSpec``:
    both fields non-nil, so an empty list counts; a JSON null does not). None otherwise."""
    if rt.group != "resource.k8s.io" or rt.kind != "ResourceSlice":
        return None
    spec = obj.get("spec")
    if version < SLICE_EXCLUSIVE_SINCE or not isinstance(spec, dict):
        return None
    if spec.get("devices") is None or spec.get("sharedCounters") is None:
        return None
    name = str(obj["metadata"].get("name", ""))
    message = 'Invalid value: "": only one of `sharedCounters` or `devices` is allowed'
    return err.invalid(rt, name, "spec", "FieldValueInvalid", message)


def custom_failure(
    rt: ResourceType, obj: Obj, old: Obj | None, served: Sequence[ResourceType]
) -> ApiError | None:
    """422 for a custom object its CRD's schema or CEL rules refuse, or for a CRD the real
    server refuses beyond its schema (apiserver_crd); None otherwise."""
    found = definition_errors(obj, served) if rt.plural == CRD_PLURAL and rt.group else []
    found = found or check(rt, obj, old)
    if not found:
        return None
    name = str(obj["metadata"].get("name", ""))
    return err.invalid_fields(rt, name, [(e.field, e.reason, e.body) for e in found])


class WriteChecks:
    """The checks every write of one server passes, in the real server's order: the schemas of
    each version in ``validate_versions`` (strict), the semantic rules, then validating
    admission (apiserver_admission) before the write commits. Each 422 lands in
    :attr:`rejected`. Not thread-safe on its own: the store's lock guards it."""

    def __init__(
        self,
        validate_versions: Sequence[str],
        admission: Admission | None,
        kube_version: tuple[int, int],
    ) -> None:
        """``kube_version``: the (major, minor) the server reports, whose semantic rules it
        applies where they differ between versions."""
        self.rejected: list[Rejection] = []
        self._versions = tuple(validate_versions)
        self._kube_version = kube_version
        # refused here, at construction, when the validator is missing
        self._schemas = Schemas(schema_validator()) if self._versions else None
        self._admission = admission

    def reject(
        self, method: str, rt: ResourceType, obj: Obj, error: ApiError, version: str | None = None
    ) -> ApiError:
        """Record ``obj`` as refused with ``error`` (422), and return ``error`` to raise."""
        name = str((obj.get("metadata") or {}).get("name") or "")
        self.rejected.append(
            Rejection(method, rt.plural, name, error.message, version, copy.deepcopy(obj))
        )
        return error

    def validate(
        self,
        method: str,
        rt: ResourceType,
        obj: Obj,
        old: Obj | None,
        served: Sequence[ResourceType],
    ) -> None:
        """Raise (and record) the first schema or semantic failure of ``obj``."""
        failure = None
        if self._schemas is not None:
            failure = schema_failure(self._schemas, rt, obj, self._versions)
        if failure is not None:
            raise self.reject(method, rt, obj, failure[1], failure[0])
        semantic = (
            event_failure(rt, obj)
            or claim_status_failure(rt, obj)
            or slice_failure(rt, obj, self._kube_version)
            or custom_failure(rt, obj, old, served)
        )
        if semantic is not None:
            raise self.reject(method, rt, obj, semantic)

    def admit(
        self,
        op: str,
        rt: ResourceType,
        obj: Obj | None,
        old: Obj | None,
        sub: str | None,
        dry: bool,
        types: Mapping[str, ResourceType],
        objects: Mapping[str, Mapping[tuple[str, str], Obj]],
    ) -> None:
        """Validating admission of one request (``types`` and ``objects``: what the server
        serves and stores, where policies and their params are found); a denial raises."""
        if self._admission is not None:
            self._admission.review(op, rt, obj, old, sub, dry, types, objects)
