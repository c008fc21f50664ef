"""The object store of the API-server emulator: CRUD with the real server's semantics.

One lock guards everything; watchers wait on :attr:`Store.changed`, a condition on that lock.
Stored objects are never mutated once stored (every write stores a fresh dict), so an event or an
answer can be serialized outside the lock, and a read copies only what it hands out to be changed
(copy on write). Each stored object's JSON as a list item is kept from its write on
(apiserver_lists.item_json), as the real server's watch cache keeps each object's encoding: a list
page is those bytes joined.

What the real server does and the store copies:

* one global, increasing ``resourceVersion`` (a string on the wire); a no-op update changes
  nothing and emits no event;
* how a create, update, patch or delete turns the old object into the new one (server-owned
  metadata, ``generation``, the status subresource, immutable fields, finalizers) is
  apiserver_strategy's; the store holds the lock, checks, admits and commits;
* every written object passes apiserver_checks (the Kubernetes JSON schemas of each version in
  ``validate_versions``, a custom object's CRD, validating admission); failures are 422 Invalid
  and recorded in :attr:`Store.rejected`.
"""

from __future__ import annotations

import copy
import random
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from agent.sim import apiserver_errors as err
from agent.sim.apiserver_admission import Admission
from agent.sim.apiserver_checks import Rejection, WriteChecks, prepare_body
from agent.sim.apiserver_crd import CRD_PLURAL, established_status, served_types
from agent.sim.apiserver_history import ADDED, DELETED, MODIFIED, History, WatchEvent
from agent.sim.apiserver_json import copy_json
from agent.sim.apiserver_lists import Page, continue_start, item_json, kind_list, list_page
from agent.sim.apiserver_select import Selection
from agent.sim.apiserver_strategy import (
    Refused,
    check_create,
    check_new_name,
    check_preconditions,
    finalized,
    generated_name,
    mark_deleting,
    name_suffix,
    patched_body,
    prepare_create,
    prepare_update,
)
from agent.sim.apiserver_types import ResourceType

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, or "" for cluster-scoped; name)


