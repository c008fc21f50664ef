"""The API server's limits on a resource.k8s.io/v1 ResourceSlice, checked before we write one.

``check_slice(obj, layout)`` returns every violation as a readable message (empty: fine).
``layout`` picks the rules of the API server we write to:

``1.34``
    Counter sets and the devices consuming them share a slice; at most 32 counters in all sets of
    a slice; a device consumes at most 32 counters and only from sets of its own slice; at most
    1024 consumed counters per slice; at most 128 devices; at most 4 taints per device.
``1.35``
    A slice has ``devices`` or ``sharedCounters``, not both; at most 8 counter sets of at most 32
    counters each; at most 2 ``consumesCounters`` entries per device, 32 counters each; at most
    128 devices, 64 when any device has taints or consumes counters; at most 16 taints per device.

``check_pool(slices, layout)`` adds what only the whole pool shows: consistent pool fields and
slice count, device names unique in the pool, and (1.35) counter set names unique in the pool
and consumed counters that exist.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

LAYOUTS = ("1.34", "1.35")

MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64  # 1.35
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ID_LENGTH = 32
MAX_DOMAIN_LENGTH = 63
MAX_VALUE_LENGTH = 64
MAX_COUNTER_SETS = 8  # 1.35
MAX_COUNTERS_PER_SET = 32  # 1.35 per set; 1.34 across all sets of a slice
MAX_CONSUMPTIONS_PER_DEVICE = 2  # 1.35
MAX_COUNTERS_PER_CONSUMPTION = 32  # 1.35 per entry; 1.34 across all entries of a device
MAX_DEVICE_COUNTERS_PER_SLICE = 1024  # 1.34
MAX_TAINTS = {"1.34": 4, "1.35": 16}
TAINT_EFFECTS = {"1.34": ("NoSchedule", "NoExecute"), "1.35": ("NoSchedule", "NoExecute", "None")}

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_LABEL_RE = re.compile(_LABEL)
_SUBDOMAIN_RE = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_C_IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUM = r"(0|[1-9][0-9]*)"
_PRE = r"(0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*)"
_BUILD = r"[0-9a-zA-Z-]+"
_SEMVER_RE = re.compile(rf"{_NUM}\.{_NUM}\.{_NUM}(-{_PRE}(\.{_PRE})*)?(\+{_BUILD}(\.{_BUILD})*)?")
_QUANTITY_RE = re.compile(
    r"(?P<num>[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?"
)
_SUFFIXES = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6))},
    **{s: Decimal(10) ** e for s, e in (("G", 9), ("T", 12), ("P", 15), ("E", 18))},
}


def parse_quantity(value: object) -> Decimal | None:
    """The value of a Kubernetes Quantity string (``"40Gi"``, ``"1k"``, ``"12e3"``), else None."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    m = _QUANTITY_RE.fullmatch(str(value))
    if m is None:
        return None
    try:
        number = Decimal(m["num"])
    except InvalidOperation:  # pragma: no cover - the pattern only lets numbers through
        return None
    suffix = m["suffix"] or ""
    if suffix[:1] in ("e", "E"):
        return number.scaleb(int(suffix[1:]))
    return number * _SUFFIXES.get(suffix, Decimal(1))


def is_dns_label(name: object) -> bool:
    return isinstance(name, str) and len(name) <= 63 and bool(_LABEL_RE.fullmatch(name))


def is_dns_subdomain(name: object, max_length: int = 253) -> bool:
    return isinstance(name, str) and len(name) <= max_length and bool(_SUBDOMAIN_RE.fullmatch(name))


def is_semver(value: object) -> bool:
    return isinstance(value, str) and bool(_SEMVER_RE.fullmatch(value))


def qualified_name_problem(name: object) -> str | None:
    """Why ``name`` is not a valid attribute/capacity name (``[domain/]cIdentifier``), or None."""
    if not isinstance(name, str):
        return "is not a string"
    domain, sep, ident = name.rpartition("/")
    if sep:
        if not domain:
            return "has an empty domain"
        if not is_dns_subdomain(domain, MAX_DOMAIN_LENGTH):
            return f"domain {domain!r} is not a lower-case DNS subdomain of at most 63 characters"
    if not ident:
        return "has an empty name"
    if len(ident) > MAX_ID_LENGTH:
        return f"name part {ident!r} is longer than {MAX_ID_LENGTH} characters"
    if not _C_IDENTIFIER_RE.fullmatch(ident):
        return f"name part {ident!r} is not a C identifier"
    return None


