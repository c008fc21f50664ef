"""The trigger layer: which udev events count, debouncing, the loop, and the inventory diff."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from agent.hotplug import (
    Debouncer,
    DevicesChanged,
    GpuRef,
    NoEvents,
    PciEvent,
    Rediscovery,
    UdevSource,
    accept,
    inventory_change,
    open_udev,
)
from agent.node import discover
from agent.sim.node import simulated_node
from agent.sim.udev import remove_gpu
from tests.fakeclock import FakeClock

LOG = logging.getLogger("tessera.test.hotplug")
H100 = {"PCI_ID": "10DE:2330", "PCI_SLOT_NAME": "0000:1B:00.0", "PCI_CLASS": "30200"}


# -- the event filter, with stand-ins for pyudev's Device ----------------------------------------


@dataclass
class FakeDevice:
    """What UdevSource reads of a pyudev Device."""

    action: str | None
    properties: dict[str, str]
    sys_name: str


@dataclass
class FakeMonitor:
    """pyudev's Monitor.poll: the queued devices, then None (a timeout)."""

    queue: list[FakeDevice]
    timeouts: list[float | None] = field(default_factory=list)
    stopped: bool = False

    def poll(self, timeout: float | None = None) -> FakeDevice | None:
        self.timeouts.append(timeout)
        return self.queue.pop(0) if self.queue else None

    def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize("action", ["add", "remove", "bind", "unbind"])
def test_nvidia_pci_events_of_the_four_actions_are_taken(action):
    assert accept(action, H100, "0000:1b:00.0") == PciEvent(action, "0000:1b:00.0")


@pytest.mark.parametrize(
    ("action", "props"),
    [
        ("change", H100),  # not one of the four
        ("online", H100),
        (None, H100),
        ("add", {**H100, "PCI_ID": "15B3:1021"}),  # a Mellanox NIC
        ("add", {**H100, "PCI_ID": "8086:352A"}),  # an Intel root port
        ("add", {"PCI_SLOT_NAME": "0000:1b:00.0"}),  # no PCI_ID: not a PCI function's event
    ],
)
def test_other_events_are_ignored(action, props):
    assert accept(action, props, "0000:1b:00.0") is None


def test_the_bus_id_falls_back_to_the_device_name():
    props = {"PCI_ID": "10de:2330"}
    assert accept("remove", props, "0000:9A:00.0") == PciEvent("remove", "0000:9a:00.0")


def test_the_udev_source_yields_values_and_takes_the_queued_rest_without_waiting():
    monitor = FakeMonitor(
        [
            FakeDevice("unbind", H100, "0000:1b:00.0"),
            FakeDevice("add", {"PCI_ID": "15B3:1021"}, "0000:1c:00.0"),
            FakeDevice("remove", H100, "0000:1b:00.0"),
        ]
    )
    source = UdevSource(monitor)
    events = source.poll(2.5)
    assert events == [PciEvent("unbind", "0000:1b:00.0"), PciEvent("remove", "0000:1b:00.0")]
    assert all(type(e) is PciEvent for e in events)  # pyudev's objects never leave
    assert monitor.timeouts == [2.5, 0, 0, 0]
    assert source.poll(1.0) == []
    source.close()
    assert monitor.stopped


def test_without_udev_one_warning_and_a_source_without_events(tmp_path, caplog):
    caplog.set_level(logging.WARNING, LOG.name)
    source = open_udev(LOG, run_dir=tmp_path / "no-udev")
    assert isinstance(source, NoEvents)
    (rec,) = [r for r in caplog.records if r.name == LOG.name]
    assert "udev is not available" in rec.getMessage()
    assert "no-udev" in rec.__dict__["fields"]["reason"]
    source.close()
    assert source.poll(60) == ()  # closed: returns at once


def test_a_netlink_failure_is_the_same_warning(tmp_path, caplog, monkeypatch):
    import pyudev

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(93, "Protocol not supported")

    monkeypatch.setattr(pyudev.Monitor, "from_netlink", refuse)
    caplog.set_level(logging.WARNING, LOG.name)
    assert isinstance(open_udev(LOG, run_dir=tmp_path), NoEvents)
    (rec,) = [r for r in caplog.records if r.name == LOG.name]
    assert "Protocol not supported" in rec.__dict__["fields"]["reason"]


