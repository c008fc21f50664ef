"""NVIDIA's layout (bench/nvidia_layout.py) against facts read in its code
(NVIDIA/k8s-dra-driver-gpu@22407113785e, cmd/gpu-kubelet-plugin: deviceinfo.go, mig.go,
partitions.go, nvlib.go, driver.go), built for simulated nodes; every slice valid for the
Kubernetes versions it is published to."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from agent.discovery.inventory import NodeInventory
from bench.common import simulated_inventory
from bench.nvidia_layout import (
    binary_si,
    camel_to_dns,
    mig_device_name,
    nvidia_slices,
    semver,
    slice_specs,
    tainted,
)
from tests.k8sschema import validate

MIG_ATTRIBUTES = {
    "architecture",
    "brand",
    "cudaComputeCapability",
    "cudaDriverVersion",
    "driverVersion",
    "parentUUID",
    "productName",
    "profile",
    "resource.kubernetes.io/pciBusID",
    "resource.kubernetes.io/pcieRoot",
    "type",
}
COUNTERS = {
    "copy-engines",
    "decoders",
    "encoders",
    "jpeg-engines",
    "memory",
    "multiprocessors",
    "ofa-engines",
}


@pytest.fixture(scope="module")
def h100() -> Iterator[NodeInventory]:
    with simulated_inventory("dgx-h100") as inv:
        yield inv


@pytest.fixture(scope="module")
def a100() -> Iterator[NodeInventory]:
    with simulated_inventory("dgx-a100") as inv:
        yield inv


def devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s.get("devices", [])}


def test_quantities_versions_and_names_are_written_as_apimachinery_and_the_driver_do() -> None:
    assert binary_si(42949672960) == "40Gi"  # NewQuantity(n, BinarySI).String()
    assert binary_si(5100273664) == "4864Mi"
    assert (binary_si(14), binary_si(0), binary_si(1025)) == ("14", "0", "1025")
    assert semver("550.90.07") == "550.90.7" and semver("8.0") == "8.0.0"
    assert camel_to_dns("copyEngines") == "copy-engines"
    assert camel_to_dns("multiprocessors") == "multiprocessors"
    assert mig_device_name(3, "1g.10gb+me", 20, 6) == "gpu-3-mig-1g10gb-me-20-6"


def test_dynamic_mig_on_hopper_publishes_a_counter_slice_then_one_slice_per_gpu(
    h100: NodeInventory,
) -> None:
    specs = slice_specs(h100, "dynamic-mig")
    assert len(specs) == 1 + len(h100.gpus)
    assert set(specs[0]) == {"sharedCounters"}
    sets = {c["name"]: c["counters"] for c in specs[0]["sharedCounters"]}
    assert set(sets) == {f"gpu-{g.device.minor}-counter-set" for g in h100.gpus}
    slots = {f"memory-slice-{i}" for i in range(8)}
    assert set(sets["gpu-0-counter-set"]) == COUNTERS | slots
    gpu0 = devices(specs[1:2])
    profiles = h100.gpus[0].device.mig_profiles
    assert len(gpu0) == 1 + sum(len(p.placements) for p in profiles)
    assert list(gpu0) == sorted(gpu0)  # sorted by name
    whole = gpu0["gpu-0"]
    assert whole["attributes"]["type"] == {"string": "gpu"} and "uuid" in whole["attributes"]
    # the whole GPU consumes every counter: its capacities, the maxima over the profiles
    (consumed,) = whole["consumesCounters"]
    assert consumed["counters"] == sets["gpu-0-counter-set"]
    assert whole["capacity"]["multiprocessors"] == {
        "value": str(max(p.multiprocessors for p in profiles))
    }


def test_a_mig_placement_consumes_its_capacities_and_only_its_memory_slices(
    h100: NodeInventory,
) -> None:
    gpu0 = devices(slice_specs(h100, "dynamic-mig")[1:2])
    small = next(p for p in h100.gpus[0].device.mig_profiles if p.name == "1g.10gb")
    place = small.placements[1]
    dev = gpu0[mig_device_name(0, "1g.10gb", small.profile_id, place.start)]
    assert set(dev["attributes"]) == MIG_ATTRIBUTES  # a dynamic MIG device has no uuid yet
    assert dev["attributes"]["profile"] == {"string": "1g.10gb"}
    assert set(dev["capacity"]) == {
        "copyEngines", "decoders", "encoders", "jpegEngines", "memory", "multiprocessors",
        "ofaEngines",
    }  # fmt: skip
    assert dev["capacity"]["encoders"] == {"value": "0"}  # zeros included
    (consumed,) = dev["consumesCounters"]
    assert consumed["counterSet"] == "gpu-0-counter-set"
    slices = {k for k in consumed["counters"] if k.startswith("memory-slice-")}
    assert slices == {f"memory-slice-{i}" for i in place.slots()}
    assert consumed["counters"]["multiprocessors"] == {"value": str(small.multiprocessors)}


def test_an_a100_with_mig_on_is_not_offered_whole_in_dynamic_mode(a100: NodeInventory) -> None:
    names = devices(slice_specs(a100, "dynamic-mig"))
    assert not any(n.startswith("gpu-") and n.count("-") == 1 for n in names)
    per_gpu = sum(len(p.placements) for p in a100.gpus[0].device.mig_profiles)
    assert len(names) == per_gpu * len(a100.gpus)


def test_without_dynamic_mig_one_slice_holds_every_device(
    a100: NodeInventory, h100: NodeInventory
) -> None:
    (whole,) = slice_specs(h100, "gpu")
    assert sorted(devices([whole])) == sorted(f"gpu-{g.device.minor}" for g in h100.gpus)
    assert devices([whole])["gpu-0"]["capacity"] == {
        "memory": {"value": binary_si(h100.gpus[0].device.memory.total)}
    }
    (static,) = slice_specs(a100, "gpu")  # MIG on: the MIG devices that exist
    dev = next(iter(devices([static]).values()))
    assert set(dev["attributes"]) == MIG_ATTRIBUTES | {"uuid"}
    assert any(k.startswith("memorySlice") for k in dev["capacity"])
    (passthrough,) = slice_specs(h100, "passthrough")
    vfio = devices([passthrough])["gpu-vfio-0"]["attributes"]
    gpu0 = min(h100.gpus, key=lambda g: g.device.minor)
    assert vfio["uuid"] == {"string": str(uuid.uuid5(uuid.NAMESPACE_DNS, gpu0.pcie.bus_id))}
    assert vfio["vendorID"] == {"string": "0x10de"}  # fmt.Sprintf("0x%04x", ...)
    assert vfio["type"] == {"string": "vfio"}


def test_the_slices_are_valid_for_the_versions_they_are_published_to(
    a100: NodeInventory, h100: NodeInventory
) -> None:
    for inv in (a100, h100):
        for mode, split, versions in (
            ("dynamic-mig", True, ("1.35.0",)),  # split counters: 1.35 and later
            ("dynamic-mig", False, ("1.34.0", "1.35.0")),
            ("gpu", True, ("1.34.0", "1.35.0")),
        ):
            for i, obj in enumerate(nvidia_slices(inv, mode, "node-a", "uid-a", split)):
                named = {**obj, "metadata": {**obj["metadata"], "name": f"slice-{i}"}}
                assert obj["metadata"]["generateName"] == f"{i:05x}-gpu.nvidia.com-node-a-"
                for version in versions:
                    validate(named, version)


def test_a_health_taint_marks_every_device_of_the_gpu_in_its_one_slice(h100: NodeInventory) -> None:
    specs = slice_specs(h100, "dynamic-mig")
    after = tainted(specs, 1)
    changed = [i for i, (a, b) in enumerate(zip(specs, after, strict=True)) if a != b]
    assert changed == [2]  # the counters slice, GPU 0's slice, then GPU 1's
    taints = {d["name"]: d.get("taints") for d in after[2]["devices"]}
    assert all(t and t[0]["key"] == "gpu.nvidia.com/xid" for t in taints.values())
    assert "gpu-1" in taints and "gpu-10" not in taints


def test_a_bad_mode_is_refused_with_the_modes_allowed(h100: NodeInventory) -> None:
    with pytest.raises(ValueError, match=r"'mig'.*gpu, static-mig, dynamic-mig, passthrough"):
        slice_specs(h100, "mig")
