"""Candidates per request and the backtracking search, as the scheduler's structured allocator
does it (k8s.io/dynamic-resource-allocation ``structured/internal/incubating/
allocator_incubating.go``: Allocate, validateDeviceRequest, allocateOne, isSelectable,
selectorsMatch, allocateDevice, checkAvailableCounters, taintPreventsAllocation;
``consumable_capacity.go``: CmpRequestOverCapacity and the request-policy rounding;
``constraint.go``: distinctAttribute).

What is computed once per call, so that a node of 200 devices costs a few milliseconds:

- each device's CEL view, when a selector first needs it, and each selector's verdict on each
  device (a class's selectors are shared by every request of that class);
- per request (and subrequest): the candidates, in first-fit order (pools by driver and name,
  slices by name, devices as listed), and for every other device the *first* reason it is not
  one: class selector false, request selector false, CEL runtime error, tainted, allocated to
  another claim, capacity too small, counters already used up, lacks a constrained attribute.

The search then picks devices as upstream does: requests in claim order, a firstAvailable
request's subrequests in order, each request's devices as combinations in candidate order (never
two orders of the same set). A device is added when it is not taken in this claim, its counters
and capacity are left, and every constraint still holds; on failure the search backtracks, so it
finds an allocation whenever one exists, or stops at ``time_limit_s`` (``GaveUp``).

For the explanation it remembers, per request, the deepest partial allocation that failed and
why each other candidate could not be added to it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dra_driver.quantity import Format, Quantity
from dra_driver.scheduler.cel.selector import DeviceView, Selector
from dra_driver.scheduler.celenv import CelCompileError, CelEnvironment
from dra_driver.scheduler.domain import (
    MAX_RESULTS,
    Allocated,
    AttributeValue,
    Claim,
    Constraint,
    Device,
    DeviceClass,
    InputError,
    Mode,
    Node,
    Request,
    RequestPolicy,
    SelectorSpec,
)

SHARE_NAMESPACE = uuid.UUID("5b0c5d36-8f3e-4f0b-9a53-7d1e3c2f6a10")
"""Share IDs are uuid5(this, claim/request/device): the same input gives the same allocation.
(Upstream draws a random UUID; any unique ID per device share is valid.)"""


# -- reasons -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reason:
    """Why a device is not used for a request, or why a request or the claim cannot be
    allocated. ``kind`` is a stable word (see ``explain`` for the list), ``text`` one line."""

    kind: str
    text: str
    details: Mapping[str, Any] = field(default_factory=dict)


def _seen(seen: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"{p}={v}" for p, v in seen)


def _qty(nanos: int) -> str:
    return str(Quantity(nanos, Format.BINARY_SI))


def _value(v: AttributeValue | None) -> str:
    if v is None:
        return "<missing>"
    return str(v[1]).lower() if v[0] == "bool" else str(v[1])


def _uses(dev: Device, counter_set: str, counter: str) -> bool:
    for u in dev.consumes:
        q = u.counters.get(counter)
        if u.counter_set == counter_set and q is not None and q.nanos > 0:
            return True
    return False


class GaveUp(Exception):
    pass


class Fatal(Exception):
    """Allocation on this node stops (upstream returns an error from Allocate)."""

    def __init__(self, reason: Reason) -> None:
        self.reason = reason
        super().__init__(reason.text)


# -- per-request analysis ------------------------------------------------------------------


@dataclass
class Analysis:
    """One request or subrequest against the node's devices."""

    request: Request
    device_class: DeviceClass | None
    rejections: dict[int, Reason] = field(default_factory=dict)
    """Device index -> first static reason it cannot be used."""
    candidates: list[int] = field(default_factory=list)
    matched: int = 0
    """Devices that satisfy the class's and the request's selectors."""
    consumed: dict[int, dict[str, Quantity]] = field(default_factory=dict)
    """Per candidate: the capacity it would consume (every capacity of the device)."""
    constraint_values: list[tuple[Constraint, int, dict[int, AttributeValue]]] = field(
        default_factory=list
    )
    """(constraint, its index in the claim, candidate -> attribute value) for constraints that
    apply to this request."""
    cel_error: Reason | None = None
    problem: Reason | None = None
    """Why this request cannot be allocated at all, known before the search."""


