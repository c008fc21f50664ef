"""How the API-server emulator's writes turn the old object into the new one.

The emulator's counterpart of the real server's REST strategies (``BeforeCreate``,
``BeforeUpdate``, ``BeforeDelete`` in k8s.io/apiserver/pkg/registry/rest/{create,update,delete}.go):
pure functions of the request body and the stored object, no lock, no storage. The store
(apiserver_store) calls them with its lock held and commits what they return.

What the real server does and these copy:

* create refuses a body with a ``resourceVersion``, sets ``uid``, ``creationTimestamp`` (and
  ``generation`` = 1 where the resource keeps one), honours ``generateName`` and drops
  ``status`` where the resource has a status subresource;
* patch applies the patch to the stored object, then updates with the result;
* update checks ``metadata.resourceVersion`` when set (409 Conflict), keeps the server-owned
  metadata, ignores status changes (normal update) or everything but status (``/status``),
  refuses a changed ``uid`` or an immutable ``spec`` and counts ``generation`` up when the
  content it covers changed;
* delete checks the ``preconditions`` of its DeleteOptions (409 Conflict); an object with
  finalizers only gets its ``deletionTimestamp`` (202) and goes when an update empties them.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

from agent.sim import apiserver_errors as err
from agent.sim.apiserver_checks import prepare_body
from agent.sim.apiserver_errors import ApiError
from agent.sim.apiserver_patch import PatchError, apply_patch
from agent.sim.apiserver_types import ResourceType

Obj = dict[str, Any]

_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # what the real server draws generated names from

#: Metadata only the server writes; an update keeps the stored values.
_SERVER_OWNED = (
    "uid",
    "creationTimestamp",
    "generation",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
)


class Refused(Exception):
    """A write refused as 422 Invalid (``error``), which the store records as a Rejection of the
    body in the state it had when refused."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


def name_suffix(rng: random.Random) -> str:
    """The five random characters appended to a ``generateName``."""
    return "".join(rng.choice(_NAME_CHARS) for _ in range(5))


def check_create(obj: Obj) -> None:
    """Refuse a body to be created that carries a ``resourceVersion`` (the real server's 500)."""
    if obj["metadata"].get("resourceVersion"):
        raise ApiError(500, "Unknown", "resourceVersion should not be set on objects to be created")


def generated_name(rng: random.Random, prefix: Any, taken: Callable[[str], bool]) -> str:
    """A name from ``generateName`` (``prefix``) and a random suffix; one not ``taken`` if one of
    eight draws finds it (else the last draw: the create then fails AlreadyExists)."""
    name = ""
    for _ in range(8):
        name = f"{prefix}{name_suffix(rng)}"
        if not taken(name):
            break
    return name


def check_new_name(rt: ResourceType, name: str) -> None:
    """Refuse a created object's missing or malformed ``metadata.name``."""
    if not name:
        raise Refused(
            err.invalid(
                rt,
                "",
                "metadata.name",
                "FieldValueRequired",
                "Required value: name or generateName is required",
            )
        )
    problem = rt.check_name(name)
    if problem:
        raise Refused(
            err.invalid(
                rt,
                name,
                "metadata.name",
                "FieldValueInvalid",
                f'Invalid value: "{name}": {problem}',
            )
        )


def prepare_create(rt: ResourceType, obj: Obj, *, uid: str, now: str) -> None:
    """Set the server-owned fields of ``obj``, a body about to be created."""
    meta = obj["metadata"]
    meta["uid"] = uid
    meta["creationTimestamp"] = now
    for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds"):
        meta.pop(server_owned, None)
    if rt.generation:
        meta["generation"] = 1
    if rt.initial_status is not None:
        obj["status"] = copy.deepcopy(rt.initial_status)
    elif rt.status and not rt.keep_status_on_create:
        obj.pop("status", None)


def prepare_update(rt: ResourceType, name: str, old: Obj, obj: Obj, subresource: str | None) -> Obj:
    """The object an update of ``old`` (named ``name``) with the body ``obj`` stores (``obj``
    itself, its server-owned fields set, unless ``subresource`` is ``status``); 409 when the
    body's resourceVersion is stale, :class:`Refused` when it changes what cannot change."""
    meta, old_meta = obj["metadata"], old["metadata"]
    asked = meta.get("resourceVersion")
    if asked and asked != old_meta["resourceVersion"]:
        raise err.conflict(rt, name)
    if subresource == "status":
        new = copy.deepcopy(old)
        if "status" in obj:
            new["status"] = obj["status"]
        else:
            new.pop("status", None)
    else:
        new = obj
        uid = meta.get("uid")
        if uid and uid != old_meta.get("uid"):
            raise Refused(
                err.invalid(
                    rt,
                    name,
                    "metadata.uid",
                    "FieldValueInvalid",
                    f'Invalid value: "{uid}": field is immutable',
                )
            )
        for owned in _SERVER_OWNED:
            if owned in old_meta:
                meta[owned] = copy.deepcopy(old_meta[owned])
            else:
                meta.pop(owned, None)
        if rt.spec_immutable and new.get("spec") != old.get("spec"):
            raise Refused(
                err.invalid(
                    rt, name, "spec", "FieldValueInvalid", "Invalid value: field is immutable"
                )
            )
        if rt.generation and rt.generation_content(new) != rt.generation_content(old):
            meta["generation"] = int(old_meta.get("generation", 0)) + 1
        if rt.status:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
    new["metadata"]["resourceVersion"] = old_meta["resourceVersion"]
    return new


def patched_body(
    rt: ResourceType, namespace: str | None, name: str, old: Obj, content_type: str, patch: Any
) -> Obj:
    """The body of the update a patch of ``old`` makes: 415 for a patch type not served, 422 for
    a patch that does not apply, 400 when it renames the object."""
    try:
        patched = apply_patch(content_type, old, patch)
    except PatchError as exc:
        if "unsupported patch type" in str(exc):
            raise ApiError(415, "UnsupportedMediaType", str(exc)) from None
        raise ApiError(422, "Invalid", str(exc)) from None
    obj = prepare_body(rt, namespace, patched)
    if obj["metadata"].get("name") != name:
        raise err.bad_request("metadata.name cannot be changed by a patch")
    return obj


def finalized(obj: Obj) -> bool:
    """Whether ``obj`` is being deleted and no finalizer holds it any more (it goes)."""
    meta = obj["metadata"]
    return bool(meta.get("deletionTimestamp")) and not meta.get("finalizers")


def check_preconditions(rt: ResourceType, name: str, old: Obj, options: Any) -> None:
    """409 when the ``preconditions`` (uid, resourceVersion) of a delete's ``options`` do not
    hold for ``old`` (named ``name``)."""
    pre = (options or {}).get("preconditions") or {} if isinstance(options, dict) else {}
    meta = old["metadata"]
    for field in ("uid", "resourceVersion"):
        want, have = pre.get(field), meta.get(field)
        if want and want != have:
            label = "UID" if field == "uid" else "ResourceVersion"
            raise err.conflict(
                rt,
                name,
                f"Precondition failed: {label} in precondition: {want}, {label} in object"
                f" meta: {have}",
            )


def mark_deleting(old: Obj, now: str) -> Obj:
    """``old`` with the ``deletionTimestamp`` a delete sets while finalizers hold it."""
    new = copy.deepcopy(old)
    new["metadata"]["deletionTimestamp"] = now
    new["metadata"]["deletionGracePeriodSeconds"] = 0
    return new