def _attribute_problem(value: object) -> str | None:
    if not isinstance(value, Mapping) or len(value) != 1:
        return "must have exactly one of int, bool, string, version"
    (kind, v), *_ = value.items()
    if kind == "int":
        ok = isinstance(v, int) and not isinstance(v, bool)
        return None if ok else "int value is not an integer"
    if kind == "bool":
        return None if isinstance(v, bool) else "bool value is not a boolean"
    if kind == "string":
        if not isinstance(v, str):
            return "string value is not a string"
        return None if len(v) <= MAX_VALUE_LENGTH else f"string longer than {MAX_VALUE_LENGTH}"
    if kind == "version":
        if not is_semver(v):
            return f"version {v!r} is not semver 2.0.0"
        return (
            None if len(str(v)) <= MAX_VALUE_LENGTH else f"version longer than {MAX_VALUE_LENGTH}"
        )
    return f"unknown value type {kind!r} (need int, bool, string or version)"


def _counters_problems(where: str, counters: object) -> list[str]:
    if not isinstance(counters, Mapping) or not counters:
        return [f"{where}: counters must be a non-empty map"]
    out = []
    for name, counter in counters.items():
        if not is_dns_label(name):
            out.append(f"{where}: counter name {name!r} is not a DNS label")
        q = counter.get("value") if isinstance(counter, Mapping) else None
        if parse_quantity(q) is None:
            out.append(f"{where}: counter {name!r} value {q!r} is not a Quantity")
    return out


def _device_problems(
    dev: Mapping[str, Any],
    layout: str,
    sets: dict[str, set[str]],
    per_device_nodes: bool,
) -> list[str]:
    name = dev.get("name")
    where = f"device {name!r}"
    out = []
    if not is_dns_label(name):
        out.append(f"{where}: name must be a DNS label (at most 63 of [a-z0-9-])")
    attrs = dev.get("attributes") or {}
    caps = dev.get("capacity") or {}
    if len(attrs) + len(caps) > MAX_ATTRIBUTES_AND_CAPACITIES:
        out.append(
            f"{where}: {len(attrs)} attributes + {len(caps)} capacities exceed the limit of "
            f"{MAX_ATTRIBUTES_AND_CAPACITIES}"
        )
    for kind, items in (("attribute", attrs), ("capacity", caps)):
        for key, value in items.items():
            problem = qualified_name_problem(key)
            if problem:
                out.append(f"{where}: {kind} name {key!r} {problem}")
            if kind == "attribute":
                problem = _attribute_problem(value)
                if problem:
                    out.append(f"{where}: attribute {key!r}: {problem}")
            else:
                q = value.get("value") if isinstance(value, Mapping) else None
                if parse_quantity(q) is None:
                    out.append(f"{where}: capacity {key!r} value {q!r} is not a Quantity")
                policy = isinstance(value, Mapping) and "requestPolicy" in value
                if policy and not dev.get("allowMultipleAllocations"):
                    out.append(
                        f"{where}: capacity {key!r} requestPolicy needs allowMultipleAllocations"
                    )
    taints = dev.get("taints") or []
    if len(taints) > MAX_TAINTS[layout]:
        out.append(f"{where}: {len(taints)} taints exceed the limit of {MAX_TAINTS[layout]}")
    for taint in taints:
        if not isinstance(taint, Mapping) or taint.get("effect") not in TAINT_EFFECTS[layout]:
            effect = taint.get("effect") if isinstance(taint, Mapping) else taint
            out.append(f"{where}: taint effect {effect!r} not one of {TAINT_EFFECTS[layout]}")
    out += _consumption_problems(where, dev.get("consumesCounters") or [], layout, sets)
    node_fields = [f for f in ("nodeName", "nodeSelector", "allNodes") if dev.get(f) is not None]
    if per_device_nodes and len(node_fields) != 1:
        out.append(f"{where}: needs exactly one of nodeName, nodeSelector, allNodes")
    if not per_device_nodes and node_fields:
        out.append(f"{where}: {', '.join(node_fields)} set without spec.perDeviceNodeSelection")
    return out


