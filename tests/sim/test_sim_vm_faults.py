"""``tessera sim fault`` for GPUs handed to VMs: no IOMMU, vfio-pci unloaded, a foreign function
in a GPU's IOMMU group, a process holding a GPU's device node; seen in the tree another process
(the agent) reads, refused where the kernel refuses."""

from __future__ import annotations

import errno
import io
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cli import main
from agent.node import NodeSource
from agent.sim.node import simulated_node


def fault(state: Path, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["sim", "fault", "--state-dir", str(state), *args], {}, out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Path, NodeSource]]:
    source = simulated_node("l40s-pcie", tmp_path)
    yield tmp_path, source


def gpu_dir(source: NodeSource, index: int) -> Path:
    return source.sysfs_root / "bus" / "pci" / "devices" / source.sim.model.gpus[index].bus


def write(source: NodeSource, path: Path, value: str) -> None:
    assert source.pci_write is not None
    source.pci_write(path, value)


def to_vfio(source: NodeSource, index: int) -> None:
    bus = source.sim.model.gpus[index].bus
    drivers = source.sysfs_root / "bus" / "pci" / "drivers"
    write(source, source.driver_root / f"proc/driver/nvidia/gpus/{bus}/unbindLock", "1")
    write(source, drivers / "nvidia" / "unbind", bus)
    write(source, gpu_dir(source, index) / "driver_override", "vfio-pci")
    write(source, drivers / "vfio-pci" / "bind", bus)


def test_iommu_off_leaves_no_groups_and_is_refused_while_vfio_is_used(node):
    state, source = node
    groups = source.sysfs_root / "kernel" / "iommu_groups"
    assert fault(state, "iommu-off")[:2] == (0, "IOMMU off\n")
    assert groups.is_dir() and list(groups.iterdir()) == []
    assert not (gpu_dir(source, 0) / "iommu_group").exists()
    assert fault(state, "iommu-on")[0] == 0
    assert (gpu_dir(source, 0) / "iommu_group" / "devices").is_dir()

    to_vfio(source, 0)
    code, _, err = fault(state, "iommu-off")
    assert code == 2 and source.sim.model.gpus[0].bus in err and "vfio-pci" in err
    assert source.sim.vm_state.iommu


def test_vfio_unloaded_removes_the_driver_and_its_nodes(node):
    state, source = node
    assert fault(state, "vfio-unloaded")[:2] == (0, "vfio-pci unloaded\n")
    drivers = source.sysfs_root / "bus" / "pci" / "drivers"
    assert not (drivers / "vfio-pci").exists()
    assert not (source.driver_root / "dev" / "vfio").exists()
    with pytest.raises(FileNotFoundError):
        write(source, drivers / "vfio-pci" / "bind", source.sim.model.gpus[0].bus)
    assert fault(state, "vfio-loaded")[0] == 0
    to_vfio(source, 1)
    code, _, err = fault(state, "vfio-unloaded")
    assert code == 2 and "in use by " + source.sim.model.gpus[1].bus in err


def test_a_foreign_function_joins_the_gpus_iommu_group(node):
    state, source = node
    gpu = source.sim.model.gpus[2]
    code, out, _ = fault(state, "foreign-in-group", "--gpu", "2")
    assert code == 0 and "0000:cd:1f.0" in out
    members = sorted(p.name for p in (gpu_dir(source, 2) / "iommu_group" / "devices").iterdir())
    assert members == [gpu.bus, "0000:cd:1f.0"]
    foreign = source.sysfs_root / "bus" / "pci" / "devices" / "0000:cd:1f.0"
    assert (foreign / "class").read_text() == "0x010802\n"
    assert os.path.basename(os.readlink(foreign / "driver")) == "nvme"
    code, _, err = fault(state, "foreign-in-group", "--gpu", "9")
    assert code == 2 and "GPU index 9 does not exist" in err


def test_a_process_holding_the_gpu_keeps_the_unbind_lock_free(node):
    state, source = node
    code, out, _ = fault(state, "hold-gpu", "--gpu", "0")
    pid = int(out)
    try:
        assert code == 0
        node0 = source.driver_root / "dev" / "nvidia0"
        assert os.readlink(f"/proc/{pid}/fd/0") == str(node0)  # the real process holds it
        # the simulated /proc's link resolves to it (through the real process's own link), as
        # a real /proc's magic link does
        assert os.readlink(source.proc_root / str(pid) / "fd" / "0") == f"/proc/{pid}/fd/0"
        assert os.stat(source.proc_root / str(pid) / "fd" / "0").st_ino == node0.stat().st_ino
        lock = source.driver_root / f"proc/driver/nvidia/gpus/{source.sim.model.gpus[0].bus}"
        write(source, lock / "unbindLock", "1")
        assert (lock / "unbindLock").read_text() == "0\n"
        unbind = source.sysfs_root / "bus" / "pci" / "drivers" / "nvidia" / "unbind"
        with pytest.raises(OSError) as info:
            write(source, unbind, source.sim.model.gpus[0].bus)
        assert info.value.errno == errno.EBUSY
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    write(source, lock / "unbindLock", "1")
    assert (lock / "unbindLock").read_text() == "1\n"
    source.sim.refresh_proc()
    assert not (source.proc_root / str(pid)).exists()
