"""The ResourceSlices of nodes that offer VMs GPUs: schema-valid for 1.34 and 1.35 and within the
API's limits in both layouts, however many vGPU devices a GPU has."""

from __future__ import annotations

from typing import Any

import pytest

from agent.discovery.inventory import NodeInventory
from agent.pcihost.vm_types import VGPU_MDEV
from dra_driver.advertise.slice_limits import check_pool, check_slice
from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.device_model import DeviceModel, DevicePolicy, advertised_devices
from tests.dra_driver.conftest import Inventory
from tests.dra_driver.vm_inventories import GIB, H200_TYPES, L40S_TYPES, passthrough, vgpu
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

Node = tuple[NodeInventory, DevicePolicy]


def node(inventory: Inventory, case: str) -> Node:
    vm = "passthrough"
    if case == "passthrough-static":
        return passthrough(inventory("dgx-h100")), DevicePolicy(virtualization=vm)
    if case == "passthrough-dynamic":
        return passthrough(inventory("dgx-h100")), DevicePolicy(
            mig_mode="dynamic", virtualization=vm
        )
    if case == "passthrough-a100-dynamic":
        inv = passthrough(inventory("dgx-a100"))  # in MIG mode: placements and vfio only
        return inv, DevicePolicy(mig_mode="dynamic", virtualization=vm)
    if case == "passthrough-l40s-gpu-1-no-iommu":
        return passthrough(inventory("l40s-pcie"), no_iommu=(1,)), DevicePolicy(virtualization=vm)
    if case == "vgpu-h200":
        return vgpu(inventory("hgx-h200"), H200_TYPES), DevicePolicy(virtualization="vgpu")
    assert case == "vgpu-l40s-mdev"
    inv = vgpu(inventory("l40s-pcie"), L40S_TYPES, interface=VGPU_MDEV)
    return inv, DevicePolicy(virtualization="vgpu")


CASES = [
    "passthrough-static",
    "passthrough-dynamic",
    "passthrough-a100-dynamic",
    "passthrough-l40s-gpu-1-no-iommu",
    "vgpu-h200",
    "vgpu-l40s-mdev",
]


def slices(model: DeviceModel, layout: str) -> list[dict[str, Any]]:
    policy = SlicePolicy(driver_name="gpu.tessera.dev", node_name="node-a", layout=layout)
    return build_slices(model, policy, generation=3)


@pytest.mark.parametrize("layout", ["1.34", "1.35"])
@pytest.mark.parametrize("case", CASES)
def test_every_vm_slice_is_valid_in_both_layouts(
    inventory: Inventory, case: str, layout: str
) -> None:
    model = advertised_devices(*node(inventory, case))
    built = slices(model, layout)
    for obj in built:
        for version in VERSIONS:
            validate_k8s(obj, version)
        assert check_slice(obj, layout) == []
    assert check_pool(built, layout) == []
    published = [d["name"] for s in built for d in s["spec"].get("devices", [])]
    assert sorted(published) == sorted(d.name for d in model.devices)


def test_108_vgpus_per_gpu_split_into_slices_of_64_in_135(inventory: Inventory) -> None:
    model = advertised_devices(*node(inventory, "vgpu-l40s-mdev"))
    assert len(model.devices) == 4 * 108
    built = slices(model, "1.35")
    sizes = [len(s["spec"].get("devices", [])) for s in built]
    assert sizes == [0, 64, 64, 64, 64, 64, 64, 48]  # the 4 counter sets first, then devices
    assert len(built[0]["spec"]["sharedCounters"]) == 4


def test_134_keeps_each_counter_set_with_its_108_consumers(inventory: Inventory) -> None:
    """1.34: a device consumes only counter sets of its own slice, which may hold 128 devices
    (the 64 of a slice with counters came with 1.35)."""
    model = advertised_devices(*node(inventory, "vgpu-l40s-mdev"))
    built = slices(model, "1.34")
    assert [len(s["spec"]["devices"]) for s in built] == [108] * 4
    assert [[cs["name"] for cs in s["spec"]["sharedCounters"]] for s in built] == [
        [f"gpu-{i}-counter-set"] for i in range(4)
    ]
    counters = built[0]["spec"]["sharedCounters"][0]["counters"]
    assert counters == {"framebuffer": {"value": str(48 * GIB)}}


def test_134_refuses_more_consumers_than_one_slice_holds(inventory: Inventory) -> None:
    many = tuple(t for t in L40S_TYPES) + tuple(
        type(t)(t.type_id + 100, t.name.replace("Q", "A"), t.framebuffer_bytes, t.max_instances)
        for t in L40S_TYPES[:2]
    )  # 108 + 56 instances
    inv = vgpu(inventory("l40s-pcie"), many, interface=VGPU_MDEV)
    model = advertised_devices(inv, DevicePolicy(virtualization="vgpu"))
    with pytest.raises(ValueError, match=r"gpu-0-counter-set: 164 consuming devices do not fit"):
        slices(model, "1.34")
    assert check_pool(slices(model, "1.35"), "1.35") == []
