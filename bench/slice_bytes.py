"""How many bytes a node's ResourceSlices weigh, and what each cut of issue 25 saved.

:func:`cuts` rebuilds the pool as it was published before the cuts (every MIG device with all
of its GPU's attributes, every capacity and counter consumption, zeros included, every candidate
counter) from today's devices and the inventory, then applies the cuts one at a time and weighs
the pool after each (:func:`bench.common.pool_bytes`). The last step must weigh exactly what the
driver builds today: the function checks it, so the table cannot drift from the code."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

from agent.discovery.inventory import NodeInventory
from agent.sim.model import model_names
from bench.common import pool_bytes, simulated_inventory
from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.device_attributes import parent_attributes
from dra_driver.device_model import (
    MIG_LEFT_OUT,
    MIG_MODES,
    AdvertisedDevice,
    DeviceModel,
    DevicePolicy,
    advertised_devices,
)
from dra_driver.mig_counters import DIMENSIONS, candidate_counters, placement_amounts

DRIVER, NODE = "gpu.tessera.dev", "bench-node"
Slices = list[dict[str, Any]]

CUTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("zero capacities, consumptions and counters", ()),
    ("counters no set of devices can exceed (dra_driver/mig_counters.py)", ()),
    ("MIG: nvlinkClique (no P2P for MIG instances)", ("nvlinkClique",)),
    ("MIG: driverVersion, cudaDriverVersion (the node's)", ("driverVersion", "cudaDriverVersion")),
    ("MIG: brand, cudaComputeCapability (the product's)", ("brand", "cudaComputeCapability")),
    ("MIG: index (minor names the GPU)", ("index",)),
)
"""Each cut, in the order applied, with the MIG attributes it leaves out."""


def _devices(slices: Slices) -> Iterator[dict[str, Any]]:
    for s in slices:
        yield from s["spec"].get("devices", [])


def _counter_sets(slices: Slices) -> Iterator[dict[str, Any]]:
    for s in slices:
        yield from s["spec"].get("sharedCounters", [])


def _values(amounts: dict[str, int]) -> dict[str, dict[str, str]]:
    return {k: {"value": str(v)} for k, v in sorted(amounts.items())}


def _before(slices: Slices, model: DeviceModel, inv: NodeInventory) -> Slices:
    """The pool as the driver built it before the cuts, from what it builds now."""
    old = copy.deepcopy(slices)
    gpus = {g.device.minor: g for g in inv.gpus}
    full: dict[str, dict[str, int]] = {}
    for minor, g in gpus.items():
        if g.device.mig_capable and g.device.mig_profiles:
            name = f"gpu-{minor}-counter-set"
            full[name] = candidate_counters(g.device.mig_profiles, g.device.memory.total)
    for cs in _counter_sets(old):
        if cs["name"] in full and "memory-slice-0" in cs["counters"]:
            cs["counters"] = _values(full[cs["name"]])
    by_name: dict[str, AdvertisedDevice] = {d.name: d for d in model.devices}
    for api in _devices(old):
        dev = by_name[api["name"]]
        consumes = api.get("consumesCounters", [])
        if dev.kind != "mig":  # the whole GPU and vfio consume their whole (dynamic) set
            for c in consumes:
                if c["counterSet"] in full and "memory-slice-0" in c["counters"]:
                    c["counters"] = _values(full[c["counterSet"]])
            continue
        gpu = gpus[dev.gpu_minor]
        parent = parent_attributes(gpu, inv.system)
        api["attributes"] |= {k: v for k, v in parent.items() if k in MIG_LEFT_OUT}
        api["attributes"] = dict(sorted(api["attributes"].items()))
        profile = next(
            (p for p in gpu.device.mig_profiles if p.profile_id == dev.mig_profile_id), None
        )
        if profile is None:
            continue
        capacity = {cap: getattr(profile, field) for _, cap, field in DIMENSIONS}
        api["capacity"] = _values(capacity) | api["capacity"]
        api["capacity"] = dict(sorted(api["capacity"].items()))
        for c in consumes:
            placement = next(p for p in profile.placements if p.start == dev.mig_placement_start)
            c["counters"] = _values(placement_amounts(profile, placement))
    return old


def _drop_zeros(slices: Slices, _: Slices) -> None:
    for cs in _counter_sets(slices):
        cs["counters"] = {k: v for k, v in cs["counters"].items() if v["value"] != "0"}
    for d in _devices(slices):
        d["capacity"] = {k: v for k, v in d["capacity"].items() if v["value"] != "0"}
        for c in d.get("consumesCounters", []):
            c["counters"] = {k: v for k, v in c["counters"].items() if v["value"] != "0"}


def _keep_needed(slices: Slices, now: Slices) -> None:
    kept = {cs["name"]: set(cs["counters"]) for cs in _counter_sets(now)}
    for cs in _counter_sets(slices):
        cs["counters"] = {k: v for k, v in cs["counters"].items() if k in kept[cs["name"]]}
    for d in _devices(slices):
        for c in d.get("consumesCounters", []):
            names = kept[c["counterSet"]]
            c["counters"] = {k: v for k, v in c["counters"].items() if k in names}


def _leave_out(names: tuple[str, ...]) -> Callable[[Slices, Slices], None]:
    def cut(slices: Slices, _: Slices) -> None:
        for d in _devices(slices):
            if d["attributes"].get("type", {}).get("string") == "mig":
                for n in names:
                    d["attributes"].pop(n, None)

    return cut


def cuts(inv: NodeInventory, policy: DevicePolicy) -> list[tuple[str, int]]:
    """(step, the pool's bytes after it): "before" first, then each cut of :data:`CUTS`."""
    model = advertised_devices(inv, policy)
    now = build_slices(model, SlicePolicy(driver_name=DRIVER, node_name=NODE), 1)
    slices = _before(now, model, inv)
    out = [("before issue 25", pool_bytes(slices))]
    steps = [_drop_zeros, _keep_needed, *(_leave_out(names) for _, names in CUTS[2:])]
    for (label, _), step in zip(CUTS, steps, strict=True):
        step(slices, now)
        out.append((label, pool_bytes(slices)))
    if out[-1][1] != pool_bytes(now):
        raise AssertionError(
            f"the cuts give {out[-1][1]} bytes, the driver builds {pool_bytes(now)}"
        )
    return out


def every_model() -> list[tuple[str, str, int, int]]:
    """(model, --mig-mode, devices, the pool's bytes) for every simulated model and mode."""
    out = []
    for name in model_names():
        with simulated_inventory(name) as inv:
            for mode in MIG_MODES:
                model = advertised_devices(inv, DevicePolicy(driver_name=DRIVER, mig_mode=mode))
                slices = build_slices(model, SlicePolicy(driver_name=DRIVER, node_name=NODE), 1)
                out.append((name, mode, len(model.devices), pool_bytes(slices)))
    return out
