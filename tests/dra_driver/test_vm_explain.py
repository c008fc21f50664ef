"""The scheduler's model (dra_driver.scheduler, what `tessera explain` runs) on nodes whose GPUs
offer VMs, with the installed DeviceClasses: a GPU's vfio device is never allocated beside any of
its container devices, in either order; vGPU claims take what the GPU can host; and a node that
offers no VM device says why a VM claim does not fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.discovery.inventory import NodeInventory
from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.device_model import DevicePolicy, advertised_devices
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.explanation import Explanation, explain
from dra_driver.scheduler.versions import Scheduler
from tests.dra_driver.conftest import Inventory
from tests.dra_driver.vm_inventories import H200_TYPES, passthrough, vgpu

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "daemonset"
CLASSES = [d for d in yaml.safe_load_all((DEPLOY / "deviceclasses.yaml").read_text()) if d]
DOMAIN = "gpu.tessera.dev"
VFIO, VGPU, GPU, MIG = (f"{k}{DOMAIN}" for k in ("vfio.", "vgpu.", "", "mig."))
Slices = list[dict[str, Any]]


def slices(inv: NodeInventory, policy: DevicePolicy, layout: str = "1.35") -> Slices:
    model = advertised_devices(inv, policy)
    return build_slices(model, SlicePolicy(DOMAIN, inv.hostname, layout=layout), generation=1)


def request(name: str, cls: str, *selectors: str, count: int = 1) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls, "count": count}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": exactly}


def claim(
    name: str, *requests: dict[str, Any], constraints: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    return {"metadata": {"name": name, "namespace": "vms"}, "spec": {"devices": devices}}


def on_gpu(minor: int) -> str:
    return f'device.attributes["{DOMAIN}"].minor == {minor}'


def holding(pool: str, *devices: str) -> dict[str, Any]:
    """A claim the scheduler already allocated these devices to (vms/holder)."""
    results = [{"request": "r", "driver": DOMAIN, "pool": pool, "device": d} for d in devices]
    return {
        "metadata": {"name": "holder", "namespace": "vms"},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def run(
    c: dict[str, Any], node: Slices, held: list[dict[str, Any]] | None = None, version: str = "1.35"
) -> Explanation:
    """``version``: the scheduler modelled; slices in a layout are explained by the scheduler of
    the version they are published for (1.35 ignores the devices of a 1.34 counter slice)."""
    return explain(
        c, CLASSES, node, held or [], cel=CelEnvironment(), scheduler=Scheduler.of(version)
    )


def reasons(e: Explanation) -> list[dict[str, Any]]:
    j = e.to_json()
    out = [j["fatal"]] if j["fatal"] else []
    for r in j["requests"]:
        for alt in r["alternatives"]:
            out += [d["reason"] for d in alt["devices"] if d["reason"]]
    return out


def reason_of(e: Explanation, device: str) -> dict[str, Any]:
    """Why the allocator passed over ``device`` (its JSON reason)."""
    for r in e.to_json()["requests"]:
        for alt in r["alternatives"]:
            for d in alt["devices"]:
                if d["device"] == device:
                    return dict(d["reason"])
    raise AssertionError(f"{device} not considered")


def devices_of(e: Explanation) -> list[str]:
    return [r["device"] for r in e.allocation()["devices"]["results"]]


# -- passthrough: the VM view and the container view of a GPU never together --------------------


@pytest.mark.parametrize("layout", ["1.34", "1.35"])
@pytest.mark.parametrize("first", ["vfio", "gpu"])
def test_a_gpus_vfio_device_and_its_whole_gpu_never_both_in_either_order(
    inventory: Inventory, first: str, layout: str
) -> None:
    inv = passthrough(inventory("l40s-pcie"))
    node = slices(inv, DevicePolicy(virtualization="passthrough"), layout)
    for minor in range(4):
        held_name = f"gpu-{minor}-vfio" if first == "vfio" else f"gpu-{minor}"
        wanted_class = GPU if first == "vfio" else VFIO
        e = run(claim("second", request("r", wanted_class, on_gpu(minor))), node,
                [holding(inv.hostname, held_name)], layout)  # fmt: skip
        assert not e.ok, e.text()
        (why,) = [r for r in reasons(e) if r["kind"] == "counters"]
        assert why["counterSet"] == f"gpu-{minor}-counter-set"
        assert f"{held_name} (claim vms/holder)" in why["text"]
        # another GPU is free for it
        other = run(claim("second", request("r", wanted_class)), node,
                    [holding(inv.hostname, held_name)], layout)  # fmt: skip
        assert other.ok and not devices_of(other)[0].startswith(f"gpu-{minor}-")


def test_one_claim_cannot_take_a_gpus_vfio_device_and_the_gpu(inventory: Inventory) -> None:
    node = slices(passthrough(inventory("l40s-pcie")), DevicePolicy(virtualization="passthrough"))
    same_gpu = [{"matchAttribute": f"{DOMAIN}/uuid"}]
    both = claim("both", request("vm", VFIO), request("ctr", GPU), constraints=same_gpu)
    e = run(both, node)
    assert not e.ok, e.text()
    apart = run(claim("both", request("vm", VFIO), request("ctr", GPU)), node)
    assert apart.ok and devices_of(apart) == ["gpu-0-vfio", "gpu-1"]


@pytest.mark.parametrize("layout", ["1.34", "1.35"])
def test_dynamic_mig_placements_and_the_vfio_device_exclude_each_other(
    inventory: Inventory, layout: str
) -> None:
    inv = passthrough(inventory("dgx-h100"))
    node = slices(inv, DevicePolicy(mig_mode="dynamic", virtualization="passthrough"), layout)
    placement = "gpu-0-mig-1g10gb-19-6"
    one_g = f'device.attributes["{DOMAIN}"].profile == "1g.10gb"'
    # a placement held: no vfio device of its GPU
    held = [holding(inv.hostname, placement)]
    e = run(claim("vm", request("r", VFIO, on_gpu(0))), node, held, layout)
    assert not e.ok, e.text()
    why = reason_of(e, "gpu-0-vfio")
    assert why["kind"] == "counters" and f"{placement} (claim vms/holder)" in why["text"]
    # the vfio device held: no placement of its GPU, and not the whole GPU
    held = [holding(inv.hostname, "gpu-0-vfio")]
    e = run(claim("ctr", request("r", MIG, one_g, on_gpu(0))), node, held, layout)
    assert not e.ok, e.text()
    for start in range(7):
        why = reason_of(e, f"gpu-0-mig-1g10gb-19-{start}")
        assert why["kind"] == "counters" and "gpu-0-vfio (claim vms/holder)" in why["text"]
    assert not run(claim("ctr", request("r", GPU, on_gpu(0))), node, held, layout).ok
    # the other GPUs are untouched
    e = run(claim("ctr", request("r", MIG, one_g, count=7)), node, held, layout)
    assert e.ok and all(d.startswith("gpu-1-") for d in devices_of(e)), e.text()


def test_a_vfio_claim_fits_a_passthrough_node_and_says_which_gpu(inventory: Inventory) -> None:
    inv = passthrough(inventory("dgx-h100"))
    node = slices(inv, DevicePolicy(virtualization="passthrough"))
    hopper = f'device.attributes["{DOMAIN}"].architecture == "Hopper"'
    e = run(claim("vm", request("gpu", VFIO, hopper, count=2)), node)
    assert e.ok, e.text()
    assert devices_of(e) == ["gpu-0-vfio", "gpu-1-vfio"]


# -- vGPU ----------------------------------------------------------------------------------------


def h200_type(name: str) -> str:
    return f'device.attributes["{DOMAIN}"].vgpuType == "{name}"'


def test_vgpu_claims_take_what_the_gpus_can_host(inventory: Inventory) -> None:
    inv = vgpu(inventory("hgx-h200"), H200_TYPES)
    node = slices(inv, DevicePolicy(virtualization="vgpu"))
    e = run(claim("vm", request("gpu", VGPU, h200_type("H200X-35C"), count=4)), node)
    assert e.ok, e.text()
    assert devices_of(e) == [f"gpu-0-vgpu-1430-{k}" for k in range(4)]
    # a whole-framebuffer vGPU on every GPU: a 17C anywhere no longer fits, by the counters
    full = [holding(inv.hostname, *[f"gpu-{i}-vgpu-1428-0" for i in range(8)])]
    e = run(claim("vm", request("gpu", VGPU, h200_type("H200X-17C"))), node, full)
    assert not e.ok
    kinds = {r["kind"] for r in reasons(e)}
    assert "counters" in kinds, e.text()
    # one GPU free again: the 17C goes there
    some = [holding(inv.hostname, *[f"gpu-{i}-vgpu-1428-0" for i in range(8) if i != 5])]
    e = run(claim("vm", request("gpu", VGPU, h200_type("H200X-17C"))), node, some)
    assert e.ok and devices_of(e) == ["gpu-5-vgpu-1431-0"], e.text()


def test_a_type_a_homogeneous_gpu_cannot_take_now_does_not_fit_there(
    inventory: Inventory,
) -> None:
    inv = vgpu(inventory("hgx-h200"), H200_TYPES, hosted={i: 1430 for i in range(8)})
    node = slices(inv, DevicePolicy(virtualization="vgpu"))
    e = run(claim("vm", request("gpu", VGPU, h200_type("H200X-70C"))), node)
    assert not e.ok
    assert e.first_reason().startswith("request gpu needs 1, 0 candidates"), e.text()
    assert 'vgpuType="H200X-35C"' in e.text()  # what the GPUs take now


# -- nodes that offer no VM device: does not fit, and why ----------------------------------------


def test_a_vfio_claim_on_a_node_without_passthrough_says_why(inventory: Inventory) -> None:
    plain = slices(inventory("dgx-h100"), DevicePolicy())
    e = run(claim("vm", request("gpu", VFIO)), plain)
    assert not e.ok
    assert e.first_reason().startswith("request gpu needs 1, 0 candidates"), e.text()
    assert "class selector false" in e.first_reason()
    assert "class vfio.gpu.tessera.dev selector #0 is false" in e.text()
    assert 'device.attributes["gpu.tessera.dev"].type="gpu"' in e.text()


def test_a_vfio_claim_on_a_vgpu_node_and_a_vgpu_claim_on_a_passthrough_node(
    inventory: Inventory,
) -> None:
    vgpu_node = slices(vgpu(inventory("hgx-h200"), H200_TYPES), DevicePolicy(virtualization="vgpu"))
    e = run(claim("vm", request("gpu", VFIO)), vgpu_node)
    assert not e.ok and 'type="vgpu"' in e.text(), e.text()
    pt = slices(passthrough(inventory("l40s-pcie")), DevicePolicy(virtualization="passthrough"))
    e = run(claim("vm", request("gpu", VGPU)), pt)
    assert not e.ok and "class-selector" in {r["kind"] for r in reasons(e)}, e.text()
    assert 'type="vfio"' in reason_of(e, "gpu-0-vfio")["text"]
    assert 'type="gpu"' in reason_of(e, "gpu-0")["text"]


def test_a_vfio_claim_where_no_gpu_has_an_iommu_group(inventory: Inventory) -> None:
    inv = passthrough(inventory("l40s-pcie"), no_iommu=(0, 1, 2, 3))
    e = run(
        claim("vm", request("gpu", VFIO)), slices(inv, DevicePolicy(virtualization="passthrough"))
    )
    assert not e.ok and "0 candidates (4 rejected: 4 class selector false)" in e.first_reason()
    assert 'type="gpu"' in e.text()  # the GPUs are there, whole only
