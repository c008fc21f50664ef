"""``meta.k8s.io/v1`` Tables, what ``kubectl get`` asks for (``Accept: application/json;as=Table;
v=v1;g=meta.k8s.io``), as the real server renders them:

* a built-in resource: the columns ``Name`` and ``Age`` (the real server has a richer printer per
  built-in kind; Name and Age are what every one of them starts with);
* a custom resource: ``Name`` then the CRD version's ``additionalPrinterColumns`` (``Name`` and
  ``Age`` when it has none), each cell its ``jsonPath`` (a dotted path, ``[n]`` and the
  ``[?(@.field=="value")]`` filter), a ``date`` cell as a human readable age
  (apiextensions-apiserver ``pkg/registry/customresource/tableconvertor``).

Ages are worded as apimachinery's ``duration.HumanDuration`` (``45s``, ``5m30s``, ``3h``, ``2d``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from agent.sim.apiserver_types import ResourceType

Obj = dict[str, Any]

_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[\?\(@\.([\w.]+)\s*==\s*[\"']([^\"']*)[\"']\)\]")
_NAME = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "description": "Name must be unique within a namespace.",
    "priority": 0,
}
_AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def wants_table(accept: str) -> bool:
    return "as=Table" in accept.replace(" ", "")


def human_duration(seconds: float) -> str:
    """apimachinery ``duration.HumanDuration``."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    m, h = s // 60, s // 3600
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if h < 24 * 8:
        return f"{h // 24}d{h % 24}h" if h % 24 else f"{h // 24}d"
    if h < 24 * 365 * 2:
        return f"{h // 24}d"
    if h < 24 * 365 * 8:
        return f"{h // 24 // 365}y{(h // 24) % 365}d"
    return f"{h // 24 // 365}y"


def json_path(obj: Any, path: str) -> Any:
    """The value at a printer column's ``jsonPath``, None when it is absent."""
    node: Any = obj
    for name, index, key, value in _STEP.findall(path.strip().removeprefix("{").removesuffix("}")):
        if name:
            node = node.get(name) if isinstance(node, dict) else None
        elif index:
            i = int(index)
            node = node[i] if isinstance(node, list) and i < len(node) else None
        else:
            matches = [x for x in node or () if isinstance(x, dict) and _at(x, key) == value]
            node = matches[0] if matches else None
        if node is None:
            return None
    return node


def _at(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return None if node is None else str(node)


def _cell(column: Mapping[str, Any], obj: Obj, now: datetime) -> Any:
    value = json_path(obj, str(column.get("jsonPath", "")))
    if value is None:
        return None
    if column.get("type") == "date" and isinstance(value, str):
        try:
            then = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return value
        return human_duration((now - then).total_seconds())
    return value


def table(rt: ResourceType, objs: Sequence[Obj], resource_version: str, now: datetime) -> Obj:
    """The Table of ``objs`` (rows carry PartialObjectMetadata, the default includeObject)."""
    columns = list(rt.columns) or [_AGE]
    definitions = [_NAME] + [
        {
            "name": c["name"],
            "type": c.get("type", "string"),
            "format": c.get("format", ""),
            "description": c.get("description", ""),
            "priority": int(c.get("priority", 0)),
        }
        for c in columns
    ]
    rows = [
        {
            "cells": [o["metadata"]["name"]] + [_cell(c, o, now) for c in columns],
            "object": {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": o["metadata"],
            },
        }
        for o in objs
    ]
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": definitions,
        "rows": rows,
    }
