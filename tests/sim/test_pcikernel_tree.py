"""The simulated kernel writes only the part of the sysfs tree a write changes
(agent/sim/pcikernel.py, ``agent.sim.sysfs.rewrite_vm_part``): after every write, driver switch
and fault, the tree must be entry for entry the one a whole write of the same state gives (each
file's text, each link's target, each directory), on a passthrough node, a node of SR-IOV vGPUs
and a node of mediated devices; and a write after one that did not finish (a process killed
between the state's update and the tree's) rewrites the whole tree."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.node import NodeSource
from agent.sim.node import simulated_node
from agent.sim.pcikernel import TREE_WRITING
from agent.sim.sysfs import write_sysfs
from agent.sim.udev import remove_gpu, removed_buses
from tests.vmnode import fault

Entry = tuple[str, str]
"""("dir", "") | ("link", target) | ("file", text)."""
Step = Callable[[NodeSource, Path], None]


def snapshot(root: Path) -> dict[str, Entry]:
    """Every entry below ``root`` by its relative path."""
    out: dict[str, Entry] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir", "")
            else:
                out[rel] = ("file", path.read_text())
    return out


def whole(node: NodeSource, tmp: Path) -> dict[str, Entry]:
    """The tree a whole write of the node's state now gives, in a fresh directory."""
    fresh = tmp / f"fresh-{uuid.uuid4().hex[:8]}"
    fake = node.sim
    write_sysfs(fake.model, fresh, removed_buses(fake), fake.vm_state)
    return snapshot(fresh)


def kwrite(path: Path, value: str) -> Step:
    def step(node: NodeSource, root: Path) -> None:
        assert node.pci_write is not None
        node.pci_write(root / path, value)

    return step


def take_lock(bus: str) -> Step:
    """NVIDIA's unbind lock of the GPU at ``bus`` (under the driver root)."""

    def step(node: NodeSource, root: Path) -> None:
        assert node.pci_write is not None
        node.pci_write(node.driver_root / LOCK.format(bus), "1")

    return step


def sim_fault(*args: str) -> Step:
    def step(node: NodeSource, root: Path) -> None:
        fault(node.sim.state_dir.parent, *args)

    return step


DRV = Path("bus/pci/drivers")
DEV = Path("bus/pci/devices")
LOCK = "proc/driver/nvidia/gpus/{}/unbindLock"


def to_vfio_and_back(bus: str) -> list[Step]:
    """NVIDIA's scripts' way of lending a GPU to vfio-pci, faults while it is there, and back."""
    return [
        take_lock(bus),
        kwrite(DRV / "nvidia" / "unbind", bus),
        kwrite(DEV / bus / "driver_override", "vfio-pci\n"),
        kwrite(DRV / "vfio-pci" / "bind", bus),
        sim_fault("foreign-in-group", "--gpu", "2"),
        kwrite(DRV / "vfio-pci" / "unbind", bus),
        sim_fault("iommu-off"),
        sim_fault("vfio-unloaded"),
        sim_fault("vfio-loaded"),
        sim_fault("iommu-on"),
        kwrite(DEV / bus / "driver_override", "\n"),
        kwrite(Path("bus/pci/drivers_probe"), bus),
    ]


MDEV = str(uuid.UUID(int=7))
VF_PF = "0000:1b:00.0"
VF = "0000:1b:00.5"
T4 = "0000:3b:00.0"
STEPS: dict[str, Callable[[NodeSource], list[Step]]] = {
    "mixed": lambda n: to_vfio_and_back(n.sim.model.gpus[2].bus),
    "vgpu-h200": lambda n: [
        kwrite(DEV / VF / "nvidia" / "current_vgpu_type", "1430"),
        kwrite(DEV / "0000:1b:00.6" / "nvidia" / "current_vgpu_type", "1430"),
        kwrite(DEV / VF / "nvidia" / "current_vgpu_type", "0"),
        kwrite(DRV / "nvidia" / "unbind", VF),
        kwrite(DRV / "nvidia" / "bind", VF),
        kwrite(DEV / VF_PF / "sriov_numvfs", "0"),
        kwrite(DEV / VF_PF / "sriov_numvfs", "3"),
        kwrite(DEV / VF_PF / "sriov_numvfs", "0"),
        kwrite(DEV / VF_PF / "sriov_numvfs", "16"),
    ],
    "vgpu-t4": lambda n: [
        kwrite(DEV / T4 / "mdev_supported_types" / "nvidia-231" / "create", MDEV),
        kwrite(Path("bus/mdev/devices") / MDEV / "remove", "1"),
        sim_fault("iommu-off"),
        sim_fault("iommu-on"),
        take_lock(T4),
        kwrite(DRV / "nvidia" / "unbind", T4),
        kwrite(DRV / "nvidia" / "bind", T4),
    ],
}


