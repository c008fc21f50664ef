"""NodeInventory + policy -> advertised devices and counter sets."""

from __future__ import annotations

import dataclasses

import pytest

from agent.sim.model import model_names
from dra_driver.device_attributes import bounded, semver
from dra_driver.device_model import (
    GIB,
    AdvertisedDevice,
    DeviceModel,
    DevicePolicy,
    advertised_devices,
    mig_device_name,
)
from tests.dra_driver.conftest import Fits, Inventory, assert_pairs_fit_unless_they_clash

STATIC = DevicePolicy(mig_mode="static")
DYNAMIC = DevicePolicy(mig_mode="dynamic")

# NVIDIA's MIG tables (A100/H100/H200): profile id -> (placement starts, size).
PLACEMENTS = {
    19: ((0, 1, 2, 3, 4, 5, 6), 1),
    20: ((0, 1, 2, 3, 4, 5, 6), 1),
    15: ((0, 2, 4, 6), 2),
    14: ((0, 2, 4), 2),
    9: ((0, 4), 4),
    5: ((0,), 4),
    0: ((0,), 8),
}

# Legal full layouts as (profile id, placement start).
LAYOUTS = {
    "7x1g": [(19, s) for s in range(7)],
    "3g+2g+1g+1g": [(14, 0), (19, 2), (19, 3), (9, 4)],
    "4g+3g": [(5, 0), (9, 4)],
    "3g+3g": [(9, 0), (9, 4)],
    "2g+2g+2g+1g": [(14, 0), (14, 2), (14, 4), (19, 6)],
    "4x1g-2slot": [(15, s) for s in (0, 2, 4, 6)],
    "2g+2g+2g+1g+me": [(14, 0), (14, 2), (14, 4), (20, 6)],
    "7g": [(0, 0)],
}
MIG_MODELS = ["dgx-a100", "dgx-h100", "hgx-h200", "mixed"]


def attrs(dev: AdvertisedDevice) -> dict[str, object]:
    """Attribute name -> plain value."""
    return {k: next(iter(v.values())) for k, v in dev.attributes}


def caps(dev: AdvertisedDevice) -> dict[str, int]:
    return {k: int(q) for k, q in dev.capacity}


def mig_devices(model: DeviceModel, minor: int) -> list[AdvertisedDevice]:
    return [d for d in model.devices if d.kind == "mig" and d.gpu_minor == minor]


def placement(model: DeviceModel, minor: int, profile_id: int, start: int) -> AdvertisedDevice:
    for d in mig_devices(model, minor):
        if d.mig_profile_id == profile_id and d.mig_placement_start == start:
            return d
    raise KeyError((minor, profile_id, start))


# --- naming and value helpers ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("550.90.07", "550.90.7"),
        ("12.4", "12.4.0"),
        ("9.0", "9.0.0"),
        ("535.104.05", "535.104.5"),
        ("560", "560.0.0"),
        ("1.2.3.4", "1.2.3+4"),
        ("r550", None),
        ("", None),
    ],
    ids=lambda v: str(v),
)
def test_semver(raw: str, want: str | None) -> None:
    assert semver(raw) == want


@pytest.mark.parametrize(
    ("args", "want"),
    [
        ((0, "1g.5gb", 19, 0), "gpu-0-mig-1g5gb-19-0"),
        ((0, "1g.5gb+me", 20, 3), "gpu-0-mig-1g5gbme-20-3"),
        ((7, "7g.141gb", 0, 0), "gpu-7-mig-7g141gb-0-0"),
    ],
    ids=["1g", "plus-me", "7g"],
)
def test_mig_device_name(args: tuple[int, str, int, int], want: str) -> None:
    assert mig_device_name(*args) == want


def test_bounded_keeps_short_strings_and_hashes_long_ones() -> None:
    assert bounded("clique-0-1") == "clique-0-1"
    long_a, long_b = "x" * 80 + "a", "x" * 80 + "b"
    assert len(bounded(long_a)) == 64
    assert bounded(long_a) != bounded(long_b)
    assert bounded(long_a) == bounded(long_a)


def test_unknown_mig_mode_is_rejected(inventory: Inventory) -> None:
    with pytest.raises(ValueError, match="mig_mode"):
        advertised_devices(inventory("l40s-pcie"), DevicePolicy(mig_mode="auto"))


def test_device_lookup(inventory: Inventory) -> None:
    model = advertised_devices(inventory("dgx-h100"), STATIC)
    assert model.device("gpu-3").gpu_minor == 3
    with pytest.raises(KeyError):
        model.device("gpu-99")


# --- static MIG and whole GPUs --------------------------------------------------------------


