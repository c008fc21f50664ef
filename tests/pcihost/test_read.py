"""read_gpu_functions: a GPU's driver, IOMMU group and vGPU layout from sysfs alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.pcihost.errors import PciHostError
from agent.pcihost.read import read_gpu_functions
from agent.pcihost.vgpu_host import VgpuHost
from agent.pcihost.vm_types import VGPU_MDEV, VGPU_VF, GpuVirtualization, Vgpu
from tests.pcihost.sysfstree import FakeKernel, SysTree

GPU, AUDIO = "0000:1b:00.0", "0000:1b:00.1"


def test_a_passthrough_gpu_with_its_audio_function(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.add_function(GPU, device=0x2204, group=12)
    tree.add_function(AUDIO, device=0x1AEF, driver="snd_hda_intel", group=12)
    assert read_gpu_functions(tree.sys, GPU) == GpuVirtualization(
        bus_id=GPU,
        vendor_id=0x10DE,
        device_id=0x2204,
        driver="nvidia",
        iommu_group=12,
        group_members=(GPU, AUDIO),
    )


def test_without_iommu_and_unbound(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.add_function(GPU, driver=None)
    gv = read_gpu_functions(tree.sys, GPU)
    assert (gv.driver, gv.iommu_group, gv.group_members, gv.vgpu_interface) == (
        None,
        None,
        (),
        None,
    )


def test_per_vf_vgpus_hopper_style(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.add_function(GPU, group=1)
    tree.add_vf(GPU, 1, "0000:1b:00.5", vgpu_type=1414)
    tree.add_vf(GPU, 0, "0000:1b:00.4", vgpu_type=0)
    gv = read_gpu_functions(tree.sys, GPU)
    assert gv.vgpu_interface == VGPU_VF
    assert gv.vgpu_functions == ("0000:1b:00.4", "0000:1b:00.5")
    assert gv.vgpus == (Vgpu(1414, "0000:1b:00.5", None),)
    assert gv.vgpu_types == () and gv.heterogeneous is False  # NVML's part


def test_vfs_without_vgpu_files_are_no_vgpu_interface(tmp_path: Path) -> None:
    """SR-IOV enabled but no vGPU host driver: not a vGPU GPU."""
    tree = SysTree(tmp_path)
    tree.add_function(GPU, group=1)
    tree.add_vf(GPU, 0, "0000:1b:00.4")
    assert read_gpu_functions(tree.sys, GPU).vgpu_interface is None


def test_mdev_on_the_gpu_and_on_ampere_vfs(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.add_function(GPU, group=1)
    tree.add_mdev_type(GPU, 222, "GRID T4-4Q", 4)
    uuid = "4b20d080-1b54-4048-85b3-a6a62d165c01"
    VgpuHost(tree.sys, FakeKernel(tree).write).create_mdev(GPU, 222, uuid)
    gv = read_gpu_functions(tree.sys, GPU)
    assert (gv.vgpu_interface, gv.vgpu_functions) == (VGPU_MDEV, (GPU,))
    assert gv.vgpus == (Vgpu(222, GPU, uuid),)

    ampere = "0000:3b:00.0"
    tree.add_function(ampere, device=0x20B5, group=2)
    vf = "0000:3b:00.4"
    tree.add_vf(ampere, 0, vf)
    tree.add_mdev_type(vf, 468, "NVIDIA A100-4C", 1)
    gv = read_gpu_functions(tree.sys, ampere)
    assert (gv.vgpu_interface, gv.vgpu_functions, gv.vgpus) == (VGPU_MDEV, (vf,), ())


def test_a_missing_function_names_the_path(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.add_function(GPU)
    with pytest.raises(PciHostError, match=r"bus/pci/devices/0000:5b:00.0 does not exist"):
        read_gpu_functions(tree.sys, "0000:5b:00.0")
