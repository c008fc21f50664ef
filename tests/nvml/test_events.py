"""EventWatcher (agent.nvml.events) against the simulator's injected XIDs."""

from typing import Any

import pytest

from agent.nvml.errors import NvmlError
from agent.nvml.events import EventWatcher
from agent.nvml.facade import Nvml
from agent.nvml.samples import XidEvent
from agent.sim.model import load_model
from agent.sim.nvml import FakeNvml

NOT_SUPPORTED = 3


@pytest.fixture
def sim(tmp_path):
    """``sim(model)`` -> (fake, facade) on a fresh state directory."""

    def make(model: str, **kw: Any) -> tuple[FakeNvml, Nvml]:
        fake = FakeNvml(load_model(model), tmp_path / "sim", **kw)
        nvml = Nvml(fake)
        nvml.init()
        return fake, nvml

    return make


def test_injected_xids_are_returned_in_order(sim):
    fake, nvml = sim("dgx-h100")
    with EventWatcher(nvml) as watcher:
        assert watcher.registered == tuple(range(8)) and watcher.skipped == {}
        fake.inject_xid(2, 48)
        fake.inject_xid(7, 31)
        assert watcher.wait(1.0) == [XidEvent(2, 48, None, None), XidEvent(7, 31, None, None)]
        assert watcher.wait(0.0) == []


def test_wait_times_out_empty(sim, monkeypatch):
    """Nothing came: empty, after asking NVML to wait the whole timeout (in milliseconds)."""
    fake, nvml = sim("l40s-pcie")
    waits: list[int] = []
    real_wait = fake.nvmlEventSetWait

    def recording_wait(eventSet, timeoutms):
        waits.append(timeoutms)
        return real_wait(eventSet, timeoutms)

    monkeypatch.setattr(fake, "nvmlEventSetWait", recording_wait)
    with EventWatcher(nvml) as watcher:
        assert watcher.wait(0.05) == []
    assert waits == [50]


def test_mig_xid_carries_the_instance(sim):
    fake, nvml = sim("dgx-a100")
    with EventWatcher(nvml, indices=[1]) as watcher:
        fake.inject_xid(1, 43, 2, 0)
        fake.inject_xid(0, 43)  # not watched
        fake.inject_errors(1, ecc_corrected=1)  # not an XID
        assert watcher.wait(1.0) == [XidEvent(1, 43, 2, 0)]
        assert watcher.wait(0.0) == []


def test_a_gpu_that_cannot_register_is_skipped_and_reported(sim):
    fake, nvml = sim("dgx-h100")
    fake.fail_call("nvmlDeviceRegisterEvents", gpu=3, code=NOT_SUPPORTED)
    fake.lose_gpu(5)
    with EventWatcher(nvml) as watcher:
        assert watcher.registered == (0, 1, 2, 4, 6, 7)
        assert set(watcher.skipped) == {3, 5}
        assert "nvmlDeviceRegisterEvents" in watcher.skipped[3]
        fake.inject_xid(3, 48)
        fake.inject_xid(4, 48)
        assert watcher.wait(1.0) == [XidEvent(4, 48, None, None)]


def test_a_gpu_falling_off_the_bus_is_xid_79(sim):
    fake, nvml = sim("dgx-h100")
    with EventWatcher(nvml) as watcher:
        fake.lose_gpu(6)
        assert watcher.wait(1.0) == [XidEvent(6, 79, None, None)]


def test_xids_from_another_simulator_instance(sim, tmp_path):
    _, nvml = sim("dgx-h100")
    other = FakeNvml(load_model("dgx-h100"), tmp_path / "sim")
    with EventWatcher(nvml) as watcher:
        other.inject_xid(0, 94)
        assert watcher.wait(2.0) == [XidEvent(0, 94, None, None)]


def test_close_is_idempotent_and_final(sim):
    _, nvml = sim("l40s-pcie")
    watcher = EventWatcher(nvml)
    watcher.close()
    watcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        watcher.wait(0)


def test_errors_of_the_event_set_are_translated(sim):
    fake, nvml = sim("l40s-pcie")
    watcher = EventWatcher(nvml)
    fake.nvmlEventSetFree(watcher._set)  # the set vanishes under the watcher
    with pytest.raises(NvmlError) as e:
        watcher.wait(0)
    assert e.value.call == "nvmlEventSetWait"


def test_after_a_gpu_leaves_and_returns_xids_carry_the_new_indexes(sim):
    """Rediscovery re-points the watcher: indexes shift when GPU 3 leaves, a returning GPU is
    watched again, and a GPU that left is not reported under another's index."""
    fake, nvml = sim("dgx-h100")
    with EventWatcher(nvml) as watcher:
        fake.set_removed(3, True)
        watcher.watch(range(7))  # NVML index 3 is model GPU 4 now
        assert watcher.registered == tuple(range(7))
        fake.inject_xid(4, 48)
        fake.inject_xid(7, 31)
        assert watcher.wait(1.0) == [XidEvent(3, 48, None, None), XidEvent(6, 31, None, None)]
        fake.set_removed(3, False)
        watcher.watch(range(8))
        fake.inject_xid(3, 79)
        fake.inject_xid(4, 13)
        assert watcher.wait(1.0) == [XidEvent(3, 79, None, None), XidEvent(4, 13, None, None)]


def test_a_gpu_no_longer_watched_reports_nothing(sim):
    fake, nvml = sim("dgx-h100")
    with EventWatcher(nvml) as watcher:
        watcher.watch([0, 1])
        fake.inject_xid(5, 48)
        fake.inject_xid(1, 48)
        assert watcher.wait(1.0) == [XidEvent(1, 48, None, None)]
