"""The installed DeviceClasses on nodes whose GPUs offer VMs (--virtualization): the VM classes
select exactly the VM devices, and every other class selects exactly what it selected on the
same node without VM devices, evaluated by the real allocator (as test_cookbook_matches_devices
does on the plain simulated nodes). The inventories are built by hand (tests/dra_driver/
vm_inventories.py) until discovery fills ``Gpu.virtualization`` on the simulator's models."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.discovery.inventory import NodeInventory
from agent.pcihost.vm_types import VGPU_MDEV
from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.device_model import DevicePolicy, advertised_devices
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.explanation import explain
from tests.deploy.test_cookbook_matches_devices import (
    INSTALLED,
    SELECTED_AT_DEFAULTS,
    VM_CLASSES,
    Node,
    check_attribute_table,
    class_claim,
    inventory,
    meant_for,
    slice_devices,
)
from tests.dra_driver.vm_inventories import H200_TYPES, L40S_TYPES, passthrough, vgpu
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

Slices = list[dict[str, Any]]


def published(inv: NodeInventory, policy: DevicePolicy) -> Slices:
    return build_slices(
        advertised_devices(inv, policy),
        SlicePolicy(driver_name="gpu.tessera.dev", node_name=inv.hostname),
        generation=1,
    )


PASSTHROUGH = DevicePolicy(virtualization="passthrough")
PASSTHROUGH_DYNAMIC = DevicePolicy(mig_mode="dynamic", virtualization="passthrough")
VGPU = DevicePolicy(virtualization="vgpu")

Build = Callable[[], tuple[NodeInventory, NodeInventory, DevicePolicy]]
"""(the node without VM facts, with them, the policy)."""


def _case(
    model: str, policy: DevicePolicy, make: Callable[[NodeInventory], NodeInventory]
) -> Build:
    def build() -> tuple[NodeInventory, NodeInventory, DevicePolicy]:
        plain = inventory(Node(model))
        return plain, make(plain), policy

    return build


VM_NODES: dict[str, Build] = {
    "dgx-h100/passthrough": _case("dgx-h100", PASSTHROUGH, passthrough),
    "dgx-h100/passthrough/dynamic": _case("dgx-h100", PASSTHROUGH_DYNAMIC, passthrough),
    "dgx-a100/passthrough": _case("dgx-a100", PASSTHROUGH, passthrough),  # MIG mode: no vfio
    "dgx-a100/passthrough/dynamic": _case("dgx-a100", PASSTHROUGH_DYNAMIC, passthrough),
    "l40s-pcie/passthrough/gpu-2-no-iommu": _case(
        "l40s-pcie", PASSTHROUGH, lambda i: passthrough(i, no_iommu=(2,))
    ),
    "mixed/passthrough": _case("mixed", PASSTHROUGH, passthrough),
    "hgx-h200/vgpu": _case("hgx-h200", VGPU, lambda i: vgpu(i, H200_TYPES)),
    "hgx-h200/vgpu/hosting-1430": _case(
        "hgx-h200", VGPU, lambda i: vgpu(i, H200_TYPES, hosted={0: 1430, 3: 1428})
    ),
    "l40s-pcie/vgpu/mdev": _case(
        "l40s-pcie", VGPU, lambda i: vgpu(i, L40S_TYPES, interface=VGPU_MDEV)
    ),
}


def selected(class_name: str, slices: Slices) -> set[str]:
    """The devices the class's selectors accept, as the allocator decides."""
    e = explain(class_claim(class_name), INSTALLED, slices, [], cel=CelEnvironment())
    ((alt,),) = [r["alternatives"] for r in e.to_json()["requests"]]
    assert len(alt["devices"]) == len(slice_devices(slices))
    return {
        d["device"]
        for d in alt["devices"]
        if d["reason"] is None or d["reason"]["kind"] != "class-selector"
    }


def test_the_vm_classes_are_installed() -> None:
    assert set(VM_CLASSES) <= {c["metadata"]["name"] for c in INSTALLED}
    for c in INSTALLED:
        for version in VERSIONS:
            validate_k8s(c, version)


