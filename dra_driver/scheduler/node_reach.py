"""Which ResourceSlices a node sees, and what an allocation says about its node. Pure: no I/O.

- :func:`node_slices`: the ResourceSlices that apply to one node, by the scheduler's rules
  (:func:`node_matches`, :func:`selector_matches`); :func:`slice_nodes`: the nodes slices name;
- :func:`node_selector`: the ``status.allocation.nodeSelector`` the scheduler writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def _dict(value: Any) -> dict[str, Any]:
    """``value`` when it is an object, else an empty one (for optional fields)."""
    return value if isinstance(value, dict) else {}


# -- which slices a node sees -------------------------------------------------------------------


def node_matches(node: Mapping[str, Any], name: str | None, all_nodes: bool, selector: Any) -> bool:
    """structured/internal/stable/pools_stable.go NodeMatches: a node name, allNodes, or a
    NodeSelector (k8s.io/component-helpers nodeaffinity: terms ORed, requirements ANDed)."""
    if name:
        return _meta(node).get("name") == name
    if all_nodes:
        return True
    if isinstance(selector, dict):
        return selector_matches(selector, node)
    return False


def _meta(node: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = node.get("metadata")
    return meta if isinstance(meta, dict) else {}


def selector_matches(selector: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """A v1 NodeSelector against a Node: any term matches; a term with no requirements matches
    nothing (core/v1 NodeSelectorTerm: "A null or empty node selector term matches no
    objects")."""
    labels = _meta(node).get("labels") or {}
    fields = {"metadata.name": _meta(node).get("name")}
    for term in selector.get("nodeSelectorTerms") or []:
        if not isinstance(term, dict):
            continue
        exprs, matchf = term.get("matchExpressions") or [], term.get("matchFields") or []
        if not exprs and not matchf:
            continue
        if all(_requirement(r, labels) for r in exprs) and all(
            _requirement(r, fields) for r in matchf
        ):
            return True
    return False


def _requirement(req: Any, values: Mapping[str, Any]) -> bool:
    if not isinstance(req, dict):
        return False
    key, op, want = req.get("key"), req.get("operator"), req.get("values") or []
    have = values.get(key) if isinstance(key, str) else None
    if op == "In":
        return have is not None and have in want
    if op == "NotIn":
        return have not in want
    if op == "Exists":
        return have is not None
    if op == "DoesNotExist":
        return have is None
    if op in ("Gt", "Lt") and have is not None and len(want) == 1:
        try:
            left, right = int(str(have)), int(str(want[0]))
        except ValueError:
            return False
        return left > right if op == "Gt" else left < right
    return False


def node_slices(
    slices: Sequence[Mapping[str, Any]], node: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The slices whose devices ``node`` can reach (pools_stable.go GatherPools): spec.nodeName,
    allNodes or a matching nodeSelector; with perDeviceNodeSelection, the slice keeps only the
    devices that match the node. Slices with sharedCounters (the 1.35 layout's counter slices)
    go with their pool when the node sees any device of it (upstream always includes them)."""
    picked: list[dict[str, Any]] = []
    counters: list[dict[str, Any]] = []
    pools: set[tuple[str, str]] = set()
    for s in slices:
        spec = s.get("spec")
        if not isinstance(spec, dict):
            continue
        pool_id = _pool_id(spec)
        if spec.get("sharedCounters") and not spec.get("devices"):
            counters.append(dict(s))
            continue
        if spec.get("perDeviceNodeSelection"):
            devices = [
                d
                for d in spec.get("devices") or []
                if isinstance(d, dict)
                and node_matches(
                    node, d.get("nodeName"), bool(d.get("allNodes")), d.get("nodeSelector")
                )
            ]
            if devices:
                picked.append({**s, "spec": {**spec, "devices": devices}})
                pools.add(pool_id)
            continue
        if node_matches(
            node, spec.get("nodeName"), bool(spec.get("allNodes")), spec.get("nodeSelector")
        ):
            picked.append(dict(s))
            pools.add(pool_id)
    for s in counters:
        if _pool_id(s["spec"]) in pools:
            picked.append(s)
    return picked


def _pool_id(spec: Mapping[str, Any]) -> tuple[str, str]:
    """(driver, pool name) of a slice, as text: a malformed slice (a list for its driver) is
    refused with its field by the parser later, not here by a set."""
    return str(spec.get("driver")), str(_dict(spec.get("pool")).get("name"))


def slice_nodes(slices: Iterable[Mapping[str, Any]]) -> list[str]:
    """The node names slices name in spec.nodeName (or their devices' nodeName), sorted."""
    names: set[str] = set()
    for s in slices:
        spec = _dict(s.get("spec"))
        if isinstance(spec.get("nodeName"), str):
            names.add(spec["nodeName"])
        for d in spec.get("devices") or []:
            if isinstance(d, dict) and isinstance(d.get("nodeName"), str):
                names.add(d["nodeName"])
    return sorted(names)


# -- what --write adds ------------------------------------------------------------------------


def node_selector(
    results: Sequence[Mapping[str, Any]], slices: Sequence[Mapping[str, Any]]
) -> dict[str, Any] | None:
    """The allocation's nodeSelector as the scheduler makes it (allocator_stable.go
    createNodeSelector): a device from a node-local slice ties the claim to that node
    (``matchFields metadata.name In [node]``); slices with a nodeSelector add their one term's
    requirements; devices of allNodes slices add nothing (None: available everywhere)."""
    where: dict[tuple[Any, Any, Any], tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
    for s in slices:
        spec = _dict(s.get("spec"))
        pool = _dict(spec.get("pool"))
        for d in spec.get("devices") or []:
            if isinstance(d, dict):
                where[(spec.get("driver"), pool.get("name"), d.get("name"))] = (spec, d)
    fields: list[Any] = []
    exprs: list[Any] = []
    for r in results:
        found = where.get((r.get("driver"), r.get("pool"), r.get("device")))
        if found is None:
            continue
        slice_spec, device = found
        source = device if slice_spec.get("perDeviceNodeSelection") else slice_spec
        if source.get("nodeName"):
            return {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {
                                "key": "metadata.name",
                                "operator": "In",
                                "values": [source["nodeName"]],
                            }
                        ]
                    }
                ]
            }
        selector = source.get("nodeSelector")
        terms = selector.get("nodeSelectorTerms") if isinstance(selector, dict) else None
        if terms and len(terms) == 1 and isinstance(terms[0], dict):
            for req in terms[0].get("matchFields") or []:
                if req not in fields:
                    fields.append(req)
            for req in terms[0].get("matchExpressions") or []:
                if req not in exprs:
                    exprs.append(req)
    if not fields and not exprs:
        return None
    term: dict[str, Any] = {}
    if exprs:
        term["matchExpressions"] = exprs
    if fields:
        term["matchFields"] = fields
    return {"nodeSelectorTerms": [term]}