def test_static_dgx_a100_balanced_advertises_only_mig_devices(inventory: Inventory) -> None:
    inv = inventory("dgx-a100", "balanced")
    model = advertised_devices(inv, STATIC)
    assert model.counter_sets == ()
    assert all(d.kind == "mig" for d in model.devices)
    for gpu in inv.gpus:
        m = gpu.device.minor
        devs = mig_devices(model, m)
        assert [d.name for d in devs] == [
            f"gpu-{m}-mig-1g5gb-19-{devs[0].mig_placement_start}",
            f"gpu-{m}-mig-1g5gb-19-{devs[1].mig_placement_start}",
            f"gpu-{m}-mig-2g10gb-14-{devs[2].mig_placement_start}",
            f"gpu-{m}-mig-3g20gb-9-{devs[3].mig_placement_start}",
        ]
        assert [attrs(d)["profile"] for d in devs] == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
        by_uuid = {i.uuid: i for i in gpu.device.mig_instances}
        for d in devs:
            a = attrs(d)
            inst = by_uuid[str(a["uuid"])]
            assert (d.uuid, d.gpu_instance_id) == (inst.uuid, inst.gpu_instance_id)
            assert d.mig_placement_start == inst.placement.start
            assert a["type"] == "mig" and a["parentUUID"] == gpu.device.uuid
            assert a["productName"] == "NVIDIA A100-SXM4-40GB" and a["minor"] == m
            assert caps(d)["memory"] == inst.memory_bytes
            assert not d.consumes_counters
        assert caps(devs[0]) == {  # a 1g.5gb has no decoder, encoder, JPEG or OFA: left out
            "multiprocessors": 14,
            "copyEngines": 1,
            "memory": 5100273664,
        }
        assert caps(devs[3])["multiprocessors"] == 42


def test_static_dgx_h100_all_1g(inventory: Inventory) -> None:
    model = advertised_devices(inventory("dgx-h100", "all-1g"), STATIC)
    assert len(model.devices) == 8 * 7
    assert [d.name for d in mig_devices(model, 2)] == [f"gpu-2-mig-1g10gb-19-{s}" for s in range(7)]


def test_static_dgx_h100_whole_gpus(inventory: Inventory) -> None:
    inv = inventory("dgx-h100")
    model = advertised_devices(inv, STATIC)
    assert [d.name for d in model.devices] == [f"gpu-{i}" for i in range(8)]
    gpu0 = model.device("gpu-0")
    assert attrs(gpu0) == {
        "type": "gpu",
        "uuid": inv.gpus[0].device.uuid,
        "productName": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia",
        "architecture": "Hopper",
        "cudaComputeCapability": "9.0.0",
        "driverVersion": "550.90.7",
        "cudaDriverVersion": "12.4.0",
        "index": 0,
        "minor": 0,
        "resource.kubernetes.io/pciBusID": "0000:1b:00.0",
        "resource.kubernetes.io/pcieRoot": "pci0000:16",
        "resource.kubernetes.io/numaNode": 0,
        "nvlinkClique": "clique-0-1-2-3-4-5-6-7",
        "nvlinkLinks": 18,
        "sharing": "none",  # the node's --sharing
        # the GPU's power-limit range and default from NVML, in watts (H100 SXM: 200..700 W)
        "powerLimitMinWatts": 200,
        "powerLimitMaxWatts": 700,
        "powerLimitDefaultWatts": 700,
    }
    assert dict(gpu0.attributes)["cudaComputeCapability"] == {"version": "9.0.0"}
    assert dict(gpu0.attributes)["index"] == {"int": 0}
    assert caps(gpu0) == {"memory": 85520809984}
    assert (gpu0.uuid, gpu0.parent_uuid, gpu0.mig_profile_id) == (
        inv.gpus[0].device.uuid,
        inv.gpus[0].device.uuid,
        None,
    )
    assert attrs(model.device("gpu-7"))["resource.kubernetes.io/numaNode"] == 1


def test_api_object_shape(inventory: Inventory) -> None:
    model = advertised_devices(inventory("dgx-h100"), STATIC)
    obj = model.device("gpu-0").api()
    assert set(obj) == {"name", "attributes", "capacity"}
    assert obj["capacity"] == {"memory": {"value": "85520809984"}}
    assert obj["attributes"]["nvlinkLinks"] == {"int": 18}  # type: ignore[index]


