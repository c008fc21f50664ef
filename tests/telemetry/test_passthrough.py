"""GPUs handed to virtual machines (issue 24, item 5): a GPU bound to vfio-pci (or unbound) is not
readable from the host, so it is not sampled, has no GPU series but ``tessera_gpu_passthrough``,
raises no health change, and is sampled again once it is bound to nvidia again; the claims
holding it keep their GPU-seconds, with no energy (the host cannot read it)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.nvml.samples import GpuSample
from agent.nvml.types import GpuDevice, MemoryInfo
from agent.pcihost.vm_types import GpuVirtualization, VgpuType
from agent.telemetry.energy import EnergyAccounting
from agent.telemetry.gpu_health import GpuHealth
from agent.telemetry.gpuinfo import GpuInfo, gpu_info
from agent.telemetry.metrics import SnapshotCollector
from agent.telemetry.sampler import REBIND_MAX_S, Sampler
from agent.telemetry.snapshot import Snapshot
from agent.usage.weights import GpuCapacity
from tests.fakeclock import FakeClock
from tests.telemetry.holders import Claim, Held

LOG = logging.getLogger("tessera.test.passthrough")
GIB = 1024**3
H200 = "NVIDIA H200"


def gpu(index: int, minor: int, *, passthrough: bool = False) -> GpuInfo:
    return GpuInfo(
        index, f"GPU-{minor}", H200, f"0000:{minor + 1:02x}:00.0", minor, passthrough=passthrough
    )


class Node:
    """GPUs that answer 300 W and an energy counter from the clock; records every read."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.reads: list[int] = []
        self.offset: dict[int, float] = {}
        self.failing: set[int] = set()

    def read(self, index: int, now: float) -> GpuSample:
        self.reads.append(index)
        if index < 0:
            raise AssertionError("a GPU NVML does not see was read")
        if index in self.failing:
            raise RuntimeError("GPU is lost")
        energy = 300.0 * now + self.offset.get(index, 0.0)
        return GpuSample(index, f"GPU-{index}", now, energy_joules=energy, power_watts=300.0)


VFIO_CLAIM = Claim(
    "uid-vm", "team-vm", "vm-disk", (Held("node-a", "gpu-1-vfio", "vfio", "GPU-1", 1),)
)


def make(
    tmp_path: Path, gpus: list[GpuInfo], holders: tuple[Claim, ...] = (VFIO_CLAIM,)
) -> tuple[Sampler, Node, FakeClock, list[GpuHealth]]:
    clock = FakeClock(100.0)
    node = Node(clock)
    changes: list[GpuHealth] = []
    sampler = Sampler(
        node="node-a",
        read=node.read,
        gpus=gpus,
        holders=lambda: holders,
        accounting=EnergyAccounting(tmp_path / "energy.json", clock),
        clock=clock,
        wall=lambda: 1.7e9 + clock.t,
        log=LOG,
        on_health_change=changes.append,
    )
    return sampler, node, clock, changes


def energy(snap: Snapshot) -> dict[str, float | None]:
    return {g.sample.uuid: g.energy_joules_total for g in snap.gpus}


Metrics = dict[str, list[tuple[dict[str, str], float]]]


def scrape(sampler: Sampler) -> Metrics:
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: sampler.latest))
    out: Metrics = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def gpu_series(metrics: dict[str, list[tuple[dict[str, str], float]]], uuid: str) -> set[str]:
    return {
        name for name, rows in metrics.items() for labels, _ in rows if labels.get("uuid") == uuid
    }


