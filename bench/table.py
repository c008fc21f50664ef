"""The one table of ``make bench``: every benchmark's key figures, each next to the floor measured
in the same run, the ratio, the goal and whether it is met.

A benchmark module's ``run(quick) -> list[Figure]`` builds its figures with :func:`measured` from
the samples of its repeats: the value is the median of the repeats' values, the floor the median
of the repeats' floors, and the ratio the median of the per-repeat ratios (each repeat's value
over the floor measured in that repeat, so load from elsewhere weighs on both sides of one
ratio; it need not equal value / floor of the medians). A goal is text plus a check of the
figure (:class:`Goal`; the constructors below); ``met`` is None without one.

``python -m bench`` prints :func:`render` of every figure and writes :func:`results` to
``bench/results.json``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Goal:
    """What a figure must achieve: ``text`` for people, ``check`` for the table."""

    text: str
    check: Callable[[Figure], bool] = field(compare=False, repr=False)


def ratio_at_most(limit: float) -> Goal:
    """The value within ``limit`` times its floor (the per-repeat ratios' median)."""

    def check(f: Figure) -> bool:
        return f.ratio is not None and f.ratio <= limit

    return Goal(f"<= {limit:g}x floor", check)


def at_most(limit: float, unit: str) -> Goal:
    return Goal(f"<= {limit:g} {unit}", lambda f: f.value <= limit)


def below(limit: float, unit: str) -> Goal:
    return Goal(f"< {limit:g} {unit}", lambda f: f.value < limit)


def equal_to(expected: float, unit: str = "") -> Goal:
    return Goal(f"= {expected:g}{' ' + unit if unit else ''}", lambda f: f.value == expected)


def floor_plus(margin: float, unit: str) -> Goal:
    """The value at most ``margin`` above its floor."""

    def check(f: Figure) -> bool:
        return f.floor is not None and f.value <= f.floor + margin

    return Goal(f"<= floor + {margin:g} {unit}", check)


@dataclass(frozen=True)
class Figure:
    """One row of the table."""

    benchmark: str
    name: str
    value: float
    unit: str
    floor: float | None = None
    """The floor, in ``unit``, measured in the same run (median of the repeats)."""
    floor_how: str = ""
    """How the floor is measured (the table's legend)."""
    ratio: float | None = None
    goal: Goal | None = None
    repeats: int = 1
    samples: tuple[float, ...] = ()
    """The repeats' values (the value is their median)."""
    floors: tuple[float, ...] = ()
    note: str = ""

    @property
    def met(self) -> bool | None:
        """Whether the goal is met; None without a goal."""
        return None if self.goal is None else self.goal.check(self)

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark,
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "floor": self.floor,
            "floor_how": self.floor_how or None,
            "ratio": self.ratio,
            "goal": self.goal.text if self.goal else None,
            "met": self.met,
            "repeats": self.repeats,
            "samples": list(self.samples),
            "floors": list(self.floors),
            "note": self.note or None,
        }


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("no samples")
    return float(statistics.median(values))


def measured(
    benchmark: str,
    name: str,
    unit: str,
    values: Sequence[float],
    floors: Sequence[float] | None = None,
    *,
    floor_how: str = "",
    goal: Goal | None = None,
    note: str = "",
) -> Figure:
    """A figure from its repeats: ``values[i]`` was measured with ``floors[i]`` (same length)."""
    if floors is not None and len(floors) != len(values):
        raise ValueError(f"{name}: {len(values)} values but {len(floors)} floors")
    ratio = None
    if floors:
        ratio = median([v / f if f else math.inf for v, f in zip(values, floors, strict=True)])
    return Figure(
        benchmark=benchmark,
        name=name,
        value=median(values),
        unit=unit,
        floor=median(floors) if floors else None,
        floor_how=floor_how,
        ratio=ratio,
        goal=goal,
        repeats=len(values),
        samples=tuple(values),
        floors=tuple(floors or ()),
        note=note,
    )


# -- printing ---------------------------------------------------------------------------------


def number(value: float, unit: str) -> str:
    """``value`` with about three significant digits and its unit."""
    if not math.isfinite(value):
        text = str(value)
    elif unit in ("", "count"):
        text = f"{value:,.0f}" if value == int(value) else f"{value:.2f}"
    elif abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    elif abs(value) >= 1 or value == 0:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3g}"
    return f"{text} {unit}" if unit and unit != "count" else text


