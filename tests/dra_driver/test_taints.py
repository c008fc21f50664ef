"""Unhealthy GPUs in the published model: tainted (``--device-taints``) or withdrawn, every
device whose parent is the GPU, in every MIG and sharing mode; the slices stay valid."""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import pytest

from dra_driver.advertise.publisher import Plan, Publisher, plan_changes
from dra_driver.advertise.slice_limits import (
    MAX_DEVICES_WITH_TAINTS_OR_COUNTERS,
    check_pool,
    check_slice,
)
from dra_driver.advertise.slice_stores import DirSliceStore
from dra_driver.advertise.slices import SlicePolicy, build_slices
from dra_driver.advertise.taints import UnhealthyGpu, UnhealthyGpus, rfc3339, taint_key, with_health
from dra_driver.device_model import DeviceModel, DevicePolicy, advertised_devices
from tests.dra_driver.conftest import Inventory
from tests.k8sschema import validate as validate_k8s

DRIVER = "gpu.tessera.dev"
VERSIONS = ("1.34.0", "1.35.0")
SINCE = 1_790_000_000.7
MODES = [
    (model, mig, mig_mode, sharing)
    for model, mig in (("dgx-h100", "balanced"), ("dgx-a100", None), ("mixed", None))
    for mig_mode in ("static", "dynamic")
    for sharing in ("none", "time-slicing", "memory-shares")
]


def model_of(inventory: Inventory, name: str, mig: str | None, mode: str, sharing: str):
    inv = inventory(name, mig)
    return inv, advertised_devices(inv, DevicePolicy(mig_mode=mode, sharing=sharing))


def sick(*uuids: str, cause: str = "xid-79") -> dict[str, UnhealthyGpu]:
    return {u: UnhealthyGpu(u, cause, SINCE) for u in uuids}


def first_gpus(model: DeviceModel, n: int) -> list[str]:
    return list(dict.fromkeys(d.parent_uuid for d in model.devices))[:n]


@pytest.mark.parametrize(("name", "mig", "mode", "sharing"), MODES)
def test_taints_mark_exactly_the_devices_of_unhealthy_gpus(
    inventory: Inventory, name: str, mig: str | None, mode: str, sharing: str
) -> None:
    _, model = model_of(inventory, name, mig, mode, sharing)
    bad = first_gpus(model, 2)
    out = with_health(model, sick(*bad), taints=True, driver_name=DRIVER)
    assert [d.name for d in out.devices] == [d.name for d in model.devices]
    assert out.counter_sets == model.counter_sets
    for before, after in zip(model.devices, out.devices, strict=True):
        if before.parent_uuid in bad:
            assert after.api()["taints"] == [
                {
                    "key": "gpu.tessera.dev/unhealthy",
                    "value": "xid-79",
                    "effect": "NoSchedule",
                    "timeAdded": rfc3339(SINCE),
                }
            ]
            assert {k: v for k, v in after.api().items() if k != "taints"} == before.api()
        else:
            assert after == before
    assert sum(1 for d in out.devices if d.taints) > 1 or mode == "static"


@pytest.mark.parametrize(("name", "mig", "mode", "sharing"), MODES)
def test_without_taints_the_devices_and_their_counter_sets_are_withdrawn(
    inventory: Inventory, name: str, mig: str | None, mode: str, sharing: str
) -> None:
    _, model = model_of(inventory, name, mig, mode, sharing)
    bad = first_gpus(model, 1)
    out = with_health(model, sick(*bad), taints=False, driver_name=DRIVER)
    assert [d.name for d in out.devices] == [
        d.name for d in model.devices if d.parent_uuid not in bad
    ]
    assert all(not d.taints for d in out.devices)
    consumed = {s for d in out.devices for s, _ in d.consumes_counters}
    assert {cs.name for cs in out.counter_sets} == consumed
    withdrawn = {s for d in model.devices if d.parent_uuid in bad for s, _ in d.consumes_counters}
    assert not withdrawn & {cs.name for cs in out.counter_sets}
    assert (
        bool(withdrawn)
        == (
            mode == "dynamic"
            and any(d.kind == "mig" for d in model.devices if d.parent_uuid in bad)
        )
        or withdrawn
    )