def _consumption_problems(
    where: str, consumes: list[Any], layout: str, sets: dict[str, set[str]]
) -> list[str]:
    out = []
    if layout == "1.35" and len(consumes) > MAX_CONSUMPTIONS_PER_DEVICE:
        out.append(
            f"{where}: {len(consumes)} consumesCounters entries exceed the limit of "
            f"{MAX_CONSUMPTIONS_PER_DEVICE}"
        )
    seen: set[object] = set()
    total = 0
    for entry in consumes:
        counter_set = entry.get("counterSet") if isinstance(entry, Mapping) else None
        counters = entry.get("counters") if isinstance(entry, Mapping) else None
        if not is_dns_label(counter_set):
            out.append(f"{where}: consumed counterSet {counter_set!r} is not a DNS label")
        if counter_set in seen:
            out.append(f"{where}: counterSet {counter_set!r} consumed more than once")
        seen.add(counter_set)
        out += _counters_problems(f"{where} consumesCounters {counter_set!r}", counters)
        n = len(counters) if isinstance(counters, Mapping) else 0
        total += n
        if layout == "1.35" and n > MAX_COUNTERS_PER_CONSUMPTION:
            out.append(
                f"{where}: consumes {n} counters of {counter_set!r}, more than "
                f"{MAX_COUNTERS_PER_CONSUMPTION}"
            )
        if layout == "1.34" and isinstance(counter_set, str):
            if counter_set not in sets:
                out.append(f"{where}: consumed counterSet {counter_set!r} is not in this slice")
            elif isinstance(counters, Mapping):
                for c in sorted(set(counters) - sets[counter_set]):
                    out.append(f"{where}: counter {c!r} is not in counterSet {counter_set!r}")
    if layout == "1.34" and total > MAX_COUNTERS_PER_CONSUMPTION:
        out.append(
            f"{where}: consumes {total} counters in all, more than {MAX_COUNTERS_PER_CONSUMPTION}"
        )
    return out


def _spec_problems(spec: Mapping[str, Any], layout: str) -> list[str]:
    out = []
    if not is_dns_subdomain(spec.get("driver"), 63):
        out.append(f"spec.driver {spec.get('driver')!r} is not a lower-case DNS subdomain <= 63")
    pool = spec.get("pool")
    if not isinstance(pool, Mapping):
        out.append("spec.pool is required")
        pool = {}
    pool_name = pool.get("name")
    if (
        not isinstance(pool_name, str)
        or len(pool_name) > 253
        or not all(is_dns_subdomain(p) for p in pool_name.split("/"))
    ):
        out.append(f"spec.pool.name {pool_name!r}: need DNS subdomains joined by '/', <= 253")
    gen = pool.get("generation")
    if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
        out.append(f"spec.pool.generation {gen!r} must be an integer >= 0")
    count = pool.get("resourceSliceCount")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        out.append(f"spec.pool.resourceSliceCount {count!r} must be an integer > 0")

    chosen = [
        f
        for f in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
        if spec.get(f) not in (None, False, "")
    ]
    if len(chosen) != 1:
        out.append(
            "exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection must be set"
            f" (set: {', '.join(chosen) or 'none'})"
        )
    for f in ("nodeName", "allNodes", "perDeviceNodeSelection"):
        if spec.get(f) in (False, ""):
            out.append(f"spec.{f} must be unset or non-empty/true")
    if spec.get("nodeName") and not is_dns_subdomain(spec["nodeName"]):
        out.append(f"spec.nodeName {spec['nodeName']!r} is not a DNS subdomain")
    return out


