"""Simulated telemetry: load model, counters, fields, processes, GPM, events, faults and the
``tessera sim fault`` command. Time comes from a fake clock; nothing reads the wall clock."""

import inspect
import io
import json
import subprocess
import sys
import textwrap

import pynvml
import pytest

from agent.cli import main
from agent.errors import ConfigError
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from agent.sim.telemetry_state import (
    STATE_FILE,
    TelemetryState,
    telemetry_from_json,
    telemetry_to_json,
)
from tests.fakeclock import FakeClock
from tests.sim.test_signatures import signature_mismatches, simulated_calls

MIB = 1024 * 1024
GIB = 1024 * MIB
ALL_LINKS = 0xFFFFFFFF
NOT_MIG = 0xFFFFFFFF
XID = pynvml.nvmlEventTypeXidCriticalError


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def sim(make_fake, clock):
    """``sim(model, **kw)``: an initialized FakeNvml on the test's state dir and fake clock."""

    def make(model: str, **kw) -> FakeNvml:
        kw.setdefault("clock", clock)
        return make_fake(model, **kw)

    return make


def field(fake, handle, field_id, scope=0):
    (value,) = fake.nvmlDeviceGetFieldValues(handle, [(field_id, scope)])
    return value


def field_value(fake, handle, field_id, scope=0):
    v = field(fake, handle, field_id, scope)
    assert v.nvmlReturn == pynvml.NVML_SUCCESS, v
    return (
        v.value.ullVal
        if v.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        else v.value.uiVal
    )


# -- load model ------------------------------------------------------------------------------


def test_power_utilization_clocks_follow_the_load(sim, clock):
    fake = sim("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000  # mW
    assert fake.nvmlDeviceGetPowerManagementLimit(h) == 700_000
    idle = fake.nvmlDeviceGetPowerUsage(h)
    assert idle == 84_000  # 12 % of the limit, mW
    util = fake.nvmlDeviceGetUtilizationRates(h)
    assert isinstance(util, pynvml.c_nvmlUtilization_t)
    assert (util.gpu, util.memory) == (0, 0)
    assert fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 345
    assert fake.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonGpuIdle

    fake.set_load(0, 0.5)
    util = fake.nvmlDeviceGetUtilizationRates(h)
    assert (util.gpu, util.memory) == (50, 30)
    assert fake.nvmlDeviceGetPowerUsage(h) == 84_000 + round(0.5 * (700_000 - 84_000))
    assert fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
    assert fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM) == 2619
    assert fake.nvmlDeviceGetCurrentClocksThrottleReasons(h) == 0
    assert fake.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) > 30
    assert fake.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES) > 0
    assert fake.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES) > 0

    fake.set_load(0, 1.0)
    assert fake.nvmlDeviceGetPowerUsage(h) == 700_000
    reasons = fake.nvmlDeviceGetCurrentClocksEventReasons(h)
    assert reasons == pynvml.nvmlClocksEventReasonSwPowerCap
    other = fake.nvmlDeviceGetHandleByIndex(1)
    assert fake.nvmlDeviceGetPowerUsage(other) == idle  # per GPU


def test_memory_used_follows_the_load(sim):
    fake = sim("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    before = fake.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
    fake.set_load(0, 0.2, memory_used_bytes=10 * GIB)
    fake.add_process(0, 4242, 2 * GIB)
    v2 = fake.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)
    assert v2.used == 12 * GIB
    assert v2.free == before.free - 12 * GIB
    v1 = fake.nvmlDeviceGetMemoryInfo(h)
    assert v1.used == 12 * GIB + v2.reserved and v1.free == v2.free
    fake.set_load(0, 0.3)  # memory unchanged when not given
    assert fake.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2).used == 12 * GIB


