"""Which pods a ``Terminate`` budget evicts (pure): in the budget's namespaces, every Pod that is
not already terminating or finished and holds a ResourceClaim allocated by Tessera's driver
(of one of the budget's ``deviceClasses``, when it names some). A pod holds a claim when the
claim's ``status.reservedFor`` names it, or when the pod's ``spec.resourceClaims`` (a claim by
name) or ``status.resourceClaimStatuses`` (a claim made from a template) names the claim.
Upstream: the ResourceClaim and Pod API references (resource.k8s.io/v1, core/v1), kubernetes.io.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

DRIVER = "gpu.tessera.dev"
"""Tessera's DRA driver name (dra_driver.device_model's default; agent.usage sits below it)."""


def _allocated_by_driver(claim: Mapping[str, Any]) -> bool:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or ()
    return any(r.get("driver") == DRIVER for r in results)


def _classes(claim: Mapping[str, Any]) -> set[str]:
    out = set()
    for r in (claim.get("spec") or {}).get("devices", {}).get("requests") or ():
        exactly = r.get("exactly") or {}
        name = exactly.get("deviceClassName") or r.get("deviceClassName")
        if name:
            out.add(name)
        for sub in r.get("firstAvailable") or ():
            if sub.get("deviceClassName"):
                out.add(sub["deviceClassName"])
    return out


def by_namespace(
    objs: Iterable[Mapping[str, Any]], wanted: Collection[str]
) -> dict[str, list[Mapping[str, Any]]]:
    """The objects of the ``wanted`` namespaces, grouped by namespace: each budget then looks
    only at its namespaces'."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    for obj in objs:
        ns = (obj.get("metadata") or {}).get("namespace", "")
        if ns in wanted:
            out.setdefault(ns, []).append(obj)
    return out


def pods_to_evict(
    namespaces: Collection[str],
    device_classes: frozenset[str] | None,
    pods: Mapping[str, Sequence[Mapping[str, Any]]],
    claims: Mapping[str, Sequence[Mapping[str, Any]]],
) -> list[tuple[str, str]]:
    """(namespace, pod) of every pod to evict, sorted; ``pods`` and ``claims`` by namespace."""
    held: set[tuple[str, str]] = set()
    holders: set[tuple[str, str]] = set()
    for claim in (c for ns in namespaces for c in claims.get(ns, ())):
        meta = claim.get("metadata") or {}
        ns = meta.get("namespace", "")
        if not _allocated_by_driver(claim):
            continue
        if device_classes is not None and not (_classes(claim) & device_classes):
            continue
        held.add((ns, meta.get("name", "")))
        for ref in (claim.get("status") or {}).get("reservedFor") or ():
            if ref.get("resource", "pods") == "pods" and not ref.get("apiGroup"):
                holders.add((ns, ref.get("name", "")))
    out = []
    for pod in (p for ns in namespaces for p in pods.get(ns, ())):
        meta = pod.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        if meta.get("deletionTimestamp"):
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        names = {
            c.get("resourceClaimName") for c in (pod.get("spec") or {}).get("resourceClaims") or ()
        }
        names |= {
            c.get("resourceClaimName")
            for c in (pod.get("status") or {}).get("resourceClaimStatuses") or ()
        }
        if (ns, name) in holders or any((ns, n) in held for n in names if n):
            out.append((ns, name))
    return sorted(out)