def check_slice(obj: Mapping[str, Any], layout: str) -> list[str]:
    """Every violation of the API limits in one ResourceSlice object (plain dict)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    out = []
    if obj.get("apiVersion") != "resource.k8s.io/v1" or obj.get("kind") != "ResourceSlice":
        out.append("apiVersion/kind must be resource.k8s.io/v1 ResourceSlice")
    metadata = obj.get("metadata") or {}
    if not is_dns_subdomain(metadata.get("name")):
        out.append(f"metadata.name {metadata.get('name')!r} is not a DNS subdomain <= 253")
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        return [*out, "spec is required"]
    out += _spec_problems(spec, layout)

    devices = spec.get("devices")
    shared = spec.get("sharedCounters")
    if layout == "1.35" and devices is not None and shared is not None:
        out.append("1.35: a slice has devices or sharedCounters, not both")
    devices = devices or []
    shared = shared or []

    sets: dict[str, set[str]] = {}
    total_shared = 0
    if layout == "1.35" and len(shared) > MAX_COUNTER_SETS:
        out.append(f"{len(shared)} counter sets exceed the limit of {MAX_COUNTER_SETS} per slice")
    for cs in shared:
        name = cs.get("name") if isinstance(cs, Mapping) else None
        counters = cs.get("counters") if isinstance(cs, Mapping) else None
        if not is_dns_label(name):
            out.append(f"counter set name {name!r} is not a DNS label")
        if isinstance(name, str) and name in sets:
            out.append(f"counter set name {name!r} is not unique in the slice")
        out += _counters_problems(f"counter set {name!r}", counters)
        n = len(counters) if isinstance(counters, Mapping) else 0
        total_shared += n
        if layout == "1.35" and n > MAX_COUNTERS_PER_SET:
            out.append(f"counter set {name!r}: {n} counters exceed the limit of 32 per set")
        if isinstance(name, str):
            sets[name] = set(counters) if isinstance(counters, Mapping) else set()
    if layout == "1.34" and total_shared > MAX_COUNTERS_PER_SET:
        out.append(f"{total_shared} counters in all counter sets exceed the 1.34 limit of 32")

    consuming = any(isinstance(d, Mapping) and d.get("consumesCounters") for d in devices)
    tainted = any(isinstance(d, Mapping) and d.get("taints") for d in devices)
    limit = MAX_DEVICES
    if layout == "1.35" and (consuming or tainted):
        limit = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS
    if len(devices) > limit:
        why = " (devices use taints or counters)" if limit < MAX_DEVICES else ""
        out.append(f"{len(devices)} devices exceed the limit of {limit} per slice{why}")
    names: set[object] = set()
    per_device_nodes = bool(spec.get("perDeviceNodeSelection"))
    consumed_total = 0
    for dev in devices:
        if not isinstance(dev, Mapping):
            out.append(f"device {dev!r} is not an object")
            continue
        if dev.get("name") in names:
            out.append(f"device name {dev.get('name')!r} is not unique in the slice")
        names.add(dev.get("name"))
        out += _device_problems(dev, layout, sets, per_device_nodes)
        consumed_total += sum(
            len(e.get("counters") or {}) for e in dev.get("consumesCounters") or []
        )
    if layout == "1.34" and consumed_total > MAX_DEVICE_COUNTERS_PER_SLICE:
        out.append(
            f"devices consume {consumed_total} counters in all, more than the 1.34 limit of "
            f"{MAX_DEVICE_COUNTERS_PER_SLICE} per slice"
        )
    return out


def check_pool(slices: Iterable[Mapping[str, Any]], layout: str) -> list[str]:
    """``check_slice`` on each slice plus the rules that span the pool's slices."""
    slices = list(slices)
    out = []
    for obj in slices:
        name = (obj.get("metadata") or {}).get("name")
        out += [f"slice {name!r}: {msg}" for msg in check_slice(obj, layout)]
    specs = [s.get("spec") or {} for s in slices]
    keys = {
        (sp.get("driver"), (sp.get("pool") or {}).get("name"), sp.get("nodeName")) for sp in specs
    }
    if len(keys) > 1:
        out.append(f"slices disagree on driver/pool/node: {sorted(map(str, keys))}")
    gens = {(sp.get("pool") or {}).get("generation") for sp in specs}
    if len(gens) > 1:
        out.append(f"slices disagree on pool generation: {sorted(map(str, gens))}")
    counts = {(sp.get("pool") or {}).get("resourceSliceCount") for sp in specs}
    if counts != {len(slices)}:
        out.append(f"resourceSliceCount {sorted(map(str, counts))} but {len(slices)} slices")
    names: dict[object, int] = {}
    sets: dict[str, set[str]] = {}
    for sp in specs:
        for d in sp.get("devices") or []:
            names[d.get("name")] = names.get(d.get("name"), 0) + 1
        for cs in sp.get("sharedCounters") or []:
            if layout == "1.35" and cs.get("name") in sets:
                out.append(f"counter set {cs.get('name')!r} is not unique in the pool")
            sets[cs.get("name")] = set(cs.get("counters") or {})
    out += [f"device name {n!r} appears {k} times in the pool" for n, k in names.items() if k > 1]
    if layout == "1.35":
        for sp in specs:
            for d in sp.get("devices") or []:
                for e in d.get("consumesCounters") or []:
                    cs_name = e.get("counterSet")
                    if cs_name not in sets:
                        out.append(f"device {d.get('name')!r}: counterSet {cs_name!r} not in pool")
                        continue
                    for c in sorted(set(e.get("counters") or {}) - sets[cs_name]):
                        out.append(f"device {d.get('name')!r}: counter {c!r} not in {cs_name!r}")
    return out
