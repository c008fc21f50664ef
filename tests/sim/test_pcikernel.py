"""The simulated kernel's answers to sysfs writes (agent/sim/pcikernel.py): driver binding with
driver_override and the NVIDIA unbind lock, SR-IOV VFs, per-VF vGPU types, mediated devices,
and what NVML, the sysfs tree, /dev/vfio and udev show after each, as on a real node."""

from __future__ import annotations

import errno
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pynvml
import pytest

from agent.node import NodeSource
from agent.sim.node import simulated_node
from agent.sim.nvml import FakeNvml
from agent.sim.udev import EVENT_LOG
from agent.sim.vmstate import Holder


@pytest.fixture
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NodeSource]:
    source = simulated_node(getattr(request, "param", "l40s-pcie"), tmp_path)
    source.nvml.init()
    yield source
    source.nvml.shutdown()


def fn_dir(node: NodeSource, bus: str) -> Path:
    return node.sysfs_root / "bus" / "pci" / "devices" / bus


def read(path: Path) -> str:
    return path.read_text().strip()


def write(node: NodeSource, path: Path, value: str) -> None:
    assert node.pci_write is not None
    node.pci_write(path, value)


def refused(node: NodeSource, path: Path, value: str) -> int:
    with pytest.raises(OSError) as info:
        write(node, path, value)
    assert info.value.errno is not None
    return info.value.errno


def driver_of(node: NodeSource, bus: str) -> str | None:
    link = fn_dir(node, bus) / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def events(node: NodeSource) -> list[tuple[str, str, str]]:
    log = node.sim.state_dir / EVENT_LOG
    lines = log.read_text().splitlines() if log.exists() else []
    return [(e["ACTION"], e["PCI_SLOT_NAME"], e.get("DRIVER", "")) for e in map(json.loads, lines)]


def test_the_tree_has_iommu_groups_bound_drivers_and_the_vfio_nodes(node: NodeSource):
    drivers = node.sysfs_root / "bus" / "pci" / "drivers"
    assert {p.name for p in drivers.iterdir()} == {"nvidia", "vfio-pci"}
    groups = set()
    for gpu in node.sim.model.gpus:
        d = fn_dir(node, gpu.bus)
        assert driver_of(node, gpu.bus) == "nvidia"
        assert read(d / "driver_override") == "(null)"
        group = d / "iommu_group"
        assert sorted(p.name for p in (group / "devices").iterdir()) == [gpu.bus]
        assert (group / "devices" / gpu.bus).resolve() == d.resolve()
        assert read(node.driver_root / f"proc/driver/nvidia/gpus/{gpu.bus}/unbindLock") == "0"
        groups.add(os.path.basename(os.readlink(group)))
    assert len(groups) == len(node.sim.model.gpus)
    assert sorted(p.name for p in (node.driver_root / "dev" / "vfio").iterdir()) == ["vfio"]


def test_a_gpu_goes_to_vfio_pci_and_back_as_nvidias_scripts_do_it(node: NodeSource):
    fake: FakeNvml = node.sim
    gpu = fake.model.gpus[1]
    after = fake.model.gpus[2]
    d = fn_dir(node, gpu.bus)
    drivers = node.sysfs_root / "bus" / "pci" / "drivers"
    lock = node.driver_root / f"proc/driver/nvidia/gpus/{gpu.bus}/unbindLock"
    group = os.path.basename(os.readlink(d / "iommu_group"))

    assert refused(node, drivers / "nvidia" / "unbind", gpu.bus) == errno.EBUSY  # no lock
    write(node, lock, "1")
    assert read(lock) == "1"
    write(node, drivers / "nvidia" / "unbind", gpu.bus)
    assert driver_of(node, gpu.bus) is None and not lock.exists()
    # NVML lost it; the GPUs after it moved down one index, as a fresh enumeration numbers them
    assert fake.nvmlDeviceGetCount() == 3
    assert fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(1)) == after.uuid
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetHandleByUUID(gpu.uuid)

    assert refused(node, drivers / "vfio-pci" / "bind", gpu.bus) == errno.ENODEV  # no id table
    write(node, d / "driver_override", "vfio-pci\n")
    assert read(d / "driver_override") == "vfio-pci"
    assert refused(node, drivers / "nvidia" / "bind", gpu.bus) == errno.ENODEV  # override says no
    write(node, drivers / "vfio-pci" / "bind", gpu.bus)
    assert driver_of(node, gpu.bus) == "vfio-pci"
    assert (drivers / "vfio-pci" / gpu.bus).resolve() == d.resolve()
    assert (node.driver_root / "dev" / "vfio" / group).is_file()
    assert refused(node, drivers / "vfio-pci" / "bind", gpu.bus) == errno.EBUSY
    assert fake.nvmlDeviceGetCount() == 3

    write(node, drivers / "vfio-pci" / "unbind", gpu.bus)
    assert not (node.driver_root / "dev" / "vfio" / group).exists()
    write(node, d / "driver_override", "\n")
    assert read(d / "driver_override") == "(null)"
    write(node, drivers / "nvidia" / "bind", gpu.bus)
    assert driver_of(node, gpu.bus) == "nvidia" and read(lock) == "0"
    assert fake.nvmlDeviceGetCount() == 4
    assert fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(1)) == gpu.uuid
    assert events(node) == [
        ("unbind", gpu.bus, "nvidia"),
        ("bind", gpu.bus, "vfio-pci"),
        ("unbind", gpu.bus, "vfio-pci"),
        ("bind", gpu.bus, "nvidia"),
    ]


