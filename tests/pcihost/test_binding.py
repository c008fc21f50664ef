"""Driver binding through driver_override, as NVIDIA's scripts do, against the simulator's kernel
(``SimPciKernel`` behind a simulated node's ``pci_write``), which moves the ``driver`` link,
keeps the unbind lock and refuses as Linux does; the one answer it cannot give (a probe that
fails) comes from the small fake kernel of tests/pcihost/sysfstree.py."""

from __future__ import annotations

import errno
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.node import NodeSource
from agent.pcihost.binding import PciBinding
from agent.pcihost.errors import PciHostError
from agent.pcihost.vm_types import NVIDIA, VFIO_PCI
from agent.sim.node import simulated_node
from agent.sim.vmstate import vf_bus
from tests.pcihost.sysfstree import FakeKernel, SysTree
from tests.vmnode import fault


@dataclass
class Recorder:
    """The node's kernel, keeping every write (path, value) it is handed."""

    source: NodeSource
    writes: list[tuple[str, str]] = field(default_factory=list)

    def write(self, path: Path, value: str) -> None:
        self.writes.append((str(path), value))
        assert self.source.pci_write is not None
        self.source.pci_write(path, value)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeSource]:
    source = simulated_node("l40s-pcie", tmp_path)
    source.nvml.init()
    yield source
    source.nvml.shutdown()


def binding(node: NodeSource, sleeps: list[float] | None = None) -> tuple[PciBinding, Recorder]:
    kernel = Recorder(node)
    waits = sleeps if sleeps is not None else []
    return PciBinding(node.sysfs_root, node.driver_root, kernel.write, sleep=waits.append), kernel


def gpu(node: NodeSource, index: int = 0) -> str:
    bus: str = node.sim.model.gpus[index].bus
    return bus


def test_reads_driver_group_and_members(node: NodeSource, tmp_path: Path) -> None:
    b, _ = binding(node)
    bus = gpu(node)
    assert b.driver(bus) == NVIDIA and b.override(bus) is None
    group = b.iommu_group(bus)
    assert group is not None and group != b.iommu_group(gpu(node, 1))
    assert b.group_members(bus) == (bus,)
    fault(tmp_path, "foreign-in-group", "--gpu", "0")  # an NVMe drive joins the GPU's group
    (nvme,) = [m for m in b.group_members(bus) if m != bus]
    assert b.group_members(nvme) == tuple(sorted((bus, nvme))) and b.iommu_group(nvme) == group
    assert b.driver(nvme) == "nvme"


def test_no_iommu_means_no_group_and_no_members(node: NodeSource, tmp_path: Path) -> None:
    fault(tmp_path, "iommu-off")
    b, _ = binding(node)
    assert b.iommu_group(gpu(node)) is None and b.group_members(gpu(node)) == ()


def test_gpu_goes_to_vfio_pci_and_back_in_nvidias_order(node: NodeSource) -> None:
    b, kernel = binding(node)
    bus = gpu(node)
    b.unbind(bus)
    b.bind(bus, VFIO_PCI)
    assert (b.driver(bus), b.override(bus)) == (VFIO_PCI, VFIO_PCI)
    sys = node.sysfs_root / "bus/pci"
    assert kernel.writes == [
        (str(b.unbind_lock_path(bus)), "1"),
        (str(sys / "drivers/nvidia/unbind"), bus),
        (str(sys / "devices" / bus / "driver_override"), VFIO_PCI),
        (str(sys / "drivers/vfio-pci/bind"), bus),
    ]
    b.unbind(bus)
    b.release_override(bus)
    b.bind(bus, NVIDIA)
    b.release_override(bus)
    assert (b.driver(bus), b.override(bus)) == (NVIDIA, None)


