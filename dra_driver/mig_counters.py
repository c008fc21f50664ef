"""Which counters a MIG-capable GPU's counter set needs, and what each placement consumes.

Dynamic MIG (``--mig-mode dynamic``) advertises every profile x placement of a GPU, and the whole
GPU, as devices consuming one counter set per GPU (``gpu-<minor>-counter-set``); the scheduler
allocates a set of devices only when, for every counter, the sum of what they consume is at most
the counter's value (KEP-4815, partitionable devices). The counters must admit exactly the sets of
placements the GPU can hold at once, and refuse the whole GPU beside any placement.

The candidates:

``memory-slice-<i>`` = 1, one per memory slot
    a placement consumes 1 of each slot it occupies, so two placements sharing a slot never fit;
``multiprocessors``, ``copy-engines``, ``decoders``, ``encoders``, ``jpeg-engines``,
``ofa-engines``, ``memory``
    the profile's amounts. The inventory has no whole-GPU SM or engine totals, so each value is
    the largest sum any set of pairwise non-overlapping placements reaches within every profile's
    ``max_instances`` (every legal layout fits by construction; it keeps ``ofa-engines`` at 1
    where only one ``+me`` instance may exist); ``memory`` is the GPU's total bytes (or that
    largest sum, should it ever be greater).

Most of them never refuse anything the slot counters do not already refuse: on an A100 no set of
non-overlapping placements has more SMs, copy engines or memory than the GPU, and once
``ofa-engines`` keeps to one ``+me`` instance, none has more decoders or JPEG engines either.
:func:`needed_counters` proves it per GPU, from NVML's placements: it drops a counter only when an
exhaustive search over every set of devices the remaining counters admit (the whole GPU, which
consumes every counter in full, included) finds none that the dropped counter would refuse. The
sets admitted are then exactly those admitted before (each drop admits nothing new), so what the
scheduler allocates is unchanged; a counter a device consumes 0 of is not written either. On the
simulated A100, H100 and H200 what is left is ``memory-slice-0`` to ``-6`` (slot 7 is only ever
taken with slot 6) and ``ofa-engines``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping, Sequence

from agent.nvml.types import GpuDevice, MigProfile, Placement
from dra_driver.device_types import CounterSet, Quantities, counter_set_name, quantities

# (counter name: a DNS label, capacity name: a C identifier, MigProfile attribute)
DIMENSIONS: tuple[tuple[str, str, str], ...] = (
    ("multiprocessors", "multiprocessors", "multiprocessors"),
    ("copy-engines", "copyEngines", "copy_engines"),
    ("decoders", "decoders", "decoders"),
    ("encoders", "encoders", "encoders"),
    ("jpeg-engines", "jpegEngines", "jpeg_engines"),
    ("ofa-engines", "ofaEngines", "ofa_engines"),
)


def slot_counter(slot: int) -> str:
    """``memory-slice-<slot>``."""
    return f"memory-slice-{slot}"


def memory_slots(profiles: tuple[MigProfile, ...]) -> int:
    """Number of memory slices: the end of the furthest placement (8 on A100/H100/H200)."""
    return max((p.start + p.size for prof in profiles for p in prof.placements), default=0)


def _profile_amounts(profile: MigProfile) -> dict[str, int]:
    amounts = {counter: getattr(profile, field) for counter, _, field in DIMENSIONS}
    amounts["memory"] = profile.memory_bytes
    return amounts


def placement_amounts(profile: MigProfile, placement: Placement) -> dict[str, int]:
    """What a placement consumes of every candidate counter (zeros included)."""
    if placement.size < 1:
        raise ValueError(f"MIG profile {profile.name}: placement {placement} has no memory slot")
    return _profile_amounts(profile) | {slot_counter(s): 1 for s in placement.slots()}


@functools.cache
def _max_layout_sums(profiles: tuple[MigProfile, ...]) -> Mapping[str, int]:
    """Per dimension, the largest sum over sets of non-overlapping placements within every
    profile's ``max_instances``. Enumerates the sets slot by slot (a few thousand per GPU)."""
    slots = memory_slots(profiles)
    starting: dict[int, list[tuple[int, MigProfile, int]]] = {s: [] for s in range(slots)}
    for i, prof in enumerate(profiles):
        for p in prof.placements:
            starting[p.start].append((i, prof, p.size))
    best = dict.fromkeys(_profile_amounts(profiles[0]) if profiles else (), 0)
    counts = [0] * len(profiles)

    def walk(slot: int, sums: dict[str, int]) -> None:
        for k, v in sums.items():
            best[k] = max(best[k], v)
        if slot >= slots:
            return
        walk(slot + 1, sums)
        for i, prof, size in starting[slot]:
            if counts[i] >= prof.max_instances:
                continue
            counts[i] += 1
            amounts = _profile_amounts(prof)
            walk(slot + size, {k: v + amounts[k] for k, v in sums.items()})
            counts[i] -= 1

    walk(0, dict.fromkeys(best, 0))
    return types.MappingProxyType(best)  # cached and shared: read-only


