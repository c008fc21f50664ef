"""read_gpu_functions: a GPU's driver, IOMMU group and vGPU layout from sysfs alone, on simulated
nodes (passthrough, SR-IOV vGPU, mdev vGPU); the layouts no simulated board has (an audio
function in the GPU's group, SR-IOV without the vGPU host driver, mdevs on Ampere VFs) on the
hand-built tree of tests/pcihost/sysfstree.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.pcihost.binding import PciBinding
from agent.pcihost.errors import PciHostError
from agent.pcihost.read import read_gpu_functions
from agent.pcihost.vgpu_host import VgpuHost
from agent.pcihost.vm_types import NVIDIA, VGPU_MDEV, VGPU_VF, GpuVirtualization, Vgpu
from agent.sim.node import simulated_node
from agent.sim.vmstate import vf_bus
from tests.pcihost.sysfstree import SysTree
from tests.vmnode import fault

GPU, AUDIO = "0000:1b:00.0", "0000:1b:00.1"


def test_a_passthrough_gpu_in_its_own_group(tmp_path: Path) -> None:
    node = simulated_node("l40s-pcie", tmp_path)
    bus = node.sim.model.gpus[0].bus
    group = PciBinding(node.sysfs_root, node.driver_root, lambda p, v: None).iommu_group(bus)
    assert group is not None
    assert read_gpu_functions(node.sysfs_root, bus) == GpuVirtualization(
        bus_id=bus,
        vendor_id=0x10DE,
        device_id=node.sim.model.gpus[0].spec.pci_device_id >> 16,
        driver=NVIDIA,
        iommu_group=group,
        group_members=(bus,),
    )


def test_a_gpu_with_its_audio_function(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.add_function(GPU, device=0x2204, group=12)
    tree.add_function(AUDIO, device=0x1AEF, driver="snd_hda_intel", group=12)
    gv = read_gpu_functions(tree.sys, GPU)
    assert (gv.iommu_group, gv.group_members) == (12, (GPU, AUDIO))


def test_without_iommu_and_unbound(tmp_path: Path) -> None:
    node = simulated_node("l40s-pcie", tmp_path)
    node.nvml.init()
    bus = node.sim.model.gpus[0].bus
    fault(tmp_path, "iommu-off")
    assert node.pci_write is not None
    PciBinding(node.sysfs_root, node.driver_root, node.pci_write).unbind(bus)
    gv = read_gpu_functions(node.sysfs_root, bus)
    assert (gv.driver, gv.iommu_group, gv.group_members, gv.vgpu_interface) == (
        None,
        None,
        (),
        None,
    )
    node.nvml.shutdown()


def test_per_vf_vgpus_hopper_style(tmp_path: Path) -> None:
    node = simulated_node("vgpu-h200", tmp_path)
    pf = node.sim.model.gpus[0].bus
    assert node.pci_write is not None
    VgpuHost(node.sysfs_root, node.pci_write).set_type(vf_bus(pf, 1), 1431)
    gv = read_gpu_functions(node.sysfs_root, pf)
    assert gv.vgpu_interface == VGPU_VF
    total = node.sim.model.gpus[0].spec.sriov_total_vfs
    assert gv.vgpu_functions == tuple(vf_bus(pf, n) for n in range(total))
    assert gv.vgpus == (Vgpu(1431, vf_bus(pf, 1), None),)
    assert gv.vgpu_types == () and gv.heterogeneous is False  # NVML's part


def test_vfs_without_vgpu_files_are_no_vgpu_interface(tmp_path: Path) -> None:
    """SR-IOV enabled but no vGPU host driver: not a vGPU GPU."""
    tree = SysTree(tmp_path)
    tree.add_function(GPU, group=1)
    tree.add_vf(GPU, 0, "0000:1b:00.4")
    assert read_gpu_functions(tree.sys, GPU).vgpu_interface is None


def test_mdevs_on_the_gpu(tmp_path: Path) -> None:
    node = simulated_node("vgpu-t4", tmp_path)
    bus = node.sim.model.gpus[0].bus
    uuid = "4b20d080-1b54-4048-85b3-a6a62d165c01"
    assert node.pci_write is not None
    VgpuHost(node.sysfs_root, node.pci_write).create_mdev(bus, 232, uuid)
    gv = read_gpu_functions(node.sysfs_root, bus)
    assert (gv.vgpu_interface, gv.vgpu_functions) == (VGPU_MDEV, (bus,))
    assert gv.vgpus == (Vgpu(232, bus, uuid),)


def test_mdevs_on_ampere_vfs(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    ampere, vf = "0000:3b:00.0", "0000:3b:00.4"
    tree.add_function(ampere, device=0x20B5, group=2)
    tree.add_vf(ampere, 0, vf)
    tree.add_mdev_type(vf, 468, "NVIDIA A100-4C", 1)
    gv = read_gpu_functions(tree.sys, ampere)
    assert (gv.vgpu_interface, gv.vgpu_functions, gv.vgpus) == (VGPU_MDEV, (vf,), ())


def test_a_missing_function_names_the_path(tmp_path: Path) -> None:
    node = simulated_node("l40s-pcie", tmp_path)
    with pytest.raises(PciHostError, match=r"bus/pci/devices/0000:5b:00.0 does not exist"):
        read_gpu_functions(node.sysfs_root, "0000:5b:00.0")