def test_a_gpu_handed_to_a_vm_is_not_read_and_has_only_its_passthrough_series(
    tmp_path: Path,
) -> None:
    sampler, node, clock, changes = make(tmp_path, [gpu(0, 0), gpu(-1, 1, passthrough=True)])
    for _ in range(3):
        sampler.tick()
        clock.advance(1.0)
    assert node.reads == [0, 0, 0]
    snap = sampler.latest
    assert snap is not None
    assert [g.sample.uuid for g in snap.gpus] == ["GPU-0"]
    assert [(p.uuid, p.minor, p.pci_bus_id) for p in snap.passthrough] == [
        ("GPU-1", 1, "0000:02:00.0")
    ]
    metrics = scrape(sampler)
    assert gpu_series(metrics, "GPU-1") == {"tessera_gpu_passthrough"}
    assert "tessera_gpu_healthy" in gpu_series(metrics, "GPU-0")
    passthrough = {labels["uuid"]: (labels, v) for labels, v in metrics["tessera_gpu_passthrough"]}
    assert passthrough["GPU-1"][1] == 1.0 and passthrough["GPU-0"][1] == 0.0
    assert passthrough["GPU-1"][0] == {
        "node": "node-a",
        "gpu": "1",
        "uuid": "GPU-1",
        "pci_bus_id": "0000:02:00.0",
        "model": H200,
    }
    assert changes == []  # no gpu-lost, no XID: nothing to alert on


def test_a_gpu_that_stops_being_readable_loses_its_series_at_once_not_stale(tmp_path: Path) -> None:
    sampler, _, clock, changes = make(tmp_path, [gpu(0, 0), gpu(1, 1)])
    sampler.tick()
    assert "tessera_gpu_power_watts" in gpu_series(scrape(sampler), "GPU-1")
    clock.advance(1.0)
    sampler.set_gpus([gpu(0, 0), gpu(-1, 1, passthrough=True)])  # bound to vfio-pci
    sampler.tick()
    assert gpu_series(scrape(sampler), "GPU-1") == {"tessera_gpu_passthrough"}
    assert changes == []


def test_a_gpu_bound_to_nvidia_again_is_sampled_again_without_the_vms_energy(
    tmp_path: Path,
) -> None:
    sampler, node, clock, changes = make(tmp_path, [gpu(0, 0), gpu(1, 1)], holders=())
    sampler.tick()
    clock.advance(1.0)
    assert energy(sampler.tick())["GPU-1"] == pytest.approx(300.0)
    sampler.set_gpus([gpu(0, 0), gpu(-1, 1, passthrough=True)])
    for _ in range(100):  # the VM runs for 100 s; the host sees none of its energy
        clock.advance(1.0)
        sampler.tick()
    node.offset[1] = 50_000.0  # the counter moved while the VM had the GPU
    sampler.set_gpus([gpu(0, 0), gpu(1, 1)])
    node.reads.clear()
    clock.advance(1.0)
    sampler.tick()
    assert node.reads == [0, 1]
    snap = sampler.latest
    assert snap is not None and snap.passthrough == ()
    by_uuid = {g.sample.uuid: g for g in snap.gpus}
    assert by_uuid["GPU-1"].healthy
    # the first reading after the VM is only a baseline: the total resumes where it stopped
    assert by_uuid["GPU-1"].energy_joules_total == pytest.approx(300.0)
    clock.advance(1.0)
    assert energy(sampler.tick())["GPU-1"] == pytest.approx(600.0)
    metrics = scrape(sampler)
    assert "tessera_gpu_power_watts" in gpu_series(metrics, "GPU-1")
    assert [v for labels, v in metrics["tessera_gpu_passthrough"] if labels["uuid"] == "GPU-1"] == [
        0.0
    ]
    assert changes == []


def test_reads_that_failed_while_the_gpu_was_unbound_for_a_vm_are_no_loss(
    tmp_path: Path,
) -> None:
    sampler, node, clock, changes = make(tmp_path, [gpu(0, 0), gpu(1, 1)])
    sampler.tick()
    node.failing.add(1)  # unbound from nvidia; the inventory does not say so yet
    clock.advance(1.0)
    sampler.tick()
    assert [(c.uuid, c.healthy, c.cause) for c in changes] == [("GPU-1", False, "gpu-lost")]
    sampler.set_gpus([gpu(0, 0), gpu(-1, 1, passthrough=True)])
    clock.advance(1.0)
    sampler.tick()
    assert [(c.uuid, c.healthy, c.cause) for c in changes[1:]] == [("GPU-1", True, None)]


