"""How the modelled scheduler reads a ResourceSlice's counter sets, per version and
DRAPartitionableDevices (:mod:`dra_driver.scheduler.versions` has the rules and their sources):
which slices it skips, which slices' devices it ignores, and where a device's counters come from.
Helpers of :func:`dra_driver.scheduler.pools.parse_slices`, on the slices' API dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from agent.decode import fields
from dra_driver.quantity import Quantity
from dra_driver.scheduler.versions import PARTITIONABLE_DEVICES, Scheduler

CounterSets = dict[str, dict[str, Quantity]]
"""Counter set -> counter -> value."""


Entry = tuple[Mapping[str, Any], str, int, int, str | None]
"""A slice of a pool: its spec, name, generation, resourceSliceCount, why it is skipped."""


def group(
    slices: Sequence[Mapping[str, Any]], scheduler: Scheduler
) -> tuple[dict[tuple[str, str], list[Entry]], dict[tuple[str, str], int]]:
    """The slices of each pool's newest generation (addSlice), and how many older ones."""
    by_pool: dict[tuple[str, str], list[Entry]] = {}
    stale: dict[tuple[str, str], int] = {}
    for i, obj in enumerate(slices):
        base = f"resourceSlices[{i}]"
        obj = fields.obj(obj, base)
        meta = fields.obj(obj.get("metadata"), f"{base}.metadata", optional=True)
        sname = (fields.opt_text(meta.get("name"), f"{base}.metadata.name") or "") or f"#{i}"
        base = f"ResourceSlice {sname}"
        spec = fields.obj(obj.get("spec"), f"{base}.spec")
        driver = fields.text(spec.get("driver"), f"{base}.spec.driver", nonempty=True)
        pool_spec = fields.obj(spec.get("pool"), f"{base}.spec.pool")
        pname = fields.text(pool_spec.get("name"), f"{base}.spec.pool.name", nonempty=True)
        gen = fields.integer(pool_spec.get("generation", 0), f"{base}.spec.pool.generation")
        count = fields.integer(
            pool_spec.get("resourceSliceCount"), f"{base}.spec.pool.resourceSliceCount"
        )
        if count < 1:
            raise fields.FieldError(
                f"{base}.spec.pool.resourceSliceCount", f"must be >= 1, got {count}"
            )
        key = (driver, pname)
        have = by_pool.setdefault(key, [])
        # addSlice: an older generation is out-dated, a newer one replaces all before it.
        if have and gen < have[0][2]:
            stale[key] = stale.get(key, 0) + 1
            continue
        if have and gen > have[0][2]:
            stale[key] = stale.get(key, 0) + len(have)
            have.clear()
        have.append((spec, sname, gen, count, skipped(spec, sname, scheduler)))
    return by_pool, stale


def skipped(spec: Mapping[str, Any], name: str, scheduler: Scheduler) -> str | None:
    """Why GatherPools (``pools_*.go``) skips this slice altogether, or None: without
    DRAPartitionableDevices a slice with ``perDeviceNodeSelection`` (both versions) or, in
    1.35, with ``sharedCounters``."""
    if scheduler.enabled(PARTITIONABLE_DEVICES):
        return None
    off = f"with {PARTITIONABLE_DEVICES} off the Kubernetes {scheduler.version} scheduler skips it"
    if spec.get("perDeviceNodeSelection") is not None:
        return f"ResourceSlice {name} is skipped: it sets perDeviceNodeSelection, and {off}"
    if scheduler.version != "1.34" and spec.get("sharedCounters"):
        return f"ResourceSlice {name} is skipped: it holds sharedCounters, and {off}"
    return None


def counted(entries: Sequence[Entry], scheduler: Scheduler) -> list[Entry]:
    """The slices that count toward the pool's resourceSliceCount: in 1.35 every slice of the
    generation (``checkSlicesInPool`` recounts them all), in 1.34 those not skipped."""
    if scheduler.version != "1.34":
        return list(entries)
    return [e for e in entries if e[4] is None]


def devices_ignored(spec: Mapping[str, Any], name: str, scheduler: Scheduler) -> str | None:
    """1.35 ``buildPool``: a slice with ``sharedCounters`` is a counter-set slice, and its
    devices (the 1.34 layout puts them there) are not read; None when they are."""
    if scheduler.counters_per_slice or not scheduler.enabled(PARTITIONABLE_DEVICES):
        return None
    if not spec.get("sharedCounters") or not spec.get("devices"):
        return None
    n = len(spec["devices"]) if isinstance(spec["devices"], list) else 0
    return (
        f"ResourceSlice {name}: its {n} devices are ignored: it holds sharedCounters, and the"
        f" Kubernetes {scheduler.version} scheduler reads a slice as counter sets or as devices"
        " (the 1.34 layout: publish with --kube-layout 1.35, or explain with --kube-version 1.34)"
    )


def counter_sets(
    spec: Mapping[str, Any],
    base: str,
    q: Callable[[object, str], Quantity],
) -> tuple[list[tuple[str, dict[str, Quantity]]], str | None]:
    """The slice's ``sharedCounters`` in order, and the first counter set name given twice in
    it (None when none is)."""
    out: list[tuple[str, dict[str, Quantity]]] = []
    seen: set[str] = set()
    twice = None
    for j, cs in enumerate(fields.items(spec.get("sharedCounters"), f"{base}.sharedCounters")):
        cp = f"{base}.sharedCounters[{j}]"
        cs = fields.obj(cs, cp)
        name = fields.text(cs.get("name"), f"{cp}.name", nonempty=True)
        counters = {
            n: q(fields.obj(c, f"{cp}.counters.{n}").get("value"), f"{cp}.counters.{n}.value")
            for n, c in fields.obj(cs.get("counters"), f"{cp}.counters").items()
        }
        if name in seen and twice is None:
            twice = name
        seen.add(name)
        out.append((name, counters))
    return out, twice


class Consumer(Protocol):
    name: str

    def counter_refs(self) -> list[tuple[str, list[str]]]: ...


def invalid_consumption(pool: str, devices: Sequence[Consumer], defined: CounterSets) -> str | None:
    """validateDeviceCounterConsumption (1.35 ``pools_*.go``): why the pool is invalid when a
    device consumes a counter set, or a counter in one, the pool does not define; else None."""
    for dev in devices:
        for counter_set, names in dev.counter_refs():
            have = defined.get(counter_set)
            if have is None:
                missing: str | None = f"counter set {counter_set}"
            else:
                absent = [n for n in names if n not in have]
                missing = f"counter {absent[0]} in counter set {counter_set}" if absent else None
            if missing:
                return (
                    f"pool {pool} is invalid: device {dev.name} consumes {missing}, which no"
                    " slice of the pool defines"
                )
    return None


__all__ = [
    "Consumer",
    "CounterSets",
    "Entry",
    "counted",
    "counter_sets",
    "devices_ignored",
    "group",
    "invalid_consumption",
    "skipped",
]
