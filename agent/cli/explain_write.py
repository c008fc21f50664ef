"""``tessera explain --write``: the allocation written back into the claim file, as the
scheduler would write ``status.allocation`` (docs/explain.md, "--write")."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from agent.fsutil import atomic_write
from dra_driver.scheduler.inputs import DocumentError, Subject


def devices_text(allocation: Mapping[str, Any]) -> str:
    """``request=pool/device, ...`` of an allocation, for a line of text."""
    results = (allocation.get("devices") or {}).get("results") or []
    return ", ".join(f"{r.get('request')}={r.get('pool')}/{r.get('device')}" for r in results)


def write_back(path: Path, allocated: Sequence[tuple[Subject, dict[str, Any] | None]]) -> list[str]:
    """Put each allocated ResourceClaim document of ``path`` back with its status.allocation
    (and a metadata.uid where it had none, as the API server gives one at create); the other
    documents stay as written. Atomic: the file is replaced at once. Returns what was done."""
    text = path.read_text(encoding="utf-8")
    as_json = text.lstrip().startswith(("{", "["))
    by_index: dict[int, dict[str, Any]] = {}
    done = []
    for subject, allocation in allocated:
        d = subject.doc
        if d is None or allocation is None:
            continue
        if d.item is not None:
            raise DocumentError(d.source, d.index, "items", "--write cannot write into a List")
        obj = json.loads(json.dumps(d.obj))
        meta = obj.setdefault("metadata", {})
        if not meta.get("uid"):
            meta["uid"] = str(uuid.uuid4())
            done.append(f"{subject.key}: metadata.uid {meta['uid']} (it had none)")
        obj.setdefault("status", {})["allocation"] = allocation
        by_index[d.index] = obj
        done.append(f"{subject.key}: {devices_text(allocation)}")
    if not by_index:
        raise DocumentError(
            str(path),
            None,
            "",
            "--write needs a ResourceClaim document to write (a template's"
            " claims are made by Kubernetes for each pod)",
        )
    nodes = list(yaml.compose_all(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    out, at = [], 0
    for index, node in enumerate(nodes):
        if index not in by_index or node is None:
            continue
        start, end = node.start_mark.index, node.end_mark.index
        obj = by_index[index]
        new = (
            json.dumps(obj, indent=2) + "\n"
            if as_json
            else yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)
        )
        out += [text[at:start], new]
        at = end
    out.append(text[at:])
    mode = path.stat().st_mode & 0o777
    atomic_write(path, "".join(out).encode(), mode=mode)
    return done