def test_healthy_gpus_leave_the_model_as_it_is(inventory: Inventory) -> None:
    _, model = model_of(inventory, "dgx-h100", None, "dynamic", "none")
    assert with_health(model, {}, taints=True, driver_name=DRIVER) is model
    assert with_health(model, sick("GPU-not-here"), taints=False, driver_name=DRIVER) is model


@pytest.mark.parametrize("layout", ["1.34", "1.35"])
@pytest.mark.parametrize("taints", [True, False], ids=["taints", "withdrawn"])
@pytest.mark.parametrize(
    ("name", "mig", "mode"),
    [
        ("dgx-h100", "all-1g", "static"),
        ("dgx-h100", None, "dynamic"),
        ("dgx-a100", "balanced", "static"),
        ("mixed", None, "dynamic"),
    ],
)
def test_slices_with_unhealthy_gpus_are_valid(
    inventory: Inventory, name: str, mig: str | None, mode: str, taints: bool, layout: str
) -> None:
    inv, model = model_of(inventory, name, mig, mode, "time-slicing")
    everything = first_gpus(model, 100)
    for bad in (everything[:1], everything):  # one GPU, and every GPU of the node
        out = with_health(model, sick(*bad, cause="gpu-lost"), taints=taints, driver_name=DRIVER)
        slices = build_slices(out, SlicePolicy(DRIVER, inv.hostname, "uid-1", layout), 3)
        for obj in slices:
            for version in VERSIONS:
                validate_k8s(obj, version)
            assert check_slice(obj, layout) == []
            devices = obj["spec"].get("devices") or []
            if layout == "1.35" and any("taints" in d for d in devices):
                assert len(devices) <= MAX_DEVICES_WITH_TAINTS_OR_COUNTERS
        assert check_pool(slices, layout) == []
        published = [d for s in slices for d in s["spec"].get("devices") or []]
        assert len(published) == len(out.devices)


def test_many_tainted_devices_split_into_slices_of_64(inventory: Inventory) -> None:
    inv, model = model_of(inventory, "dgx-h100", None, "static", "none")
    many = DeviceModel(
        devices=tuple(dataclasses.replace(model.devices[0], name=f"gpu-x{i}") for i in range(100)),
        counter_sets=(),
    )
    plain = build_slices(many, SlicePolicy(DRIVER, inv.hostname, None, "1.35"), 1)
    assert [len(s["spec"]["devices"]) for s in plain] == [100]
    uuid = model.devices[0].parent_uuid
    tainted = with_health(many, sick(uuid), taints=True, driver_name=DRIVER)
    slices = build_slices(tainted, SlicePolicy(DRIVER, inv.hostname, None, "1.35"), 1)
    assert [len(s["spec"]["devices"]) for s in slices] == [64, 36]
    assert check_pool(slices, "1.35") == []


def test_the_taint_key_uses_the_driver_name_as_domain() -> None:
    assert taint_key("gpu.example.com") == "gpu.example.com/unhealthy"
    assert rfc3339(0.9) == "1970-01-01T00:00:00Z"


def _applied(stored: list[dict[str, Any]], plan: Plan) -> list[dict[str, Any]]:
    """The pool once ``plan`` is written over ``stored``."""
    by_name = {o["metadata"]["name"]: o for o in stored}
    for o in (*plan.creates, *plan.updates):
        by_name[o["metadata"]["name"]] = o
    return [o for n, o in sorted(by_name.items()) if n not in plan.deletes]


