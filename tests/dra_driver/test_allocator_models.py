"""The allocator on the ResourceSlices our driver publishes for simulated nodes, with the real
DeviceClasses and examples under deploy/daemonset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.device_model import AdvertisedDevice, DeviceModel, DevicePolicy, advertised_devices
from dra_driver.scheduler.celenv import CelEnvironment
from dra_driver.scheduler.explanation import explain
from tests.dra_driver.conftest import Inventory
from tests.dra_driver.test_devices import LAYOUTS

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


# -- dynamic MIG on the scheduler's model, with the counters the driver advertises ------------


def one_gpu_pool(inventory: Inventory, model: str) -> tuple[DeviceModel, list[dict[str, Any]]]:
    """GPU 0 of a model in dynamic MIG mode, alone in its pool (the other GPUs' counters are
    their own: test_devices.py checks that)."""
    full = advertised_devices(inventory(model), DevicePolicy(mig_mode="dynamic"))
    one = DeviceModel(
        devices=tuple(d for d in full.devices if d.gpu_minor == 0),
        counter_sets=full.counter_sets[:1],
    )
    return one, build_slices(one, SlicePolicy(driver_name="gpu.tessera.dev", node_name=model), 1)


def holding(pool: str, devices: list[str]) -> dict[str, Any]:
    """A claim the scheduler allocated ``devices`` to."""
    results = [
        {"request": "r", "driver": "gpu.tessera.dev", "pool": pool, "device": d} for d in devices
    ]
    return {
        "metadata": {"name": "held", "namespace": "other"},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def statuses(
    claim_class: str, slices: list[dict[str, Any]], held: dict[str, Any]
) -> dict[str, str]:
    """device -> "rejected: <kind>" or "ok", for a claim of one device of the class."""
    claim = {
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {
            "devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": claim_class}}]}
        },
    }
    e = explain(claim, CLASSES, slices, [held], cel=CelEnvironment())
    devices = e.to_json()["requests"][0]["alternatives"][0]["devices"]
    return {
        d["device"]: f"rejected: {d['reason']['kind']}" if d["status"] == "rejected" else "ok"
        for d in devices
    }


def clash(a: AdvertisedDevice, b: AdvertisedDevice) -> bool:
    """Whether a GPU can never hold both: they share a memory slot, or both are +me instances
    (one media-engine instance a GPU); the whole GPU clashes with every placement."""
    if a.kind == "gpu" or b.kind == "gpu":
        return True
    assert a.mig_placement_start is not None and b.mig_placement_start is not None
    a_end = a.mig_placement_start + (a.mig_placement_size or 0)
    b_end = b.mig_placement_start + (b.mig_placement_size or 0)
    overlap = a.mig_placement_start < b_end and b.mig_placement_start < a_end
    profile = {n: str(dict(d.attributes)["profile"]["string"]) for n, d in ((0, a), (1, b))}
    return overlap or all(p.endswith("+me") for p in profile.values())


@pytest.mark.parametrize("model", ["dgx-a100", "dgx-h100"], ids=str)
def test_the_scheduler_refuses_every_clashing_pair_and_only_those(
    inventory: Inventory, model: str
) -> None:
    devices, node = one_gpu_pool(inventory, model)
    for held in devices.devices:
        seen = statuses("mig.gpu.tessera.dev", node, holding(model, [held.name]))
        for d in devices.devices:
            if d.kind != "mig" or d.name == held.name:
                continue
            want = "rejected: counters" if clash(held, d) else "ok"
            assert seen[d.name] == want, (held.name, d.name)
        if held.kind == "mig" and any(d.kind == "gpu" for d in devices.devices):
            whole = statuses("gpu.tessera.dev", node, holding(model, [held.name]))
            assert whole["gpu-0"] == "rejected: counters", held.name


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=str)
def test_the_scheduler_completes_every_legal_layout(inventory: Inventory, layout: str) -> None:
    devices, node = one_gpu_pool(inventory, "dgx-a100")
    names = [
        next(
            d.name
            for d in devices.devices
            if (d.mig_profile_id, d.mig_placement_start) == (pid, start) and d.kind == "mig"
        )
        for pid, start in LAYOUTS[layout]
    ]
    seen = statuses("mig.gpu.tessera.dev", node, holding("dgx-a100", names[:-1]))
    assert seen[names[-1]] == "ok", (layout, names)
