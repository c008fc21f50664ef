"""Making and removing vGPUs through NVIDIA's sysfs files (per-VF types and mdevs), against a
fake kernel that makes the mdev and moves the counts as the host driver does."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from agent.pcihost.errors import PciHostError
from agent.pcihost.vgpu_host import VgpuHost, parse_creatable
from agent.pcihost.vm_types import Vgpu
from tests.pcihost.sysfstree import FakeKernel, SysTree

PF = "0000:1b:00.0"
VF0, VF1 = "0000:1b:00.4", "0000:1b:00.5"
UUID = "4b20d080-1b54-4048-85b3-a6a62d165c01"


@pytest.fixture
def vf_tree(tmp_path: Path) -> SysTree:
    t = SysTree(tmp_path)
    t.add_function(PF, group=1)
    t.add_vf(PF, 0, VF0, vgpu_type=0)
    t.add_vf(PF, 1, VF1, vgpu_type=0)
    return t


@pytest.fixture
def mdev_tree(tmp_path: Path) -> SysTree:
    t = SysTree(tmp_path)
    t.add_function(PF, device=0x1EB8, group=1)
    t.add_mdev_type(PF, 222, "GRID T4-4Q", available=4)
    t.add_mdev_type(PF, 230, "GRID T4-16Q", available=0)
    return t


def test_creatable_lists_skip_a_header_line() -> None:
    text = "ID    : vGPU Name\n1428 : NVIDIA H200X-141C\n1414 : NVIDIA H200X-1-18C\n"
    assert parse_creatable(text) == {1428: "NVIDIA H200X-141C", 1414: "NVIDIA H200X-1-18C"}


def test_a_vf_takes_a_type_and_gives_it_back(vf_tree: SysTree) -> None:
    kernel = FakeKernel(vf_tree)
    host = VgpuHost(vf_tree.sys, kernel.write)
    assert host.creatable(VF1) == {1428: "NVIDIA H200X-141C", 1414: "NVIDIA H200X-1-18C"}
    assert host.current_type(VF1) == 0
    host.set_type(VF1, 1414)
    host.set_type(VF1, 1414)  # idempotent
    assert host.current_type(VF1) == 1414
    assert host.vgpus(PF) == (Vgpu(type_id=1414, function=VF1, mdev_uuid=None),)
    with pytest.raises(PciHostError, match="type 1414 already; clear it"):
        host.set_type(VF1, 1428)
    host.clear_type(VF1)
    host.clear_type(VF1)  # idempotent
    assert host.vgpus(PF) == ()
    assert [v for _, v in kernel.writes] == ["1414", "0"]


def test_a_type_the_vf_cannot_take_names_the_file_value_errno_and_what_it_can(
    vf_tree: SysTree,
) -> None:
    host = VgpuHost(vf_tree.sys, FakeKernel(vf_tree).write)
    with pytest.raises(PciHostError) as err:
        host.set_type(VF0, 999)
    message = str(err.value)
    assert "current_vgpu_type" in message and "'999'" in message and "EINVAL" in message
    assert "[1414, 1428]" in message
    assert err.value.errno == errno.EINVAL
    with pytest.raises(PciHostError, match="not a vGPU VF"):
        host.current_type(PF)


def test_an_mdev_is_made_found_and_removed(mdev_tree: SysTree) -> None:
    kernel = FakeKernel(mdev_tree)
    host = VgpuHost(mdev_tree.sys, kernel.write)
    assert host.creatable(PF) == {222: "GRID T4-4Q"}  # 230 has no instance left
    host.create_mdev(PF, 222, UUID)
    host.create_mdev(PF, 222, UUID)  # idempotent
    assert host.vgpus(PF) == (Vgpu(type_id=222, function=PF, mdev_uuid=UUID),)
    assert host.mdev_group(UUID) == 100
    type_dir = mdev_tree.fn(PF) / "mdev_supported_types" / "nvidia-222"
    assert (type_dir / "available_instances").read_text() == "3\n"
    with pytest.raises(PciHostError, match=re.escape(f"exists already on {PF} with type 222")):
        host.create_mdev(PF, 230, UUID)
    host.remove_mdev(UUID)
    host.remove_mdev(UUID)  # idempotent
    assert host.vgpus(PF) == ()
    assert len(kernel.writes) == 2
    with pytest.raises(PciHostError, match=f"no mediated device {UUID}"):
        host.mdev_group(UUID)


def test_mdev_errors_name_the_type_and_the_kernels_answer(mdev_tree: SysTree) -> None:
    host = VgpuHost(mdev_tree.sys, FakeKernel(mdev_tree).write)
    with pytest.raises(PciHostError, match=r"no vGPU type 999.*types there: \[222, 230\]"):
        host.create_mdev(PF, 999, UUID)
    with pytest.raises(PciHostError) as err:
        host.create_mdev(PF, 230, UUID)
    assert "nvidia-230/create" in str(err.value) and "EDQUOT" in str(err.value)
    assert "available_instances 0" in str(err.value)
    with pytest.raises(PciHostError, match="canonical lower-case"):
        host.create_mdev(PF, 222, UUID.upper())
    with pytest.raises(PciHostError, match="offers no vGPUs"):
        VgpuHost(mdev_tree.sys, FakeKernel(mdev_tree).write).creatable(
            mdev_tree.add_function("0000:2b:00.0").name
        )
