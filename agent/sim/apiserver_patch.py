"""PATCH bodies: JSON merge patch (RFC 7386) and JSON patch (RFC 6902).

A strategic merge patch is applied as a merge patch: right for maps and scalars, while lists are
replaced whole instead of merged by key (the emulator has no patch-merge-key metadata).
"""

from __future__ import annotations

import copy
from typing import Any

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class PatchError(ValueError):
    """A patch that cannot be applied (the real server answers 400 or 422)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: ``patch`` merged into ``target`` (neither is modified)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out: dict[str, Any] = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], path: str) -> tuple[Any, str]:
    if not parts:
        raise PatchError(f"cannot operate on the whole document: {path!r}")
    cur = doc
    for part in parts[:-1]:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise PatchError(f"path not found: {path!r}")
    return cur, parts[-1]


def _get(doc: Any, path: str) -> Any:
    cur = doc
    for part in _pointer(path):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise PatchError(f"path not found: {path!r}")
    return cur


def _remove(doc: Any, path: str) -> Any:
    parent, key = _parent(doc, _pointer(path), path)
    if isinstance(parent, dict) and key in parent:
        return parent.pop(key)
    if isinstance(parent, list) and key.isdigit() and int(key) < len(parent):
        return parent.pop(int(key))
    raise PatchError(f"path not found: {path!r}")


def _add(doc: Any, path: str, value: Any, replace: bool) -> None:
    parent, key = _parent(doc, _pointer(path), path)
    if isinstance(parent, dict):
        if replace and key not in parent:
            raise PatchError(f"path not found: {path!r}")
        parent[key] = value
    elif isinstance(parent, list):
        if key == "-" and not replace:
            parent.append(value)
        elif key.isdigit() and int(key) <= len(parent) - (1 if replace else 0):
            if replace:
                parent[int(key)] = value
            else:
                parent.insert(int(key), value)
        else:
            raise PatchError(f"index out of range: {path!r}")
    else:
        raise PatchError(f"path not found: {path!r}")


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902: the result of applying the operation list ``ops`` to ``target``."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or not isinstance(op.get("path"), str):
            raise PatchError(f"invalid operation {op!r}")
        kind, path = op.get("op"), op["path"]
        if kind in ("add", "replace"):
            if "value" not in op:
                raise PatchError(f"{kind} without a value at {path!r}")
            _add(doc, path, copy.deepcopy(op["value"]), kind == "replace")
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "test":
            if _get(doc, path) != op.get("value"):
                raise PatchError(f"test failed at {path!r}")
        elif kind in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise PatchError(f"{kind} without from at {path!r}")
            value = _remove(doc, source) if kind == "move" else copy.deepcopy(_get(doc, source))
            _add(doc, path, value, False)
        else:
            raise PatchError(f"unknown JSON patch operation {kind!r}")
    return doc


def apply_patch(content_type: str, target: dict[str, Any], patch: Any) -> Any:
    """``patch`` of media type ``content_type`` applied to ``target``."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media in (MERGE, STRATEGIC):
        if not isinstance(patch, dict):
            raise PatchError("a merge patch must be a JSON object")
        return merge_patch(target, patch)
    if media == JSON_PATCH:
        return json_patch(target, patch)
    raise PatchError(f"unsupported patch type {media!r}")