class Store:
    """All objects of one emulated API server."""

    def __init__(
        self,
        types: Sequence[ResourceType],
        *,
        validate_versions: Sequence[str],
        rng: random.Random,
        history_size: int,
        clock: Callable[[], datetime],
        admission: Admission | None = None,
        kube_version: tuple[int, int] = (1, 35),
    ) -> None:
        self.types = {t.plural: t for t in types}
        self._checks = WriteChecks(validate_versions, admission, kube_version)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.rv = 0
        self.closed = False
        self._rng = rng
        self._clock = clock
        self._objects: dict[str, dict[Key, Obj]] = {t: {} for t in self.types}
        self._encoded: dict[str, dict[Key, bytes]] = {t: {} for t in self.types}
        self._history = History(self.types, history_size)

    @property
    def rejected(self) -> list[Rejection]:
        """Every write answered 422 Invalid, in order."""
        return self._checks.rejected

    def clock(self) -> datetime:
        """Now, by the server's clock."""
        return self._clock().astimezone(UTC)

    def type_of(self, resource: str) -> ResourceType:
        try:
            return self.types[resource]
        except KeyError:
            raise ValueError(
                f"unknown resource {resource!r}: served are {', '.join(sorted(self.types))}"
            ) from None

    def close(self) -> None:
        """Wake every watcher for good (they end their streams)."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    # ------------------------------------------------------------------------------- helpers

    def _now(self) -> str:
        return self._clock().astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def _uid(self) -> str:
        return str(uuid.UUID(int=self._rng.getrandbits(128), version=4))

    def _commit(self, rt: ResourceType, kind: str, key: Key, obj: Obj, old: Obj | None) -> Obj:
        """Store (or drop, for DELETED) ``obj`` under a new resourceVersion; lock held."""
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if kind == DELETED:
            del self._objects[rt.plural][key]
            del self._encoded[rt.plural][key]
        else:
            self._objects[rt.plural][key] = obj
            self._encoded[rt.plural][key] = item_json(obj)
        self._history.record(rt.plural, WatchEvent(self.rv, kind, obj, old))
        self.changed.notify_all()
        if rt.plural == CRD_PLURAL:
            self._serve_crd(kind, obj)
        copied: Obj = copy_json(obj)
        return copied

    def _validate(self, method: str, rt: ResourceType, obj: Obj, old: Obj | None = None) -> None:
        self._checks.validate(method, rt, obj, old, list(self.types.values()))

    def _admit(
        self,
        op: str,
        rt: ResourceType,
        obj: Obj | None,
        old: Obj | None,
        sub: str | None,
        dry: bool,
    ) -> None:
        """Validating admission (apiserver_admission) after the schema checks, before the write
        commits, as the real server's chain runs it; a denial raises. Lock held."""
        self._checks.admit(op, rt, obj, old, sub, dry, self.types, self._objects)

    def admit(self, op: str, rt: ResourceType, obj: Obj, sub: str) -> None:
        """Validating admission of a subresource request the store does not write itself (a
        pod's eviction: ``CREATE`` of ``pods/eviction`` with the Eviction as the object, as
        the real server admits it); a denial raises."""
        with self.lock:
            self._admit(op, rt, obj, None, sub, False)

    def _key(self, rt: ResourceType, namespace: str | None, name: str) -> Key:
        return (namespace or "" if rt.namespaced else "", name)

    def _existing(self, rt: ResourceType, namespace: str | None, name: str) -> tuple[Key, Obj]:
        key = self._key(rt, namespace, name)
        old = self._objects[rt.plural].get(key)
        if old is None:
            raise err.not_found(rt, name)
        return key, old

    # ------------------------------------------------------------------------------- reads

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        with self.lock:
            got: Obj = copy_json(self._existing(rt, namespace, name)[1])
            return got

    def objects(
        self, rt: ResourceType, selection: Selection | None = None, *, name: str | None = None
    ) -> list[Obj]:
        selection = selection or Selection()
        with self.lock:
            found = sorted(self._objects[rt.plural].items())
            return [
                copy_json(o)
                for k, o in found
                if selection.matches(o) and (name is None or k[1] == name)
            ]

    def list_objects(
        self, rt: ResourceType, selection: Selection, *, limit: int = 0, token: str = ""
    ) -> Page:
        """The ``<Kind>List`` of the selected objects, a page of ``limit`` from ``token`` on
        (the stored objects and their stored JSON, not copies)."""
        start = continue_start(token)
        with self.lock:
            rv = self.rv
            encoded = self._encoded[rt.plural]
            found = [
                (k, o, encoded[k])
                for k, o in sorted(self._objects[rt.plural].items())
                if selection.matches(o) and (start is None or list(k) > start)
            ]
        return list_page(rt, rv, found, limit)

    # ------------------------------------------------------------------------------- writes

    def create(
        self, rt: ResourceType, namespace: str | None, body: Any, *, dry_run: bool = False
    ) -> Obj:
        obj = prepare_body(rt, namespace, body)
        meta = obj["metadata"]
        with self.lock:
            if rt.namespaced and "namespaces" in self.types:
                ns = meta["namespace"]
                if ("", ns) not in self._objects["namespaces"]:
                    raise err.not_found(self.types["namespaces"], ns)
            check_create(obj)
            name = str(meta.get("name") or "")
            if not name and meta.get("generateName"):
                stored = self._objects[rt.plural]
                name = generated_name(
                    self._rng,
                    meta["generateName"],
                    lambda n: self._key(rt, meta.get("namespace"), n) in stored,
                )
                meta["name"] = name
            try:
                check_new_name(rt, name)
            except Refused as refused:
                raise self._checks.reject("POST", rt, obj, refused.error) from None
            key = self._key(rt, meta.get("namespace"), name)
            if key in self._objects[rt.plural]:
                raise err.already_exists(rt, name)
            prepare_create(rt, obj, uid=self._uid(), now=self._now())
            self._validate("POST", rt, obj)
            self._admit("CREATE", rt, obj, None, None, dry_run)
            if dry_run:
                return copy.deepcopy(obj)
            return self._commit(rt, ADDED, key, obj, None)

    def update(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
        method: str = "PUT",
    ) -> Obj:
        obj = prepare_body(rt, namespace, body)
        if obj["metadata"].get("name", "") != name:
            raise err.bad_request(
                f"the name of the object ({obj['metadata'].get('name', '')}) does not match the"
                f" name on the URL ({name})"
            )
        with self.lock:
            key, old = self._existing(rt, namespace, name)
            return self._update_locked(rt, key, old, obj, subresource, dry_run, method)

    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> Obj:
        with self.lock:
            key, old = self._existing(rt, namespace, name)
            obj = patched_body(rt, namespace, name, old, content_type, patch)
            return self._update_locked(rt, key, old, obj, subresource, dry_run, "PATCH")

    def _update_locked(
        self,
        rt: ResourceType,
        key: Key,
        old: Obj,
        obj: Obj,
        subresource: str | None,
        dry_run: bool,
        method: str,
    ) -> Obj:
        try:
            new = prepare_update(rt, key[1], old, obj, subresource)
        except Refused as refused:
            raise self._checks.reject(method, rt, obj, refused.error) from None
        self._validate(method, rt, new, old)
        self._admit("UPDATE", rt, new, old, subresource, dry_run)
        if new == old or dry_run:
            return copy.deepcopy(new)
        if finalized(new):
            return self._commit(rt, DELETED, key, new, old)
        return self._commit(rt, MODIFIED, key, new, old)

    def delete(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        options: Any = None,
        *,
        dry_run: bool = False,
    ) -> tuple[int, Obj]:
        """(HTTP status, object): 200 and the last state, or 202 while finalizers remain."""
        with self.lock:
            key, old = self._existing(rt, namespace, name)
            check_preconditions(rt, name, old, options)
            self._admit("DELETE", rt, None, old, None, dry_run)
            return self._delete_locked(rt, key, old, dry_run)

    def _delete_locked(
        self, rt: ResourceType, key: Key, old: Obj, dry_run: bool, force: bool = False
    ) -> tuple[int, Obj]:
        if rt.plural == "namespaces" and not dry_run:
            for other in self.types.values():
                if other.namespaced:
                    for k, o in sorted(self._objects[other.plural].items()):
                        if k[0] == key[1]:
                            self._commit(other, DELETED, k, copy.deepcopy(o), o)
        if old["metadata"].get("finalizers") and not force:
            if old["metadata"].get("deletionTimestamp"):
                return 202, copy.deepcopy(old)
            new = mark_deleting(old, self._now())
            return 202, new if dry_run else self._commit(rt, MODIFIED, key, new, old)
        gone = copy.deepcopy(old)
        return 200, gone if dry_run else self._commit(rt, DELETED, key, gone, old)

    def delete_collection(self, rt: ResourceType, selection: Selection) -> Obj:
        """Delete every selected object; the ``<Kind>List`` of what was deleted."""
        with self.lock:
            items = []
            for key, obj in sorted(self._objects[rt.plural].items()):
                if selection.matches(obj):
                    self._admit("DELETE", rt, None, obj, None, False)
                    items.append(self._delete_locked(rt, key, obj, False)[1])
            rv = self.rv
        return kind_list(rt, {"resourceVersion": str(rv)}, items)

    # ------------------------------------------------------------------------------- seeding

    def put(self, rt: ResourceType, body: Any) -> Obj:
        """Store ``body`` as is (no validation), creating or replacing; emits the event."""
        namespace = (
            (body.get("metadata") or {}).get("namespace") if isinstance(body, dict) else None
        )
        obj = prepare_body(rt, namespace, body)
        meta = obj["metadata"]
        with self.lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + name_suffix(self._rng)
            if not meta.get("name"):
                raise ValueError("put_object needs metadata.name or metadata.generateName")
            key = self._key(rt, meta.get("namespace"), meta["name"])
            old = self._objects[rt.plural].get(key)
            old_meta = old["metadata"] if old else {}
            meta.setdefault("uid", old_meta.get("uid") or self._uid())
            meta.setdefault("creationTimestamp", old_meta.get("creationTimestamp") or self._now())
            if rt.generation:
                meta.setdefault("generation", old_meta.get("generation", 1))
            return self._commit(rt, MODIFIED if old else ADDED, key, obj, old)

    def remove(self, rt: ResourceType, namespace: str | None, name: str) -> Obj | None:
        """Delete at once, finalizers or not; the last state, or None when absent."""
        with self.lock:
            key = self._key(rt, namespace, name)
            old = self._objects[rt.plural].get(key)
            return None if old is None else self._delete_locked(rt, key, old, False, True)[1]

    # ------------------------------------------------------------------------------- watch

    def watch_start(
        self, rt: ResourceType, selection: Selection, resource_version: str
    ) -> tuple[int, list[WatchEvent]]:
        """(cursor, initial events) of a watch from ``resource_version`` ("" or "0": now,
        with an ADDED event for every selected object, like the real server)."""
        with self.lock:
            if resource_version in ("", "0"):
                found = sorted(self._objects[rt.plural].items())
                initial = [WatchEvent(self.rv, ADDED, o, None) for _, o in found]
                return self.rv, [e for e in initial if selection.matches(e.obj)]
            try:
                asked = int(resource_version)
            except ValueError:
                raise err.bad_request(
                    f"invalid resource version {resource_version!r}: must be an integer"
                ) from None
            self._history.check(rt.plural, asked)
            return asked, []

    def wait_events(
        self, rt: ResourceType, cursor: int, timeout: float
    ) -> tuple[list[WatchEvent], int]:
        """(events after ``cursor``, current resourceVersion), waiting up to ``timeout`` for one.

        Raises 410 (an ApiError) when events after ``cursor`` already left the history.
        """
        with self.changed:
            if not self._history.has_after(rt.plural, cursor) and not self.closed and timeout > 0:
                self.changed.wait(timeout)
            self._history.check(rt.plural, cursor)
            return self._history.after(rt.plural, cursor), self.rv

    def compact(self) -> None:
        """Forget the watch history: a watch from any older resourceVersion gets 410."""
        with self.lock:
            self._history.compact(self.rv)

    # ------------------------------------------------------------------------------- CRDs, pods

    def _serve_crd(self, kind: str, crd: Obj) -> None:
        """Serve a committed CRD's resources at once (a deleted one's stop, its objects go), then
        write its Established status as the real establishing controller does. Lock held;
        ``types`` is replaced, never changed, so a request reading it unlocked sees one table."""
        name = crd["metadata"]["name"]
        serves = [] if kind == DELETED else served_types(crd)
        types = dict(self.types)
        for rt in [t for t in types.values() if t.crd == name]:
            if rt.plural not in {t.plural for t in serves}:
                for key, o in sorted(self._objects[rt.plural].items()):
                    self._commit(rt, DELETED, key, copy.deepcopy(o), o)
                del types[rt.plural]
        for rt in serves:
            types[rt.plural] = rt
            self._objects.setdefault(rt.plural, {})
            self._encoded.setdefault(rt.plural, {})
            self._history.add(rt.plural)
        self.types = types
        status = None if kind == DELETED else established_status(crd, self._now())
        if status is not None:
            new = {**copy.deepcopy(crd), "status": status}
            self._commit(self.types[CRD_PLURAL], MODIFIED, ("", name), new, crd)

    def check_body(self, rt: ResourceType, obj: Obj) -> None:
        """Validate a body that is not stored (an Eviction) as a write's: 422 when it fails."""
        with self.lock:
            self._validate("POST", rt, obj)

    def rewrite(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        change: Callable[[Obj], Obj | None],
    ) -> tuple[bool, Obj]:
        """A server-side change of one object (as the real server's own strategies make, e.g. a
        pod's graceful deletion), atomic and unvalidated: ``change`` gets a copy of the object
        and returns its new state, or None to delete it (finalizers still hold it). (deleted,
        the state after)."""
        with self.lock:
            key, old = self._existing(rt, namespace, name)
            new = change(copy.deepcopy(old))
            if new is None:
                code, last = self._delete_locked(rt, key, old, False)
                return code == 200, last
            if new == old:
                return False, new
            return False, self._commit(rt, MODIFIED, key, new, old)
