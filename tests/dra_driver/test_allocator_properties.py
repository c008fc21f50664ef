"""Properties of the allocator on small random nodes and claims: whatever it allocates satisfies
every selector, constraint, counter and capacity rule (checked by a simple, separate checker),
and it answers "no allocation" only when an exhaustive search over every assignment (written
here, brute force) finds none either."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.explanation import explain
from tests.dra_driver.allocator_helpers import DRIVER, allocated, claim, dev, klass, rslice

A = f'device.attributes["{DRIVER}"]'
GI = 2**30
EXPRESSIONS: dict[str, Callable[[Dev], bool]] = {
    "true": lambda d: True,
    f'"a" in {A} && {A}.a == 0': lambda d: d.a == 0,
    f'"a" in {A} && {A}.a != 0': lambda d: d.a is not None and d.a != 0,
    f"{A}.b": lambda d: d.b,
    f"!{A}.b": lambda d: not d.b,
    "device.allowMultipleAllocations": lambda d: d.multi,
}
CLASSES = {"any": "true", "bees": f"{A}.b", "multi": "device.allowMultipleAllocations"}


@dataclass(frozen=True)
class Dev:
    name: str
    a: int | None
    b: bool
    multi: bool
    memory_gi: int | None
    policy: bool
    consumes: tuple[int, int]


@dataclass(frozen=True)
class Req:
    name: str  # "r0" or "r0/s1"
    base: str
    cls: str
    expr: str
    count: int  # 0: All
    memory_gi: int | None


@dataclass(frozen=True)
class World:
    devices: tuple[Dev, ...]
    totals: tuple[int, int]
    groups: tuple[tuple[Req, ...], ...]
    constraint: tuple[str, tuple[str, ...]] | None  # (kind, requests)
    held: frozenset[str]  # whole devices allocated to another claim
    shares: dict[str, int]  # multi device -> Gi consumed by other claims


@st.composite
def worlds(draw: st.DrawFn) -> World:
    n = draw(st.integers(1, 5))
    devices = []
    for i in range(n):
        multi = draw(st.booleans())
        memory = draw(st.sampled_from([None, 2, 4])) if not multi else draw(st.sampled_from([2, 4]))
        devices.append(
            Dev(
                name=f"d{i}",
                a=draw(st.sampled_from([None, 0, 1, 2])),
                b=draw(st.booleans()),
                multi=multi,
                memory_gi=memory,
                policy=multi and draw(st.booleans()),
                consumes=(draw(st.integers(0, 2)), draw(st.integers(0, 2))),
            )
        )
    groups = []
    for g in range(draw(st.integers(1, 3))):
        alts = []
        for s in range(draw(st.integers(1, 2))):
            alts.append(
                Req(
                    name=f"r{g}" if s == 0 and not alts else f"r{g}/s{s}",
                    base=f"r{g}",
                    cls=draw(st.sampled_from(sorted(CLASSES))),
                    expr=draw(st.sampled_from(sorted(EXPRESSIONS))),
                    # All (0) only as a request or first subrequest: after the first, 1.34
                    # and 1.35 run it oddly (test_allocator_allmode.py's table has those)
                    count=draw(st.sampled_from([1, 1, 2, 0] if s == 0 else [1, 1, 2])),
                    memory_gi=draw(st.sampled_from([None, None, 1, 2, 3])),
                )
            )
        if len(alts) > 1:
            alts = [Req(**{**a.__dict__, "name": f"r{g}/s{i}"}) for i, a in enumerate(alts)]
        groups.append(tuple(alts))
    constraint = None
    if draw(st.booleans()):
        names = sorted({r.base for alts in groups for r in alts})
        which = draw(st.lists(st.sampled_from(names), unique=True, max_size=2))
        constraint = (draw(st.sampled_from(["matchAttribute", "distinctAttribute"])), tuple(which))
    held = frozenset(
        d.name for d in devices if not d.multi and draw(st.booleans()) and draw(st.booleans())
    )
    shares = {d.name: draw(st.integers(1, 2)) for d in devices if d.multi and draw(st.booleans())}
    return World(
        tuple(devices),
        (draw(st.integers(0, 3)), draw(st.integers(0, 3))),
        tuple(groups),
        constraint,
        held,
        shares,
    )


# -- the world as API objects ---------------------------------------------------------------


def api(
    world: World,
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    devices = []
    for d in world.devices:
        attrs: dict[str, Any] = {"b": d.b}
        if d.a is not None:
            attrs["a"] = d.a
        capacity = None
        if d.memory_gi is not None:
            cap: dict[str, Any] = {"value": f"{d.memory_gi}Gi"}
            if d.policy:
                cap["requestPolicy"] = {
                    "default": "1Gi",
                    "validRange": {"min": "1Gi", "step": "2Gi"},
                }
            capacity = {"memory": cap}
        consumes = {"s": {"c1": d.consumes[0], "c2": d.consumes[1]}} if any(d.consumes) else None
        devices.append(
            dev(d.name, attrs=attrs, capacity=capacity, consumes=consumes, multi=d.multi)
        )
    totals = {"s": {"c1": world.totals[0], "c2": world.totals[1]}}
    # the 1.35 layout: the pool's counter sets in a slice of their own
    slices = [
        rslice([], name="counters", count=2, counters=totals),
        rslice(devices, name="devices", count=2),
    ]
    requests = []
    for alts in world.groups:
        bodies = []
        for r in alts:
            body: dict[str, Any] = {
                "deviceClassName": r.cls,
                "selectors": [{"cel": {"expression": r.expr}}],
            }
            if r.count:
                body["count"] = r.count
            else:
                body["allocationMode"] = "All"
            if r.memory_gi is not None:
                body["capacity"] = {"requests": {"memory": f"{r.memory_gi}Gi"}}
            bodies.append((r, body))
        if len(alts) == 1:
            requests.append({"name": alts[0].base, "exactly": bodies[0][1]})
        else:
            requests.append(
                {
                    "name": alts[0].base,
                    "firstAvailable": [{"name": r.name.split("/")[1], **b} for r, b in bodies],
                }
            )
    constraints = None
    if world.constraint is not None:
        kind, which = world.constraint
        constraints = [{kind: f"{DRIVER}/a", **({"requests": list(which)} if which else {})}]
    others = [allocated("held", *({"device": n} for n in sorted(world.held)))] if world.held else []
    for name, gi in sorted(world.shares.items()):
        others.append(
            allocated(
                f"share-{name}",
                {
                    "device": name,
                    "shareID": f"id-{name}",
                    "consumedCapacity": {"memory": f"{gi}Gi"},
                },
            )
        )
    classes = [klass(n, e) for n, e in CLASSES.items()]
    return claim(*requests, constraints=constraints), classes, slices, others


# -- the rules, written out simply ----------------------------------------------------------


def consumed_gi(d: Dev, r: Req) -> int | None:
    """What a request consumes of a device's memory (None: the device cannot take it)."""
    if d.memory_gi is None:
        return None if r.memory_gi is not None else 0
    if r.memory_gi is None:
        return 1 if d.policy else d.memory_gi
    if d.policy:  # min 1Gi, step 2Gi: 1, 3, 5, ...
        return r.memory_gi if r.memory_gi % 2 == 1 else r.memory_gi + 1
    return r.memory_gi


