"""The ``<Kind>List`` answers of the API-server emulator: pages cut by ``limit``, continue tokens.

As the real server answers a list (k8s.io/apiserver/pkg/storage: ``EncodeContinue`` and
``DecodeContinue``): a page of at most ``limit`` items, then ``metadata.continue``, an opaque
token naming the last key served and the resourceVersion of the list, and
``metadata.remainingItemCount``; the items carry no kind or apiVersion. The token is the
emulator's own encoding (base64 of JSON); a client only passes it back.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.sim import apiserver_errors as err
from agent.sim.apiserver_json import copy_json, encode_json
from agent.sim.apiserver_types import ResourceType

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, or "" for cluster-scoped; name)
HEAD = ("apiVersion", "kind")
"""What a list's items leave out (the list names them once)."""


def item_json(obj: Obj) -> bytes:
    """The JSON of stored ``obj`` as an item of a list: without apiVersion and kind. The store
    keeps it from the write on, as the real server's watch cache keeps each object's encoding,
    so that a list page is these bytes joined, never a copy and an encoding of every object."""
    return encode_json({k: v for k, v in obj.items() if k not in HEAD})


def continue_start(token: str) -> list[str] | None:
    """The key a continued list starts after (None for a first page); 400 for a bad token."""
    if not token:
        return None
    try:
        return list(json.loads(base64.urlsafe_b64decode(token.encode()))["start"])
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise err.bad_request(f"continue key is not valid: {token!r}") from None


def kind_list(rt: ResourceType, meta: Obj, items: list[Obj]) -> Obj:
    """The ``<Kind>List`` of ``items`` with list metadata ``meta``."""
    return {
        "kind": f"{rt.kind}List",
        "apiVersion": rt.api_version,
        "metadata": meta,
        "items": items,
    }


@dataclass(frozen=True)
class Page:
    """One list answer: its metadata and its items, both as stored (shared with the store, never
    to be changed) and as each item's stored JSON."""

    rt: ResourceType
    meta: Obj
    items: Sequence[Obj]
    encoded: Sequence[bytes]

    def body(self) -> bytes:
        """The ``<Kind>List`` as JSON: the bytes ``encode_json(self.value())`` gives (same keys,
        same order), joined from each item's stored JSON."""
        head = encode_json({k: v for k, v in kind_list(self.rt, self.meta, []).items()
                            if k != "items"})  # fmt: skip
        return head[:-1] + b',"items":[' + b",".join(self.encoded) + b"]}"

    def value(self) -> Obj:
        """The ``<Kind>List`` as a fresh object (its items copies, without apiVersion/kind)."""
        items = [copy_json({k: v for k, v in o.items() if k not in HEAD}) for o in self.items]
        return kind_list(self.rt, dict(self.meta), items)


def list_page(
    rt: ResourceType, rv: int, found: Sequence[tuple[Key, Obj, bytes]], limit: int
) -> Page:
    """The page of the first ``limit`` (0: all) of ``found`` ((key, object, its item_json)),
    sorted by key, as of resourceVersion ``rv``; a continue token when more remain."""
    meta: Obj = {"resourceVersion": str(rv)}
    if limit > 0 and len(found) > limit:
        last = found[limit - 1][0]
        meta["continue"] = base64.urlsafe_b64encode(
            json.dumps({"rv": rv, "start": list(last)}).encode()
        ).decode()
        meta["remainingItemCount"] = len(found) - limit
        found = found[:limit]
    return Page(rt, meta, [o for _, o, _ in found], [e for _, _, e in found])
