"""The counters a dynamic-MIG GPU advertises admit exactly the sets of devices that all of the
candidate counters (every engine, memory and memory slot) admit: what the scheduler allocates is
unchanged by leaving counters out (dra_driver/mig_counters.py)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from agent.nvml.types import MigProfile, Placement
from dra_driver.device_model import (
    AdvertisedDevice,
    DeviceModel,
    DevicePolicy,
    advertised_devices,
)
from dra_driver.mig_counters import candidate_counters, needed_counters, placement_amounts
from tests.dra_driver.conftest import Fits, Inventory, assert_pairs_fit_unless_they_clash
from tests.dra_driver.vm_inventories import passthrough

DYNAMIC = DevicePolicy(mig_mode="dynamic")
MIG_MODELS = ["dgx-a100", "dgx-h100", "hgx-h200", "mixed"]


def disjoint_sets(
    items: list[tuple[MigProfile, Placement]], start: int = 0
) -> Iterator[list[tuple[MigProfile, Placement]]]:
    """Every set of pairwise non-overlapping placements (by memory slot), the empty one too."""
    yield []
    for i in range(start, len(items)):
        slots = set(items[i][1].slots())
        later = [j for j in range(i + 1, len(items)) if not slots & set(items[j][1].slots())]
        for rest in disjoint_sets([items[j] for j in later]):
            yield [items[i], *rest]


def admitted(chosen: list[dict[str, int]], caps: dict[str, int], counters: set[str]) -> bool:
    return all(sum(a.get(c, 0) for a in chosen) <= caps[c] for c in counters)


@pytest.mark.parametrize("model_name", MIG_MODELS, ids=str)
def test_counters_left_out_never_refuse_what_the_others_admit(
    inventory: Inventory, model_name: str
) -> None:
    """Exhaustively, per GPU: every set of non-overlapping placements (and each with the whole
    GPU beside it) is admitted by the counters advertised exactly when the full candidate set
    admits it; two overlapping placements are refused by the slots advertised."""
    inv = inventory(model_name)
    kinds = {(g.device.mig_profiles, g.device.memory.total): g.device for g in inv.gpus}
    for d in (d for d in kinds.values() if d.mig_capable):  # one GPU of each kind
        caps = candidate_counters(d.mig_profiles, d.memory.total)
        kept = set(needed_counters(d.mig_profiles, d.memory.total))
        assert kept < set(caps)
        items = [(prof, p) for prof in d.mig_profiles for p in prof.placements]
        count = 0
        for chosen in disjoint_sets(items):
            amounts = [placement_amounts(prof, p) for prof, p in chosen]
            assert admitted(amounts, caps, kept) == admitted(amounts, caps, set(caps)), chosen
            if chosen:  # the whole GPU consumes every counter in full
                assert not admitted([*amounts, caps], caps, kept)
            count += 1
        assert count > 100
        for (pa, a), (pb, b) in itertools.combinations(items, 2):
            if set(a.slots()) & set(b.slots()):
                both = [placement_amounts(pa, a), placement_amounts(pb, b)]
                assert not admitted(both, caps, kept), (pa.name, a, pb.name, b)


def _profile(name: str, starts: tuple[int, ...], *, sms: int, max_instances: int) -> MigProfile:
    return MigProfile(
        profile_id=len(name),
        enum=0,
        name=name,
        slice_count=1,
        memory_bytes=1,
        multiprocessors=sms,
        copy_engines=0,
        decoders=0,
        encoders=0,
        jpeg_engines=0,
        ofa_engines=0,
        max_instances=max_instances,
        placements=tuple(Placement(start=s, size=1) for s in starts),
    )


def test_a_counter_some_layout_exceeds_is_kept() -> None:
    """Two 1-slot placements that do not overlap, but only one instance of the profile may
    exist: only the SM counter (the largest legal sum, 10) keeps them apart, so it stays."""
    profiles = (_profile("1g.1gb", (0, 1), sms=10, max_instances=1),)
    kept = needed_counters(profiles, 4)
    assert "multiprocessors" in kept
    caps = candidate_counters(profiles, 4)
    both = [placement_amounts(profiles[0], p) for p in profiles[0].placements]
    assert not admitted(both, caps, set(kept))
    # with two instances allowed nothing but the slots is needed
    free = (_profile("1g.1gb", (0, 1), sms=10, max_instances=2),)
    assert needed_counters(free, 4) == ("memory-slice-0", "memory-slice-1")


def _mig(model: DeviceModel, minor: int) -> list[AdvertisedDevice]:
    return [d for d in model.devices if d.kind == "mig" and d.gpu_minor == minor]


@pytest.mark.parametrize("model_name", ["dgx-h100", "hgx-h200"], ids=str)
def test_vfio_excludes_the_whole_gpu_and_every_placement(
    inventory: Inventory, fits: Fits, model_name: str
) -> None:
    model = advertised_devices(
        passthrough(inventory(model_name)),
        DevicePolicy(mig_mode="dynamic", virtualization="passthrough"),
    )
    vfio, whole = model.device("gpu-0-vfio"), model.device("gpu-0")
    assert fits(model, [vfio]) and not fits(model, [vfio, whole])
    for d in _mig(model, 0):
        assert fits(model, [d]) and not fits(model, [vfio, d]), d.name


@pytest.mark.parametrize("model_name", MIG_MODELS, ids=str)
def test_no_capacity_or_consumption_is_zero(inventory: Inventory, model_name: str) -> None:
    model = advertised_devices(inventory(model_name), DYNAMIC)
    for d in model.devices:
        assert all(int(q) > 0 for _, q in d.capacity), d.name
        for _, counters in d.consumes_counters:
            assert counters and all(int(q) > 0 for _, q in counters), d.name
    for cs in model.counter_sets:
        assert all(int(q) > 0 for _, q in cs.counters), cs.name


@pytest.mark.parametrize(
    "chosen",
    [("7g.40gb",), ("1g.5gb",), ("1g.5gb+me",), ("1g.5gb", "3g.20gb"), ("1g.10gb", "4g.20gb")],
    ids=",".join,
)
def test_chosen_profiles_still_keep_every_clash_apart(
    inventory: Inventory, fits: Fits, chosen: tuple[str, ...]
) -> None:
    """--mig-profiles: the counters are those the chosen profiles need (fewer), and they still
    refuse every overlapping pair, two +me instances, and the whole GPU beside any of them."""
    inv = passthrough(inventory("dgx-a100", "none"))  # MIG off: the whole GPU is offered too
    policy = DevicePolicy(mig_mode="dynamic", virtualization="passthrough", mig_profiles=chosen)
    # an A100 with MIG off offers no placements: look at them on one in MIG mode
    on = advertised_devices(
        inventory("dgx-a100"), DevicePolicy(mig_mode="dynamic", mig_profiles=chosen)
    )
    devs = _mig(on, 0)
    assert {str(dict(d.attributes)["profile"]["string"]) for d in devs} == set(chosen)
    whole = {c.name: c for c in on.counter_sets}["gpu-0-counter-set"]
    assert_pairs_fit_unless_they_clash(fits, on, devs)
    for d in devs:
        full = AdvertisedDevice(
            name="gpu-0", kind="gpu", gpu_index=0, gpu_minor=0, parent_uuid="", uuid=None,
            attributes=(), capacity=(), consumes_counters=((whole.name, whole.counters),),
        )  # fmt: skip
        assert not fits(on, [full, d]), d.name
    plain = advertised_devices(inv, policy)  # MIG off: whole GPU and vfio, still apart
    assert not fits(plain, [plain.device("gpu-0"), plain.device("gpu-0-vfio")])