def selectable(world: World, d: Dev, r: Req) -> bool:
    return EXPRESSIONS[CLASSES[r.cls]](d) and EXPRESSIONS[r.expr](d)


def fits_alone(world: World, d: Dev, r: Req) -> bool:
    c = consumed_gi(d, r)
    if c is None:
        return False
    if d.memory_gi is None:
        return True
    return c + (world.shares.get(d.name, 0) if d.multi else 0) <= d.memory_gi


def all_set(world: World, r: Req) -> list[Dev]:
    return [d for d in world.devices if selectable(world, d, r) and fits_alone(world, d, r)]


def valid(world: World, picks: list[tuple[Req, Dev]], in_order: bool = True) -> bool:
    """Every rule, for a complete assignment of devices to the chosen (sub)requests, in the
    order they were picked. A device that allows multiple allocations may be picked again, by
    any request (allocator_experimental.go allocateOne). ``in_order``: distinctAttribute as
    constraint.go keeps it when devices are only added (one value per request, the last one
    added); the search also removes devices when it backtracks, which forgets the request's
    value, so an allocation it finds after backtracking may hold two alike devices of one
    request (``in_order=False`` checks only that each has the attribute)."""
    for r, d in picks:
        if not selectable(world, d, r) or d.name in world.held or not fits_alone(world, d, r):
            return False
    by_req: dict[str, list[str]] = {}
    for r, d in picks:
        if not d.multi:
            by_req.setdefault(r.name, []).append(d.name)
    if any(len(v) != len(set(v)) for v in by_req.values()):
        return False
    exclusive = [d.name for _, d in picks if not d.multi]
    if len(exclusive) != len(set(exclusive)):
        return False
    memory: dict[str, int] = {}
    for r, d in picks:
        if d.multi and d.memory_gi is not None:
            memory[d.name] = memory.get(d.name, world.shares.get(d.name, 0)) + (
                consumed_gi(d, r) or 0
            )
            if memory[d.name] > d.memory_gi:
                return False
    # counters: a device consumes its counters once (a shared one with its first share); what
    # is checked is every counter that a newly consuming device lists (both, here)
    new = {
        d.name: d for _, d in picks if any(d.consumes) and not (d.multi and d.name in world.shares)
    }
    if new:
        consuming = {
            **new,
            **{d.name: d for d in world.devices if d.name in world.held or d.name in world.shares},
        }
        for k in (0, 1):
            if sum(d.consumes[k] for d in consuming.values()) > world.totals[k]:
                return False
    if world.constraint is not None:
        kind, which = world.constraint
        values = [d.a for r, d in picks if not which or r.base in which]
        if any(v is None for v in values):
            return False
        if kind == "matchAttribute" and len(set(values)) > 1:
            return False
        if kind == "distinctAttribute" and in_order:
            remembered: dict[str, int | None] = {}
            for r, d in picks:
                if which and r.base not in which:
                    continue
                if remembered and d.a in remembered.values():
                    return False
                remembered[r.base] = d.a
    return True


