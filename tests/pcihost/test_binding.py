"""Driver binding through driver_override, as NVIDIA's scripts do, against a fake kernel that
moves the ``driver`` link as Linux does."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from agent.pcihost.binding import PciBinding
from agent.pcihost.errors import PciHostError
from tests.pcihost.sysfstree import FakeKernel, SysTree

GPU = "0000:1b:00.0"
AUDIO = "0000:1b:00.1"


@pytest.fixture
def tree(tmp_path: Path) -> SysTree:
    t = SysTree(tmp_path)
    t.add_driver("vfio-pci")
    t.add_function(GPU, group=7)
    t.add_function(AUDIO, device=0x22BA, driver="snd_hda_intel", group=7)
    return t


def binding(tree: SysTree, kernel: FakeKernel, sleeps: list[float] | None = None) -> PciBinding:
    waits = sleeps if sleeps is not None else []
    return PciBinding(tree.sys, tree.driver_root, kernel.write, sleep=waits.append)


def test_reads_driver_group_and_members(tree: SysTree) -> None:
    b = binding(tree, FakeKernel(tree))
    assert b.driver(GPU) == "nvidia" and b.driver(AUDIO) == "snd_hda_intel"
    assert b.iommu_group(GPU) == 7
    assert b.group_members(AUDIO) == (GPU, AUDIO)
    assert b.override(GPU) is None


def test_no_iommu_means_no_group_and_no_members(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.add_function(GPU)
    b = binding(tree, FakeKernel(tree))
    assert b.iommu_group(GPU) is None and b.group_members(GPU) == ()


def test_gpu_goes_to_vfio_pci_and_back_in_nvidias_order(tree: SysTree) -> None:
    kernel = FakeKernel(tree)
    b = binding(tree, kernel)
    b.unbind(GPU)
    b.bind(GPU, "vfio-pci")
    assert tree.driver_of(GPU) == "vfio-pci" and tree.override_of(GPU) == "vfio-pci"
    lock = str(b.unbind_lock_path(GPU))
    sys = tree.sys / "bus/pci"
    assert kernel.writes == [
        (lock, "1"),
        (str(sys / "drivers/nvidia/unbind"), GPU),
        (str(sys / "devices" / GPU / "driver_override"), "vfio-pci"),
        (str(sys / "drivers/vfio-pci/bind"), GPU),
    ]
    b.unbind(GPU)
    b.release_override(GPU)
    b.bind(GPU, "nvidia")
    b.release_override(GPU)
    assert tree.driver_of(GPU) == "nvidia" and tree.override_of(GPU) == "(null)"


def test_every_change_is_idempotent(tree: SysTree) -> None:
    kernel = FakeKernel(tree)
    b = binding(tree, kernel)
    b.unbind(AUDIO)
    b.bind(AUDIO, "vfio-pci")
    done = len(kernel.writes)
    b.bind(AUDIO, "vfio-pci")  # bound already
    b.unbind(AUDIO)
    b.unbind(AUDIO)  # unbound already
    b.release_override(AUDIO)
    b.release_override(AUDIO)  # unset already
    assert len(kernel.writes) == done + 2
    assert tree.driver_of(AUDIO) is None and tree.override_of(AUDIO) == "(null)"


def test_unbind_lock_is_tried_five_times_then_names_the_gpu(tree: SysTree) -> None:
    kernel = FakeKernel(tree, busy_gpus={GPU})
    sleeps: list[float] = []
    b = binding(tree, kernel, sleeps)
    with pytest.raises(PciHostError) as err:
        b.unbind(GPU)
    assert GPU in str(err.value) and "unbindLock" in str(err.value)
    assert "read back '0'" in str(err.value)
    assert sleeps == [1, 2, 3, 4]
    assert tree.driver_of(GPU) == "nvidia"  # never unbound without the lock
    assert all(path.endswith("unbindLock") for path, _ in kernel.writes)


def test_a_gpu_without_the_lock_file_is_unbound_as_nvidias_script_does(tmp_path: Path) -> None:
    tree = SysTree(tmp_path)
    tree.add_function(GPU, unbind_lock=False)
    binding(tree, FakeKernel(tree)).unbind(GPU)
    assert tree.driver_of(GPU) is None


def test_a_failed_bind_clears_the_override_and_says_what_the_kernel_answered(
    tree: SysTree,
) -> None:
    kernel = FakeKernel(tree, refuse_bind={GPU})
    b = binding(tree, kernel)
    b.unbind(GPU)
    with pytest.raises(PciHostError) as err:
        b.bind(GPU, "vfio-pci")
    message = str(err.value)
    assert "drivers/vfio-pci/bind" in message and repr(GPU) in message
    assert "ENODEV" in message and err.value.errno == errno.ENODEV
    assert tree.override_of(GPU) == "(null)" and tree.driver_of(GPU) is None


def test_bind_refuses_a_function_bound_elsewhere_and_a_driver_not_loaded(
    tmp_path: Path,
) -> None:
    tree = SysTree(tmp_path)
    tree.add_function(GPU)
    kernel = FakeKernel(tree)
    b = binding(tree, kernel)
    with pytest.raises(PciHostError, match="bound to nvidia; unbind it first"):
        b.bind(GPU, "vfio-pci")
    b.unbind(GPU)
    with pytest.raises(PciHostError, match="modprobe vfio-pci") as err:
        b.bind(GPU, "vfio-pci")
    assert "drivers/vfio-pci does not exist" in str(err.value)
    assert tree.override_of(GPU) == "(null)"


def test_bad_addresses_are_refused_before_any_path_is_built(tree: SysTree) -> None:
    b = binding(tree, FakeKernel(tree))
    for bad in ("../../etc", "0000:1B:00.0", "1b:00.0"):
        with pytest.raises(PciHostError, match=re.escape("DDDD:BB:DD.F")):
            b.driver(bad)
    with pytest.raises(PciHostError, match=re.escape("no PCI function 0000:99:00.0")):
        b.driver("0000:99:00.0")
