"""Counters and consumable capacity: what the node's allocated claims leave of each pool's
counters (``checkAvailableCounters``), what the claim's picks so far take of them and of shared
devices' capacity, and the request policies that round a request
(k8s.io/dynamic-resource-allocation ``structured/internal/incubating/allocator_incubating.go``:
checkAvailableCounters, allocateDevice; ``structured/internal/experimental/`` (the only variant
with consumable capacity, used when DRAConsumableCapacity is on) ``consumable_capacity.go``:
CmpRequestOverCapacity and the request-policy rounding, and allocator_experimental.go's
allocateDevice: a device that allows multiple allocations skips its counters once its capacity
is in use)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dra_driver.quantity import Format, Quantity
from dra_driver.scheduler.domain import Allocated, Device, Node, Request, RequestPolicy
from dra_driver.scheduler.outcome import Pick, Reason


def _qty(nanos: int) -> str:
    return str(Quantity(nanos, Format.BINARY_SI))


def _uses(dev: Device, counter_set: str, counter: str) -> bool:
    for u in dev.consumes:
        q = u.counters.get(counter)
        if u.counter_set == counter_set and q is not None and q.nanos > 0:
            return True
    return False


def _same_scope(a: Device, b: Device) -> bool:
    """Whether ``a`` and ``b`` draw on the same counter sets (same pool, and in 1.34 slice)."""
    return a.pool_index == b.pool_index and a.counter_slice == b.counter_slice


def _key(dev: Device, counter_set: str, counter: str) -> tuple[int, str, str, str]:
    return (dev.pool_index, dev.counter_slice, counter_set, counter)


class Usage:
    """The counters and capacity of one claim's allocation in progress, against what the
    node's allocated claims hold. The search takes and releases as it picks and backtracks."""

    def __init__(self, node: Node, allocated: Allocated) -> None:
        self.node = node
        self.allocated = allocated
        self._available: dict[tuple[int, str], dict[tuple[str, str], int]] = {}
        self._counters: dict[tuple[int, str, str, str], int] = {}
        self._capacity: dict[int, dict[str, int]] = {}

    def available(self, dev: Device) -> dict[tuple[str, str], int]:
        """checkAvailableCounters: the counters ``dev`` draws on (its pool's, or in 1.34 its
        slice's: ``Device.counter_slice``) less what allocated devices consume (may go
        negative: then none is left)."""
        scope = (dev.pool_index, dev.counter_slice)
        avail = self._available.get(scope)
        if avail is None:
            pool = self.node.pools[dev.pool_index]
            sets = pool.slice_counters.get(dev.counter_slice, {}) if scope[1] else pool.counters
            avail = {(s, c): q.nanos for s, cs in sets.items() for c, q in cs.items()}
            for d in pool.devices:
                if d.counter_slice != scope[1] or not self.allocated.holds(d.key):
                    continue
                for use in d.consumes:
                    for c, q in use.counters.items():
                        if (use.counter_set, c) in avail:
                            avail[(use.counter_set, c)] -= q.nanos
            self._available[scope] = avail
        return avail

    def _counter_holders(
        self, dev: Device, counter_set: str, counter: str, picks: Sequence[Pick]
    ) -> list[str]:
        pool = self.node.pools[dev.pool_index]
        out = []
        for pick in picks:
            d = pick.device
            if _same_scope(d, dev) and _uses(d, counter_set, counter):
                out.append(f"{d.name} (request {pick.request.full_name})")
        for d in pool.devices:
            if (
                _same_scope(d, dev)
                and self.allocated.holds(d.key)
                and _uses(d, counter_set, counter)
            ):
                owner = self.allocated.owners.get(d.key) or ", ".join(
                    self.allocated.share_owners.get(d.key, ())
                )
                out.append(f"{d.name} ({owner})")
        return out

    def skip_counters(self, dev: Device) -> bool:
        """A device that allows multiple allocations consumes its counters once: not again when
        some of its capacity is in use already (allocateDevice)."""
        return dev.allow_multiple and (
            dev.key in self.allocated.shared or dev.index in self._capacity
        )

    def check_counters(self, dev: Device, in_claim: bool, picks: Sequence[Pick]) -> Reason | None:
        """The device's counters against what is left (and, ``in_claim``, what ``picks``
        take); the reason names who uses them."""
        if not dev.consumes or self.skip_counters(dev):
            return None
        avail = self.available(dev)
        for use in dev.consumes:
            for c, q in use.counters.items():
                if (use.counter_set, c) not in avail:
                    # 1.34 checks its slice's counter sets only: one it lacks is not enforced
                    # (1.35 makes such a pool invalid before)
                    continue
                used = self._counters.get(_key(dev, use.counter_set, c), 0) if in_claim else 0
                left = avail[(use.counter_set, c)] - used
                if q.nanos > left:
                    holders = self._counter_holders(dev, use.counter_set, c, picks)
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

    def check_capacity(
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

    def holds_capacity(self, index: int) -> bool:
        """Whether the claim's picks so far use some of device ``index``'s capacity."""
        return index in self._capacity

    def take_counters(self, dev: Device) -> None:
        if dev.consumes and not self.skip_counters(dev):
            for use in dev.consumes:
                for counter, q in use.counters.items():
                    k = _key(dev, use.counter_set, counter)
                    self._counters[k] = self._counters.get(k, 0) + q.nanos

    def release_counters(self, dev: Device) -> None:
        if dev.consumes and not self.skip_counters(dev):
            for use in dev.consumes:
                for counter, q in use.counters.items():
                    self._counters[_key(dev, use.counter_set, counter)] -= q.nanos

    def take_capacity(self, index: int, consumed: Mapping[str, Quantity]) -> None:
        mine = self._capacity.setdefault(index, {})
        for name, q in consumed.items():
            mine[name] = mine.get(name, 0) + q.nanos

    def release_capacity(
        self, index: int, consumed: Mapping[str, Quantity] | None, picks: Sequence[Pick]
    ) -> None:
        """Give back what a pick took; the device leaves the claim's use when nothing of it is
        taken any more and no pick (``picks``, after this one left) holds it."""
        mine = self._capacity[index]
        for name, q in (consumed or {}).items():
            mine[name] -= q.nanos
        if not any(mine.values()) and not any(p.device.index == index for p in picks):
            del self._capacity[index]


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