# -- debouncing --------------------------------------------------------------------------------


def test_a_burst_is_due_once_after_its_last_event():
    d = Debouncer(debounce=2.0, max_delay=10.0)
    assert d.due_at() is None
    d.event(PciEvent("unbind", "0000:1b:00.0"), 100.0)
    d.event(PciEvent("remove", "0000:1b:00.0"), 100.5)
    d.event(PciEvent("add", "0000:2a:00.0"), 101.0)
    d.event(PciEvent("bind", "0000:2a:00.0"), 101.2)
    assert d.due_at() == pytest.approx(103.2)
    assert d.take() == frozenset({"0000:2a:00.0"})
    assert d.due_at() is None and d.take() == frozenset()


def test_an_endless_trickle_is_still_read_at_the_maximum_delay():
    d = Debouncer(debounce=2.0, max_delay=10.0)
    for t in range(0, 30):  # one event a second, forever
        d.event(PciEvent("bind", "0000:1b:00.0"), 100.0 + t)
    assert d.due_at() == 110.0


class ScriptedSource:
    """Events at given clock times; a poll advances the fake clock to the next event or by its
    timeout (never sleeps). Sets ``stop`` once the clock passes ``until``."""

    def __init__(
        self,
        clock: FakeClock,
        script: list[tuple[float, PciEvent]],
        until: float,
        stop: threading.Event,
    ) -> None:
        self.clock, self.script, self.until, self.stop = (
            clock,
            sorted(script, key=lambda p: p[0]),
            until,
            stop,
        )
        self.timeouts: list[float] = []

    def poll(self, timeout_s: float) -> Sequence[PciEvent]:
        self.timeouts.append(timeout_s)
        end = self.clock.t + timeout_s
        if self.script and self.script[0][0] <= end:
            at = self.script[0][0]
            self.clock.t = max(self.clock.t, at)
            out = []
            while self.script and self.script[0][0] == at:
                out.append(self.script.pop(0)[1])
            return out
        self.clock.t = end
        if self.clock.t >= self.until:
            self.stop.set()
        return []

    def close(self) -> None:
        pass


def run_loop(script: list[tuple[float, PciEvent]], until: float, interval: float, debounce=2.0):
    clock = FakeClock()
    stop = threading.Event()
    source = ScriptedSource(clock, [(1000.0 + t, e) for t, e in script], 1000.0 + until, stop)
    calls: list[tuple[float, frozenset[str]]] = []
    loop = Rediscovery(
        source,
        lambda rebound: calls.append((clock.t - 1000.0, rebound)),
        interval=interval,
        debounce=debounce,
        log=LOG,
        clock=clock,
    )
    loop.run(stop)
    return calls, source


def test_the_loop_reads_a_burst_once_and_periodically_otherwise():
    bus = "0000:1b:00.0"
    burst = [(5.0, PciEvent("unbind", bus)), (5.0, PciEvent("remove", bus)),
             (6.0, PciEvent("add", bus)), (6.5, PciEvent("bind", bus))]  # fmt: skip
    calls, _ = run_loop(burst, until=125.0, interval=60.0)
    # one rediscovery 2 s after the burst's last event; the periodic one counts from it
    assert calls == [(8.5, frozenset({bus})), (68.5, frozenset())]


def test_interval_zero_reads_only_on_events():
    calls, source = run_loop([(30.0, PciEvent("remove", "0000:1b:00.0"))], until=600, interval=0)
    assert calls == [(32.0, frozenset())]
    assert max(source.timeouts) <= 1.0  # still wakes to see stop


def test_periodic_re_reads_without_events():
    calls, _ = run_loop([], until=200, interval=60.0)
    assert [t for t, _ in calls] == [60.0, 120.0, 180.0]


