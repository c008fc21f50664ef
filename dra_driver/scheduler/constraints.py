"""The claim's constraints during the search (k8s.io/dynamic-resource-allocation
``structured/internal/incubating/constraint.go``): ``matchAttribute`` (every device of the
requests it names has the same value of the attribute) and ``distinctAttribute`` (no two have
the same value), checked against the devices picked so far."""

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
    hold it, per distinctAttribute constraint how many picks hold each value."""

    def __init__(self) -> None:
        self._match: dict[int, tuple[AttributeValue, int]] = {}
        self._distinct: dict[int, dict[AttributeValue, int]] = {}

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
                if self._distinct.get(ci, {}).get(v, 0) > 0:
                    others = _holders(c, v, picks)
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
                seen = self._distinct.setdefault(ci, {})
                seen[v] = seen.get(v, 0) + 1

    def remove(self, a: Analysis, idx: int) -> None:
        for c, ci, values in a.constraint_values:
            v = values[idx]
            if c.kind == "matchAttribute":
                fixed = self._match[ci]
                self._match[ci] = (fixed[0], fixed[1] - 1)
            else:
                self._distinct[ci][v] -= 1


def _holders(c: Constraint, value: AttributeValue, picks: Sequence[Pick]) -> list[str]:
    return [
        p.device.name
        for p in picks
        if c.applies_to(p.request) and p.device.attribute(c.attribute) == value
    ]
