"""What the usage meter saves when the agent stops (agent/telemetry/sampler.py
``finish_usage``, agent/telemetry/usage_meter.py ``close``): the time up to the stop, a claim
released since the last tick counted to its release, and never a stop held up by a stuck tick."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import pytest

from agent.nvml.samples import GpuSample
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.sampler import Sampler
from agent.telemetry.usage_meter import UsageMeter
from agent.usage.counters import UsageLedger
from agent.usage.weights import GpuCapacity
from tests.fakeclock import FakeClock
from tests.telemetry.holders import Claim, Held
from tests.telemetry.test_sampler import Node, info

LOG = logging.getLogger("tessera.test.usage-stop")
A = Claim("uid-a", "team-a", "job-a", (Held("node-a", "gpu-0", "gpu", "GPU-0", 0),))
B = Claim("uid-b", "team-b", "job-b", (Held("node-a", "gpu-1", "gpu", "GPU-1", 1),))


class StuckReads(Node):
    """The scripted GPUs, whose reads can get stuck (an NVML call that does not return)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.stuck = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def read(self, index: int, now: float) -> GpuSample:
        if self.stuck:
            self.entered.set()
            self.release.wait(30)
        return super().read(index, now)


class Setup:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = FakeClock(100.0)
        self.node = StuckReads(self.clock)
        self.held: tuple[Claim, ...] = (A, B)
        self.changes: dict[str, float] = {}
        self.path = tmp_path / "usage.json"
        self.meter = UsageMeter(self.path, "boot", LOG, wall=lambda: 1.7e9 + self.clock.t)
        self.sampler = Sampler(
            node="node-a",
            read=self.node.read,
            gpus=[
                dataclasses.replace(info(i), capacity=GpuCapacity(f"GPU-{i}", 80 << 30))
                for i in range(2)
            ],
            holders=lambda: self.held,
            holders_changed=lambda: self.changes,
            accounting=EnergyAccounting(tmp_path / "energy.json", self.clock),
            clock=self.clock,
            wall=lambda: 1.7e9 + self.clock.t,
            log=LOG,
            usage=self.meter,
        )

    def stored(self) -> tuple[float | None, dict[str, float]]:
        ledger = UsageLedger(self.path, "boot")
        counted = {k[0]: c.allocated_gpu_seconds for k, c in ledger.counters().items()}
        return ledger.through, counted


def test_a_stop_counts_up_to_itself_and_a_release_since_the_last_tick_to_it(tmp_path: Path):
    s = Setup(tmp_path)
    s.sampler.tick()
    s.clock.t += 1.0
    s.sampler.tick()
    s.clock.t += 0.25  # B's claim unprepared 0.25 s after the last tick, the stop 0.5 s after
    s.held, s.changes = (A,), {"uid-b": s.clock.t}
    s.clock.t += 0.25
    s.sampler.finish_usage(5.0)
    through, counted = s.stored()
    assert counted == pytest.approx({"uid-a": 1.5, "uid-b": 1.25})
    assert through == pytest.approx(1.7e9 + s.clock.t)
    assert s.meter.report(1 << 20) is not None  # the last report carries what was saved


def test_a_stop_does_not_wait_for_a_tick_stuck_in_a_read(tmp_path: Path, caplog):
    s = Setup(tmp_path)
    s.sampler.tick()
    s.clock.t += 1.0
    s.sampler.tick()
    s.node.stuck = True
    stuck = threading.Thread(target=s.sampler.tick, daemon=True)
    stuck.start()
    assert s.node.entered.wait(10)
    try:
        with caplog.at_level(logging.WARNING):
            s.sampler.finish_usage(0.01)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("telemetry tick is still running at the stop" in m for m in warned), warned
        through, counted = s.stored()  # what the ticks before it counted, saved
        assert counted == pytest.approx({"uid-a": 1.0, "uid-b": 1.0})
        assert through == pytest.approx(1.7e9 + 101.0)
    finally:
        s.node.release.set()
        stuck.join(10)


def test_a_stop_does_not_wait_for_counters_stuck_in_a_write_and_then_reports_nothing(
    tmp_path: Path, caplog
):
    s = Setup(tmp_path)
    s.sampler.tick()
    s.clock.t += 1.0
    s.sampler.tick()
    held = s.meter._lock  # a tick stuck in the ledger's write (a hung disk) holds it
    held.acquire()
    try:
        with caplog.at_level(logging.WARNING):
            s.meter.close(timeout=0.01)
        assert any("still being written at the stop" in r.getMessage() for r in caplog.records)
        assert s.meter.report(1 << 20) is None  # nothing the file may not hold is reported
    finally:
        held.release()