@pytest.mark.parametrize("node", list(VM_NODES))
@pytest.mark.parametrize("class_name", list(SELECTED_AT_DEFAULTS))
def test_each_class_selects_exactly_the_devices_it_is_for(class_name: str, node: str) -> None:
    _, inv, policy = VM_NODES[node]()
    slices = published(inv, policy)
    meant = {n for n, d in slice_devices(slices).items() if meant_for(class_name, d)}
    assert selected(class_name, slices) == meant


@pytest.mark.parametrize("node", list(VM_NODES))
@pytest.mark.parametrize("class_name", sorted(set(SELECTED_AT_DEFAULTS) - set(VM_CLASSES)))
def test_the_other_classes_select_what_they_did_without_vm_devices(
    class_name: str, node: str
) -> None:
    """On a passthrough node, exactly what the class selected before; on a vGPU node nothing:
    its GPUs are not advertised for containers."""
    plain, inv, policy = VM_NODES[node]()
    before = selected(class_name, published(plain, DevicePolicy(mig_mode=policy.mig_mode)))
    after = selected(class_name, published(inv, policy))
    assert after == (set() if policy.virtualization == "vgpu" else before)


@pytest.mark.parametrize(
    ("node", "vfio", "vgpus"),
    [
        ("dgx-h100/passthrough", 8, 0),
        ("dgx-h100/passthrough/dynamic", 8, 0),
        ("dgx-a100/passthrough", 0, 0),
        ("dgx-a100/passthrough/dynamic", 8, 0),
        ("l40s-pcie/passthrough/gpu-2-no-iommu", 3, 0),
        ("mixed/passthrough", 4, 0),
        ("hgx-h200/vgpu", 0, 8 * 15),
        ("hgx-h200/vgpu/hosting-1430", 0, 6 * 15 + 4 + 1),
        ("l40s-pcie/vgpu/mdev", 0, 4 * 108),
    ],
)
def test_the_vm_classes_select_what_each_node_offers(node: str, vfio: int, vgpus: int) -> None:
    _, inv, policy = VM_NODES[node]()
    slices = published(inv, policy)
    assert len(selected("vfio.gpu.tessera.dev", slices)) == vfio
    assert len(selected("vgpu.gpu.tessera.dev", slices)) == vgpus


@pytest.mark.parametrize("node", list(VM_NODES))
def test_the_cookbook_says_which_vm_devices_carry_each_attribute(node: str) -> None:
    _, inv, policy = VM_NODES[node]()
    check_attribute_table(advertised_devices(inv, policy))


# -- the cookbook's VM claims ---------------------------------------------------------------------

COOKBOOK = Path(__file__).resolve().parents[2] / "docs" / "claims-cookbook.md"


def cookbook_claim(heading: str) -> dict[str, Any]:
    """The ResourceClaimTemplate of a cookbook section, schema-checked, as the claim it makes."""
    doc = COOKBOOK.read_text()
    section = doc[doc.index(f"## {heading}\n") :]
    section = section[: section.index("\n## ", 1)]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)
    template = yaml.safe_load(block)
    for version in VERSIONS:
        validate_k8s(template, version)
    return {"metadata": dict(template["metadata"]), "spec": template["spec"]["spec"]}


@pytest.mark.parametrize(
    ("heading", "node", "device", "not_on"),
    [
        ("A VM with a passed-through GPU", "dgx-h100/passthrough", "gpu-0-vfio", "hgx-h200/vgpu"),
        ("A VM with a vGPU", "hgx-h200/vgpu", "gpu-0-vgpu-1430-0", "dgx-h100/passthrough"),
    ],
)
def test_the_cookbook_vm_claims_allocate_where_the_node_offers_them(
    heading: str, node: str, device: str, not_on: str
) -> None:
    claim = cookbook_claim(heading)
    _, inv, policy = VM_NODES[node]()
    e = explain(claim, INSTALLED, published(inv, policy), [], cel=CelEnvironment())
    assert e.ok, e.text()
    assert [r["device"] for r in e.allocation()["devices"]["results"]] == [device]
    plain, _, _ = VM_NODES[node]()
    assert not explain(
        claim, INSTALLED, published(plain, DevicePolicy()), [], cel=CelEnvironment()
    ).ok
    _, other, other_policy = VM_NODES[not_on]()
    e = explain(claim, INSTALLED, published(other, other_policy), [], cel=CelEnvironment())
    assert not e.ok and "class selector false" in e.first_reason()