def test_the_unbind_lock_is_not_taken_while_a_process_holds_the_gpu(node: NodeSource):
    gpu = node.sim.model.gpus[0]
    lock = node.driver_root / f"proc/driver/nvidia/gpus/{gpu.bus}/unbindLock"
    node.sim.update_vm(lambda s: (replace(s, holders=(Holder(os.getpid(), gpu.index),)), None))
    write(node, lock, "1")
    assert read(lock) == "0"  # the write succeeds; reading it back says not taken
    unbind = node.sysfs_root / "bus" / "pci" / "drivers" / "nvidia" / "unbind"
    assert refused(node, unbind, gpu.bus) == errno.EBUSY
    assert refused(node, lock, "2") == errno.EINVAL


def test_drivers_probe_binds_what_the_override_allows(node: NodeSource):
    gpu = node.sim.model.gpus[0]
    pci = node.sysfs_root / "bus" / "pci"
    write(node, node.driver_root / f"proc/driver/nvidia/gpus/{gpu.bus}/unbindLock", "1")
    write(node, pci / "drivers" / "nvidia" / "unbind", gpu.bus)
    write(node, fn_dir(node, gpu.bus) / "driver_override", "vfio-pci")
    write(node, pci / "drivers_probe", gpu.bus)
    assert driver_of(node, gpu.bus) == "vfio-pci"
    assert refused(node, pci / "drivers_probe", "0000:ff:00.0") == errno.ENODEV


def test_a_refused_write_changes_nothing(node: NodeSource):
    before = node.sim.vm_state
    nvidia = node.sysfs_root / "bus" / "pci" / "drivers" / "nvidia"
    assert refused(node, nvidia / "bind", node.sim.model.gpus[0].bus) == errno.EBUSY
    assert refused(node, nvidia / "new_id", "10de 2330") == errno.EACCES
    assert refused(node, fn_dir(node, node.sim.model.gpus[0].bus) / "vendor", "1") == errno.EACCES
    assert node.sim.vm_state == before


@pytest.mark.parametrize("node", ["vgpu-h200"], indirect=True)
def test_sriov_vfs_are_enabled_and_disabled_as_linux_allows(node: NodeSource):
    gpu = node.sim.model.gpus[0]
    d = fn_dir(node, gpu.bus)
    assert (read(d / "sriov_totalvfs"), read(d / "sriov_numvfs")) == ("16", "16")
    vf0 = os.readlink(d / "virtfn0")
    assert vf0 == "../0000:1b:00.4"
    assert os.readlink(fn_dir(node, "0000:1b:00.4") / "physfn") == f"../{gpu.bus}"
    vf_group = os.path.basename(os.readlink(fn_dir(node, "0000:1b:00.4") / "iommu_group"))
    assert vf_group != os.path.basename(os.readlink(d / "iommu_group"))  # a group per VF

    assert refused(node, d / "sriov_numvfs", "8") == errno.EBUSY  # non-zero to non-zero
    assert refused(node, d / "sriov_numvfs", "17") == errno.ERANGE
    assert refused(node, d / "sriov_numvfs", "many") == errno.EINVAL
    write(node, d / "sriov_numvfs", "0")
    assert not (d / "virtfn0").exists() and not fn_dir(node, "0000:1b:00.4").exists()
    write(node, d / "sriov_numvfs", "4")
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("virtfn")) == [
        "virtfn0", "virtfn1", "virtfn2", "virtfn3"
    ]  # fmt: skip
    assert driver_of(node, "0000:1b:00.7") == "nvidia"
    assert not fn_dir(node, "0000:1b:01.0").exists()


