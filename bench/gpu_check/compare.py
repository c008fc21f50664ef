"""Comparing two sets of facts, and the facts of what the driver advertises.

:func:`differences` pairs the facts of the real node and of the simulator by path and keeps what
differs under each fact's rule (:mod:`bench.gpu_check.probe`: value, kind, units). Below a
difference in whether something exists (a profile, a device), its own facts are not listed again.
The same difference on several GPUs is one line, ``gpu[0,1,2].…``.

:func:`advertised_facts` turns a :class:`~dra_driver.device_model.DeviceModel` into facts: which
devices, and per device its attribute names and types, capacity names and the counters it
consumes. Values are not compared there: every value the driver advertises comes from an NVML
fact compared at its source (the probe), and one difference is reported once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from bench.gpu_check.probe import (
    COMPARE_KIND,
    COMPARE_UNITS,
    NOT_SIMULATED,
    Fact,
    Facts,
    Json,
    is_marker,
)
from dra_driver.device_model import DeviceModel

ABSENT = "<absent>"
UNITS_FACTOR = 10.0
_GPU_PATH = re.compile(r"^gpu\[(\d+)\]\.(.*)$")
_DEVICE_NAME = re.compile(r"^gpu-(\d+)(?=-|$)")


@dataclass(frozen=True)
class Difference:
    path: str
    real: Json
    simulated: Json

    def json(self) -> dict[str, Json]:
        return {"path": self.path, "real": self.real, "simulated": self.simulated}


def kind(value: Json) -> str:
    """A failure marker itself, else the value's JSON type."""
    if is_marker(value):
        return str(value)
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def _differ(real: Fact, sim: Fact) -> bool:
    rule = real.compare
    if rule == COMPARE_KIND:
        return kind(real.value) != kind(sim.value)
    if rule == COMPARE_UNITS:
        if kind(real.value) != kind(sim.value):
            return True
        a, b = real.value, sim.value
        if isinstance(a, int | float) and isinstance(b, int | float) and a > 0 and b > 0:
            return abs(math.log10(a / b)) >= math.log10(UNITS_FACTOR)
        return False
    return bool(real.value != sim.value)


def differences(real: Facts, sim: Facts) -> tuple[list[Difference], list[Difference]]:
    """(differences, facts the simulator does not have a call for), in path order."""
    found: list[Difference] = []
    unsimulated: list[Difference] = []
    for path in sorted(set(real) | set(sim), key=_path_key):
        r, s = real.get(path), sim.get(path)
        if r is not None and s is not None and not _differ(r, s):
            continue
        diff = Difference(path, ABSENT if r is None else r.value, ABSENT if s is None else s.value)
        (unsimulated if diff.simulated == NOT_SIMULATED else found).append(diff)
    return group_gpus(_below_existence(found)), group_gpus(unsimulated)


def _path_key(path: str) -> list[tuple[int, int | str]]:
    """Natural order: gpu[2] before gpu[10], enum=9 before enum=10."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", path)]


def _below_existence(found: list[Difference]) -> list[Difference]:
    """Drop the facts below a path that exists on one side only, or whose presence differs."""
    roots = [d.path for d in found if not _leaf_difference(d)]
    return [d for d in found if not any(d.path.startswith(r + ".") for r in roots)]


def _leaf_difference(d: Difference) -> bool:
    presence = (ABSENT, "present")
    if any(isinstance(v, str) and v in presence for v in (d.real, d.simulated)):
        return False
    return is_marker(d.real) == is_marker(d.simulated)


def group_gpus(found: list[Difference]) -> list[Difference]:
    """``gpu[0].x`` and ``gpu[1].x`` with the same two values: one ``gpu[0,1].x``."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    first: dict[tuple[str, str, str], Difference] = {}
    out: list[Difference | tuple[str, str, str]] = []
    for d in found:
        m = _GPU_PATH.match(d.path)
        if m is None:
            out.append(d)
            continue
        key = (m.group(2), repr(d.real), repr(d.simulated))
        if key not in groups:
            groups[key], first[key] = [], d
            out.append(key)
        groups[key].append(int(m.group(1)))
    result: list[Difference] = []
    for item in out:
        if isinstance(item, Difference):
            result.append(item)
            continue
        indices = ",".join(str(i) for i in sorted(groups[item]))
        d = first[item]
        result.append(Difference(f"gpu[{indices}].{item[0]}", d.real, d.simulated))
    return result


# -- what the driver advertises ---------------------------------------------------------------


def rename_gpus(name: str, minors: Mapping[int, int]) -> str:
    """``gpu-<minor>…`` with the minor mapped (the simulator's minor -> the real GPU's)."""

    def swap(m: re.Match[str]) -> str:
        minor = int(m.group(1))
        return f"gpu-{minors.get(minor, minor)}"

    return _DEVICE_NAME.sub(swap, name)


def advertised_facts(
    model: DeviceModel, label: str, minors: Mapping[int, int] | None = None
) -> Facts:
    """``<label>.device[NAME]`` per device, with ``.attribute[NAME]`` (its type),
    ``.capacity[NAME]``, ``.consumes[SET].counter[NAME]``; ``<label>.counterSet[NAME]`` with
    ``.counter[NAME]``. Device and counter-set names use the real GPUs' minors (``minors`` maps
    the simulator's to them)."""
    m = minors or {}
    facts: Facts = {}
    for dev in model.devices:
        p = f"{label}.device[{rename_gpus(dev.name, m)}]"
        facts[p] = Fact("present")
        for name, typed in dev.attributes:
            facts[f"{p}.attribute[{name}]"] = Fact(",".join(sorted(typed)))
        for name, _ in dev.capacity:
            facts[f"{p}.capacity[{name}]"] = Fact("quantity")
        for counter_set, counters in dev.consumes_counters:
            for counter, _ in counters:
                c = f"{p}.consumes[{rename_gpus(counter_set, m)}].counter[{counter}]"
                facts[c] = Fact("quantity")
    for cs in model.counter_sets:
        p = f"{label}.counterSet[{rename_gpus(cs.name, m)}]"
        facts[p] = Fact("present")
        for counter, _ in cs.counters:
            facts[f"{p}.counter[{counter}]"] = Fact("quantity")
    return facts