def test_energy_is_the_integral_of_power(sim, clock):
    fake = sim("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(3)
    start = fake.nvmlDeviceGetTotalEnergyConsumption(h)
    integral_mj = 0.0
    schedule = [(0.0, 7.0), (0.35, 13.5), (1.0, 4.25), (0.8, 20.0), (0.05, 9.0)]
    for utilization, seconds in schedule:
        fake.set_load(3, utilization)
        for _ in range(10):  # power is sampled as a collector would
            integral_mj += fake.nvmlDeviceGetPowerUsage(h) * seconds / 10
            clock.advance(seconds / 10)
    fake.add_process(3, 77, GIB, sm_utilization=0.4)
    integral_mj += fake.nvmlDeviceGetPowerUsage(h) * 30
    clock.advance(30)
    energy = fake.nvmlDeviceGetTotalEnergyConsumption(h) - start
    assert energy == pytest.approx(integral_mj, rel=1e-3)
    assert field_value(fake, h, pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION) == (
        fake.nvmlDeviceGetTotalEnergyConsumption(h)
    )


def test_nothing_changes_while_the_clock_stands_still(sim, clock):
    fake = sim("dgx-h100")
    fake.set_load(0, 0.9)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    first = fake.nvmlDeviceGetTotalEnergyConsumption(h)
    assert fake.nvmlDeviceGetTotalEnergyConsumption(h) == first
    clock.advance(2)
    assert fake.nvmlDeviceGetTotalEnergyConsumption(h) == first + 2 * 700_000 * 0.12 + round(
        2 * 0.9 * 616_000
    )


def test_energy_continues_across_a_restart_and_resets_on_driver_reload(sim, clock, state_dir):
    fake = sim("dgx-h100")
    fake.set_load(0, 0.5)
    clock.advance(100)
    h = fake.nvmlDeviceGetHandleByIndex(0)
    before = fake.nvmlDeviceGetTotalEnergyConsumption(h)
    assert before > 0
    fake.nvmlShutdown()

    clock.advance(10)  # the driver kept counting while no agent ran
    again = FakeNvml(load_model("dgx-h100"), state_dir, clock=clock)
    again.nvmlInit()
    h = again.nvmlDeviceGetHandleByIndex(0)
    assert again.nvmlDeviceGetTotalEnergyConsumption(h) == before + 10 * 392_000
    assert again.nvmlDeviceGetUtilizationRates(h).gpu == 50  # the load persisted too

    again.inject_errors(0, ecc_corrected=3, pcie_replays=2, remapped_correctable=1)
    again.reload_driver()
    assert again.nvmlDeviceGetTotalEnergyConsumption(h) == 0
    assert again.nvmlDeviceGetUtilizationRates(h).gpu == 0  # processes ended with the driver
    assert field_value(again, h, pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL) == 0
    assert field_value(again, h, pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL) == 3
    assert field_value(again, h, pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER) == 0
    assert field_value(again, h, pynvml.NVML_FI_DEV_REMAPPED_COR) == 1
    assert again.telemetry_state.driver_generation == 1
    clock.advance(1)
    assert again.nvmlDeviceGetTotalEnergyConsumption(h) == 84_000


def test_a_clock_that_restarted_is_a_reboot(sim, clock, state_dir):
    fake = sim("dgx-h100")
    fake.set_load(0, 1.0)
    clock.advance(50)
    rebooted = FakeNvml(load_model("dgx-h100"), state_dir, clock=FakeClock(3.0))
    rebooted.nvmlInit()
    h = rebooted.nvmlDeviceGetHandleByIndex(0)
    assert rebooted.nvmlDeviceGetTotalEnergyConsumption(h) == 0
    assert rebooted.nvmlDeviceGetUtilizationRates(h).gpu == 0
    assert rebooted.telemetry_state.driver_generation == 1


# -- field values ----------------------------------------------------------------------------


def test_field_values_array_and_units_on_h100(sim, clock):
    fake = sim("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.set_load(0, 0.5)
    clock.advance(10)
    ids = [
        pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
        pynvml.NVML_FI_DEV_POWER_INSTANT,
        pynvml.NVML_FI_DEV_MEMORY_TEMP,
        pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER,
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
        pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,
        pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
        pynvml.NVML_FI_DEV_REMAPPED_COR,
        pynvml.NVML_FI_DEV_REMAPPED_UNC,
        pynvml.NVML_FI_DEV_REMAPPED_PENDING,
    ]
    values = fake.nvmlDeviceGetFieldValues(h, ids)
    assert isinstance(values[0], pynvml.c_nvmlFieldValue_t) and len(values) == len(ids)
    assert [v.nvmlReturn for v in values] == [pynvml.NVML_SUCCESS] * len(ids)
    assert [v.fieldId for v in values] == [i if isinstance(i, int) else i[0] for i in ids]
    assert values[4].scopeId == ALL_LINKS
    assert values[1].value.uiVal == fake.nvmlDeviceGetPowerUsage(h)
    assert values[2].value.uiVal > fake.nvmlDeviceGetTemperature(h, 0)  # HBM runs warmer
    assert values[4].value.ullVal > 0 and values[5].value.ullVal > 0
    assert values[4].timestamp == int(clock() * 1e6)


def test_nvlink_scope_is_the_link_and_all_links_sum(sim, clock):
    fake = sim("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    fake.set_load(0, 0.25)
    clock.advance(3)
    tx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    per_link = [field_value(fake, h, tx, link) for link in range(18)]
    assert field_value(fake, h, tx, ALL_LINKS) == sum(per_link) > 0
    assert field(fake, h, tx, 18).nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert field_value(fake, h, pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT) == 18


def test_fields_the_product_lacks_are_not_supported(sim):
    fake = sim("l40s-pcie")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    lacking = [
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
        (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 0),
        pynvml.NVML_FI_DEV_MEMORY_TEMP,  # GDDR6: no memory sensor
        pynvml.NVML_FI_DEV_RETIRED_SBE,  # row remapping replaced page retirement
    ]
    values = fake.nvmlDeviceGetFieldValues(h, lacking)
    assert [v.nvmlReturn for v in values] == [pynvml.NVML_ERROR_NOT_SUPPORTED] * 4
    ok = fake.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, 400])
    assert [v.nvmlReturn for v in ok] == [pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_INVALID_ARGUMENT]


def test_mig_device_handles_have_no_power_or_fields(sim):
    fake = sim("dgx-a100")  # balanced MIG layout by default
    h = fake.nvmlDeviceGetHandleByIndex(0)
    mh = fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetPowerUsage(mh)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetUtilizationRates(h)  # no whole-GPU utilization in MIG mode
    (v,) = fake.nvmlDeviceGetFieldValues(mh, [pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION])
    assert v.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert fake.nvmlDeviceGetClockInfo(mh, pynvml.NVML_CLOCK_SM) == fake.nvmlDeviceGetClockInfo(
        h, pynvml.NVML_CLOCK_SM
    )
    assert fake.nvmlDeviceGetPowerUsage(h) == 48_000


# -- processes -------------------------------------------------------------------------------


def test_processes_and_process_utilization(sim, clock):
    fake = sim("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(2)
    assert fake.nvmlDeviceGetComputeRunningProcesses(h) == []
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetProcessUtilization(h, 0)
    fake.add_process(2, 300, 3 * GIB, sm_utilization=0.3)
    fake.add_process(2, 200, 1 * GIB)  # no utilization sample
    procs = fake.nvmlDeviceGetComputeRunningProcesses(h)
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(200, GIB), (300, 3 * GIB)]
    assert {(p.gpuInstanceId, p.computeInstanceId) for p in procs} == {(NOT_MIG, NOT_MIG)}
    assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 30
    (sample,) = fake.nvmlDeviceGetProcessUtilization(h, 0)
    assert isinstance(sample, pynvml.c_nvmlProcessUtilizationSample_t)
    assert (sample.pid, sample.smUtil, sample.timeStamp) == (300, 30, int(clock() * 1e6))
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than what was seen
        fake.nvmlDeviceGetProcessUtilization(h, sample.timeStamp)
    clock.advance(1)
    assert len(fake.nvmlDeviceGetProcessUtilization(h, sample.timeStamp)) == 1
    fake.remove_process(2, 300)
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetProcessUtilization(h, 0)
    with pytest.raises(ConfigError, match="no process 300"):
        fake.remove_process(2, 300)


def test_mig_processes_carry_instance_ids(sim):
    fake = sim("dgx-a100")
    h = fake.nvmlDeviceGetHandleByIndex(1)
    gis = fake.state.gpus[1].gpu_instances
    gi = gis[0]
    with pytest.raises(ConfigError, match="MIG mode"):
        fake.add_process(1, 10, GIB)
    fake.add_process(1, 10, GIB, gpu_instance_id=gi.id, sm_utilization=0.1)
    fake.add_process(1, 11, 2 * GIB, gpu_instance_id=gis[1].id)
    procs = fake.nvmlDeviceGetComputeRunningProcesses(h)
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in procs] == [
        (10, gi.id, gi.compute_instances[0].id),
        (11, gis[1].id, gis[1].compute_instances[0].id),
    ]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetProcessUtilization(h, 0)
    for i in range(4):
        mh = fake.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
        mine = fake.nvmlDeviceGetComputeRunningProcesses(mh)
        gi_id = fake.nvmlDeviceGetGpuInstanceId(mh)
        assert {p.gpuInstanceId for p in mine} <= {gi_id}
        used = fake.nvmlDeviceGetMemoryInfo(mh).used
        assert used == sum(p.usedGpuMemory for p in mine)
    assert fake.nvmlDeviceGetPowerUsage(h) > 48_000  # the MIG processes load the GPU