def met_text(met: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[met]


def floor_legend(figures: Sequence[dict[str, Any]]) -> dict[str, str]:
    """How each floor was measured, by its mark (``[a]``, ``[b]``, ...) in order of appearance."""
    legend: dict[str, str] = {}
    for f in figures:
        how = f["floor_how"]
        if f["floor"] is not None and how and how not in legend.values():
            legend[f"[{chr(ord('a') + len(legend))}]"] = how
    return legend


def render(figures: Sequence[Figure]) -> list[str]:
    """The table's lines: one row per figure, then the legend of the floors."""
    legend = floor_legend([f.to_json() for f in figures])
    mark = {how: key for key, how in legend.items()}
    header = ["benchmark", "figure", "value", "floor", "ratio", "goal", "met?"]
    rows = []
    for f in figures:
        floor = "-"
        if f.floor is not None:
            floor = number(f.floor, f.unit) + (f" {mark[f.floor_how]}" if f.floor_how else "")
        rows.append(
            [
                f.benchmark,
                f.name,
                number(f.value, f.unit),
                floor,
                "-" if f.ratio is None else f"{f.ratio:.2f}x",
                f.goal.text if f.goal else "-",
                met_text(f.met),
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {2, 3, 4}
    lines = []
    for n, row in enumerate([header, *rows]):
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    if legend:
        lines.append("")
        lines.append("floors (measured in the same run):")
        lines.extend(f"  {key} {how}" for key, how in legend.items())
    goals = [f.met for f in figures if f.met is not None]
    lines.append("")
    lines.append(f"goals met: {sum(goals)} of {len(goals)}")
    return lines


def markdown(figures: Sequence[Figure] | Sequence[dict[str, Any]]) -> list[str]:
    """The same table in Markdown (for docs/performance.md), from figures or their JSON."""
    lines = [
        "| benchmark | figure | value | floor | ratio | goal | met? |",
        "|---|---|--:|--:|--:|---|---|",
    ]
    docs = [f.to_json() if isinstance(f, Figure) else f for f in figures]
    mark = {how: key for key, how in floor_legend(docs).items()}
    for d in docs:
        unit = str(d["unit"])
        floor = "-"
        if d["floor"] is not None:
            floor = number(float(d["floor"]), unit)
            if d["floor_how"]:
                floor += f" {mark[d['floor_how']]}"
        ratio = "-" if d["ratio"] is None else f"{float(d['ratio']):.2f}x"
        lines.append(
            f"| {d['benchmark']} | {d['name']} | {number(float(d['value']), unit)} | {floor} |"
            f" {ratio} | {d['goal'] or '-'} | {met_text(d['met'])} |"
        )
    return lines


def main(argv: Sequence[str]) -> int:
    """``python -m bench.table [RESULTS_JSON]``: the table of a run (default the last whole run,
    ``bench/results.json``) in Markdown, with its date, machine and load."""
    path = Path(argv[0]) if argv else Path(__file__).resolve().parent / "results.json"
    doc = json.loads(path.read_text())
    m = doc["machine"]
    before, after = m["load_average_before"][0], m["load_average_after"][0]
    print(
        f"{doc['started']}, {'QUICK, ' if doc['quick'] else ''}{m['cpus']} CPUs, wall time"
        f" {doc['wall_s'] / 60:.1f} min, 1-minute load average {before:.2f} before and"
        f" {after:.2f} after; goals met: {doc['goals']['met']} of {doc['goals']['total']}"
    )
    print()
    print("\n".join(markdown(doc["figures"])))
    print()
    for key, how in floor_legend(doc["figures"]).items():
        print(f"- {key} {how}")
    return 0


# -- results.json -----------------------------------------------------------------------------


def machine(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """Where and under what load the run happened."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
    }


def results(
    figures: Sequence[Figure],
    *,
    quick: bool,
    started: float,
    wall_s: float,
    benchmarks: dict[str, dict[str, Any]],
    machine_info: dict[str, Any],
) -> dict[str, Any]:
    """What ``bench/results.json`` holds: the run, every figure, and the tally of goals."""
    goals = [f.met for f in figures if f.met is not None]
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "quick": quick,
        "wall_s": wall_s,
        "machine": machine_info,
        "benchmarks": benchmarks,
        "figures": [f.to_json() for f in figures],
        "goals": {"met": sum(goals), "missed": len(goals) - sum(goals), "total": len(goals)},
    }


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