# -- the diff ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_inventories(tmp_path_factory: pytest.TempPathFactory):
    state = tmp_path_factory.mktemp("sim")
    source = simulated_node("dgx-h100", state)
    source.nvml.init()
    try:
        before = discover(source)
        remove_gpu(source.sim, 3)
        after = discover(source)
    finally:
        source.nvml.shutdown()
    return before, after


def test_the_diff_names_gpus_by_uuid_and_devices_by_name(two_inventories):
    before, after = two_inventories
    gone = before.gpus[3]
    names_before = [f"gpu-{g.device.minor}" for g in before.gpus]
    names_after = [f"gpu-{g.device.minor}" for g in after.gpus]
    change = inventory_change(before, after, names_before, names_after, ["0000:2a:00.0"])
    assert change.removed_gpus == (GpuRef(3, gone.device.uuid, gone.pcie.bus_id),)
    assert change.added_gpus == ()
    assert change.removed_devices == ("gpu-3",) and change.added_devices == ()
    assert change.rebound == ("0000:2a:00.0",)
    assert change.devices_changed
    # the way back: the GPU at its old index again, the others' indexes shift back
    back = inventory_change(after, before, names_after, names_before)
    assert back.added_gpus == (GpuRef(3, gone.device.uuid, gone.pcie.bus_id),)
    assert back.removed_gpus == () and back.added_devices == ("gpu-3",)


def test_shifted_indexes_alone_are_no_change(two_inventories):
    before, after = two_inventories
    assert [g.device.index for g in after.gpus] == list(range(7))  # GPU 4 is index 3 now
    assert after.gpus[3].device.uuid == before.gpus[4].device.uuid
    same = inventory_change(after, after, ["gpu-4"], ["gpu-4"])
    assert same == DevicesChanged() and not same.devices_changed
    assert not replace(same, rebound=("0000:1b:00.0",)).devices_changed


def test_no_previous_inventory_is_everything_added(two_inventories, tmp_path: Path):
    _, after = two_inventories
    change = inventory_change(None, after, (), ["gpu-0"])
    assert len(change.added_gpus) == 7 and change.added_devices == ("gpu-0",)


def test_a_gpu_nvml_still_lists_but_sysfs_no_longer_has_is_left_out(tmp_path: Path):
    """A real NVML may keep a hot-removed GPU in its enumeration (one nvmlInit): sysfs decides."""
    from agent.node import rediscover
    from agent.sim.sysfs import write_sysfs

    source = simulated_node("dgx-h100", tmp_path)
    source.nvml.init()
    try:
        before = discover(source)
        gone = before.gpus[6].pcie.bus_id
        write_sysfs(source.sim.model, source.sysfs_root, frozenset({gone}))  # NVML unchanged
        reread = rediscover(source, before)
        assert [g.device.minor for g in reread.inventory.gpus] == [0, 1, 2, 3, 4, 5, 7]
        assert reread.gone == (f"6/{gone}",) and reread.kept_unreadable == ()
        write_sysfs(source.sim.model, source.sysfs_root)
        source.sim.lose_gpu(2)  # lost but on the bus: kept as it was, for the health code
        reread = rediscover(source, before)
        assert reread.kept_unreadable == (2,)
        assert reread.inventory.gpus[2] == before.gpus[2]
    finally:
        source.nvml.shutdown()


def test_a_gpu_sysfs_has_but_nvml_does_not_enumerate_is_named_not_advertised(tmp_path: Path):
    """A real NVML does not enumerate a GPU hot-added after nvmlInit: rediscovery names it."""
    from agent.node import rediscover
    from agent.sim.sysfs import write_sysfs

    source = simulated_node("dgx-h100", tmp_path)
    source.nvml.init()
    try:
        before = discover(source)
        assert rediscover(source, before).unlisted == ()  # NVSwitches and NICs are not GPUs
        added = source.sim.model.gpus[3].bus
        source.sim.set_removed(3, True)  # NVML stops counting it...
        write_sysfs(source.sim.model, source.sysfs_root)  # ...while sysfs has it
        reread = rediscover(source, None)
        assert reread.unlisted == (added,)
        assert 3 not in [g.device.minor for g in reread.inventory.gpus]
    finally:
        source.nvml.shutdown()
