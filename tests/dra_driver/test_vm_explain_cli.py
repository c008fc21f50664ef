"""`tessera explain` on the VM DeviceClasses, over ResourceSlice files of a passthrough node and of
a vGPU node (built by hand from simulated inventories until the simulator's vgpu-h200 and
vgpu-t4 models and discovery's VM facts exist; then `--simulate MODEL --virtualization ...`):
exit 0 and the device where the claim fits, exit 1 and the reason where the node offers none."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli import main
from agent.discovery.inventory import NodeInventory
from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.device_model import DevicePolicy, advertised_devices
from tests.dra_driver.conftest import Inventory
from tests.dra_driver.vm_inventories import H200_TYPES, passthrough, vgpu
from tests.k8sschema import VERSIONS
from tests.k8sschema import validate as validate_k8s

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ROOT / "deploy" / "daemonset" / "deviceclasses.yaml"


def write_slices(directory: Path, inv: NodeInventory, policy: DevicePolicy) -> Path:
    directory.mkdir()
    built = build_slices(
        advertised_devices(inv, policy), SlicePolicy("gpu.tessera.dev", inv.hostname), 1
    )
    for i, obj in enumerate(built):
        for version in VERSIONS:
            validate_k8s(obj, version)
        (directory / f"slice-{i}.yaml").write_text(yaml.safe_dump(obj))
    return directory


def claim_file(path: Path, cls: str, selector: str | None = None) -> Path:
    exactly: dict[str, Any] = {"deviceClassName": cls}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "vm-gpu", "namespace": "vms"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }
    for version in VERSIONS:
        validate_k8s(obj, version)
    path.write_text(yaml.safe_dump(obj))
    return path


def explain(claim: Path, slices: Path) -> tuple[int, dict[str, Any]]:
    out, err = io.StringIO(), io.StringIO()
    argv = ["explain", str(claim), "--class", str(CLASSES), "--slices", str(slices), "-o", "json"]
    code = main(argv, {}, out, err)
    assert code in (0, 1), err.getvalue()
    return code, json.loads(out.getvalue())


def allocated(answer: dict[str, Any]) -> list[str]:
    """The devices the one node's answer allocates to the one claim."""
    ((node,),) = [answer["nodes"]]
    ((c,),) = [node["claims"]]
    return [r["device"] for r in c["allocation"]["devices"]["results"]]


def test_a_vfio_claim_on_a_passthrough_node(tmp_path: Path, inventory: Inventory) -> None:
    inv = passthrough(inventory("dgx-h100"))
    slices = write_slices(tmp_path / "slices", inv, DevicePolicy(virtualization="passthrough"))
    code, answer = explain(claim_file(tmp_path / "c.yaml", "vfio.gpu.tessera.dev"), slices)
    assert code == 0 and answer["fittingNodes"] == [inv.hostname], answer
    assert allocated(answer) == ["gpu-0-vfio"]


def test_a_vgpu_claim_on_a_vgpu_node(tmp_path: Path, inventory: Inventory) -> None:
    inv = vgpu(inventory("hgx-h200"), H200_TYPES)
    slices = write_slices(tmp_path / "slices", inv, DevicePolicy(virtualization="vgpu"))
    sel = 'device.attributes["gpu.tessera.dev"].vgpuType == "H200X-70C"'
    code, answer = explain(claim_file(tmp_path / "c.yaml", "vgpu.gpu.tessera.dev", sel), slices)
    assert code == 0 and answer["fittingNodes"] == [inv.hostname], answer
    assert allocated(answer) == ["gpu-0-vgpu-1429-0"]


@pytest.mark.parametrize("cls", ["vfio.gpu.tessera.dev", "vgpu.gpu.tessera.dev"])
def test_a_vm_claim_where_the_node_offers_none(
    tmp_path: Path, inventory: Inventory, cls: str
) -> None:
    plain = write_slices(tmp_path / "slices", inventory("l40s-pcie"), DevicePolicy())
    code, answer = explain(claim_file(tmp_path / "c.yaml", cls), plain)
    assert code == 1 and answer["fits"] is False
    ((node,),) = [answer["nodes"]]
    assert node["reason"].startswith("request gpu needs 1, 0 candidates (4 rejected: 4 class")
    text = json.dumps(answer)
    assert "class-selector" in text and f"class {cls} selector #0 is false" in text
    assert 'type=\\"gpu\\"' in text  # what the node's devices are instead