def test_a_gpu_a_prepare_hands_over_is_not_read_before_the_inventory_says_so(
    tmp_path: Path,
) -> None:
    """The prepare tells the sampler before it unbinds the GPU: until the inventory is read
    again no GPU is read (every GPU after it in PCI order changes its NVML index: a read would
    fail or read a neighbour), so no health change at all (the daemon would otherwise withdraw
    the vfio device the VM holds, or a neighbour's devices, and raise a Node event)."""
    sampler, node, clock, changes = make(tmp_path, [gpu(0, 0), gpu(1, 1)])
    before = sampler.tick()
    sampler.hand_over("0000:02:00.0")
    node.failing.add(1)  # unbound from nvidia; the inventory does not say so yet
    node.reads.clear()
    clock.advance(1.0)
    assert sampler.tick() is before and node.reads == []  # the last snapshot stands
    sampler.set_gpus([gpu(0, 0), gpu(-1, 1, passthrough=True)])  # the rediscovery
    clock.advance(1.0)
    snap = sampler.tick()
    assert node.reads == [0] and [p.uuid for p in snap.passthrough] == ["GPU-1"]
    sampler.set_gpus([gpu(0, 0), gpu(1, 1)])  # given back, read again
    node.failing.clear()
    node.reads.clear()
    clock.advance(1.0)
    sampler.tick()
    assert node.reads == [0, 1] and changes == []


def test_a_hand_over_that_never_ends_stops_the_reads_for_a_bounded_time(tmp_path: Path) -> None:
    """A prepare that died between its hooks cannot stop telemetry for good."""
    sampler, node, clock, changes = make(tmp_path, [gpu(0, 0), gpu(1, 1)])
    sampler.tick()
    sampler.hand_over("0000:02:00.0")
    node.reads.clear()
    clock.advance(REBIND_MAX_S - 1)
    sampler.tick()
    assert node.reads == []
    clock.advance(2.0)
    sampler.tick()
    assert node.reads == [0] and changes == []  # GPU 1 is still taken for handed over


def test_a_gpu_whose_hand_over_failed_is_read_again_once_given_back(tmp_path: Path) -> None:
    sampler, node, clock, changes = make(tmp_path, [gpu(0, 0), gpu(1, 1)])
    sampler.hand_over("0000:02:00.0")
    sampler.tick()
    sampler.handed_back("0000:02:00.0")  # the prepare's rollback bound it to nvidia again
    node.reads.clear()
    clock.advance(1.0)
    sampler.tick()
    assert node.reads == [0, 1] and changes == []


def test_a_fatal_xid_stays_with_a_gpu_handed_to_a_vm(tmp_path: Path) -> None:
    sampler, _, clock, changes = make(tmp_path, [gpu(0, 0), gpu(1, 1)])
    sampler.restore_faults({"GPU-1": (79, 1.7e9)})
    sampler.tick()
    assert [(c.uuid, c.healthy, c.cause) for c in changes] == [("GPU-1", False, "xid-79")]
    sampler.set_gpus([gpu(0, 0), gpu(-1, 1, passthrough=True)])
    clock.advance(1.0)
    sampler.tick()
    assert len(changes) == 1  # only a reset clears it
    assert sampler.sticky_faults() == {"GPU-1": (79, pytest.approx(1.7e9))}


def test_a_vfio_claim_accrues_the_whole_gpus_seconds_and_no_energy(tmp_path: Path) -> None:
    sampler, _, clock, _ = make(tmp_path, [gpu(0, 0), gpu(-1, 1, passthrough=True)])
    sampler.tick()
    for _ in range(10):
        clock.advance(1.0)
        sampler.tick()
    snap = sampler.latest
    assert snap is not None
    (usage,) = snap.claims
    assert (usage.uid, usage.device, usage.rule) == ("uid-vm", "gpu-1-vfio", "exclusive")
    assert usage.gpu_seconds_total == pytest.approx(10.0)
    assert usage.energy_joules_total == 0.0
    assert usage.share == 1.0
    assert [(p.device, p.uid) for p in snap.prepared] == [("gpu-1-vfio", "uid-vm")]
    metrics = scrape(sampler)
    (row,) = metrics["tessera_claim_gpu_seconds_total"]
    assert row[0]["device"] == "gpu-1-vfio" and row[1] == pytest.approx(10.0)


