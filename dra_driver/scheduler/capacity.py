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


class Usage:
    """The counters and capacity of one claim's allocation in progress, against what the
    node's allocated claims hold. The search takes and releases as it picks and backtracks."""

    def __init__(self, node: Node, allocated: Allocated) -> None:
        self.node = node
        self.allocated = allocated
        self._available: dict[int, dict[tuple[str, str], int]] = {}
        self._counters: dict[tuple[int, str, str], int] = {}
        self._capacity: dict[int, dict[str, int]] = {}

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

    def _counter_holders(
        self, dev: Device, counter_set: str, counter: str, picks: Sequence[Pick]
    ) -> list[str]:
        pool = self.node.pools[dev.pool_index]
        out = []
        for pick in picks:
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
        avail = self.available(dev.pool_index)
        for use in dev.consumes:
            for c, q in use.counters.items():
                used = (
                    self._counters.get((dev.pool_index, use.counter_set, c), 0) if in_claim else 0
                )
                left = avail.get((use.counter_set, c), 0) - used
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
                    k = (dev.pool_index, use.counter_set, counter)
                    self._counters[k] = self._counters.get(k, 0) + q.nanos

    def release_counters(self, dev: Device) -> None:
        if dev.consumes and not self.skip_counters(dev):
            for use in dev.consumes:
                for counter, q in use.counters.items():
                    self._counters[(dev.pool_index, use.counter_set, counter)] -= q.nanos

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