def test_every_change_is_idempotent(node: NodeSource) -> None:
    b, kernel = binding(node)
    bus = gpu(node)
    b.unbind(bus)
    b.bind(bus, VFIO_PCI)
    done = len(kernel.writes)
    b.bind(bus, VFIO_PCI)  # bound already
    b.unbind(bus)
    b.unbind(bus)  # unbound already
    b.release_override(bus)
    b.release_override(bus)  # unset already
    assert len(kernel.writes) == done + 2
    assert (b.driver(bus), b.override(bus)) == (None, None)


def test_unbind_lock_is_tried_five_times_then_names_the_gpu(
    node: NodeSource, tmp_path: Path
) -> None:
    pid = int(fault(tmp_path, "hold-gpu", "--gpu", "0"))  # a process holds /dev/nvidia0
    try:
        sleeps: list[float] = []
        b, kernel = binding(node, sleeps)
        bus = gpu(node)
        with pytest.raises(PciHostError) as err:
            b.unbind(bus)
        assert bus in str(err.value) and "unbindLock" in str(err.value)
        assert "read back '0'" in str(err.value)
        assert sleeps == [1, 2, 3, 4]
        assert b.driver(bus) == NVIDIA  # never unbound without the lock
        assert [p for p, _ in kernel.writes] == [str(b.unbind_lock_path(bus))] * 5
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_function_without_the_lock_file_is_unbound_as_nvidias_script_does(
    tmp_path: Path,
) -> None:
    """A VF of the vGPU host driver has no ``unbindLock`` (only GPUs do)."""
    source = simulated_node("vgpu-h200", tmp_path)
    b, kernel = binding(source)
    vf = vf_bus(gpu(source), 0)
    assert not b.unbind_lock_path(vf).exists()
    b.unbind(vf)
    assert b.driver(vf) is None
    assert [p for p, _ in kernel.writes] == [
        str(source.sysfs_root / "bus/pci/drivers/nvidia/unbind")
    ]


def test_a_failed_bind_clears_the_override_and_says_what_the_kernel_answered(
    tmp_path: Path,
) -> None:
    """A probe that fails (the driver refuses the device): the simulated node has none, so the
    fake kernel answers."""
    tree = SysTree(tmp_path)
    tree.add_driver(VFIO_PCI)
    bus = "0000:1b:00.0"
    tree.add_function(bus, group=7)
    kernel = FakeKernel(tree, refuse_bind={bus})
    b = PciBinding(tree.sys, tree.driver_root, kernel.write, sleep=lambda s: None)
    b.unbind(bus)
    with pytest.raises(PciHostError) as err:
        b.bind(bus, VFIO_PCI)
    message = str(err.value)
    assert "drivers/vfio-pci/bind" in message and repr(bus) in message
    assert "ENODEV" in message and err.value.errno == errno.ENODEV
    assert tree.override_of(bus) == "(null)" and tree.driver_of(bus) is None


def test_bind_refuses_a_function_bound_elsewhere_and_a_driver_not_loaded(
    node: NodeSource, tmp_path: Path
) -> None:
    b, _ = binding(node)
    bus = gpu(node)
    with pytest.raises(PciHostError, match="bound to nvidia; unbind it first"):
        b.bind(bus, VFIO_PCI)
    fault(tmp_path, "vfio-unloaded")
    b.unbind(bus)
    with pytest.raises(PciHostError, match="modprobe vfio-pci") as err:
        b.bind(bus, VFIO_PCI)
    assert "drivers/vfio-pci does not exist" in str(err.value)
    assert b.override(bus) is None


def test_bad_addresses_are_refused_before_any_path_is_built(node: NodeSource) -> None:
    b, _ = binding(node)
    for bad in ("../../etc", "0000:1B:00.0", "1b:00.0"):
        with pytest.raises(PciHostError, match=re.escape("DDDD:BB:DD.F")):
            b.driver(bad)
    with pytest.raises(PciHostError, match=re.escape("no PCI function 0000:99:00.0")):
        b.driver("0000:99:00.0")
