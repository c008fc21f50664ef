"""The NVML readers against the real pynvml, on a host where an NVIDIA driver loads (skipped
elsewhere): what ``NvmlApi`` says about pynvml holds when NVML answers, not only in signatures."""

import time

import pynvml

from agent.nvml.events import EventWatcher
from agent.nvml.facade import Nvml
from agent.nvml.telemetry import TelemetryReader
from tests.hardware import needs_driver

pytestmark = needs_driver


def test_discovery_reads_every_gpu():
    with Nvml(pynvml) as nv:
        assert nv.system().driver_version
        devices = nv.devices()
        assert len(devices) == nv.device_count() >= 1
        for d in devices:
            assert d.uuid.startswith("GPU-") and d.memory.total > 0
            assert d.pci_bus_id.count(":") == 2 and d.architecture != ""


def test_telemetry_reads_every_gpu():
    with Nvml(pynvml) as nv:
        reader = TelemetryReader(nv)
        try:
            samples = reader.read_all(time.monotonic())
        finally:
            reader.close()
    assert samples and not any(s.lost for s in samples)
    assert all(s.uuid.startswith("GPU-") for s in samples)


def test_the_event_watcher_registers_or_skips_every_gpu():
    with Nvml(pynvml) as nv, EventWatcher(nv) as watcher:
        assert set(watcher.registered) | set(watcher.skipped) == set(range(nv.device_count()))