def test_vgpu_claims_get_their_framebuffers_share_of_the_gpus_time_and_energy(
    tmp_path: Path,
) -> None:
    # two H200X-35C vGPUs (35 GiB each) on a 140 GiB GPU the host still reads (vGPU host driver)
    cap = GpuCapacity("GPU-0", 140 * GIB, vgpu_framebuffers=((1001, 35 * GIB),))
    g = replace(gpu(0, 0), capacity=cap)
    vgpus = tuple(
        Claim(
            f"uid-{k}",
            "team-vm",
            f"vm-{k}",
            (Held("node-a", f"gpu-0-vgpu-1001-{k}", "vgpu", "GPU-0", 0, vgpu_type_id=1001),),
        )
        for k in range(2)
    )
    sampler, _, clock, _ = make(tmp_path, [g], holders=vgpus)
    sampler.tick()
    for _ in range(4):
        clock.advance(1.0)
        sampler.tick()
    snap = sampler.latest
    assert snap is not None
    for usage in snap.claims:
        assert usage.rule == "vgpu-framebuffer"
        assert usage.share == pytest.approx(0.25)
        assert usage.gpu_seconds_total == pytest.approx(4 * 0.25)
        assert usage.energy_joules_total == pytest.approx(4 * 300.0 * 0.25)


def test_gpu_info_says_passthrough_from_the_bound_driver_and_reads_vgpu_framebuffers() -> None:
    def device(index: int) -> GpuDevice:
        return GpuDevice(
            index=index,
            minor=3,
            uuid="GPU-3",
            name=H200,
            brand="Nvidia",
            architecture="Hopper",
            compute_capability=(9, 0),
            pci_bus_id="0000:1b:00.0",
            pci_device_id=0x233510DE,
            serial=None,
            memory=MemoryInfo(140 * GIB, 140 * GIB, 0),
            mig_mode=None,
        )

    def virt(driver: str | None) -> GpuVirtualization:
        return GpuVirtualization(
            "0000:1b:00.0",
            0x10DE,
            0x2335,
            driver,
            12,
            ("0000:1b:00.0",),
            vgpu_types=(VgpuType(1001, "NVIDIA H200X-35C", 35 * GIB, 4),),
        )

    assert not gpu_info(device(0)).passthrough  # no virtualization discovery: the host reads it
    assert not gpu_info(device(0), virt("nvidia")).passthrough
    assert gpu_info(device(-1), virt("vfio-pci")).passthrough
    assert gpu_info(device(-1), virt(None)).passthrough  # unbound: nothing reads it
    assert gpu_info(device(-1)).passthrough  # NVML does not see it, whatever else is known
    cap = gpu_info(device(0), virt("nvidia")).capacity
    assert cap is not None and cap.vgpu_framebuffers == ((1001, 35 * GIB),)


def test_the_energy_state_of_a_node_with_a_gpu_handed_over_is_read_back(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    accounting = EnergyAccounting(tmp_path / "energy.json", clock)
    gpus = [gpu(0, 0), gpu(-1, 1, passthrough=True)]
    for t in (100.0, 110.0):
        accounting.update(
            [GpuSample(0, "GPU-0", t, energy_joules=300.0 * t), GpuSample(-1, "GPU-1", t)],
            gpus,
            [VFIO_CLAIM],
        )
    accounting.close()
    again = EnergyAccounting(tmp_path / "energy.json", clock)
    (usage,) = again.usage()
    assert (usage.device, usage.gpu_seconds_total, usage.energy_joules_total) == (
        "gpu-1-vfio",
        pytest.approx(10.0),
        0.0,
    )
    assert again.gpu_energy("GPU-0") == pytest.approx(3000.0)
