"""DeviceModel -> ResourceSlice objects: schema-valid, within the limits, in both layouts."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import pytest

from agent.sim.model import model_names
from dra_driver.advertise.slice_limits import (
    check_pool,
    check_slice,
    is_dns_label,
    is_dns_subdomain,
)
from dra_driver.advertise.slices import SlicePolicy, build_slices, slice_name, spec_equal
from dra_driver.device_model import (
    AdvertisedDevice,
    CounterSet,
    DeviceModel,
    DevicePolicy,
    advertised_devices,
)
from tests.dra_driver.conftest import Inventory
from tests.k8sschema import validate as validate_k8s

DRIVER = "gpu.tessera.dev"
VERSIONS = ("1.34.0", "1.35.0")
CASES = [(m, None) for m in model_names()] + [("dgx-h100", "all-1g"), ("dgx-h100", "balanced")]


def policy(node: str = "node-a", layout: str = "1.35", uid: str | None = "uid-1") -> SlicePolicy:
    return SlicePolicy(driver_name=DRIVER, node_name=node, node_uid=uid, layout=layout)


def plain_device(i: int) -> AdvertisedDevice:
    return AdvertisedDevice(
        name=f"gpu-{i}",
        kind="gpu",
        gpu_index=i,
        gpu_minor=i,
        parent_uuid=f"GPU-{i}",
        uuid=f"GPU-{i}",
        mig_profile_id=None,
        mig_placement_start=None,
        mig_placement_size=None,
        gpu_instance_id=None,
        compute_instance_id=None,
        attributes=(("type", {"string": "gpu"}),),
        capacity=(("memory", "1024"),),
    )


@pytest.mark.parametrize("layout", ["1.34", "1.35"], ids=lambda v: f"layout-{v}")
@pytest.mark.parametrize("mode", ["static", "dynamic"], ids=str)
@pytest.mark.parametrize(
    ("model_name", "mig_layout"), CASES, ids=[f"{m}-{lay or 'default'}" for m, lay in CASES]
)
def test_every_slice_is_valid(
    inventory: Inventory, model_name: str, mig_layout: str | None, mode: str, layout: str
) -> None:
    inv = inventory(model_name, mig_layout)
    model = advertised_devices(inv, DevicePolicy(mig_mode=mode))
    slices = build_slices(model, policy(inv.hostname, layout), generation=7)
    for obj in slices:
        for version in VERSIONS:
            validate_k8s(obj, version)
        assert check_slice(obj, layout) == []
        assert obj["spec"]["pool"] == {
            "name": inv.hostname,
            "generation": 7,
            "resourceSliceCount": len(slices),
        }
        assert is_dns_subdomain(obj["metadata"]["name"])
    assert check_pool(slices, layout) == []
    names = [d["name"] for s in slices for d in s["spec"].get("devices", [])]
    assert all(is_dns_label(n) for n in names)
    assert len(names) == len(set(names)) == len(model.devices)
    assert names == [d.name for d in model.devices] or layout == "1.34"
    assert len({s["metadata"]["name"] for s in slices}) == len(slices)
    # Determinism: the same inventory builds the same objects.
    again = build_slices(
        advertised_devices(inv, DevicePolicy(mig_mode=mode)),
        policy(inv.hostname, layout),
        generation=7,
    )
    assert again == slices


def test_dynamic_135_counters_first(inventory: Inventory) -> None:
    model = advertised_devices(inventory("dgx-a100"), DevicePolicy(mig_mode="dynamic"))
    slices = build_slices(model, policy(), 1)
    first = slices[0]["spec"]
    assert "devices" not in first and len(first["sharedCounters"]) == 8
    assert all("sharedCounters" not in s["spec"] for s in slices[1:])
    # an A100 in MIG mode offers its 25 placements, not itself (leaving MIG needs a reset)
    assert [len(s["spec"]["devices"]) for s in slices[1:]] == [
        50,
        50,
        50,
        50,
    ]  # two whole GPUs each


def test_dynamic_134_one_counter_set_per_slice(inventory: Inventory) -> None:
    model = advertised_devices(inventory("mixed", "balanced"), DevicePolicy(mig_mode="dynamic"))
    slices = build_slices(model, policy(layout="1.34"), 1)
    assert len(slices) == 3
    for s in slices[:2]:
        (cs,) = s["spec"]["sharedCounters"]
        assert len(s["spec"]["devices"]) == 25  # the A100s are in MIG mode: placements only
        for d in s["spec"]["devices"]:
            assert [c["counterSet"] for c in d["consumesCounters"]] == [cs["name"]]
    assert [d["name"] for d in slices[2]["spec"]["devices"]] == ["gpu-2", "gpu-3"]
    assert "sharedCounters" not in slices[2]["spec"]


def test_many_counter_sets_split_by_eight(inventory: Inventory) -> None:
    model = advertised_devices(inventory("dgx-h100"), DevicePolicy(mig_mode="dynamic"))
    sets = tuple(
        dataclasses.replace(cs, name=f"gpu-{i}-counter-set")
        for i, cs in enumerate(model.counter_sets * 3)
    )
    slices = build_slices(DeviceModel(devices=(), counter_sets=sets), policy(), 1)
    assert [len(s["spec"]["sharedCounters"]) for s in slices] == [8, 8, 8]
    assert check_pool(slices, "1.35") == []


def test_plain_devices_chunk_at_128() -> None:
    model = DeviceModel(devices=tuple(plain_device(i) for i in range(300)), counter_sets=())
    for layout in ("1.34", "1.35"):
        slices = build_slices(model, policy(layout=layout), 2)
        assert [len(s["spec"]["devices"]) for s in slices] == [128, 128, 44]
        assert check_pool(slices, layout) == []


@pytest.mark.parametrize("layout", ["1.34", "1.35"], ids=str)
def test_empty_model_still_publishes_one_slice(layout: str) -> None:
    slices = build_slices(DeviceModel(devices=(), counter_sets=()), policy(layout=layout), 0)
    assert len(slices) == 1
    assert slices[0]["spec"]["devices"] == []
    assert "sharedCounters" not in slices[0]["spec"]
    for version in VERSIONS:
        validate_k8s(slices[0], version)
    assert check_slice(slices[0], layout) == []


def test_metadata_owner_and_labels() -> None:
    model = DeviceModel(devices=(plain_device(0),), counter_sets=())
    (owned,) = build_slices(model, policy(uid="abc"), 1)
    assert owned["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "abc", "controller": True}
    ]
    assert owned["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "tessera"}
    assert re.fullmatch(r"node-a-gpu-tessera-dev-[0-9a-f]{8}-0", owned["metadata"]["name"])
    (unowned,) = build_slices(model, policy(uid=None), 1)
    assert "ownerReferences" not in unowned["metadata"]


def test_bad_arguments_are_rejected() -> None:
    model = DeviceModel(devices=(), counter_sets=())
    with pytest.raises(ValueError, match="layout"):
        build_slices(model, policy(layout="1.33"), 1)
    with pytest.raises(ValueError, match="generation"):
        build_slices(model, policy(), -1)


def test_134_rejects_a_device_on_two_counter_sets() -> None:
    cs = (CounterSet("a", (("x", "1"),)), CounterSet("b", (("x", "1"),)))
    dev = dataclasses.replace(
        plain_device(0), consumes_counters=(("a", (("x", "1"),)), ("b", (("x", "1"),)))
    )
    with pytest.raises(ValueError, match="one counter set"):
        build_slices(DeviceModel(devices=(dev,), counter_sets=cs), policy(layout="1.34"), 1)


# --- slice names -----------------------------------------------------------------------------


def test_slice_name_format() -> None:
    name = slice_name(policy("worker-1.example.com"), 3)
    assert re.fullmatch(r"worker-1\.example\.com-gpu-tessera-dev-[0-9a-f]{8}-3", name)
    other_driver = SlicePolicy(driver_name="nic.example.org", node_name="worker-1")
    assert re.fullmatch(r"worker-1-nic-example-org-[0-9a-f]{8}-0", slice_name(other_driver, 0))


def test_slice_names_of_different_node_driver_pairs_never_collide() -> None:
    """Dashed forms coincide here ('a-gpu-tessera-dev'); the names must not."""
    a = slice_name(SlicePolicy(driver_name="gpu.tessera.dev", node_name="a"), 0)
    b = slice_name(SlicePolicy(driver_name="tessera.dev", node_name="a-gpu"), 0)
    assert a != b


@pytest.mark.parametrize("length", [200, 240, 253], ids=lambda n: f"node-{n}")
def test_long_node_names_are_shortened(length: int) -> None:
    node_a = ("a" * 61 + ".") * 4
    node_a = node_a[: length - 1] + "a"
    node_b = node_a[:-1] + "b"
    a, b = slice_name(policy(node_a), 12), slice_name(policy(node_b), 12)
    assert len(a) <= 253 and is_dns_subdomain(a)
    assert a != b
    assert a == slice_name(policy(node_a), 12)
    assert re.search(r"-gpu-tessera-dev-[0-9a-f]{8}-12$", a)


# --- spec_equal ------------------------------------------------------------------------------


@pytest.fixture
def built(inventory: Inventory) -> dict[str, Any]:
    """MIG is off: an A100 in dynamic mode offers itself whole (40 GiB first)."""
    model = advertised_devices(inventory("dgx-a100", "none"), DevicePolicy(mig_mode="dynamic"))
    return build_slices(model, policy(), 4)[1]


def stored(obj: dict[str, Any]) -> dict[str, Any]:
    """What reading it back from the API server looks like."""
    out = copy.deepcopy(obj)
    out["metadata"] |= {
        "uid": "5e1",
        "resourceVersion": "991",
        "creationTimestamp": "2025-01-01T00:00:00Z",
        "generation": 3,
        "managedFields": [{"manager": "tessera"}],
    }
    out["spec"]["pool"]["generation"] = 9
    return out


def test_spec_equal_ignores_server_fields_and_generation(built: dict[str, Any]) -> None:
    assert spec_equal(built, stored(built))
    assert spec_equal(stored(built), built)


def test_spec_equal_compares_quantities_by_value(built: dict[str, Any]) -> None:
    other = stored(built)
    other["spec"]["devices"][0]["capacity"]["memory"]["value"] = "40Gi"
    assert spec_equal(built, other)  # 42949672960 == 40Gi
    other["spec"]["devices"][0]["capacity"]["memory"]["value"] = "40G"
    assert not spec_equal(built, other)


def test_spec_equal_treats_omitted_empty_lists_as_empty() -> None:
    (empty,) = build_slices(DeviceModel(devices=(), counter_sets=()), policy(), 1)
    other = stored(empty)
    del other["spec"]["devices"]
    assert spec_equal(empty, other)


@pytest.mark.parametrize(
    "change",
    ["name", "label", "owner", "attribute", "device-count", "slice-count", "node"],
    ids=str,
)
def test_spec_equal_sees_changes_we_own(built: dict[str, Any], change: str) -> None:
    other = stored(built)
    if change == "name":
        other["metadata"]["name"] += "x"
    elif change == "label":
        other["metadata"]["labels"]["team"] = "a"
    elif change == "owner":
        other["metadata"]["ownerReferences"][0]["uid"] = "other"
    elif change == "attribute":
        other["spec"]["devices"][0]["attributes"]["productName"]["string"] = "x"
    elif change == "device-count":
        other["spec"]["devices"].pop()
    elif change == "slice-count":
        other["spec"]["pool"]["resourceSliceCount"] += 1
    else:
        other["spec"]["nodeName"] = "node-b"
    assert not spec_equal(built, other)
