"""Telemetry reads through the facade (agent.nvml.telemetry) against the simulator: fields
present or absent per product, base units, lost GPUs, errors, and the NVML calls per read."""

import threading
from collections import Counter
from typing import Any

import pynvml
import pytest

from agent.nvml.facade import Nvml
from agent.nvml.mig import MigControl
from agent.nvml.samples import GpuSample
from agent.nvml.telemetry import TelemetryReader
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml
from tests.fakeclock import FakeClock

MIB = 1024 * 1024
GIB = 1024 * MIB
UNKNOWN = 999  # NVML_ERROR_UNKNOWN

# NVML calls per GPU per read once warm (documented in agent.nvml.telemetry)
WHOLE_GPU_CALLS = 12  # fields + 10 reads + process utilization (only with processes)
MIG_GPU_BASE_CALLS = 10  # fields + 9 reads (no utilization, no process utilization in MIG mode)


class Counting:
    """The simulated pynvml module, counting every nvml* call made through it."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if name.startswith("nvml") and callable(value) and not isinstance(value, type):

            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls[name] += 1
                return value(*args, **kwargs)

            return counted
        return value

    def total(self) -> int:
        return sum(self.calls.values())


@pytest.fixture
def clock():
    return FakeClock(500.0)


@pytest.fixture
def node(tmp_path, clock):
    """``node(model, **kw)`` -> (fake, counting module, reader) on a fresh state directory."""

    def make(model: str, **kw: Any) -> tuple[FakeNvml, Counting, TelemetryReader]:
        fake = FakeNvml(load_model(model), tmp_path / model, clock=clock, **kw)
        counting = Counting(fake)
        nvml = Nvml(counting)
        nvml.init()
        return fake, counting, TelemetryReader(nvml)

    return make


def steady_calls(counting: Counting, reader: TelemetryReader, index: int, clock: FakeClock) -> int:
    """NVML calls of one read after a warm-up read."""
    reader.read(index, clock())
    clock.advance(1)
    counting.calls.clear()
    reader.read(index, clock())
    return counting.total()


# -- what a sample holds -----------------------------------------------------------------------


def test_h100_sample_in_base_units(node, clock):
    fake, _, reader = node("dgx-h100")
    idle = reader.read(0, clock())
    assert isinstance(idle, GpuSample)
    assert idle.uuid.startswith("GPU-") and idle.timestamp == clock() and not idle.lost
    assert idle.power_watts == pytest.approx(84.0)  # 12 % of 700 W
    assert idle.utilization_gpu == 0.0 and idle.throttle_reasons == 1  # GpuIdle
    assert idle.clock_sm_hertz == 345e6 and idle.clock_memory_hertz == 2619e6
    fake.set_load(0, 0.5, memory_used_bytes=8 * GIB)
    fake.add_process(0, 1234, 2 * GIB, sm_utilization=0.25)
    clock.advance(10)
    s = reader.read(0, clock())
    assert s.utilization_gpu == pytest.approx(0.75) and s.utilization_memory == pytest.approx(0.45)
    assert s.memory_used_bytes == 10 * GIB
    assert s.memory_reserved_bytes == 512 * MIB
    assert s.memory_free_bytes == 81559 * MIB - 512 * MIB - 10 * GIB
    assert s.power_watts == pytest.approx(84 + 0.75 * 616)
    assert s.energy_joules == pytest.approx(10 * (84 + 0.75 * 616))
    assert s.temperature_gpu_celsius is not None
    assert s.temperature_memory_celsius is not None
    assert s.temperature_memory_celsius > s.temperature_gpu_celsius
    assert s.clock_sm_hertz == 1980e6
    assert s.pcie_rx_bytes_per_second is not None and s.pcie_rx_bytes_per_second > 0
    assert s.pcie_tx_bytes_per_second is not None and s.pcie_tx_bytes_per_second > 0
    assert s.nvlink_tx_bytes is not None and s.nvlink_tx_bytes > 0
    assert s.nvlink_tx_bytes % (18 * 1024) == 0  # KiB per link, summed over 18 links, in bytes
    assert s.nvlink_rx_bytes is not None and s.nvlink_rx_bytes > 0
    assert (s.ecc_corrected, s.ecc_uncorrected, s.pcie_replays) == (0, 0, 0)
    assert (s.remapped_rows_correctable, s.remapped_rows_uncorrectable) == (0, 0)
    assert s.remap_pending is False
    assert s.mig == () and s.errors == ()
    (p,) = s.processes
    assert (p.pid, p.used_memory_bytes, p.gpu_instance_id, p.compute_instance_id) == (
        1234,
        2 * GIB,
        None,
        None,
    )
    assert p.sm_utilization == pytest.approx(0.25)


def test_error_counters_reach_the_sample(node, clock):
    fake, _, reader = node("dgx-h100")
    counts = {"ecc_corrected": 5, "ecc_uncorrected": 1, "pcie_replays": 7}
    fake.inject_errors(1, **counts, remapped_correctable=2, remap_pending=True)
    s = reader.read(1, clock())
    assert (s.ecc_corrected, s.ecc_uncorrected, s.pcie_replays) == (5, 1, 7)
    assert (s.remapped_rows_correctable, s.remap_pending) == (2, True)


def test_l40s_has_no_nvlink_and_no_memory_temperature(node, clock):
    fake, _, reader = node("l40s-pcie")
    fake.set_load(2, 0.3)
    s = reader.read(2, clock())
    assert s.nvlink_tx_bytes is None and s.nvlink_rx_bytes is None
    assert s.temperature_memory_celsius is None
    assert s.power_watts == pytest.approx(350 * (0.12 + 0.3 * 0.88))
    assert s.energy_joules == 0.0  # present: zero is a value, not absence
    assert s.utilization_gpu == pytest.approx(0.3)
    assert s.ecc_corrected == 0 and s.remap_pending is False
    assert s.mig == () and s.errors == ()


def test_a100_mig_sample(node, clock):
    fake, _, reader = node("dgx-a100")  # balanced layout: 3g, 2g, 1g, 1g
    gis = fake.state.gpus[0].gpu_instances
    fake.add_process(0, 42, 3 * GIB, gpu_instance_id=gis[0].id, sm_utilization=0.2)
    s = reader.read(0, clock())
    assert s.utilization_gpu is None and s.utilization_memory is None  # none in MIG mode
    assert s.power_watts is not None and s.power_watts > 48
    assert len(s.mig) == 4
    spec = load_model("dgx-a100").gpus[0].spec
    sizes = {gi.id: spec.profile(gi.profile_id).memory_mib * MIB for gi in gis}
    assert {m.gpu_instance_id: m.memory_total_bytes for m in s.mig} == sizes
    busy = next(m for m in s.mig if m.gpu_instance_id == gis[0].id)
    assert busy.memory_used_bytes == 3 * GIB and busy.uuid.startswith("MIG-")
    clock.advance(1)
    s = reader.read(0, clock())
    assert {m.utilization for m in s.mig} == {None}  # Ampere: no GPM
    (p,) = s.processes
    assert p.gpu_instance_id == gis[0].id and p.compute_instance_id == 0
    assert p.sm_utilization is None  # no per-process utilization in MIG mode
    assert s.errors == ()


def test_h100_mig_utilization_from_gpm(node, clock):
    fake, _, reader = node("dgx-h100", mig_layout="balanced")
    gi = next(g for g in fake.state.gpus[0].gpu_instances if g.profile_id == 14)  # 2g: 32 SMs
    fake.add_process(0, 7, GIB, gpu_instance_id=gi.id, sm_utilization=0.16)
    first = reader.read(0, clock())
    assert {m.utilization for m in first.mig} == {None}  # GPM needs two samples
    clock.advance(5)
    second = reader.read(0, clock())
    by_gi = {m.gpu_instance_id: m.utilization for m in second.mig}
    assert by_gi[gi.id] == pytest.approx(0.16 * 132 / 32)
    assert {u for g, u in by_gi.items() if g != gi.id} == {0.0}
    reader.close()


def test_mig_layout_changes_are_picked_up(node, clock):
    fake, _, reader = node("dgx-a100")
    assert len(reader.read(3, clock()).mig) == 4
    fake.apply_mig_layout("all-7g")
    reader.read(3, clock())  # the old MIG handles fail: re-enumerate next time
    assert [m.memory_total_bytes for m in reader.read(3, clock()).mig] == [40448 * MIB]


def test_a_refresh_asked_from_another_thread_shows_new_mig_devices_at_the_next_read(
    tmp_path, clock
):
    """Dynamic MIG makes devices behind the reader's back; the agent asks for a refresh of that
    GPU (from the prepare's thread) and the next read lists them, not the 60th."""
    fake = FakeNvml(load_model("dgx-h100"), tmp_path / "h100", clock=clock)
    nvml = Nvml(fake)
    nvml.init()
    reader = TelemetryReader(nvml)
    assert reader.read(2, clock()).mig == () and reader.read(3, clock()).mig == ()
    mig = MigControl(nvml)
    for gpu in (2, 3):
        assert mig.set_mode(gpu, True)
        mig.create(gpu, 19, 0, 1)  # a 1g.10gb at placement 0
    asker = threading.Thread(target=reader.refresh, args=(2,))
    asker.start()
    asker.join()
    (made,) = reader.read(2, clock()).mig
    assert made.uuid == nvml.mig_instances(2)[0].uuid
    assert reader.read(3, clock()).mig == ()  # not asked: left for its periodic re-enumeration
    reader.refresh()  # every GPU
    assert len(reader.read(3, clock()).mig) == 1


# -- lost GPUs and errors --------------------------------------------------------------------


def test_a_lost_gpu_reads_lost_and_the_others_still_read(node, clock):
    fake, _, reader = node("dgx-h100")
    uuid = reader.read(4, clock()).uuid
    fake.lose_gpu(4)
    lost = reader.read(4, clock())
    assert lost.lost and lost.uuid == uuid
    assert lost.power_watts is None and lost.energy_joules is None and lost.processes == ()
    others = [reader.read(i, clock()) for i in range(8) if i != 4]
    assert not any(s.lost for s in others)
    assert all(s.power_watts is not None for s in others)
    fake.recover_gpu(4)
    back = reader.read(4, clock())
    assert not back.lost and back.uuid == uuid and back.power_watts is not None


def test_lost_before_the_first_read(node, clock):
    fake, _, reader = node("l40s-pcie")
    fake.lose_gpu(1)
    s = reader.read(1, clock())
    assert s.lost and s.uuid == ""


def test_a_failing_call_leaves_its_field_absent_and_is_named(node, clock):
    fake, _, reader = node("dgx-h100")
    fake.fail_call("nvmlDeviceGetPowerUsage", gpu=0, code=UNKNOWN, times=None)
    fake.fail_call("nvmlDeviceGetPcieThroughput", gpu=0, code=UNKNOWN, times=1)
    s = reader.read(0, clock())
    assert s.power_watts is None and not s.lost
    assert s.pcie_tx_bytes_per_second is None and s.pcie_rx_bytes_per_second is not None
    assert s.errors == ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetPcieThroughput")
    assert s.energy_joules is not None and s.utilization_gpu is not None
    assert reader.read(1, clock()).errors == ()
    assert reader.read(0, clock()).errors == ("nvmlDeviceGetPowerUsage",)


def test_a_failing_memory_read(node, clock):
    fake, _, reader = node("dgx-a100")
    fake.fail_call("nvmlDeviceGetMemoryInfo", gpu=2, code=UNKNOWN, times=None)
    s = reader.read(2, clock())
    assert s.memory_used_bytes is None and s.memory_free_bytes is None
    assert {m.memory_total_bytes for m in s.mig} == {None} and len(s.mig) == 4
    assert set(s.errors) == {"nvmlDeviceGetMemoryInfo"}
    assert s.power_watts is not None


def test_a_reader_keeps_its_gpm_samples_between_reads(tmp_path, clock):
    fake = FakeNvml(load_model("dgx-h100"), tmp_path, mig_layout="balanced", clock=clock)
    nvml = Nvml(fake)
    nvml.init()
    reader = TelemetryReader(nvml)
    assert reader.read(0, clock()).mig[0].utilization is None
    clock.advance(1)
    assert reader.read(0, clock()).mig[0].utilization == 0.0  # GPM kept its sample
    reader.close()


def test_read_all(node, clock):
    _, _, reader = node("l40s-pcie")
    samples = reader.read_all(clock())
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert len({s.uuid for s in samples}) == 4


# -- NVML calls per read ---------------------------------------------------------------------


def test_calls_per_read_whole_gpu(node, clock):
    fake, counting, reader = node("dgx-h100")
    assert steady_calls(counting, reader, 0, clock) == WHOLE_GPU_CALLS - 1  # no processes
    fake.add_process(0, 1, GIB, sm_utilization=0.5)
    assert steady_calls(counting, reader, 0, clock) == WHOLE_GPU_CALLS
    assert counting.calls["nvmlDeviceGetFieldValues"] == 1
    assert counting.calls["nvmlDeviceGetHandleByIndex"] == 0  # cached
    assert counting.calls["nvmlDeviceGetUUID"] == 0


def test_calls_per_read_pcie_gpu(node, clock):
    fake, counting, reader = node("l40s-pcie")
    fake.add_process(3, 1, GIB, sm_utilization=0.5)
    assert steady_calls(counting, reader, 3, clock) <= WHOLE_GPU_CALLS


def test_calls_per_read_mig_gpu(node, clock):
    _, counting, reader = node("dgx-a100")  # 4 MIG devices, no GPM
    first = counting.total()
    reader.read(0, clock())
    assert counting.total() - first <= 45  # handle, UUID, MIG enumeration, probes
    assert steady_calls(counting, reader, 0, clock) <= MIG_GPU_BASE_CALLS + 4
    assert counting.calls["nvmlDeviceGetUtilizationRates"] == 0  # learned: NotSupported


def test_calls_per_read_mig_gpu_with_gpm(node, clock):
    _, counting, reader = node("dgx-h100", mig_layout="all-1g")  # 7 MIG devices in 7 GIs
    assert steady_calls(counting, reader, 0, clock) <= MIG_GPU_BASE_CALLS + 7 + 2 * 7
    assert counting.calls["nvmlGpmMigSampleGet"] == 7
    assert counting.calls["nvmlGpmMetricsGet"] == 7
    assert counting.calls["nvmlGpmSampleAlloc"] == 0  # buffers reused


def test_gpm_buffers_are_freed(node, clock):
    fake, counting, reader = node("dgx-h100", mig_layout="balanced")
    reader.read(0, clock())
    assert counting.calls["nvmlGpmSampleAlloc"] == 8
    reader.close()
    assert counting.calls["nvmlGpmSampleFree"] == 8
    assert fake._gpm_samples == {}


# -- older or mismatched pynvml ----------------------------------------------------------------


class Hiding(Counting):
    """The simulated module without the listed calls (an older pynvml)."""

    def __init__(self, module: Any, missing: set[str]) -> None:
        super().__init__(module)
        self.missing = missing

    def __getattr__(self, name: str) -> Any:
        if name in self.missing:
            raise AttributeError(name)
        return super().__getattr__(name)


class Mismatching(Counting):
    """The simulated module where the listed unversioned calls raise pynvml's
    NVMLLibraryMismatchError (a pynvml newer than the driver)."""

    def __init__(self, module: Any, mismatched: set[str]) -> None:
        super().__init__(module)
        self.mismatched = mismatched

    def __getattr__(self, name: str) -> Any:
        if name in self.mismatched:

            def mismatch(*args: Any, **kwargs: Any) -> Any:
                self.calls[name] += 1
                raise pynvml.NVMLLibraryMismatchError(f"{name} is not in this driver")

            return mismatch
        return super().__getattr__(name)


def reader_over(module: Counting) -> TelemetryReader:
    nvml = Nvml(module)
    nvml.init()
    return TelemetryReader(nvml)


def test_a_pynvml_without_gpm_and_clocks_event_reasons(tmp_path, clock):
    fake = FakeNvml(load_model("dgx-h100"), tmp_path, mig_layout="balanced", clock=clock)
    old = Hiding(fake, {"nvmlGpmMigSampleGet", "nvmlDeviceGetCurrentClocksEventReasons"})
    reader = reader_over(old)
    reader.read(0, clock())
    clock.advance(1)
    s = reader.read(0, clock())
    assert s.errors == () and s.throttle_reasons == 1  # GpuIdle, by the deprecated name
    assert len(s.mig) == 4 and {m.utilization for m in s.mig} == {None}
    assert old.calls["nvmlGpmSampleAlloc"] == 0 and old.calls["nvmlGpmQueryDeviceSupport"] == 0


def test_a_library_mismatch_falls_back_like_function_not_found(tmp_path, clock):
    fake = FakeNvml(load_model("dgx-h100"), tmp_path, clock=clock)
    fake.add_process(0, 1, GIB, sm_utilization=0.5)
    calls = {"nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetComputeRunningProcesses"}
    mismatching = Mismatching(fake, calls)
    reader = reader_over(mismatching)
    first = reader.read(0, clock())
    assert first.errors == () and first.throttle_reasons is not None  # by the deprecated name
    assert first.processes == ()  # unsupported: absent
    mismatching.calls.clear()
    second = reader.read(0, clock())
    assert second.errors == () and second.throttle_reasons is not None
    assert {name: mismatching.calls[name] for name in calls} == dict.fromkeys(calls, 0)


def test_a_cached_handle_follows_its_gpu_when_indexes_shift(node, clock):
    """After GPU 3 leaves, NVML index 3 is GPU 4: the reader drops the handle it cached for
    index 3 at its next read rather than report GPU 3's numbers (or its loss) as index 3's."""
    fake, _, reader = node("dgx-h100")
    assert reader.read(3, clock()).uuid == fake.model.gpus[3].uuid
    fake.set_removed(3, True)
    reader.expect({i: g.uuid for i, g in enumerate(fake.present())})
    clock.advance(1)
    sample = reader.read(3, clock())
    assert (sample.uuid, sample.lost) == (fake.model.gpus[4].uuid, False)