def test_re_rendering_an_unchanged_health_state_writes_nothing(inventory: Inventory) -> None:
    """A health change is one round of writes: a taint touches only the slice of the GPU's
    devices (one write in place, the generation kept); withdrawing the GPU changes the counters
    slice too (a new generation, every slice); re-rendering the same state writes nothing."""
    inv, model = model_of(inventory, "dgx-h100", "balanced", "dynamic", "none")
    policy = SlicePolicy(DRIVER, inv.hostname, "uid-1", "1.35")
    bad = first_gpus(model, 1)
    for taints, generation in ((True, 1), (False, 2)):
        stored = build_slices(model, policy, 1)
        unhealthy = with_health(model, sick(*bad), taints=taints, driver_name=DRIVER)
        plan = plan_changes(stored, unhealthy, policy, 1)
        assert plan.writes > 0 and plan.generation == generation  # the health change: one round
        assert plan.writes == (1 if taints else len(stored))
        stored = _applied(stored, plan)
        again = with_health(model, sick(*bad), taints=taints, driver_name=DRIVER)
        assert plan_changes(stored, again, policy, generation).writes == 0  # steady: nothing
        back = plan_changes(stored, model, policy, generation)  # recovered: one round back
        assert back.writes > 0 and back.generation == (1 if taints else 3)


def test_the_unhealthy_set_is_a_snapshot() -> None:
    gpus = UnhealthyGpus()
    gpus.update("GPU-1", UnhealthyGpu("GPU-1", "xid-48", 1.0))
    seen = gpus.snapshot()
    gpus.update("GPU-1", None)
    assert list(seen) == ["GPU-1"] and dict(gpus.snapshot()) == {}
    with pytest.raises(TypeError):
        seen["GPU-2"] = UnhealthyGpu("GPU-2", "gpu-lost", 1.0)  # type: ignore[index]


class GateOff(DirSliceStore):
    """An API server without the DRADeviceTaints gate: it stores devices without taints."""

    def _write(self, obj, previous):
        obj = copy.deepcopy(obj)
        for dev in obj["spec"].get("devices") or []:
            dev.pop("taints", None)
        return super()._write(obj, previous)


def test_a_server_that_drops_taints_is_noticed_once_and_the_hook_called(
    inventory: Inventory, tmp_path, caplog
) -> None:
    inv, model = model_of(inventory, "dgx-h100", None, "static", "none")
    calls: list[bool] = []
    publisher = Publisher(
        GateOff(tmp_path),
        SlicePolicy(DRIVER, inv.hostname),
        logging.getLogger("test.taints"),
        on_taints_dropped=lambda: calls.append(publisher.taints_dropped),
    )
    publisher.set_devices(model)
    publisher.reconcile()
    assert not publisher.taints_dropped  # nothing tainted yet: nothing to notice
    tainted = with_health(model, sick(*first_gpus(model, 1)), taints=True, driver_name=DRIVER)
    publisher.set_devices(tainted)
    with caplog.at_level(logging.ERROR):
        publisher.reconcile()
        publisher.reconcile()  # written again (the stored copy differs): noticed only once
    assert publisher.taints_dropped and calls == [True]
    assert sum("DRADeviceTaints" in r.message for r in caplog.records) == 1
    withdrawn = with_health(model, sick(*first_gpus(model, 1)), taints=False, driver_name=DRIVER)
    publisher.set_devices(withdrawn)
    publisher.reconcile()
    assert publisher.reconcile().writes == 0  # what the agent falls back to converges


def test_a_server_that_keeps_taints_is_not_mistaken(inventory: Inventory, tmp_path) -> None:
    inv, model = model_of(inventory, "dgx-h100", None, "static", "none")
    publisher = Publisher(
        DirSliceStore(tmp_path), SlicePolicy(DRIVER, inv.hostname), logging.getLogger("t")
    )
    publisher.set_devices(
        with_health(model, sick(*first_gpus(model, 1)), taints=True, driver_name=DRIVER)
    )
    publisher.reconcile()
    assert not publisher.taints_dropped and publisher.reconcile().writes == 0
