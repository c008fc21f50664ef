"""Builders of resource.k8s.io/v1 objects for the allocator's tests (API dicts, as YAML gives)."""

from __future__ import annotations

from typing import Any

DRIVER = "gpu.tessera.dev"


def dev(
    name: str,
    *,
    attrs: dict[str, Any] | None = None,
    capacity: dict[str, Any] | None = None,
    consumes: dict[str, dict[str, Any]] | None = None,
    multi: bool = False,
    taints: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A device; ``attrs`` values are typed by their Python type (str, int, bool)."""
    out: dict[str, Any] = {"name": name}
    typed = {}
    for k, v in (attrs or {}).items():
        if isinstance(v, bool):
            typed[k] = {"bool": v}
        elif isinstance(v, int):
            typed[k] = {"int": v}
        elif isinstance(v, str) and v.startswith("v"):
            typed[k] = {"version": v[1:]}
        else:
            typed[k] = {"string": v}
    if typed:
        out["attributes"] = typed
    if capacity:
        out["capacity"] = {
            k: (v if isinstance(v, dict) else {"value": v}) for k, v in capacity.items()
        }
    if consumes:
        out["consumesCounters"] = [
            {"counterSet": s, "counters": {c: {"value": str(q)} for c, q in cs.items()}}
            for s, cs in consumes.items()
        ]
    if multi:
        out["allowMultipleAllocations"] = True
    if taints:
        out["taints"] = taints
    return out


def rslice(
    devices: list[dict[str, Any]],
    *,
    pool: str = "node-a",
    name: str | None = None,
    generation: int = 1,
    count: int = 1,
    counters: dict[str, dict[str, Any]] | None = None,
    driver: str = DRIVER,
    node: str = "node-a",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": driver,
        "nodeName": node,
        "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
    }
    if devices:
        spec["devices"] = devices
    if counters:
        spec["sharedCounters"] = [
            {"name": s, "counters": {c: {"value": str(q)} for c, q in cs.items()}}
            for s, cs in counters.items()
        ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name or f"{pool}-{generation}"},
        "spec": spec,
    }


def klass(name: str, *expressions: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": e}} for e in expressions]},
    }


def exact(
    name: str,
    cls: str = "gpu",
    *,
    count: int | None = None,
    selectors: tuple[str, ...] = (),
    mode: str | None = None,
    admin: bool | None = None,
    tolerations: list[dict[str, str]] | None = None,
    capacity: dict[str, str] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": cls}
    if count is not None:
        body["count"] = count
    if selectors:
        body["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    if mode is not None:
        body["allocationMode"] = mode
    if admin is not None:
        body["adminAccess"] = admin
    if tolerations is not None:
        body["tolerations"] = tolerations
    if capacity is not None:
        body["capacity"] = {"requests": capacity}
    return {"name": name, "exactly": body}


def first_available(name: str, *subs: dict[str, Any]) -> dict[str, Any]:
    """``subs`` are ``exact(...)`` requests; their ``exactly`` bodies become subrequests."""
    return {"name": name, "firstAvailable": [{"name": s["name"], **s["exactly"]} for s in subs]}


def claim(
    *requests: dict[str, Any],
    constraints: list[dict[str, Any]] | None = None,
    name: str = "c",
    namespace: str = "default",
    config: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    if config:
        devices["config"] = config
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": devices},
    }


def allocated(name: str, *results: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    """An allocated claim; ``results`` are ``{"device": ..., ...}`` (driver/pool default)."""
    full = [{"request": "r", "driver": DRIVER, "pool": "node-a", **r} for r in results]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": full}}},
    }


A = f'device.attributes["{DRIVER}"]'
"""How a selector names one of our driver's attributes."""
GPU = klass("gpu", f'{A}.type == "gpu"')
MIG = klass("mig", f'{A}.type == "mig"')
# one GPU's MIG placements: a 1g at memory slice 0 or 3, a 3g over slices 0-2
MIG_COUNTERS = {"gpu-0-set": {"s0": 1, "s1": 1, "s2": 1, "s3": 1}}
MIGS = [
    dev("mig-1g-0", attrs={"type": "mig", "profile": "1g"}, consumes={"gpu-0-set": {"s0": 1}}),
    dev("mig-1g-3", attrs={"type": "mig", "profile": "1g"}, consumes={"gpu-0-set": {"s3": 1}}),
    dev(
        "mig-3g-0",
        attrs={"type": "mig", "profile": "3g"},
        consumes={"gpu-0-set": {"s0": 1, "s1": 1, "s2": 1}},
    ),
]