@pytest.mark.parametrize("model", sorted(STEPS))
def test_each_write_leaves_the_tree_a_whole_write_gives(model: str, tmp_path: Path) -> None:
    node = simulated_node(model, tmp_path / "node")
    root = node.sysfs_root
    if model == "vgpu-t4":
        assert node.sim.model.gpus[0].bus == T4
    if model == "vgpu-h200":
        assert node.sim.model.gpus[0].bus == VF_PF
    states = [node.sim.vm_state]
    for i, step in enumerate(STEPS[model](node)):
        step(node, root)
        states.append(node.sim.vm_state)
        assert states[-1] != states[-2], f"step {i} changed nothing"  # each step is a change
        assert snapshot(root) == whole(node, tmp_path), f"step {i}"
        assert not (node.sim.state_dir / TREE_WRITING).exists()


def test_a_refused_write_leaves_no_write_in_progress(tmp_path: Path) -> None:
    node = simulated_node("mixed", tmp_path / "node")
    bus = node.sim.model.gpus[2].bus
    assert node.pci_write is not None
    with pytest.raises(OSError):
        node.pci_write(node.sysfs_root / DRV / "vfio-pci" / "bind", bus)  # bound to nvidia
    assert not (node.sim.state_dir / TREE_WRITING).exists()


def test_a_write_after_an_unfinished_one_rewrites_the_whole_tree(tmp_path: Path) -> None:
    """A process killed between the state's update and the tree's left the marker and a tree
    behind its state (here: another GPU's override and a hot-removed GPU's entries)."""
    node = simulated_node("mixed", tmp_path / "node")
    gpus = node.sim.model.gpus
    remove_gpu(node.sim, 0, tmp_path / "elsewhere")  # the state only: the tree still has it
    stale = node.sysfs_root / DEV / gpus[3].bus / "driver_override"
    stale.write_text("vfio-pci\n")
    (node.sim.state_dir / TREE_WRITING).touch()
    assert node.pci_write is not None
    node.pci_write(node.driver_root / LOCK.format(gpus[2].bus), "1")
    assert stale.read_text() == "(null)\n"
    assert not (node.sysfs_root / DEV / gpus[0].bus).exists()
    assert snapshot(node.sysfs_root) == whole(node, tmp_path)
    assert not (node.sim.state_dir / TREE_WRITING).exists()


@pytest.mark.parametrize("own", [True, False], ids=["own-tree", "given-tree"])
def test_only_the_simulators_own_tree_is_written_in_part(tmp_path: Path, own: bool) -> None:
    """In its own tree (``<sim dir>/sys``, which every kernel of the node writes) a write leaves
    what the VM state does not decide alone (here a GPU's ``numa_node``, edited by hand); a tree
    given with ``--sysfs-root`` may be any, and is rewritten whole at each write, as before."""
    given = None if own else tmp_path / "given-sys"
    if given is not None:
        write_sysfs(simulated_node("mixed", tmp_path / "probe").sim.model, given)
    node = simulated_node("mixed", tmp_path / "node", sysfs_root=given)
    gpu = node.sim.model.gpus[2]
    numa = node.sysfs_root / DEV / node.sim.model.gpus[0].bus / "numa_node"
    numa.write_text("9\n")
    take_lock(gpu.bus)(node, node.sysfs_root)
    kwrite(DRV / "nvidia" / "unbind", gpu.bus)(node, node.sysfs_root)
    assert (numa.read_text() == "9\n") is own
    assert not (node.sysfs_root / DEV / gpu.bus / "driver").exists()