@pytest.mark.parametrize("node", ["vgpu-h200"], indirect=True)
def test_vf_vgpu_types_are_homogeneous_and_counted(node: NodeSource):
    vfs = [f"0000:1b:00.{f}" for f in range(4, 8)] + ["0000:1b:01.0"]

    def creatable(vf: str) -> list[str]:
        return (fn_dir(node, vf) / "nvidia" / "creatable_vgpu_types").read_text().splitlines()

    def set_type(vf: str, value: str) -> None:
        write(node, fn_dir(node, vf) / "nvidia" / "current_vgpu_type", value)

    assert creatable(vfs[0]) == [
        "1428 : NVIDIA H200X-141C",
        "1429 : NVIDIA H200X-70C",
        "1430 : NVIDIA H200X-35C",
        "1431 : NVIDIA H200X-17C",
    ]
    assert read(fn_dir(node, vfs[0]) / "nvidia" / "current_vgpu_type") == "0"
    set_type(vfs[0], "1430")
    assert read(fn_dir(node, vfs[0]) / "nvidia" / "current_vgpu_type") == "1430"
    assert creatable(vfs[0]) == []
    assert creatable(vfs[1]) == ["1430 : NVIDIA H200X-35C"]  # homogeneous
    current = fn_dir(node, vfs[1]) / "nvidia" / "current_vgpu_type"
    assert refused(node, current, "1428") == errno.EINVAL
    assert refused(node, fn_dir(node, vfs[0]) / "nvidia" / "current_vgpu_type", "1430") == (
        errno.EBUSY
    )
    for vf in vfs[1:4]:
        set_type(vf, "1430")
    assert creatable(vfs[4]) == []  # H200X-35C: 4 per GPU
    assert refused(node, fn_dir(node, vfs[4]) / "nvidia" / "current_vgpu_type", "1430") == (
        errno.EINVAL
    )
    assert creatable("0000:9d:00.4")[0] == "1428 : NVIDIA H200X-141C"  # the other GPU: free
    set_type(vfs[0], "0")
    assert creatable(vfs[4]) == ["1430 : NVIDIA H200X-35C"]


@pytest.mark.parametrize("node", ["vgpu-t4"], indirect=True)
def test_mediated_devices_are_created_and_removed(node: NodeSource):
    gpu = node.sim.model.gpus[0]
    types = fn_dir(node, gpu.bus) / "mdev_supported_types"
    assert read(types / "nvidia-231" / "name") == "GRID T4-2Q"
    assert read(types / "nvidia-231" / "available_instances") == "8"
    assert read(types / "nvidia-231" / "device_api") == "vfio-pci"
    assert (node.sysfs_root / "class" / "mdev_bus" / gpu.bus).resolve() == (
        fn_dir(node, gpu.bus).resolve()
    )
    first = str(uuid.uuid4())
    write(node, types / "nvidia-231" / "create", first + "\n")
    mdev = node.sysfs_root / "bus" / "mdev" / "devices" / first
    assert mdev.resolve().parent == fn_dir(node, gpu.bus).resolve()
    assert os.path.basename(os.readlink(mdev / "mdev_type")) == "nvidia-231"
    group = os.path.basename(os.readlink(mdev / "iommu_group"))
    assert (node.driver_root / "dev" / "vfio" / group).is_file()
    assert read(types / "nvidia-231" / "available_instances") == "7"
    assert read(types / "nvidia-234" / "available_instances") == "0"  # homogeneous
    assert refused(node, types / "nvidia-234" / "create", str(uuid.uuid4())) == errno.EUSERS
    assert refused(node, types / "nvidia-231" / "create", first) == errno.EEXIST
    assert refused(node, types / "nvidia-231" / "create", "not-a-uuid") == errno.EINVAL

    write(node, mdev / "remove", "1")
    assert not mdev.exists() and not (fn_dir(node, gpu.bus) / first).exists()
    assert not (node.driver_root / "dev" / "vfio" / group).exists()
    assert read(types / "nvidia-234" / "available_instances") == "1"


@pytest.mark.parametrize(
    ("model", "types", "sriov"),
    [("vgpu-h200", ["H200X-141C", "H200X-70C", "H200X-35C", "H200X-17C"], True),
     ("vgpu-t4", ["T4-1Q", "T4-2Q", "T4-4Q", "T4-8Q", "T4-16Q", "T4-16C"], False),
     ("l40s-pcie", [], None)],
)  # fmt: skip
def test_nvml_gives_the_vgpu_types_of_a_vgpu_host(tmp_path: Path, model, types, sriov):
    source = simulated_node(model, tmp_path)
    with source.nvml as nvml:
        found = nvml.vgpu_types(1)
        assert [t.name.split(" ")[-1] for t in found] == types
        assert nvml.vgpu_heterogeneous(1) is False
        assert nvml.vgpu_sriov(1) is sriov
    if model == "vgpu-h200":
        h35 = found[2]
        assert (h35.type_id, h35.name, h35.max_instances) == (1430, "NVIDIA H200X-35C", 4)
        assert h35.framebuffer_bytes == 33378 * 1024 * 1024


def test_a_node_opened_again_has_the_tree_of_its_state(node: NodeSource, tmp_path: Path):
    """The state is the truth (one atomic update per write); a restarted agent (or one killed
    between the update and the tree's rewrite) reads the tree written from it."""
    gpu = node.sim.model.gpus[3]
    drivers = node.sysfs_root / "bus" / "pci" / "drivers"
    write(node, node.driver_root / f"proc/driver/nvidia/gpus/{gpu.bus}/unbindLock", "1")
    write(node, drivers / "nvidia" / "unbind", gpu.bus)
    (fn_dir(node, gpu.bus) / "driver_override").write_text("stale\n")  # a torn rewrite
    again = simulated_node("l40s-pcie", tmp_path)
    with again.nvml as nvml:
        assert nvml.device_count() == 3
    assert driver_of(again, gpu.bus) is None
    assert read(fn_dir(again, gpu.bus) / "driver_override") == "(null)"
