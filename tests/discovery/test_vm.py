"""Discovery with ``--virtualization``: every GPU's virtualization facts, and a GPU lent to a VM
(bound to vfio-pci, which NVML does not enumerate) kept from its cached facts, index -1, never
reported gone by rediscovery or hot-plug.

The simulated node gives NVML and the sysfs tree with its IOMMU groups (issue 24's design section
1: ``driver`` and ``iommu_group`` links); the binding to vfio-pci is changed in that tree by
hand, and NVML stops enumerating the GPU as it does for a GPU the nvidia driver let go (the
simulator's ``set_removed``). NVML's vGPU facts come from a stand-in with the facade's two
methods."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.discovery.inventory import NodeInventory
from agent.discovery.vm import VmDiscovery, vm_discovery
from agent.discovery.vm_cache import CACHE_NAME, decode, load
from agent.errors import ConfigError
from agent.hotplug import inventory_change
from agent.node import NodeSource, discover, rediscover
from agent.pcihost.vm_types import NVIDIA, VFIO_PCI, VgpuType
from agent.sim.node import simulated_node
from agent.sim.sysfs import write_sysfs

LOG = logging.getLogger("tessera.test.discovery.vm")
H200_35C = VgpuType(
    type_id=1418, name="NVIDIA H200X-35C", framebuffer_bytes=35 << 30, max_instances=4
)


class VgpuStandIn:
    """``Nvml.vgpu_types`` / ``Nvml.vgpu_heterogeneous`` as a test sets them, by NVML index."""

    def __init__(self, types: dict[int, tuple[VgpuType, ...]], heterogeneous: set[int]) -> None:
        self.types = types
        self.heterogeneous = heterogeneous
        self.asked: list[int] = []

    def vgpu_types(self, index: int) -> tuple[VgpuType, ...]:
        self.asked.append(index)
        return self.types.get(index, ())

    def vgpu_heterogeneous(self, index: int) -> bool:
        return index in self.heterogeneous


def function_dir(source: NodeSource, bdf: str) -> Path:
    return Path(os.path.realpath(source.sysfs_root / "bus" / "pci" / "devices" / bdf))


def set_driver(source: NodeSource, bdf: str, driver: str | None) -> None:
    link = function_dir(source, bdf) / "driver"
    if link.is_symlink():
        link.unlink()
    if driver is not None:
        drivers = source.sysfs_root / "bus" / "pci" / "drivers" / driver
        drivers.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(drivers, link.parent))


def group_of(source: NodeSource, bdf: str) -> int:
    """The GPU's IOMMU group in the simulator's tree."""
    return int(os.path.basename(os.readlink(function_dir(source, bdf) / "iommu_group")))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeSource]:
    source = simulated_node("dgx-h100", tmp_path)
    source.nvml.init()
    yield source
    source.nvml.shutdown()


def vm_of(tmp_path: Path, vgpu: VgpuStandIn | None = None) -> VmDiscovery:
    vm = vm_discovery("passthrough", tmp_path / "state", vgpu or VgpuStandIn({}, set()), LOG)
    assert vm is not None
    return vm


def lend_to_vm(source: NodeSource, index: int) -> str:
    """GPU ``index`` of the model goes to vfio-pci: NVML stops enumerating it."""
    bus: str = source.sim.model.gpus[index].bus
    set_driver(source, bus, None)
    set_driver(source, bus, VFIO_PCI)
    source.sim.set_removed(index, True)
    return bus


def by_bus(inv: NodeInventory) -> dict[str, int]:
    return {g.pcie.bus_id: g.index for g in inv.gpus}


def test_the_mode_decides_whether_discovery_reads_virtualization(tmp_path: Path) -> None:
    nvml = VgpuStandIn({}, set())
    assert vm_discovery("none", tmp_path, nvml, LOG) is None
    assert vm_discovery(False, tmp_path, nvml, LOG) is None
    for on in ("passthrough", "vgpu", True):
        vm = vm_discovery(on, tmp_path, nvml, LOG)
        assert vm is not None and vm.cache == tmp_path / CACHE_NAME
    with pytest.raises(ConfigError, match=r"'vfio' is not a mode: choose one of none, passthrough"):
        vm_discovery("vfio", tmp_path, nvml, LOG)


def test_every_gpu_gets_its_iommu_group_driver_and_nvmls_vgpu_facts(
    node: NodeSource, tmp_path: Path
) -> None:
    vgpu = VgpuStandIn({1: (H200_35C,)}, heterogeneous={1})
    inv = discover(node, vm_of(tmp_path, vgpu))
    assert all(g.virtualization is not None for g in inv.gpus)
    first, second = inv.gpus[0].virtualization, inv.gpus[1].virtualization
    assert first is not None and second is not None
    bus = inv.gpus[0].pcie.bus_id
    assert (first.bus_id, first.driver, first.iommu_group) == (bus, NVIDIA, group_of(node, bus))
    assert first.group_members == (inv.gpus[0].pcie.bus_id,)
    assert first.vendor_id == 0x10DE and first.vgpu_types == () and not first.heterogeneous
    assert second.vgpu_types == (H200_35C,) and second.heterogeneous
    assert sorted(vgpu.asked) == list(range(len(inv.gpus)))
    assert discover(node).gpus[0].virtualization is None  # --virtualization none: as before


def test_a_gpu_lent_to_a_vm_stays_with_its_facts_and_is_not_gone(
    node: NodeSource, tmp_path: Path
) -> None:
    vm = vm_of(tmp_path)
    before = discover(node, vm)
    lent = before.gpus[3]
    bus = lend_to_vm(node, 3)
    reread = rediscover(node, before, vm)
    after = reread.inventory
    assert reread.gone == () and reread.unlisted == () and reread.kept_unreadable == ()
    kept = [g for g in after.gpus if g.pcie.bus_id == bus]
    assert len(kept) == 1 and kept[0].index == -1
    assert kept[0].device.uuid == lent.device.uuid and kept[0].device.minor == lent.device.minor
    assert kept[0].device.mig_profiles == lent.device.mig_profiles
    assert kept[0].virtualization is not None and kept[0].virtualization.driver == VFIO_PCI
    assert kept[0].virtualization.iommu_group == group_of(node, bus)
    assert after.gpus[-1] is kept[0]  # NVML's GPUs first, by index
    assert [g.index for g in after.gpus[:-1]] == list(range(len(before.gpus) - 1))
    change = inventory_change(before, after, (), ())
    assert change.removed_gpus == () and change.added_gpus == ()
    assert after.gpu(0).device.uuid == before.gpu(0).device.uuid


def test_without_virtualization_the_lent_gpu_is_unlisted_as_before(
    node: NodeSource, tmp_path: Path
) -> None:
    """The test above fails the same way without ``vm``: the GPU leaves the inventory."""
    before = discover(node)
    bus = lend_to_vm(node, 3)
    reread = rediscover(node, before)
    assert bus not in by_bus(reread.inventory)


def test_a_restart_keeps_the_lent_gpu_from_the_cache_written_only_on_change(
    node: NodeSource, tmp_path: Path
) -> None:
    vm = vm_of(tmp_path)
    assert vm.cache is not None
    first = discover(node, vm)
    written = vm.cache.stat()
    assert set(load(vm.cache)) == set(by_bus(first))
    discover(node, vm)
    assert vm.cache.stat().st_ino == written.st_ino  # same facts: not rewritten
    bus = lend_to_vm(node, 5)
    restarted = discover(node, vm)  # a new agent: no previous inventory, the cache alone
    assert by_bus(restarted)[bus] == -1
    assert load(vm.cache)[bus].uuid == first.gpus[5].device.uuid
    assert vm.cache.stat().st_ino == written.st_ino  # the lent GPU's facts did not change


def test_back_on_nvidia_it_is_nvmls_again_and_hot_removed_it_is_forgotten(
    node: NodeSource, tmp_path: Path
) -> None:
    vm = vm_of(tmp_path)
    before = discover(node, vm)
    bus = lend_to_vm(node, 2)
    lent = rediscover(node, before, vm).inventory
    set_driver(node, bus, None)
    set_driver(node, bus, NVIDIA)
    node.sim.set_removed(2, False)
    back = rediscover(node, lent, vm).inventory
    assert by_bus(back) == by_bus(before)
    assert inventory_change(lent, back, (), ()).removed_gpus == ()

    bus = lend_to_vm(node, 2)
    lent = rediscover(node, back, vm).inventory
    write_sysfs(node.sim.model, node.sysfs_root, frozenset({bus}))  # pulled from the node
    gone = rediscover(node, lent, vm)
    assert bus not in by_bus(gone.inventory)
    assert vm.cache is not None and bus not in load(vm.cache)
    assert [g.uuid for g in inventory_change(lent, gone.inventory, (), ()).removed_gpus] == [
        before.gpus[2].device.uuid
    ]


def test_an_unbound_gpu_halfway_to_vfio_pci_is_kept(node: NodeSource, tmp_path: Path) -> None:
    vm = vm_of(tmp_path)
    before = discover(node, vm)
    bus = before.gpus[1].pcie.bus_id
    set_driver(node, bus, None)
    node.sim.set_removed(1, True)
    kept = next(g for g in rediscover(node, before, vm).inventory.gpus if g.pcie.bus_id == bus)
    assert kept.index == -1 and kept.virtualization is not None
    assert kept.virtualization.driver is None


def test_an_unreadable_cache_is_reported_and_replaced(
    node: NodeSource, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    vm = vm_of(tmp_path)
    assert vm.cache is not None
    vm.cache.parent.mkdir(parents=True)
    vm.cache.write_text('{"version": 1, "gpus": {"0000:18:00.0": {"uuid": "GPU-x"}}}')
    bus = lend_to_vm(node, 0)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        inv = discover(node, vm)
    assert bus not in by_bus(inv)  # nothing known about it: not advertised
    record = next(r for r in caplog.records if "cannot be read" in r.getMessage())
    assert record.fields["path"] == str(vm.cache) and "KeyError" in record.fields["error"]  # type: ignore[attr-defined]
    assert set(decode(vm.cache.read_bytes())) == set(by_bus(inv))
