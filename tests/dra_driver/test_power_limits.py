"""``powerLimit`` in a GpuConfig: the forms it accepts, the ones it refuses (each message naming
the path, the value and what is allowed), and the plan's check against the GPU it lands on (its
NVML range, whether it is held alone, whether NVML can set its limit at all)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dra_driver.device_model import DeviceModel, DevicePolicy, advertised_devices
from dra_driver.errors import ClaimError, ParamsError
from dra_driver.kubeletplugin.claims import AllocatedDevice, Allocation, ClaimKey, OpaqueConfig
from dra_driver.kubeletplugin.params import API_VERSION, validate, watts
from dra_driver.kubeletplugin.plan import SharingPolicy, plan_claim

CLAIM = ClaimKey("ns", "a", "uid-a")


def config(power: Any, kind: str = "GpuConfig", **extra: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": kind, "powerLimit": power, **extra}


@pytest.mark.parametrize(
    ("value", "milliwatts"),
    [("300W", 300_000), ("287.5W", 287_500), ("0.3kW", 300_000), ("1.5kW", 1_500_000),
     ("0.001W", 1), (" 350W ", 350_000), ("10kW", 10_000_000)],
)  # fmt: skip
def test_accepted_forms_decode_to_milliwatts(value: str, milliwatts: int) -> None:
    assert validate(config(value)).power_limit_mw == milliwatts


def test_no_power_limit_leaves_the_gpu_alone() -> None:
    assert validate({"apiVersion": API_VERSION, "kind": "GpuConfig"}).power_limit_mw is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (300, '300 has no unit (watts or milliwatts?); write "300W" for watts'),
        ("300", '"300" has no unit (watts or milliwatts?); write "300W" for watts'),
        ("300w", 'unit "w" of "300w" is not allowed (did you mean W?)'),
        ("300KW", 'unit "KW" of "300KW" is not allowed (did you mean kW?)'),
        ("300mW", 'unit "mW" of "300mW" is not allowed;'),
        ("300 W", '"300 W" is not a power'),
        ("-5W", '"-5W" is not a power'),
        ("0W", '"0W" is not more than 0'),
        ("0.0001W", '"0.0001W" is finer than 1mW'),
        ("10.001kW", '"10.001kW" is too large'),
        (True, "true is a boolean;"),
        ({"watts": 300}, '{"watts": 300} is an object;'),
    ],
)
def test_refused_forms_say_what_is_wrong_and_what_is_allowed(value: Any, problem: str) -> None:
    with pytest.raises(ParamsError) as e:
        validate(config(value))
    message = str(e.value)
    assert message.startswith("parameters.powerLimit: ")
    assert problem in message
    assert 'allowed: a string of a number and a unit, W or kW, such as "300W"' in message


def test_a_mig_device_config_cannot_cap_power_and_says_why() -> None:
    with pytest.raises(ParamsError) as e:
        validate(config("100W", kind="MigDeviceConfig"))
    assert str(e.value) == (
        "parameters.powerLimit: not allowed on a MigDeviceConfig: a MIG device has no power limit"
        " of its own (NVML's power limit is the physical GPU's, shared by all its MIG devices);"
        " cap a whole GPU with a GpuConfig instead"
    )


@pytest.mark.parametrize("strategy", ["TimeSlicing", "MPS"])
def test_a_shared_gpu_cannot_be_capped(strategy: str) -> None:
    with pytest.raises(ParamsError) as e:
        validate(config("300W", sharing={"strategy": strategy}))
    assert str(e.value).startswith(
        f"parameters.powerLimit: only allowed with strategy Exclusive, and the strategy is"
        f" {strategy}: a power limit caps the whole GPU"
    )


def test_exclusive_said_out_loud_is_fine() -> None:
    assert validate(config("300W", sharing={"strategy": "Exclusive"})).power_limit_mw == 300_000


def test_watts_are_written_as_people_write_them() -> None:
    assert [watts(v) for v in (300_000, 287_500, 1, 1_000_000)] == [
        "300W", "287.5W", "0.001W", "1000W"
    ]  # fmt: skip


# -- the plan: the GPU the config lands on ----------------------------------------------------


@pytest.fixture
def h100(inventory: Any) -> DeviceModel:
    return advertised_devices(inventory("dgx-h100"), DevicePolicy())


def allocation(*devices: str, cfg: dict[str, Any] | None) -> Allocation:
    return Allocation(
        claim=CLAIM,
        devices=tuple(AllocatedDevice("gpu", "gpu.tessera.dev", "node-a", d) for d in devices),
        configs=(OpaqueConfig("FromClaim", (), cfg),) if cfg is not None else (),
    )


def test_a_cap_in_the_gpus_range_is_planned_on_each_gpu_of_the_config(h100: DeviceModel) -> None:
    plan = plan_claim(allocation("gpu-0", "gpu-1", cfg=config("350W")), h100)
    assert [(p.device.name, p.power_limit_mw) for p in plan.devices] == [
        ("gpu-0", 350_000), ("gpu-1", 350_000)
    ]  # fmt: skip
    assert all(p.sharing is None for p in plan.devices)


def test_the_advertised_range_is_the_one_checked(h100: DeviceModel) -> None:
    attrs = dict(h100.device("gpu-0").attributes)
    low, high = (
        int(str(attrs["powerLimitMinWatts"]["int"])),
        int(str(attrs["powerLimitMaxWatts"]["int"])),
    )
    for edge in (low, high):
        plan = plan_claim(allocation("gpu-0", cfg=config(f"{edge}W")), h100)
        assert plan.devices[0].power_limit_mw == edge * 1000


@pytest.mark.parametrize("value", ["199.999W", "700.001W", "50W", "1kW"])
def test_a_cap_outside_the_range_names_the_device_value_and_range(
    h100: DeviceModel, value: str
) -> None:
    with pytest.raises(ParamsError) as e:
        plan_claim(allocation("gpu-3", cfg=config(value)), h100)
    shown = watts(validate(config(value)).power_limit_mw or 0)
    assert str(e.value) == (
        f"gpu-3: powerLimit {shown} is outside the GPU's range; allowed: 200W to 700W (its"
        " default: 700W)"
    )


def test_a_gpu_without_power_management_is_refused(h100: DeviceModel) -> None:
    bare = dataclasses.replace(h100.device("gpu-0"), power_limits=None)
    model = DeviceModel(devices=(bare,), counter_sets=())
    with pytest.raises(ParamsError) as e:
        plan_claim(allocation("gpu-0", cfg=config("300W")), model)
    assert "gpu-0: powerLimit 300W: this GPU's power limit cannot be set (NVML answers" in str(
        e.value
    )


def test_a_memory_share_cannot_be_capped(inventory: Any) -> None:
    model = advertised_devices(inventory("dgx-h100"), DevicePolicy(sharing="memory-shares"))
    cfg = config("300W", sharing={"strategy": "MPS"})
    with pytest.raises(ParamsError):  # MPS and a cap: refused by the config itself
        plan_claim(allocation("gpu-0", cfg=cfg), model, SharingPolicy(mode="memory-shares"))
    with pytest.raises(ClaimError) as e:  # no strategy: Exclusive, which a share cannot be
        plan_claim(
            allocation("gpu-0", cfg=config("300W")), model, SharingPolicy(mode="memory-shares")
        )
    assert e.value.reason == "sharing_mismatch"
    assert "asks to hold it alone with strategy Exclusive" in str(e.value)


def test_time_slicing_nodes_still_cap_a_gpu_held_alone(inventory: Any) -> None:
    model = advertised_devices(inventory("dgx-h100"), DevicePolicy(sharing="time-slicing"))
    plan = plan_claim(
        allocation("gpu-0", cfg=config("400W")), model, SharingPolicy(mode="time-slicing")
    )
    assert (plan.devices[0].sharing, plan.devices[0].power_limit_mw) == (None, 400_000)


def test_mig_devices_of_a_claim_are_not_capped_by_its_gpu_config(inventory: Any) -> None:
    model = advertised_devices(inventory("dgx-h100"), DevicePolicy(mig_mode="dynamic"))
    placement = next(d.name for d in model.devices if d.kind == "mig")
    plan = plan_claim(allocation("gpu-1", placement, cfg=config("400W")), model)
    assert {p.device.name: p.power_limit_mw for p in plan.devices} == {
        "gpu-1": 400_000, placement: None
    }  # fmt: skip
