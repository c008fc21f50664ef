"""Which pods a ``Terminate`` budget evicts (pure): in the budget's namespaces, every Pod that is
not already terminating or finished and holds a ResourceClaim allocated by Tessera's driver
(of one of the budget's ``deviceClasses``, when it names some). A pod holds a claim when the
claim's ``status.reservedFor`` names it, or when the pod's ``spec.resourceClaims`` (a claim by
name) or ``status.resourceClaimStatuses`` (a claim made from a template) names the claim.
Upstream: the ResourceClaim and Pod API references (resource.k8s.io/v1, core/v1), kubernetes.io.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
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


def pods_to_evict(
    namespaces: Collection[str],
    device_classes: frozenset[str] | None,
    pods: Iterable[Mapping[str, Any]],
    claims: Iterable[Mapping[str, Any]],
) -> list[tuple[str, str]]:
    """(namespace, pod) of every pod to evict, sorted."""
    wanted = set(namespaces)
    held: set[tuple[str, str]] = set()
    holders: set[tuple[str, str]] = set()
    for claim in claims:
        meta = claim.get("metadata") or {}
        ns = meta.get("namespace", "")
        if ns not in wanted or not _allocated_by_driver(claim):
            continue
        if device_classes is not None and not (_classes(claim) & device_classes):
            continue
        held.add((ns, meta.get("name", "")))
        for ref in (claim.get("status") or {}).get("reservedFor") or ():
            if ref.get("resource", "pods") == "pods" and not ref.get("apiGroup"):
                holders.add((ns, ref.get("name", "")))
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        if ns not in wanted or meta.get("deletionTimestamp"):
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