def assignments(world: World) -> Iterator[list[tuple[Req, Dev]]]:
    """Every way to pick a subrequest per request and devices for it."""
    options = []
    for alts in world.groups:
        per_group = []
        for r in alts:
            if r.count == 0:
                devs = all_set(world, r)
                if devs:
                    per_group.append([[(r, d) for d in devs]])
            else:
                per_group.append(
                    [
                        [(r, d) for d in combo]
                        for combo in itertools.product(world.devices, repeat=r.count)
                    ]
                )
        options.append([choice for alt in per_group for choice in alt])
    for combo in itertools.product(*options):
        yield [p for part in combo for p in part]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_allocations_are_valid_and_complete(world: World) -> None:
    c, classes, slices, others = api(world)
    e = explain(c, classes, slices, others, cel=CelEnvironment(), clock=lambda: 0.0)
    assert not e.gave_up
    if e.error is not None:
        # allocateDevice(must=true): the only error these worlds can meet, whether or not
        # some assignment exists (upstream stops at it)
        assert e.error.kind == "constraint" and world.constraint is not None, e.text()
        assert any(r.count == 0 for alts in world.groups for r in alts)
        event("error")
        return
    exists = any(valid(world, a) for a in assignments(world))
    event("fits" if e.ok else "does not fit")
    if not e.ok:
        assert not exists, e.text()
        return
    reqs = {r.name: r for alts in world.groups for r in alts}
    devs = {d.name: d for d in world.devices}
    results = e.allocation()["devices"]["results"]
    picks = [(reqs[r["request"]], devs[r["device"]]) for r in results]
    assert valid(world, picks, in_order=False), e.text()
    chosen: dict[str, list[str]] = {}
    for r, d in picks:
        chosen.setdefault(r.name, []).append(d.name)
    for name, names in chosen.items():
        r = reqs[name]
        expected = r.count or len(all_set(world, r))
        assert len(names) == expected
    assert {r.base for r, _ in picks} | {
        alts[0].base for alts in world.groups if not any(r.name in chosen for r in alts)
    } == {alts[0].base for alts in world.groups}
    assert len({reqs[n].base for n in chosen}) == len(world.groups)
    for r, d in picks:
        result = next(x for x in results if x["request"] == r.name and x["device"] == d.name)
        if d.multi:
            gi = consumed_gi(d, r)
            assert result["consumedCapacity"] == {"memory": f"{gi}Gi"} if gi else True
            assert result["shareID"]
        else:
            assert "shareID" not in result