@pytest.mark.parametrize("mode", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_l40s_has_no_clique(inventory: Inventory, mode: DevicePolicy) -> None:
    model = advertised_devices(inventory("l40s-pcie"), mode)
    assert [d.name for d in model.devices] == [f"gpu-{i}" for i in range(4)]
    assert model.counter_sets == ()
    for d in model.devices:
        assert "nvlinkClique" not in attrs(d)
        assert attrs(d)["nvlinkLinks"] == 0
        assert attrs(d)["architecture"] == "Ada Lovelace"
        assert attrs(d)["cudaComputeCapability"] == "8.9.0"


def test_mixed_clique_only_on_the_a100_pair(inventory: Inventory) -> None:
    model = advertised_devices(inventory("mixed"), STATIC)
    cliques = {d.name: attrs(d).get("nvlinkClique") for d in model.devices}
    assert cliques == {"gpu-0": "clique-0-1", "gpu-1": "clique-0-1", "gpu-2": None, "gpu-3": None}


@pytest.mark.parametrize("model_name", model_names(), ids=str)
@pytest.mark.parametrize("mode", [STATIC, DYNAMIC], ids=["static", "dynamic"])
def test_order_and_determinism(inventory: Inventory, model_name: str, mode: DevicePolicy) -> None:
    inv = inventory(model_name)
    model = advertised_devices(inv, mode)
    assert model == advertised_devices(inv, mode)

    def key(d: AdvertisedDevice) -> tuple[int, int, int, int, int]:
        if d.kind == "gpu":
            return (d.gpu_minor, 0, 0, 0, 0)
        g = inv.gpu(d.gpu_index).device
        slices = next(p.slice_count for p in g.mig_profiles if p.profile_id == d.mig_profile_id)
        return (d.gpu_minor, 1, slices, d.mig_profile_id or 0, d.mig_placement_start or 0)

    assert list(model.devices) == sorted(model.devices, key=key)
    names = [d.name for d in model.devices]
    assert len(names) == len(set(names))


# --- dynamic MIG -----------------------------------------------------------------------------


def whole_gpu(model: DeviceModel, minor: int) -> AdvertisedDevice:
    """The whole GPU, or on an A100 in MIG mode (not offered whole) what it would consume: its
    entire counter set (so the counter model is checked on every MIG GPU)."""
    try:
        return model.device(f"gpu-{minor}")
    except KeyError:
        (cs,) = [c for c in model.counter_sets if c.name == f"gpu-{minor}-counter-set"]
        any_mig = mig_devices(model, minor)[0]
        return dataclasses.replace(
            any_mig, name=f"gpu-{minor}", kind="gpu", consumes_counters=((cs.name, cs.counters),)
        )


@pytest.mark.parametrize(
    ("model_name", "layout", "whole", "placements"),
    [
        ("dgx-a100", "balanced", False, True),  # Ampere in MIG mode: leaving it needs a reset
        ("dgx-a100", "none", True, False),  # Ampere, MIG off: entering it needs a reset
        ("dgx-h100", "balanced", True, True),  # Hopper switches when idle: both
        ("dgx-h100", "none", True, True),
    ],
    ids=["a100-mig", "a100-no-mig", "h100-mig", "h100-no-mig"],
)
def test_dynamic_mode_offers_what_the_gpu_can_switch_to(
    inventory: Inventory, model_name: str, layout: str, whole: bool, placements: bool
) -> None:
    model = advertised_devices(inventory(model_name, layout), DYNAMIC)
    names = {d.name for d in model.devices}
    assert ("gpu-0" in names) == whole
    assert bool(mig_devices(model, 0)) == placements
    assert next(cs.name for cs in model.counter_sets) == "gpu-0-counter-set"


@pytest.mark.parametrize("sharing", ["time-slicing", "memory-shares"])
def test_sharing_lets_several_claims_allocate_a_whole_gpu(
    inventory: Inventory, sharing: str
) -> None:
    policy = DevicePolicy(sharing=sharing, memory_share_min=2 * GIB, memory_share_step=GIB)
    model = advertised_devices(inventory("dgx-h100"), policy)
    api = model.device("gpu-0").api()
    assert api["allowMultipleAllocations"] is True
    memory = api["capacity"]["memory"]  # type: ignore[index]
    if sharing == "memory-shares":
        assert memory["requestPolicy"] == {
            "default": str(2 * GIB),
            "validRange": {"min": str(2 * GIB), "step": str(GIB)},
        }
    else:
        assert "requestPolicy" not in memory
    plain = advertised_devices(inventory("dgx-h100"), DevicePolicy()).device("gpu-0").api()
    assert "allowMultipleAllocations" not in plain


@pytest.mark.parametrize("mig_mode", ["static", "dynamic"])
@pytest.mark.parametrize("sharing", ["none", "time-slicing", "memory-shares"])
def test_whole_gpus_carry_the_sharing_mode_their_node_prepares(
    inventory: Inventory, sharing: str, mig_mode: str
) -> None:
    """The attribute classes select on (deploy/daemonset/deviceclasses.yaml): every whole GPU
    says the node's --sharing, MIG devices (never shared between claims) say nothing."""
    model = advertised_devices(
        inventory("dgx-h100"), DevicePolicy(mig_mode=mig_mode, sharing=sharing)
    )
    for d in model.devices:
        assert attrs(d).get("sharing") == (sharing if d.kind == "gpu" else None), d.name
    assert {d.kind for d in model.devices} == ({"gpu", "mig"} if mig_mode == "dynamic" else {"gpu"})


@pytest.mark.parametrize("model_name", ["dgx-a100", "dgx-h100"], ids=str)
def test_dynamic_placements_match_the_tables(inventory: Inventory, model_name: str) -> None:
    inv = inventory(model_name)
    model = advertised_devices(inv, DYNAMIC)
    for gpu in inv.gpus:
        m = gpu.device.minor
        if gpu.device.architecture != "Ampere":  # an A100 in MIG mode is not offered whole
            whole = model.device(f"gpu-{m}")
            assert whole.kind == "gpu" and whole.consumes_counters
        found: dict[int, list[tuple[int, int]]] = {}
        for d in mig_devices(model, m):
            assert d.mig_profile_id is not None and d.mig_placement_start is not None
            assert d.uuid is None and d.gpu_instance_id is None
            assert "uuid" not in attrs(d) and attrs(d)["parentUUID"] == gpu.device.uuid
            found.setdefault(d.mig_profile_id, []).append(
                (d.mig_placement_start, d.mig_placement_size or 0)
            )
        want = {pid: [(s, size) for s in starts] for pid, (starts, size) in PLACEMENTS.items()}
        assert found == want


def test_dynamic_counter_values(inventory: Inventory) -> None:
    a100 = advertised_devices(inventory("dgx-a100"), DYNAMIC)
    h100 = advertised_devices(inventory("dgx-h100"), DYNAMIC)
    assert len(a100.counter_sets) == 8
    # slot 7 is only ever taken with slot 6; no set of non-overlapping placements has more SMs,
    # engines or memory than the GPU, and none more decoders or JPEG engines once ofa-engines
    # keeps to one +me instance (dra_driver/mig_counters.py proves it per GPU)
    slices = {f"memory-slice-{i}": "1" for i in range(7)}
    assert dict(a100.counter_sets[0].counters) == {"ofa-engines": "1", **slices}
    assert h100.counter_sets[3].name == "gpu-3-counter-set"
    assert dict(h100.counter_sets[3].counters) == {"ofa-engines": "1", **slices}
    for cs in a100.counter_sets:
        assert [c for c, _ in cs.counters] == sorted(c for c, _ in cs.counters)


@pytest.mark.parametrize("model_name", MIG_MODELS, ids=str)
def test_overlapping_placements_never_fit_together(
    inventory: Inventory, fits: Fits, model_name: str
) -> None:
    model = advertised_devices(inventory(model_name), DYNAMIC)
    minor = 0
    devs = mig_devices(model, minor)
    whole = whole_gpu(model, minor)
    assert fits(model, [whole])
    for d in devs:
        assert fits(model, [d]), d.name
        assert not fits(model, [whole, d]), d.name
    assert_pairs_fit_unless_they_clash(fits, model, devs)


def test_counters_of_one_gpu_do_not_limit_another(inventory: Inventory, fits: Fits) -> None:
    model = advertised_devices(inventory("dgx-h100"), DYNAMIC)
    assert fits(model, [model.device("gpu-0"), model.device("gpu-1-mig-7g80gb-0-0")])


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=str)
@pytest.mark.parametrize("model_name", MIG_MODELS, ids=str)
def test_every_legal_full_layout_fits(
    inventory: Inventory, fits: Fits, model_name: str, layout: str
) -> None:
    model = advertised_devices(inventory(model_name), DYNAMIC)
    for minor in {d.gpu_minor for d in model.devices if d.kind == "mig"}:
        devs = [placement(model, minor, pid, start) for pid, start in LAYOUTS[layout]]
        assert fits(model, devs), (minor, [d.name for d in devs])
        # The layout is full: the whole GPU no longer fits next to it.
        assert not fits(model, [*devs, whole_gpu(model, minor)])


def test_dynamic_mixed_non_mig_gpus_stay_plain(inventory: Inventory) -> None:
    model = advertised_devices(inventory("mixed"), DYNAMIC)
    assert [cs.name for cs in model.counter_sets] == ["gpu-0-counter-set", "gpu-1-counter-set"]
    for name in ("gpu-2", "gpu-3"):
        assert model.device(name).consumes_counters == ()
    assert len(mig_devices(model, 2)) == 0


def test_dynamic_ignores_existing_instances(inventory: Inventory) -> None:
    """MIG is enabled with a layout on dgx-a100: dynamic mode still offers every placement."""
    inv = inventory("dgx-a100", "balanced")
    assert inv.gpus[0].device.mig_instances
    model = advertised_devices(inv, DYNAMIC)
    assert len(mig_devices(model, 0)) == sum(len(s) for s, _ in PLACEMENTS.values())