# -- GPM -------------------------------------------------------------------------------------


def gpm_metrics(fake, s1, s2, *metric_ids):
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    mg.numMetrics = len(metric_ids)
    mg.sample1, mg.sample2 = s1, s2
    for i, m in enumerate(metric_ids):
        mg.metrics[i].metricId = m
    fake.nvmlGpmMetricsGet(mg)
    return [(mg.metrics[i].nvmlReturn, mg.metrics[i].value) for i in range(len(metric_ids))]


def test_gpm_gives_mig_utilization_on_hopper(sim, clock):
    fake = sim("dgx-h100", mig_layout="balanced")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 1
    gi = next(g for g in fake.state.gpus[0].gpu_instances if g.profile_id == 9)  # 3g: 60 SMs
    fake.add_process(0, 5, GIB, gpu_instance_id=gi.id, sm_utilization=0.2)  # of the GPU's 132
    s1, s2 = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
    assert fake.nvmlGpmMigSampleGet(h, gi.id, s1) is s1
    clock.advance(2)
    fake.remove_process(0, 5)  # busy for 2 s of the 4
    clock.advance(2)
    fake.nvmlGpmMigSampleGet(h, gi.id, s2)
    sm = pynvml.NVML_GPM_METRIC_SM_UTIL
    occupancy = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    (util, occ, other) = gpm_metrics(fake, s1, s2, sm, occupancy, pynvml.NVML_GPM_METRIC_FP64_UTIL)
    assert util[0] == pynvml.NVML_SUCCESS
    assert util[1] == pytest.approx(100 * 0.2 * 132 / 60 / 2)
    assert occ[1] == pytest.approx(util[1] / 2)
    assert other[0] == pynvml.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlGpmMigSampleGet(h, 99, s1)
    fake.nvmlGpmSampleFree(s1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        gpm_metrics(fake, s1, s2, sm)


def test_no_gpm_on_ampere(sim):
    fake = sim("dgx-a100")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 0
    sample = fake.nvmlGpmSampleAlloc()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlGpmMigSampleGet(h, fake.state.gpus[0].gpu_instances[0].id, sample)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlGpmSampleGet(h, sample)


# -- events ----------------------------------------------------------------------------------


def test_xid_reaches_registered_event_sets(sim):
    fake = sim("dgx-h100")
    fake.inject_xid(1, 31)  # before registration: not delivered
    es = fake.nvmlEventSetCreate()
    for i in (1, 2):
        fake.nvmlDeviceRegisterEvents(fake.nvmlDeviceGetHandleByIndex(i), XID, es)
    fake.inject_xid(0, 13)  # GPU 0 is not registered
    fake.inject_xid(2, 48)
    fake.inject_xid(1, 94)
    got = []
    for _ in range(2):
        data = fake.nvmlEventSetWait(es, 1000)
        assert isinstance(data, pynvml.c_nvmlEventData_t)
        assert data.eventType == XID
        got.append((fake.nvmlDeviceGetIndex(data.device), data.eventData))
        assert (data.gpuInstanceId, data.computeInstanceId) == (NOT_MIG, NOT_MIG)
    assert got == [(2, 48), (1, 94)]
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait_v2(es, 0)
    fake.nvmlEventSetFree(es)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlEventSetWait(es, 0)


def test_a_double_bit_error_xid_moves_the_uncorrected_ecc_counters(sim):
    """XID 48 is NVIDIA's "DBE (Double Bit Error) ECC Error": the driver counts it in the
    uncorrected (double-bit) ECC totals, the counter docs/runbooks.md tells an SRE to check
    (tessera_gpu_ecc_errors_total{type="uncorrected"}, from NVML_FI_DEV_ECC_DBE_VOL_TOTAL)."""
    fake = sim("dgx-h100")
    h = fake.nvmlDeviceGetHandleByIndex(2)
    other = fake.nvmlDeviceGetHandleByIndex(1)
    dbe = (pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL)
    before = [field_value(fake, h, f) for f in dbe]
    fake.inject_xid(2, 48)
    assert [field_value(fake, h, f) for f in dbe] == [before[0] + 1, before[1] + 1]
    fake.inject_xid(1, 94)  # a contained ECC error: its own XID, not a double-bit count here
    fake.inject_xid(2, 13)
    assert [field_value(fake, other, f) for f in dbe] == [0, 0]
    assert [field_value(fake, h, f) for f in dbe] == [before[0] + 1, before[1] + 1]


def test_mig_xid_and_unsupported_event_types(sim):
    fake = sim("dgx-a100")
    h = fake.nvmlDeviceGetHandleByIndex(0)
    es = fake.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypePowerSourceChange, es)
    fake.nvmlDeviceRegisterEvents(h, XID | pynvml.nvmlEventTypeDoubleBitEccError, es)
    fake.inject_xid(0, 43, 3, 0)
    fake.inject_errors(0, ecc_uncorrected=1)
    data = fake.nvmlEventSetWait(es, 100)
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (43, 3, 0)
    data = fake.nvmlEventSetWait(es, 100)
    assert data.eventType == pynvml.nvmlEventTypeDoubleBitEccError


