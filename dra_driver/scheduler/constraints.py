"""The claim's constraints during the search (k8s.io/dynamic-resource-allocation
``structured/internal/experimental/``: matchAttributeConstraint in allocator_experimental.go,
distinctAttributeConstraint in constraint.go): ``matchAttribute`` (every device of the requests
it names has the same value of the attribute) and ``distinctAttribute``, checked against the
devices picked so far.

``distinctAttribute`` is kept as upstream keeps it, which is not "no two devices alike": the
constraint remembers one value per request (the base request's name; the value of the device
added last for it) and how many devices it holds; a device may be added when none is held, or
when its value differs from every remembered one; removing a device forgets its request's value.
So it tells apart the devices of different requests (what the API documents it for: "avoid
allocating multiple requests to the same device"), but of one request's devices only compares
each with the one before it (and the other requests' values): a request of count 4 on two
memory-share GPUs gets gpu-0, gpu-1, gpu-0, gpu-1."""

from __future__ import annotations

from collections.abc import Sequence

from dra_driver.scheduler.domain import AttributeValue, Constraint
from dra_driver.scheduler.outcome import Analysis, Pick, Reason


def _value(v: AttributeValue | None) -> str:
    if v is None:
        return "<missing>"
    return str(v[1]).lower() if v[0] == "bool" else str(v[1])


class Constraints:
    """What the picks so far fix: per matchAttribute constraint its value and how many picks
    hold it, per distinctAttribute constraint the value remembered per request and how many
    picks it holds (distinctAttributeConstraint's ``attributes`` and ``numDevices``)."""

    def __init__(self) -> None:
        self._match: dict[int, tuple[AttributeValue, int]] = {}
        self._distinct: dict[int, tuple[dict[str, AttributeValue], int]] = {}

    def check(self, a: Analysis, idx: int, picks: Sequence[Pick]) -> Reason | None:
        """Whether candidate ``idx`` of ``a`` keeps every constraint that applies to its
        request, given ``picks``."""
        for c, ci, values in a.constraint_values:
            v = values[idx]
            if c.kind == "matchAttribute":
                fixed = self._match.get(ci)
                if fixed is not None and fixed[1] > 0 and fixed[0] != v:
                    others = _holders(c, fixed[0], picks)
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
                remembered, held = self._distinct.get(ci, ({}, 0))
                if held > 0 and v in remembered.values():
                    names = {r for r, value in remembered.items() if value == v}
                    others = _holders(c, v, picks, names) or sorted(names)
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
        return None

    def add(self, a: Analysis, idx: int) -> None:
        for c, ci, values in a.constraint_values:
            v = values[idx]
            if c.kind == "matchAttribute":
                fixed = self._match.get(ci)
                self._match[ci] = (v, fixed[1] + 1 if fixed else 1)
            else:
                remembered, held = self._distinct.get(ci, ({}, 0))
                remembered[a.request.base_name] = v
                self._distinct[ci] = (remembered, held + 1)

    def remove(self, a: Analysis, idx: int) -> None:
        for c, ci, _ in a.constraint_values:
            if c.kind == "matchAttribute":
                fixed = self._match[ci]
                self._match[ci] = (fixed[0], fixed[1] - 1)
            else:
                remembered, held = self._distinct[ci]
                remembered.pop(a.request.base_name, None)
                self._distinct[ci] = (remembered, held - 1)


def _holders(
    c: Constraint,
    value: AttributeValue,
    picks: Sequence[Pick],
    requests: set[str] | None = None,
) -> list[str]:
    """The picks under ``c`` with ``value`` (of the base ``requests`` only, when given)."""
    return [
        p.device.name
        for p in picks
        if c.applies_to(p.request)
        and p.device.attribute(c.attribute) == value
        and (requests is None or p.request.base_name in requests)
    ]
