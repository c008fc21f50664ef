"""GPU health through the sampler: sticky fatal XIDs, application XIDs, recovery = observation
+ probe, health keyed by UUID."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from agent.config import load_config
from agent.errors import ConfigError
from agent.nvml.samples import GpuSample, XidEvent
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.gpu_health import (
    APPLICATION_XIDS,
    FATAL_XIDS,
    GpuHealth,
    HealthTracker,
    application_xids,
    parse_xids,
)
from agent.telemetry.gpuinfo import GpuInfo
from agent.telemetry.sampler import Sampler

LOG = logging.getLogger("tessera.test.health")


def info(index: int, uuid: str | None = None) -> GpuInfo:
    return GpuInfo(
        index, uuid or f"GPU-{index}", "NVIDIA H100 80GB HBM3", f"0000:{index:02x}:00.0", index
    )


class Node:
    """Scripted reads: GPUs (by UUID) in ``lost`` are GpuIsLost; ``remap`` ones report a
    pending row remapping; XIDs queued in ``pending`` are drained by the next tick."""

    def __init__(self) -> None:
        self.t = 100.0
        self.lost: set[str] = set()
        self.remap: set[str] = set()
        self.pending: list[XidEvent] = []
        self.uuids: dict[int, str] = {}

    def read(self, index: int, now: float) -> GpuSample:
        uuid = self.uuids.get(index, f"GPU-{index}")
        if uuid in self.lost:
            return GpuSample(index, uuid, now, lost=True)
        return GpuSample(index, uuid, now, power_watts=100.0, remap_pending=uuid in self.remap)

    def xids(self) -> list[XidEvent]:
        out, self.pending = self.pending, []
        return out


class Run:
    def __init__(self, tmp_path, gpus: int = 2, **kw) -> None:
        self.node = Node()
        self.changes: list[GpuHealth] = []

        def clock() -> float:
            return self.node.t

        self.sampler = Sampler(
            node="node-a",
            read=self.node.read,
            gpus=[info(i) for i in range(gpus)],
            holders=lambda: (),
            accounting=EnergyAccounting(tmp_path / "energy.json", clock),
            log=LOG,
            clock=clock,
            wall=lambda: 1.7e9 + self.node.t,
            xids=self.node.xids,
            on_health_change=self.changes.append,
            **kw,
        )

    def tick(self) -> list[bool]:
        self.node.t += 1
        return [g.healthy for g in self.sampler.tick().gpus]

    def xid(self, index: int, xid: int) -> None:
        self.node.pending.append(XidEvent(index, xid, None, None))

    def causes(self) -> list[tuple[str, bool, str | None]]:
        return [(c.uuid, c.healthy, c.cause) for c in self.changes]


def test_a_fatal_xid_is_sticky_without_an_observed_recovery(tmp_path):
    run = Run(tmp_path)
    run.tick()
    run.xid(1, 48)
    assert run.tick() == [True, False]
    for _ in range(20):  # reads keep working: no recovery was observed
        assert run.tick() == [True, False]
    assert run.causes() == [("GPU-1", False, "xid-48")]
    assert run.changes[0].since == 1.7e9 + 102.0 and run.changes[0].index == 1


def test_xid_79_then_the_gpu_answers_again_and_passes_the_probe(tmp_path):
    run = Run(tmp_path)
    run.tick()
    run.node.lost.add("GPU-0")  # fell off the bus: the XID and failing reads
    run.xid(0, 79)
    assert run.tick() == [False, True]
    assert run.tick() == [False, True]
    run.node.lost.clear()  # `sim fault recover`: the GPU answers again
    assert run.tick() == [False, True]  # the first good read of the probe
    assert run.tick() == [True, True]  # the second: healthy
    assert run.causes() == [("GPU-0", False, "xid-79"), ("GPU-0", True, None)]


def test_a_reset_observed_then_the_probe_makes_a_fatal_xid_gpu_healthy(tmp_path):
    run = Run(tmp_path)
    run.xid(1, 94)
    assert run.tick() == [True, False]
    run.sampler.observe_reset("GPU-1")
    assert run.tick() == [True, False]
    assert run.tick() == [True, True]
    assert run.causes() == [("GPU-1", False, "xid-94"), ("GPU-1", True, None)]


def test_a_failing_probe_keeps_the_gpu_unhealthy(tmp_path, caplog):
    run = Run(tmp_path)
    run.xid(0, 48)
    run.tick()
    run.node.remap.add("GPU-0")  # still pending after the reset: disqualifying
    run.sampler.observe_reset("GPU-0")
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        for _ in range(5):
            assert run.tick() == [False, True]
    assert sum("health probe fails" in r.message for r in caplog.records) == 1  # not every tick
    run.node.remap.clear()
    assert run.tick() == [False, True]
    assert run.tick() == [True, True]


def test_a_failed_read_or_a_new_fatal_xid_during_the_probe_starts_it_over(tmp_path):
    run = Run(tmp_path, gpus=1)
    run.node.lost.add("GPU-0")
    assert run.tick() == [False]
    run.node.lost.clear()
    assert run.tick() == [False]  # probe 1/2
    run.node.lost.add("GPU-0")
    assert run.tick() == [False]
    run.node.lost.clear()
    assert run.tick() == [False]  # probe 1/2 again
    run.xid(0, 63)
    assert run.tick() == [False]  # a fatal XID while probing: sticky again
    for _ in range(3):
        assert run.tick() == [False]
    assert run.causes() == [("GPU-0", False, "gpu-lost"), ("GPU-0", False, "xid-63")]
    assert run.changes[1].since == run.changes[0].since  # still the same unhealthy spell


def test_a_reset_before_the_fatal_xid_does_not_count(tmp_path):
    run = Run(tmp_path, gpus=1)
    run.sampler.observe_reset("GPU-0")
    run.xid(0, 79)
    run.tick()
    for _ in range(4):
        assert run.tick() == [False]


@pytest.mark.parametrize("xid", [*sorted(APPLICATION_XIDS), 1, 999])
def test_application_and_unknown_xids_change_nothing(tmp_path, xid):
    run = Run(tmp_path)
    run.xid(0, xid)
    run.xid(0, xid)
    assert run.tick() == [True, True]
    assert run.sampler.latest is not None
    assert run.sampler.latest.gpus[0].xid_counts == ((xid, 2),)
    assert run.changes == []


def test_configured_application_xids_are_logged_as_such(tmp_path, caplog):
    run = Run(tmp_path, application_xids=application_xids(frozenset({3})))
    run.xid(0, 3)
    run.xid(0, 8)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert run.tick() == [True, True]
    kinds = {r.fields["xid"]: r.fields["kind"] for r in caplog.records if r.message == "XID event"}
    assert kinds == {3: "application", 8: "unknown"}


@pytest.mark.parametrize("xid", [119, 154])
def test_an_unknown_xid_is_a_warning_and_counted(tmp_path, caplog, xid):
    """XIDs newer than the agent's lists (119 a GSP RPC timeout, 154 a changed recovery action)
    are never silent: a warning naming them as unknown, and a count (the metric
    tessera_gpu_xid_errors_total{xid} the TesseraGpuUnknownXid alert reads)."""
    run = Run(tmp_path)
    run.xid(1, xid)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        assert run.tick() == [True, True]
    (record,) = [r for r in caplog.records if r.message == "XID event"]
    assert record.levelno == logging.WARNING
    assert (record.fields["xid"], record.fields["kind"]) == (xid, "unknown")
    assert run.sampler.latest is not None
    assert run.sampler.latest.gpus[1].xid_counts == ((xid, 1),)


def test_the_application_xids_setting(tmp_path):
    config = load_config({"application_xids": "1, 2,3"}, {})
    assert config.telemetry.application_xids == frozenset({1, 2, 3})
    assert application_xids(config.telemetry.application_xids) == APPLICATION_XIDS | {1, 2, 3}
    assert load_config({}, {"TESSERA_APPLICATION_XIDS": "8"}).telemetry.application_xids == {8}
    assert load_config({}, {}).telemetry.application_xids is None
    with pytest.raises(ConfigError, match=r"--application-xids: '1,x' .*'x' is not a whole"):
        load_config({"application_xids": "1,x"}, {})
    with pytest.raises(ConfigError, match=r"TESSERA_APPLICATION_XIDS='13,79' names fatal XID"):
        load_config({}, {"TESSERA_APPLICATION_XIDS": "13,79"})
    for fatal in FATAL_XIDS:
        with pytest.raises(ValueError, match=str(fatal)):
            parse_xids(str(fatal))


def test_health_stays_with_the_uuid_when_indexes_shift(tmp_path):
    run = Run(tmp_path)
    run.xid(1, 48)
    assert run.tick() == [True, False]
    # rediscovery: GPU-1 is now index 0, a new GPU took index 1
    run.node.uuids = {0: "GPU-1", 1: "GPU-9"}
    run.sampler.set_gpus([info(0, "GPU-1"), info(1, "GPU-9")])
    assert run.tick() == [False, True]
    assert run.sampler.latest is not None
    assert run.sampler.latest.gpus[0].xid_counts == ((48, 1),)
    assert run.sampler.latest.gpus[1].xid_counts == ()
    run.sampler.observe_reset("GPU-1")
    run.tick()
    assert run.tick() == [True, True]
    assert [(c.uuid, c.index, c.healthy) for c in run.changes] == [
        ("GPU-1", 1, False),
        ("GPU-1", 0, True),
    ]


def test_the_tracker_refuses_a_probe_of_no_reads():
    with pytest.raises(ValueError):
        HealthTracker(0)


def test_a_lost_gpu_is_gpu_lost_and_recovers_after_the_probe(tmp_path):
    run = Run(tmp_path, probe_reads=3)
    run.node.lost.add("GPU-1")
    assert run.tick() == [True, False]
    run.node.lost.clear()
    assert [run.tick() for _ in range(3)] == [[True, False], [True, False], [True, True]]
    assert run.causes() == [("GPU-1", False, "gpu-lost"), ("GPU-1", True, None)]
    assert replace(run.changes[1], since=0) == GpuHealth("GPU-1", 1, True, None, 0)


def test_a_restored_fatal_xid_holds_from_the_first_tick_with_its_original_since(tmp_path):
    first = Run(tmp_path)
    first.xid(1, 48)
    first.tick()
    sticky = first.sampler.sticky_faults()
    assert sticky == {"GPU-1": (48, first.changes[0].since)}

    again = Run(tmp_path)  # the next agent: no XID event will come again
    again.sampler.restore_faults(sticky)
    assert again.tick() == [True, False]
    for _ in range(5):  # reads work: still no recovery observed
        assert again.tick() == [True, False]
    (change,) = again.changes
    assert (change.cause, change.since) == ("xid-48", first.changes[0].since)
    again.sampler.observe_reset("GPU-1")  # a re-bind clears it as it would the first time
    again.tick()
    assert again.tick() == [True, True] and again.sampler.sticky_faults() == {}