def test_xid_from_another_instance_on_the_same_directory(sim, state_dir):
    fake = sim("dgx-h100")
    es = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(fake.nvmlDeviceGetHandleByIndex(5), XID, es)
    other = FakeNvml(load_model("dgx-h100"), state_dir)
    other.inject_xid(5, 92)
    assert fake.nvmlEventSetWait(es, 1000).eventData == 92


def test_xid_from_another_process(sim, state_dir):
    fake = sim("dgx-h100")
    es = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(fake.nvmlDeviceGetHandleByIndex(6), XID, es)
    script = textwrap.dedent(
        f"""
        from agent.sim.model import load_model
        from agent.sim.nvml import FakeNvml
        FakeNvml(load_model("dgx-h100"), {str(state_dir)!r}).inject_xid(6, 74)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert fake.nvmlEventSetWait(es, 5000).eventData == 74


# -- GPU lost --------------------------------------------------------------------------------


def every_call_on(fake, h, mh=None):
    """Calls taking a GPU handle (and a MIG device handle when given), as thunks."""
    calls = [
        lambda: fake.nvmlDeviceGetUUID(h),
        lambda: fake.nvmlDeviceGetName(h),
        lambda: fake.nvmlDeviceGetPciInfo(h),
        lambda: fake.nvmlDeviceGetMemoryInfo(h),
        lambda: fake.nvmlDeviceGetMigMode(h),
        lambda: fake.nvmlDeviceGetUtilizationRates(h),
        lambda: fake.nvmlDeviceGetPowerUsage(h),
        lambda: fake.nvmlDeviceGetTotalEnergyConsumption(h),
        lambda: fake.nvmlDeviceGetTemperature(h, 0),
        lambda: fake.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
        lambda: fake.nvmlDeviceGetCurrentClocksEventReasons(h),
        lambda: fake.nvmlDeviceGetPcieThroughput(h, 0),
        lambda: fake.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_MEMORY_TEMP]),
        lambda: fake.nvmlDeviceGetComputeRunningProcesses(h),
        lambda: fake.nvmlDeviceGetProcessUtilization(h, 0),
        lambda: fake.nvmlDeviceGetNvLinkState(h, 0),
        lambda: fake.nvmlDeviceRegisterEvents(h, XID, fake.nvmlEventSetCreate()),
        lambda: fake.nvmlGpmQueryDeviceSupport(h),
    ]
    if mh is not None:
        calls += [
            lambda: fake.nvmlDeviceGetMemoryInfo(mh),
            lambda: fake.nvmlDeviceGetGpuInstanceId(mh),
            lambda: fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 0),
        ]
    return calls


def test_a_lost_gpu_fails_every_call_until_it_recovers(sim):
    fake = sim("dgx-a100")
    h = fake.nvmlDeviceGetHandleByIndex(4)
    mh = fake.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    es = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(h, XID, es)
    fake.lose_gpu(4)
    for call in every_call_on(fake, h, mh):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    data = fake.nvmlEventSetWait(es, 100)
    assert (fake.nvmlDeviceGetHandleByIndex(4), data.eventData) == (data.device, 79)
    assert fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(5)).startswith("GPU-")
    fake.recover_gpu(4)
    assert fake.nvmlDeviceGetUUID(h).startswith("GPU-")
    assert fake.nvmlDeviceGetMemoryInfo(mh).total > 0


def test_an_injected_xid_79_loses_the_gpu_like_a_real_one(sim):
    fake = sim("dgx-a100")
    h = fake.nvmlDeviceGetHandleByIndex(2)
    es = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(h, XID, es)
    fake.inject_xid(2, 48)  # another fatal XID: the GPU still answers
    assert fake.nvmlDeviceGetMemoryInfo(h).total > 0
    fake.inject_xid(2, 79)
    assert [fake.nvmlEventSetWait(es, 100).eventData for _ in range(2)] == [48, 79]
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetMemoryInfo(h)
    assert fake.nvmlDeviceGetMemoryInfo(fake.nvmlDeviceGetHandleByIndex(3)).total > 0
    fake.recover_gpu(2)
    assert fake.nvmlDeviceGetMemoryInfo(h).total > 0


def test_injected_call_failures(sim):
    fake = sim("dgx-h100")
    h0, h1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    fake.fail_call("nvmlDeviceGetPowerUsage", gpu=0, code=pynvml.NVML_ERROR_UNKNOWN, times=2)
    fake.nvmlDeviceGetPowerUsage(h1)  # another GPU
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Unknown):
            fake.nvmlDeviceGetPowerUsage(h0)
    assert fake.nvmlDeviceGetPowerUsage(h0) > 0
    fake.fail_call("nvmlDeviceGetTemperature", code=pynvml.NVML_ERROR_TIMEOUT, times=None)
    for h in (h0, h1, h0):
        with pytest.raises(pynvml.NVMLError_Timeout):
            fake.nvmlDeviceGetTemperature(h, 0)
    fake.clear_failures()
    assert fake.nvmlDeviceGetTemperature(h0, 0) > 0


def test_controls_check_their_arguments(sim):
    fake = sim("dgx-h100")
    with pytest.raises(ConfigError, match="GPU index 8"):
        fake.set_load(8, 0.5)
    with pytest.raises(ConfigError, match="between 0 and 1"):
        fake.set_load(0, 1.5)
    with pytest.raises(ConfigError, match="not in MIG mode"):
        fake.add_process(0, 1, GIB, gpu_instance_id=1)
    with pytest.raises(ConfigError, match="positive"):
        fake.inject_xid(0, 0)
    with pytest.raises(ConfigError, match="not an NVML call"):
        fake.fail_call("GetPowerUsage")


# -- state file, signatures ------------------------------------------------------------------


def test_state_round_trips_and_a_corrupt_file_is_set_aside(sim, state_dir, clock):
    fake = sim("dgx-a100")
    gi = fake.state.gpus[0].gpu_instances[0].id
    fake.add_process(0, 1, GIB, gpu_instance_id=gi, sm_utilization=0.5)
    fake.inject_xid(0, 48, gi, 0)
    fake.fail_call("nvmlDeviceGetPowerUsage", times=None)
    clock.advance(5)
    fake.set_load(1, 0.3)
    state = fake.telemetry_state
    assert isinstance(state, TelemetryState)
    assert telemetry_from_json(json.loads(json.dumps(telemetry_to_json(state)))) == state
    (state_dir / STATE_FILE).write_text("{ not json")
    again = FakeNvml(load_model("dgx-a100"), state_dir, clock=clock)
    assert (state_dir / (STATE_FILE + ".corrupt")).exists()
    assert again.telemetry_state.gpus[1].utilization == 0.0


TELEMETRY_CALLS_TEXT = """
nvmlDeviceGetUtilizationRates nvmlDeviceGetPowerUsage nvmlDeviceGetEnforcedPowerLimit
nvmlDeviceGetPowerManagementLimit nvmlDeviceGetTotalEnergyConsumption nvmlDeviceGetTemperature
nvmlDeviceGetClockInfo nvmlDeviceGetMaxClockInfo nvmlDeviceGetCurrentClocksEventReasons
nvmlDeviceGetCurrentClocksThrottleReasons nvmlDeviceGetPcieThroughput
nvmlDeviceGetPcieReplayCounter nvmlDeviceGetFieldValues nvmlDeviceGetComputeRunningProcesses
nvmlDeviceGetComputeRunningProcesses_v3 nvmlDeviceGetProcessUtilization nvmlGpmQueryDeviceSupport
nvmlGpmSampleAlloc nvmlGpmSampleFree nvmlGpmSampleGet nvmlGpmMigSampleGet nvmlGpmMetricsGet
nvmlEventSetCreate nvmlDeviceRegisterEvents nvmlDeviceGetSupportedEventTypes nvmlEventSetWait
nvmlEventSetWait_v2 nvmlEventSetFree
"""
TELEMETRY_CALLS = TELEMETRY_CALLS_TEXT.split()


@pytest.mark.parametrize("name", TELEMETRY_CALLS, ids=str)
def test_telemetry_call_is_simulated_with_pynvml_signature(name):
    assert name in simulated_calls(FakeNvml)
    assert inspect.isfunction(getattr(pynvml, name))


def test_all_simulated_calls_still_match_pynvml():
    assert signature_mismatches(FakeNvml) == []


def test_fake_nvml_takes_a_clock_keyword():
    params = inspect.signature(FakeNvml).parameters
    assert params["clock"].kind == inspect.Parameter.KEYWORD_ONLY
    assert params["mig_layout"].default is None


# -- tessera sim fault -----------------------------------------------------------------------


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), environ={}, out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def agent_dir(tmp_path, clock):
    """An agent state directory with the simulator in ``sim/`` (as ``tessera run`` lays it)."""
    fake = FakeNvml(load_model("dgx-h100"), tmp_path / "agent" / "sim", clock=clock)
    fake.nvmlInit()
    return tmp_path / "agent", fake


def test_sim_fault_xid_reaches_the_running_simulator(agent_dir):
    directory, fake = agent_dir
    es = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(fake.nvmlDeviceGetHandleByIndex(3), XID, es)
    args = ["--state-dir", str(directory), "xid", "--gpu", "3", "--xid", "48"]
    rc, out, err = run_cli("sim", "fault", *args)
    assert (rc, err) == (0, "")
    assert out == "injected XID 48 on GPU 3\n"
    assert fake.nvmlEventSetWait(es, 1000).eventData == 48
    fake.nvmlDeviceGetPowerUsage(fake.nvmlDeviceGetHandleByIndex(3))  # 48: still answers
    rc, out, err = run_cli("sim", "fault", *args[:-1], "79")
    assert (rc, err) == (0, "")
    assert out == (
        "injected XID 79 on GPU 3\n"
        "GPU 3 fell off the bus; its NVML calls now fail until `recover`\n"
    )
    assert fake.nvmlEventSetWait(es, 1000).eventData == 79
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetPowerUsage(fake.nvmlDeviceGetHandleByIndex(3))


def test_sim_fault_gpu_lost_recover_load_and_driver_reload(agent_dir, clock):
    directory, fake = agent_dir
    d = ["sim", "fault", "--state-dir", str(directory / "sim")]  # the simulator's own dir works
    h = fake.nvmlDeviceGetHandleByIndex(2)
    rc, out, _ = run_cli(*d, "gpu-lost", "--gpu", "2")
    assert rc == 0 and "GPU 2 fell off the bus" in out
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetPowerUsage(h)
    rc, out, _ = run_cli(*d, "recover", "--gpu", "2")
    assert rc == 0 and out == "GPU 2 recovered\n"
    rc, out, _ = run_cli(*d, "load", "--gpu", "2", "--utilization", "0.75", "--memory-mib", "1024")
    assert rc == 0 and "utilization 0.75, 1024 MiB in use" in out
    assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 75
    assert fake.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2).used == GIB
    clock.advance(10)
    assert fake.nvmlDeviceGetTotalEnergyConsumption(h) > 0
    rc, out, _ = run_cli(*d, "driver-reload")
    assert rc == 0 and out.startswith("driver reloaded")
    assert fake.nvmlDeviceGetUtilizationRates(h).gpu == 0
    rc, out, _ = run_cli(*d, "fail-call", "--call", "nvmlDeviceGetPowerUsage", "--gpu", "2")
    assert rc == 0 and "fails with NVML error 999 for the next 1 call(s)" in out
    with pytest.raises(pynvml.NVMLError_Unknown):
        fake.nvmlDeviceGetPowerUsage(h)


def test_sim_fault_errors_are_one_line(agent_dir, tmp_path):
    directory, _ = agent_dir
    rc, out, err = run_cli("sim", "fault", "--state-dir", str(directory), "recover", "--gpu", "9")
    assert (rc, out) == (2, "")
    assert "GPU index 9 does not exist" in err and err.count("\n") == 1
    rc, _, err = run_cli("sim", "fault", "--state-dir", str(tmp_path / "nowhere"), "driver-reload")
    assert rc == 2 and "no simulated node" in err
    rc, _, err = run_cli("sim", "fault", "driver-reload")
    assert rc == 2 and "--state-dir" in err