@dataclass(frozen=True)
class Pick:
    request: Request
    device: Device
    consumed: Mapping[str, Quantity] | None
    """Set for devices that allow multiple allocations (the result's consumedCapacity)."""
    share_id: str | None


@dataclass
class Attempt:
    """The deepest failed state of one request: what was placed and why the rest did not fit."""

    placed: list[Pick]
    rejections: dict[int, Reason]
    reason: Reason | None = None
    """A reason for the request as a whole (too few candidates, too many results)."""


@dataclass
class Outcome:
    ok: bool
    picks: list[Pick]
    selected: dict[int, int]
    """Request group index -> chosen alternative."""
    analyses: list[list[Analysis]]
    attempts: dict[tuple[int, int], Attempt]
    blocker: tuple[int, int] | None
    fatal: Reason | None
    gave_up: bool
    steps: int


class Search:
    def __init__(
        self,
        claim: Claim,
        classes: Mapping[str, DeviceClass],
        node: Node,
        allocated: Allocated,
        cel: CelEnvironment,
        *,
        time_limit_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.claim = claim
        self.classes = classes
        self.node = node
        self.allocated = allocated
        self.cel = cel
        self.time_limit_s = time_limit_s
        self.clock = clock
        self._views: dict[int, DeviceView] = {}
        self._class_verdicts: dict[tuple[str, int], Reason | None] = {}
        self._compiled: dict[str, Selector] = {}
        self._available: dict[int, dict[tuple[str, str], int]] = {}
        # search state
        self.picks: list[Pick] = []
        self._exclusive: dict[int, str] = {}
        self._counters: dict[tuple[int, str, str], int] = {}
        self._capacity: dict[int, dict[str, int]] = {}
        self._match: dict[int, tuple[AttributeValue, int]] = {}
        self._distinct: dict[int, dict[AttributeValue, int]] = {}
        self.attempts: dict[tuple[int, int], Attempt] = {}
        self._depth: dict[tuple[int, int], int] = {}
        self._blocker: tuple[int, int] | None = None
        self._blocker_depth = -1
        self.selected: dict[int, int] = {}
        self.steps = 0
        self._deadline = 0.0

    # -- CEL ---------------------------------------------------------------------------------
    def compile(self, spec: SelectorSpec) -> Selector:
        sel = self._compiled.get(spec.expression)
        if sel is None:
            try:
                sel = self.cel.compile(spec.expression)
            except CelCompileError as e:
                raise InputError(f"{spec.path}.cel.expression", str(e)) from None
            self._compiled[spec.expression] = sel
        return sel

    def _view(self, dev: Device) -> DeviceView:
        view = self._views.get(dev.index)
        if view is None:
            view = self.cel.device(
                dev.driver, dev.raw_attributes, dev.raw_capacity, dev.allow_multiple
            )
            self._views[dev.index] = view
        return view

    def _selectors(
        self,
        selectors: Sequence[tuple[SelectorSpec, Selector]],
        dev: Device,
        kind: str,
        owner: str,
    ) -> Reason | None:
        """selectorsMatch: every selector in order; the first false or error decides."""
        for i, (spec, sel) in enumerate(selectors):
            verdict = sel.evaluate(self._view(dev))
            details = {"selector": i, "expression": spec.expression, "seen": dict(verdict.seen)}
            if kind == "class-selector":
                details["class"] = owner.removeprefix("class ")
            if verdict.error is not None:
                return Reason(
                    "cel-error",
                    f"{owner} selector #{i}: CEL runtime error: {verdict.error}"
                    " (the scheduler stops allocating on this node at such an error)",
                    {**details, "error": verdict.error, "source": kind},
                )
            if not verdict.matched:
                seen = f" (saw {_seen(verdict.seen)})" if verdict.seen else ""
                return Reason(
                    kind, f"{owner} selector #{i} is false: {spec.expression}{seen}", details
                )
        return None

    # -- counters and capacity ------------------------------------------------------------------
    def available(self, pool_index: int) -> dict[tuple[str, str], int]:
        """checkAvailableCounters: the pool's counters less what allocated devices consume
        (may go negative: then none is left)."""
        avail = self._available.get(pool_index)
        if avail is None:
            pool = self.node.pools[pool_index]
            avail = {(s, c): q.nanos for s, cs in pool.counters.items() for c, q in cs.items()}
            for dev in pool.devices:
                if not self.allocated.holds(dev.key):
                    continue
                for use in dev.consumes:
                    for c, q in use.counters.items():
                        if (use.counter_set, c) in avail:
                            avail[(use.counter_set, c)] -= q.nanos
            self._available[pool_index] = avail
        return avail

    def _counter_holders(self, dev: Device, counter_set: str, counter: str) -> list[str]:
        pool = self.node.pools[dev.pool_index]
        out = []
        for pick in self.picks:
            d = pick.device
            if d.pool_index == dev.pool_index and _uses(d, counter_set, counter):
                out.append(f"{d.name} (request {pick.request.full_name})")
        for d in pool.devices:
            if self.allocated.holds(d.key) and _uses(d, counter_set, counter):
                owner = self.allocated.owners.get(d.key) or ", ".join(
                    self.allocated.share_owners.get(d.key, ())
                )
                out.append(f"{d.name} ({owner})")
        return out

    def _skip_counters(self, dev: Device) -> bool:
        """A device that allows multiple allocations consumes its counters once: not again when
        some of its capacity is in use already (allocateDevice)."""
        return dev.allow_multiple and (
            dev.key in self.allocated.shared or dev.index in self._capacity
        )

    def _check_counters(self, dev: Device, in_claim: bool) -> Reason | None:
        if not dev.consumes or self._skip_counters(dev):
            return None
        avail = self.available(dev.pool_index)
        for use in dev.consumes:
            for c, q in use.counters.items():
                used = (
                    self._counters.get((dev.pool_index, use.counter_set, c), 0) if in_claim else 0
                )
                left = avail.get((use.counter_set, c), 0) - used
                if q.nanos > left:
                    holders = self._counter_holders(dev, use.counter_set, c)
                    taken = f"; used by {', '.join(holders[:4])}" if holders else ""
                    if len(holders) > 4:
                        taken += f" and {len(holders) - 4} more"
                    return Reason(
                        "counters",
                        f"counter {use.counter_set}/{c} exhausted: needs {_qty(q.nanos)},"
                        f" {_qty(max(left, 0))} left{taken}",
                        {
                            "counterSet": use.counter_set,
                            "counter": c,
                            "needs": _qty(q.nanos),
                            "left": _qty(max(left, 0)),
                            "usedBy": holders,
                        },
                    )
        return None

    def _capacity_check(
        self, req: Request, dev: Device, in_claim: bool
    ) -> tuple[Reason | None, dict[str, Quantity]]:
        """CmpRequestOverCapacity (consumable_capacity.go): every capacity of the device, the
        request's amount (or the policy's default, or all of it when it asks for none) rounded
        up per the request policy, plus what other claims (and this claim) consume, within
        the capacity's value."""
        missing = [n for n in req.capacity if n not in dev.capacity]
        if missing:
            has = ", ".join(sorted(dev.capacity)) or "none"
            return Reason(
                "capacity",
                f"requests capacity {missing[0]}, which the device does not have (it has: {has})",
                {"capacity": missing[0], "missing": True},
            ), {}
        consumed: dict[str, Quantity] = {}
        allocated = self.allocated.shared.get(dev.key, {})
        mine = self._capacity.get(dev.index, {}) if in_claim else {}
        for name, cap in dev.capacity.items():
            requested = req.capacity.get(name)
            amount = consume(requested, cap.value, cap.policy)
            consumed[name] = amount
            shown_req = str(requested) if requested is not None else "nothing"
            if cap.policy is not None and violates(amount, cap.policy):
                return Reason(
                    "capacity",
                    f"capacity {name}: request {shown_req} (rounded {amount}) is not allowed"
                    f" by its request policy ({describe_policy(cap.policy)})",
                    {
                        "capacity": name,
                        "requested": shown_req,
                        "rounded": str(amount),
                        "policy": describe_policy(cap.policy),
                    },
                ), {}
            used = (allocated[name].nanos if name in allocated else 0) + mine.get(name, 0)
            if amount.nanos + used > cap.value.nanos:
                return Reason(
                    "capacity",
                    f"capacity {name} too small: requested {shown_req}, rounded {amount},"
                    f" available {_qty(cap.value.nanos - used)} of {cap.value}",
                    {
                        "capacity": name,
                        "requested": shown_req,
                        "rounded": str(amount),
                        "available": _qty(cap.value.nanos - used),
                        "total": str(cap.value),
                    },
                ), {}
        return None, consumed

    # -- analysis --------------------------------------------------------------------------------
    def analyse(self, req: Request) -> Analysis:
        cls = self.classes.get(req.class_name)
        a = Analysis(req, cls)
        if cls is None:
            known = ", ".join(sorted(self.classes)) or "none given"
            a.problem = Reason(
                "unknown-class",
                f"request {req.full_name}: DeviceClass {req.class_name!r} not found"
                f" (known: {known})",
                {"class": req.class_name},
            )
            return a
        class_sels = [(s, self.compile(s)) for s in cls.selectors]
        req_sels = [(s, self.compile(s)) for s in req.selectors]
        constraints = [(c, i) for i, c in enumerate(self.claim.constraints) if c.applies_to(req)]
        a.constraint_values = [(c, i, {}) for c, i in constraints]
        all_mode = req.mode is Mode.ALL
        for dev in self.node.devices:
            pool = self.node.pools[dev.pool_index]
            if pool.problem is not None:
                # allocateOne skips incomplete and invalid pools
                a.rejections[dev.index] = Reason("pool", pool.problem, {"pool": pool.ref})
                continue
            held = self.allocated.owners.get(dev.key)
            # For ExactCount upstream checks "in use" before the selectors, so a CEL error on
            # an allocated device never stops it; the explanation still evaluates them, so
            # that a device that would not match anyway is not reported as merely allocated.
            fatal = held is None or req.admin_access or all_mode
            if self._selected(cls, class_sels, req_sels, dev, a, fatal) is not None:
                continue
            a.matched += 1
            reason, consumed = self._capacity_check(req, dev, in_claim=False)
            if reason is not None:
                a.rejections[dev.index] = reason
                continue
            reason = self._static(req, dev, held)
            if reason is None:
                for c, _, values in a.constraint_values:
                    v = dev.attribute(c.attribute)
                    if v is None:
                        reason = Reason(
                            "constraint",
                            f"{c}: the device has no attribute {c.attribute}",
                            {"constraint": c.kind, "attribute": c.attribute, "value": None},
                        )
                        break
                    values[dev.index] = v
            if reason is not None:
                a.rejections[dev.index] = reason
                if all_mode and a.problem is None:
                    # allocateDevice(must=true): every matching device or none
                    a.problem = Reason(
                        reason.kind,
                        f"request {req.full_name} (allocationMode All) needs every matching"
                        f" device, but {dev.name}: {reason.text}",
                        {**reason.details, "device": dev.name},
                    )
                continue
            if dev.allow_multiple:
                a.consumed[dev.index] = consumed
            a.candidates.append(dev.index)
        if all_mode:
            for pool in self.node.pools:
                if pool.problem is not None and a.problem is None:
                    # validateDeviceRequest: "all" cannot be known while a pool is unusable
                    a.problem = Reason(
                        "pool",
                        f"request {req.full_name} asks for all devices, but {pool.problem}",
                        {"pool": pool.ref},
                    )
            if a.problem is None and not a.candidates:
                a.problem = Reason(
                    "no-candidates",
                    f"request {req.full_name} asks for all matching devices, and none matches",
                )
            if a.problem is None and len(a.candidates) > MAX_RESULTS:
                a.problem = Reason(
                    "too-many",
                    f"request {req.full_name} asks for all {len(a.candidates)} matching devices,"
                    f" more than the {MAX_RESULTS} one claim may hold",
                )
        return a

    def _selected(
        self,
        cls: DeviceClass,
        class_sels: Sequence[tuple[SelectorSpec, Selector]],
        req_sels: Sequence[tuple[SelectorSpec, Selector]],
        dev: Device,
        a: Analysis,
        fatal: bool,
    ) -> Reason | None:
        """isSelectable: the class's selectors, then the request's; the first that is false or
        fails decides (and is recorded as the device's rejection)."""
        key = (cls.name, dev.index)
        if key in self._class_verdicts:
            reason = self._class_verdicts[key]
        else:
            reason = self._selectors(class_sels, dev, "class-selector", f"class {cls.name}")
            self._class_verdicts[key] = reason
        if reason is None:
            reason = self._selectors(
                req_sels, dev, "request-selector", f"request {a.request.full_name}"
            )
        if reason is not None:
            a.rejections[dev.index] = reason
            if reason.kind == "cel-error" and fatal and a.cel_error is None:
                a.cel_error = Reason(
                    "cel-error",
                    f"request {a.request.full_name}, device {dev.name}: {reason.text}",
                    {**reason.details, "device": dev.name},
                )
        return reason

    def _static(self, req: Request, dev: Device, held: str | None) -> Reason | None:
        for taint in dev.taints:
            if taint.blocks() and not any(t.tolerates(taint) for t in req.tolerations):
                return Reason(
                    "tainted",
                    f"tainted {taint}, not tolerated",
                    {
                        "taint": str(taint),
                        "key": taint.key,
                        "value": taint.value,
                        "effect": taint.effect,
                    },
                )
        if held is not None and not req.admin_access:
            return Reason("allocated", f"allocated to {held}", {"owner": held})
        return self._check_counters(dev, in_claim=False)

    # -- search ------------------------------------------------------------------------------------
    def run(self) -> Outcome:
        groups = self.claim.requests
        analyses = [[self.analyse(r) for r in g.alternatives] for g in groups]
        self._analyses = analyses
        fatal = None
        # validateDeviceRequest runs for every request and subrequest before the search: an
        # unknown class, or a CEL error while collecting "all" devices, stops allocation.
        for alts in analyses:
            for a in alts:
                if a.problem is not None and a.problem.kind == "unknown-class":
                    fatal = fatal or a.problem
                if a.request.mode is Mode.ALL and a.cel_error is not None:
                    fatal = fatal or a.cel_error
        minimum = sum(
            min(
                a.request.count if a.request.mode is Mode.EXACT_COUNT else len(a.candidates)
                for a in alts
            )
            for alts in analyses
        )
        if fatal is None and minimum > MAX_RESULTS:
            fatal = Reason(
                "too-many",
                f"the claim asks for at least {minimum} devices, more"
                f" than the {MAX_RESULTS} one claim may hold",
            )
        ok = gave_up = False
        if fatal is None:
            self._deadline = self.clock() + self.time_limit_s
            try:
                ok = self._request(0)
            except GaveUp:
                gave_up = True
            except Fatal as e:
                fatal = e.reason
        return Outcome(
            ok=ok,
            picks=list(self.picks) if ok else [],
            selected=dict(self.selected) if ok else {},
            analyses=analyses,
            attempts=self.attempts,
            blocker=self._blocker,
            fatal=fatal,
            gave_up=gave_up,
            steps=self.steps,
        )

    def _tick(self) -> None:
        self.steps += 1
        if self.clock() > self._deadline:
            raise GaveUp

    def _request(self, gi: int) -> bool:
        if gi == len(self.claim.requests):
            return True
        for ai, a in enumerate(self._analyses[gi]):
            if a.cel_error is not None:
                raise Fatal(a.cel_error)
            self.selected[gi] = ai
            if a.problem is not None:
                self._record(gi, ai, a, reason=a.problem)
                continue
            if a.request.mode is Mode.ALL:
                if self._all(gi, ai, a):
                    return True
            elif self._next(gi, ai, a, 0, 0):
                return True
        del self.selected[gi]
        return False

    def _all(self, gi: int, ai: int, a: Analysis) -> bool:
        self._tick()
        if len(self.picks) + len(a.candidates) > MAX_RESULTS:
            self._record(gi, ai, a, reason=self._too_many(a, len(a.candidates)))
            return False
        added: list[int] = []
        for idx in a.candidates:
            reason = self._add(a, idx)
            if reason is not None:
                dev = self.node.devices[idx]
                self._record(
                    gi,
                    ai,
                    a,
                    reason=Reason(
                        reason.kind,
                        f"request {a.request.full_name} (allocationMode All) needs every matching"
                        f" device, but {dev.name}: {reason.text}",
                        {**reason.details, "device": dev.name},
                    ),
                )
                for i in reversed(added):
                    self._remove(a, i)
                return False
            added.append(idx)
        if self._request(gi + 1):
            return True
        for i in reversed(added):
            self._remove(a, i)
        return False

    def _too_many(self, a: Analysis, need: int) -> Reason:
        return Reason(
            "too-many",
            f"request {a.request.full_name} needs {need} more devices on top of"
            f" {len(self.picks)}: more than the {MAX_RESULTS} one claim may hold",
        )

    def _next(self, gi: int, ai: int, a: Analysis, k: int, start: int) -> bool:
        """allocateOne for device k of an ExactCount request: try the candidates from
        ``start`` on (combinations, not permutations)."""
        count = a.request.count
        if k == count:
            return self._request(gi + 1)
        self._tick()
        need = count - k
        if len(self.picks) + need > MAX_RESULTS:
            self._record(gi, ai, a, reason=self._too_many(a, need))
            return False
        cands = a.candidates
        if len(cands) < count:
            self._record(
                gi,
                ai,
                a,
                reason=Reason(
                    "too-few",
                    f"request {a.request.full_name} needs {count}, {len(cands)}"
                    f" candidate{'s' if len(cands) != 1 else ''}",
                    {"needs": count, "candidates": len(cands)},
                ),
            )
            return False
        for ci in range(start, len(cands) - need + 1):
            idx = cands[ci]
            if self._add(a, idx) is not None:
                continue
            if self._next(gi, ai, a, k + 1, ci + 1):
                return True
            self._remove(a, idx)
        self._record(gi, ai, a)
        return False

    def _check(self, a: Analysis, idx: int) -> Reason | None:
        """allocateDevice's checks against the claim's picks so far, without changing them."""
        dev = self.node.devices[idx]
        taken = self._exclusive.get(idx)
        if taken is not None:
            return Reason(
                "taken", f"already chosen for request {taken} of this claim", {"request": taken}
            )
        reason = self._check_counters(dev, in_claim=True)
        if reason is not None:
            return reason
        for c, ci, values in a.constraint_values:
            v = values[idx]
            if c.kind == "matchAttribute":
                fixed = self._match.get(ci)
                if fixed is not None and fixed[1] > 0 and fixed[0] != v:
                    others = self._holders(c, fixed[0])
                    return Reason(
                        "constraint",
                        f"{c}: {_value(v)}, but {', '.join(others)} has {_value(fixed[0])}",
                        {
                            "constraint": c.kind,
                            "attribute": c.attribute,
                            "value": _value(v),
                            "conflictsWith": {n: _value(fixed[0]) for n in others},
                        },
                    )
            else:
                if self._distinct.get(ci, {}).get(v, 0) > 0:
                    others = self._holders(c, v)
                    return Reason(
                        "constraint",
                        f"{c}: {_value(v)} is already taken by {', '.join(others)}",
                        {
                            "constraint": c.kind,
                            "attribute": c.attribute,
                            "value": _value(v),
                            "conflictsWith": {n: _value(v) for n in others},
                        },
                    )
        if dev.allow_multiple and idx in self._capacity:
            reason, _ = self._capacity_check(a.request, dev, in_claim=True)
            if reason is not None:
                return reason
        return None

    def _holders(self, c: Constraint, value: AttributeValue) -> list[str]:
        return [
            p.device.name
            for p in self.picks
            if c.applies_to(p.request) and p.device.attribute(c.attribute) == value
        ]

    def _add(self, a: Analysis, idx: int) -> Reason | None:
        reason = self._check(a, idx)
        if reason is not None:
            return reason
        dev = self.node.devices[idx]
        req = a.request
        if dev.consumes and not self._skip_counters(dev):
            for use in dev.consumes:
                for counter, q in use.counters.items():
                    k = (dev.pool_index, use.counter_set, counter)
                    self._counters[k] = self._counters.get(k, 0) + q.nanos
        for c, ci, values in a.constraint_values:
            v = values[idx]
            if c.kind == "matchAttribute":
                fixed = self._match.get(ci)
                self._match[ci] = (v, fixed[1] + 1 if fixed else 1)
            else:
                seen = self._distinct.setdefault(ci, {})
                seen[v] = seen.get(v, 0) + 1
        consumed = None
        share_id = None
        if dev.allow_multiple:
            consumed = a.consumed[idx]
            mine = self._capacity.setdefault(idx, {})
            for name, q in consumed.items():
                mine[name] = mine.get(name, 0) + q.nanos
            share_id = str(
                uuid.uuid5(
                    SHARE_NAMESPACE,
                    f"{self.claim.uid or self.claim.ref}/{req.full_name}/{'/'.join(dev.key)}",
                )
            )
        else:
            self._exclusive[idx] = req.full_name
        self.picks.append(Pick(req, dev, consumed, share_id))
        return None

    def _remove(self, a: Analysis, idx: int) -> None:
        pick = self.picks.pop()
        dev = pick.device
        assert dev.index == idx
        if dev.allow_multiple:
            mine = self._capacity[idx]
            for name, q in (pick.consumed or {}).items():
                mine[name] -= q.nanos
            if not any(mine.values()) and not self._any_pick(idx):
                del self._capacity[idx]
        else:
            del self._exclusive[idx]
        if dev.consumes and not self._skip_counters(dev):
            for use in dev.consumes:
                for counter, q in use.counters.items():
                    self._counters[(dev.pool_index, use.counter_set, counter)] -= q.nanos
        for c, ci, values in a.constraint_values:
            v = values[idx]
            if c.kind == "matchAttribute":
                fixed = self._match[ci]
                self._match[ci] = (fixed[0], fixed[1] - 1)
            else:
                self._distinct[ci][v] -= 1

    def _any_pick(self, idx: int) -> bool:
        return any(p.device.index == idx for p in self.picks)

    def _record(self, gi: int, ai: int, a: Analysis, reason: Reason | None = None) -> None:
        """Keep the deepest failed state of this request (and of the whole search)."""
        depth = len(self.picks)
        key = (gi, ai)
        if depth > self._blocker_depth:
            self._blocker_depth = depth
            self._blocker = key
        if key in self._depth and self._depth[key] >= depth:
            return
        self._depth[key] = depth
        rejections: dict[int, Reason] = {}
        mine = {p.device.index for p in self.picks if p.request is a.request}
        for idx in a.candidates:
            if idx in mine:
                continue
            why = self._check(a, idx)
            rejections[idx] = why or Reason(
                "no-completion",
                "fits with the devices chosen so far, but no complete allocation includes it",
            )
        self.attempts[key] = Attempt(list(self.picks), rejections, reason)


# -- request policies (consumable_capacity.go) ---------------------------------------------------


def consume(requested: Quantity | None, value: Quantity, policy: RequestPolicy | None) -> Quantity:
    """calculateConsumedCapacity: nothing requested: the policy's default, else the whole
    capacity; otherwise the request rounded up to the range's min + n*step, or to the first
    valid value not below it (the request itself when there is none)."""
    if requested is None:
        return policy.default if policy is not None and policy.default is not None else value
    if policy is None:
        return requested
    if policy.has_range and policy.range_min is not None:
        lo = policy.range_min
        if requested < lo:
            return lo
        if policy.range_step is None:
            return requested
        step, base = policy.range_step.value(), lo.value()
        n, rest = divmod(requested.value() - base, step)
        return Quantity.from_int(base + step * (n + (1 if rest else 0)), Format.BINARY_SI)
    if policy.valid_values:
        for v in policy.valid_values:
            if requested <= v:
                return v
    return requested


def violates(amount: Quantity, policy: RequestPolicy) -> bool:
    """violatesPolicy: the default is always allowed; above the range's max or off its step,
    or not one of the valid values, is not."""
    if policy.default is not None and amount == policy.default:
        return False
    if policy.has_range:
        if policy.range_max is not None and amount > policy.range_max:
            return True
        if policy.range_step is not None and policy.range_min is not None:
            return bool((amount.value() - policy.range_min.value()) % policy.range_step.value())
        return False
    if policy.valid_values:
        return amount not in policy.valid_values
    return False


def describe_policy(policy: RequestPolicy) -> str:
    parts = []
    if policy.default is not None:
        parts.append(f"default {policy.default}")
    if policy.has_range:
        rng = f"min {policy.range_min}"
        if policy.range_max is not None:
            rng += f", max {policy.range_max}"
        if policy.range_step is not None:
            rng += f", step {policy.range_step}"
        parts.append(rng)
    if policy.valid_values:
        parts.append("valid values " + ", ".join(str(v) for v in policy.valid_values))
    return "; ".join(parts) or "none"