def candidate_counters(profiles: tuple[MigProfile, ...], total_memory: int) -> dict[str, int]:
    """Every candidate counter and its value (see the module docstring), zeros included."""
    values = dict(_max_layout_sums(profiles))
    values["memory"] = max(values.get("memory", 0), total_memory)
    for slot in range(memory_slots(profiles)):
        values[slot_counter(slot)] = 1
    return values


def _dominated_slots(profiles: tuple[MigProfile, ...]) -> set[int]:
    """Memory slots whose counter never refuses what another slot's does not: every placement
    on slot ``s`` is also on a slot ``t`` kept (the slot counters are 1, so two placements that
    share ``s`` share ``t`` too; the whole GPU takes every slot). Checked from the last slot down,
    against the slots not dropped before it (on A100/H100/H200: slot 7, only taken with 6)."""
    slots = memory_slots(profiles)
    covering = {s: set() for s in range(slots)}  # type: dict[int, set[tuple[int, int]]]
    for prof in profiles:
        for p in prof.placements:
            for s in p.slots():
                covering[s].add((prof.profile_id, p.start))
    dropped: set[int] = set()
    for s in reversed(range(slots)):
        if any(t != s and t not in dropped and covering[s] <= covering[t] for t in range(slots)):
            dropped.add(s)
    return dropped


def _exceeds(
    profiles: tuple[MigProfile, ...], caps: Mapping[str, int], kept: Sequence[str], tested: str
) -> bool:
    """Whether some set of pairwise non-overlapping placements fits every counter in ``kept``
    yet sums above ``tested``'s value. A walk slot by slot (skip the slot, or start one of the
    placements that start there), each branch cut as soon as a kept counter is exceeded (what
    a placement consumes is never negative). The whole GPU needs no walk: it overlaps every
    placement, and alone it consumes each counter's value exactly. Hand-written: a few thousand
    sets per GPU, no solver needed."""
    slots = memory_slots(profiles)
    starting: dict[int, list[tuple[int, list[int], int]]] = {s: [] for s in range(slots)}
    for prof in profiles:
        amounts = _profile_amounts(prof)
        for p in prof.placements:
            starting[p.start].append((p.size, [amounts[k] for k in kept], amounts[tested]))
    kept_caps = [caps[k] for k in kept]
    cap = caps[tested]
    # the most ``tested`` the slots from s on can still add, whatever is kept: a branch that
    # cannot pass the value with it is cut (a bound, so the answer is the same)
    reach = [0] * (slots + 1)
    for s in reversed(range(slots)):
        reach[s] = max([reach[s + 1]] + [e + reach[s + n] for n, _, e in starting[s]])

    def walk(slot: int, sums: list[int], total: int) -> bool:
        if total > cap:
            return True
        if slot >= slots or total + reach[slot] <= cap:
            return False
        for size, amounts, extra in starting[slot]:
            added = [a + b for a, b in zip(sums, amounts, strict=True)]
            if all(a <= c for a, c in zip(added, kept_caps, strict=True)) and walk(
                slot + size, added, total + extra
            ):
                return True
        return walk(slot + 1, sums, total)

    return walk(0, [0] * len(kept), 0)


@functools.cache
def needed_counters(profiles: tuple[MigProfile, ...], total_memory: int) -> tuple[str, ...]:
    """The candidate counters the scheduler needs, sorted: the memory slots but those
    :func:`_dominated_slots` finds, and of the engine and memory counters, taken one at a time,
    those that some set the others admit would exceed (:func:`_exceeds`)."""
    caps = candidate_counters(profiles, total_memory)
    dominated = _dominated_slots(profiles)
    slots = [slot_counter(s) for s in range(memory_slots(profiles)) if s not in dominated]
    kept = ["memory", *(counter for counter, _, _ in DIMENSIONS)]
    for counter in list(kept):
        others = [k for k in kept if k != counter]
        if not _exceeds(profiles, caps, others, counter):
            kept = others
    return tuple(sorted(slots + kept))


def gpu_counter_set(
    device: GpuDevice, profiles: tuple[MigProfile, ...] | None = None
) -> CounterSet:
    """The dynamic-MIG counter set of one MIG-capable GPU, for the placements of ``profiles``
    (unset: all of the GPU's; ``--mig-profiles`` can offer fewer): the counters they need. With
    no profile offered, one ``memory`` counter, all of it (the whole GPU and its vfio device
    still exclude each other)."""
    profiles = device.mig_profiles if profiles is None else profiles
    if not profiles:
        return CounterSet(
            name=counter_set_name(device.minor),
            counters=quantities({"memory": device.memory.total}),
        )
    caps = candidate_counters(profiles, device.memory.total)
    kept = needed_counters(profiles, device.memory.total)
    return CounterSet(
        name=counter_set_name(device.minor), counters=quantities({k: caps[k] for k in kept})
    )


def placement_consumption(
    counters: CounterSet, profile: MigProfile, placement: Placement
) -> tuple[tuple[str, Quantities], ...]:
    """What a placement consumes of its GPU's counter set: the counters kept, zeros left out."""
    amounts = placement_amounts(profile, placement)
    used = {c: amounts[c] for c, _ in counters.counters if amounts.get(c, 0) > 0}
    return ((counters.name, quantities(used)),)
