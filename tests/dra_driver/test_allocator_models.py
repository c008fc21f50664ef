"""The allocator on the ResourceSlices our driver publishes for simulated nodes, with the real
DeviceClasses and examples under deploy/daemonset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.device_model import DevicePolicy, advertised_devices
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.explanation import explain
from tests.dra_driver.conftest import Inventory

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "daemonset"
CLASSES = list(yaml.safe_load_all((DEPLOY / "deviceclasses.yaml").read_text()))


def slices(inventory: Inventory, model: str, **policy: Any) -> list[dict[str, Any]]:
    devices = advertised_devices(inventory(model), DevicePolicy(**policy))
    return build_slices(
        devices, SlicePolicy(driver_name="gpu.tessera.dev", node_name=model), generation=1
    )


def example(name: str) -> dict[str, Any]:
    """The claim of an example file (a ResourceClaimTemplate's claim spec, normalised)."""
    for doc in yaml.safe_load_all((DEPLOY / "examples" / name).read_text()):
        if doc["kind"] == "ResourceClaim":
            return doc
        if doc["kind"] == "ResourceClaimTemplate":
            return {
                "metadata": {"name": doc["metadata"]["name"], "namespace": "default"},
                "spec": doc["spec"]["spec"],
            }
    raise AssertionError(name)


def mig_claim(profile: str, count: int) -> dict[str, Any]:
    sel = f'device.attributes["gpu.tessera.dev"].profile == "{profile}"'
    return {
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "mig",
                        "exactly": {
                            "deviceClassName": "mig.gpu.tessera.dev",
                            "count": count,
                            "selectors": [{"cel": {"expression": sel}}],
                        },
                    }
                ]
            }
        },
    }


def test_dynamic_mig_2g_fits_an_h100_not_an_a100_40gb(inventory: Inventory) -> None:
    claim = example("dynamic-mig-2g.yaml")
    h100 = explain(
        claim, CLASSES, slices(inventory, "dgx-h100", mig_mode="dynamic"), [], cel=CelEnvironment()
    )
    assert h100.ok, h100.text()
    a100 = explain(
        claim, CLASSES, slices(inventory, "dgx-a100", mig_mode="dynamic"), [], cel=CelEnvironment()
    )
    assert not a100.ok
    assert a100.first_reason().startswith("request mig needs 1, 0 candidates")
    assert "request selector false" in a100.first_reason()


def test_counters_of_an_allocated_placement_push_the_claim_to_the_next_gpus(
    inventory: Inventory,
) -> None:
    node = slices(inventory, "dgx-a100", mig_mode="dynamic")
    taken = {
        "metadata": {"name": "train", "namespace": "ml"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "r",
                            "driver": "gpu.tessera.dev",
                            "pool": "dgx-a100",
                            "device": "gpu-0-mig-7g40gb-0-0",
                        }
                    ]
                }
            }
        },
    }
    e = explain(mig_claim("1g.5gb", 8), CLASSES, node, [taken], cel=CelEnvironment())
    assert e.ok, e.text()
    chosen = [r["device"] for r in e.allocation()["devices"]["results"]]
    assert not any(d.startswith("gpu-0-") for d in chosen)
    assert len(chosen) == 8
    alt = e.to_json()["requests"][0]["alternatives"][0]
    gpu0 = next(d for d in alt["devices"] if d["device"] == "gpu-0-mig-1g5gb-19-0")
    assert gpu0["reason"]["kind"] == "counters"
    assert gpu0["reason"]["counterSet"] == "gpu-0-counter-set"
    assert "gpu-0-mig-7g40gb-0-0 (claim ml/train)" in gpu0["reason"]["text"]


def test_more_mig_devices_than_placements(inventory: Inventory) -> None:
    node = slices(inventory, "dgx-a100", mig_mode="dynamic")
    e = explain(mig_claim("3g.20gb", 17), CLASSES, node, [], cel=CelEnvironment())
    assert e.first_reason().startswith("request mig needs 17, 16 candidates")


def test_memory_share_example_on_shared_h100s(inventory: Inventory) -> None:
    node = slices(inventory, "dgx-h100", sharing="memory-shares")
    claim = example("memory-share-8gi.yaml")
    e = explain(claim, CLASSES, node, [], cel=CelEnvironment())
    assert e.ok, e.text()
    (result,) = e.allocation()["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": "8Gi"}
    full = [
        {
            "metadata": {"name": f"big-{i}", "namespace": "default"},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {
                                "request": "gpu",
                                "driver": "gpu.tessera.dev",
                                "pool": "dgx-h100",
                                "device": f"gpu-{i}",
                                "shareID": f"s{i}",
                                "consumedCapacity": {"memory": "75Gi"},
                            }
                        ]
                    }
                }
            },
        }
        for i in range(8)
    ]
    e = explain(claim, CLASSES, node, full, cel=CelEnvironment())
    assert not e.ok
    assert "8 capacity" in e.first_reason()
    assert "capacity memory too small: requested 8Gi" in e.text()


@pytest.mark.parametrize(("model", "fits"), [("dgx-h100", True), ("l40s-pcie", False)])
def test_four_nvlink_gpus(inventory: Inventory, model: str, fits: bool) -> None:
    e = explain(
        example("four-nvlink-gpus.yaml"),
        CLASSES,
        slices(inventory, model),
        [],
        cel=CelEnvironment(),
    )
    assert e.ok is fits, e.text()
    if not fits:
        assert e.first_reason().startswith("request gpus needs 4, 0 candidates")
