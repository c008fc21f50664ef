"""The simulator's power under a cap: a limit set through NVML is kept (in the state directory,
for every process) until a driver reload, the draw never exceeds it, the GPU runs slower rather
than less busy, and the energy counter integrates the capped power. Time is a fake clock."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from agent.sim.nvml import FakeNvml
from tests.fakeclock import FakeClock

H100_MIN_MW, H100_MAX_MW = 200_000, 700_000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def sim(make_fake: Callable[..., FakeNvml], clock: FakeClock) -> Callable[..., FakeNvml]:
    def make(model: str = "dgx-h100", **kw: Any) -> FakeNvml:
        kw.setdefault("clock", clock)
        return make_fake(model, **kw)

    return make


def energy_rate_w(fake: FakeNvml, h: Any, clock: FakeClock, seconds: float = 10.0) -> float:
    """Watts from the energy counter over ``seconds`` of the fake clock."""
    before = fake.nvmlDeviceGetTotalEnergyConsumption(h)
    clock.advance(seconds)
    return (fake.nvmlDeviceGetTotalEnergyConsumption(h) - before) / 1000 / seconds


def test_nvml_reports_the_range_and_default_of_each_product(sim: Callable[..., FakeNvml]) -> None:
    for model, (low, high) in (("dgx-h100", (200_000, 700_000)), ("dgx-a100", (100_000, 400_000))):
        fake = sim(model)
        h = fake.nvmlDeviceGetHandleByIndex(0)
        assert fake.nvmlDeviceGetPowerManagementLimitConstraints(h) == [low, high]
        assert fake.nvmlDeviceGetPowerManagementDefaultLimit(h) == high
        assert fake.nvmlDeviceGetPowerManagementLimit(h) == high


def test_a_gpu_capped_at_half_its_limit_uses_less_energy_per_second_under_the_same_load(
    sim: Callable[..., FakeNvml], clock: FakeClock
) -> None:
    fake = sim()
    free, capped = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    for index in (0, 1):
        fake.set_load(index, 1.0)
    fake.nvmlDeviceSetPowerManagementLimit(capped, H100_MAX_MW // 2)
    free_w = energy_rate_w(fake, free, clock)
    capped_w = energy_rate_w(fake, capped, clock)
    assert free_w == pytest.approx(700.0)
    assert capped_w == pytest.approx(350.0)
    assert capped_w < free_w
    # the same work keeps the GPU as busy, at a lower clock, and says why
    assert fake.nvmlDeviceGetUtilizationRates(capped).gpu == 100
    assert fake.nvmlDeviceGetClockInfo(capped, pynvml.NVML_CLOCK_SM) < fake.nvmlDeviceGetClockInfo(
        free, pynvml.NVML_CLOCK_SM
    )
    reasons = fake.nvmlDeviceGetCurrentClocksEventReasons(capped)
    assert reasons & pynvml.nvmlClocksEventReasonSwPowerCap


@pytest.mark.parametrize("load", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_the_draw_never_exceeds_the_cap(sim: Callable[..., FakeNvml], load: float) -> None:
    fake = sim()
    h = fake.nvmlDeviceGetHandleByIndex(2)
    fake.set_load(2, load)
    for cap in (H100_MIN_MW, 300_000, 500_000, H100_MAX_MW):
        fake.nvmlDeviceSetPowerManagementLimit(h, cap)
        draw = fake.nvmlDeviceGetPowerUsage(h)
        assert draw <= cap
        assert fake.nvmlDeviceGetEnforcedPowerLimit(h) == cap
        fields = fake.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_POWER_INSTANT])
        assert fields[0].value.uiVal == draw


def test_a_cap_above_the_draw_changes_nothing(
    sim: Callable[..., FakeNvml], clock: FakeClock
) -> None:
    fake = sim()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.set_load(0, 0.2)
    idle_ish = fake.nvmlDeviceGetPowerUsage(h)
    clock_before = fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
    fake.nvmlDeviceSetPowerManagementLimit(h, 600_000)
    assert fake.nvmlDeviceGetPowerUsage(h) == idle_ish
    assert fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == clock_before
    assert fake.nvmlDeviceGetCurrentClocksEventReasons(h) == 0


def test_energy_before_the_cap_is_counted_at_the_old_power(
    sim: Callable[..., FakeNvml], clock: FakeClock
) -> None:
    fake = sim()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.set_load(0, 1.0)
    start = fake.nvmlDeviceGetTotalEnergyConsumption(h)
    clock.advance(10)
    fake.nvmlDeviceSetPowerManagementLimit(h, 350_000)
    clock.advance(10)
    assert fake.nvmlDeviceGetTotalEnergyConsumption(h) - start == 10 * 700_000 + 10 * 350_000


def test_the_limit_is_kept_for_other_processes_until_a_driver_reload(
    sim: Callable[..., FakeNvml],
) -> None:
    fake = sim()
    fake.nvmlDeviceSetPowerManagementLimit(fake.nvmlDeviceGetHandleByIndex(4), 400_000)
    other = sim()  # another process over the same state directory
    h = other.nvmlDeviceGetHandleByIndex(4)
    assert other.nvmlDeviceGetPowerManagementLimit(h) == 400_000
    assert other.nvmlDeviceGetPowerManagementLimit(other.nvmlDeviceGetHandleByIndex(5)) == 700_000
    other.reload_driver()
    assert fake.nvmlDeviceGetPowerManagementLimit(fake.nvmlDeviceGetHandleByIndex(4)) == 700_000


@pytest.mark.parametrize("milliwatts", [H100_MIN_MW - 1, H100_MAX_MW + 1, 0])
def test_a_limit_outside_the_range_is_an_invalid_argument(
    sim: Callable[..., FakeNvml], milliwatts: int
) -> None:
    fake = sim()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceSetPowerManagementLimit(h, milliwatts)
    assert fake.nvmlDeviceGetPowerManagementLimit(h) == H100_MAX_MW


def test_a_mig_device_has_no_power_limit_of_its_own(sim: Callable[..., FakeNvml]) -> None:
    fake = sim("dgx-a100", mig_layout="balanced")
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(fake.nvmlDeviceGetHandleByIndex(0), 0)
    for call in (
        lambda: fake.nvmlDeviceSetPowerManagementLimit(mig, 300_000),
        lambda: fake.nvmlDeviceGetPowerManagementLimitConstraints(mig),
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
