"""Making and removing vGPUs through NVIDIA's sysfs files (per-VF types and mdevs) on simulated
nodes: the simulator's kernel makes the mdev, moves the counts and applies the homogeneous rule
as the host driver does."""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.node import NodeSource
from agent.pcihost.errors import PciHostError
from agent.pcihost.vgpu_host import VgpuHost, parse_creatable
from agent.pcihost.vm_types import Vgpu
from agent.sim.node import simulated_node
from agent.sim.vmstate import vf_bus
from tests.vmnode import fault

UUID = "4b20d080-1b54-4048-85b3-a6a62d165c01"
H200_TYPES = {
    1428: "NVIDIA H200X-141C",
    1429: "NVIDIA H200X-70C",
    1430: "NVIDIA H200X-35C",
    1431: "NVIDIA H200X-17C",
}
"""agent/sim/gpus.yaml, H200."""


@dataclass
class Host:
    """A VgpuHost over a simulated node's kernel, keeping the values written."""

    source: NodeSource
    writes: list[str] = field(default_factory=list)

    def write(self, path: Path, value: str) -> None:
        self.writes.append(value)
        assert self.source.pci_write is not None
        self.source.pci_write(path, value)

    @property
    def host(self) -> VgpuHost:
        return VgpuHost(self.source.sysfs_root, self.write)

    def gpu(self, index: int = 0) -> str:
        bus: str = self.source.sim.model.gpus[index].bus
        return bus


def test_creatable_lists_skip_a_header_line() -> None:
    text = "ID    : vGPU Name\n1428 : NVIDIA H200X-141C\n1414 : NVIDIA H200X-1-18C\n"
    assert parse_creatable(text) == {1428: "NVIDIA H200X-141C", 1414: "NVIDIA H200X-1-18C"}


def test_a_vf_takes_a_type_and_gives_it_back(tmp_path: Path) -> None:
    h = Host(simulated_node("vgpu-h200", tmp_path))
    host, pf = h.host, h.gpu()
    vf0, vf1 = vf_bus(pf, 0), vf_bus(pf, 1)
    assert host.creatable(vf1) == H200_TYPES
    assert host.current_type(vf1) == 0
    host.set_type(vf1, 1430)
    host.set_type(vf1, 1430)  # idempotent
    assert host.current_type(vf1) == 1430
    assert host.vgpus(pf) == (Vgpu(type_id=1430, function=vf1, mdev_uuid=None),)
    assert host.creatable(vf1) == {}  # it has a type
    assert host.creatable(vf0) == {1430: H200_TYPES[1430]}  # homogeneous: the type in use
    with pytest.raises(PciHostError, match="type 1430 already; clear it"):
        host.set_type(vf1, 1431)
    host.clear_type(vf1)
    host.clear_type(vf1)  # idempotent
    assert host.vgpus(pf) == ()
    assert host.creatable(vf0) == H200_TYPES
    assert h.writes == ["1430", "0"]


def test_a_type_the_vf_cannot_take_names_the_file_value_errno_and_what_it_can(
    tmp_path: Path,
) -> None:
    h = Host(simulated_node("vgpu-h200", tmp_path))
    host, pf = h.host, h.gpu()
    with pytest.raises(PciHostError) as err:
        host.set_type(vf_bus(pf, 0), 999)
    message = str(err.value)
    assert "current_vgpu_type" in message and "'999'" in message and "EINVAL" in message
    assert str(sorted(H200_TYPES)) in message
    assert err.value.errno == errno.EINVAL
    with pytest.raises(PciHostError, match="not a vGPU VF"):
        host.current_type(pf)


def test_an_mdev_is_made_found_and_removed(tmp_path: Path) -> None:
    h = Host(simulated_node("vgpu-t4", tmp_path))
    host, gpu = h.host, h.gpu()
    assert set(host.creatable(gpu)) == {230, 231, 232, 233, 234, 321}
    host.create_mdev(gpu, 234, UUID)  # GRID T4-16Q: one instance per GPU
    host.create_mdev(gpu, 234, UUID)  # idempotent
    assert host.vgpus(gpu) == (Vgpu(type_id=234, function=gpu, mdev_uuid=UUID),)
    assert host.mdev_group(UUID) is not None
    type_dir = h.source.sysfs_root / "bus/pci/devices" / gpu / "mdev_supported_types"
    assert (type_dir / "nvidia-234" / "available_instances").read_text() == "0\n"
    assert host.creatable(gpu) == {}  # homogeneous, and the type is full
    with pytest.raises(PciHostError, match=re.escape(f"exists already on {gpu} with type 234")):
        host.create_mdev(gpu, 230, UUID)
    host.remove_mdev(UUID)
    host.remove_mdev(UUID)  # idempotent
    assert host.vgpus(gpu) == ()
    assert len(h.writes) == 2
    with pytest.raises(PciHostError, match=f"no mediated device {UUID}"):
        host.mdev_group(UUID)


def test_mdev_errors_name_the_type_and_the_kernels_answer(tmp_path: Path) -> None:
    h = Host(simulated_node("vgpu-t4", tmp_path))
    host, gpu = h.host, h.gpu()
    with pytest.raises(PciHostError, match=r"no vGPU type 999.*types there: \[230, 231,"):
        host.create_mdev(gpu, 999, UUID)
    host.create_mdev(gpu, 234, UUID)
    with pytest.raises(PciHostError) as err:
        host.create_mdev(gpu, 234, UUID.replace("4b", "5c", 1))
    assert "nvidia-234/create" in str(err.value) and "EUSERS" in str(err.value)
    assert "available_instances 0" in str(err.value)
    with pytest.raises(PciHostError, match="canonical lower-case"):
        host.create_mdev(gpu, 230, UUID.upper())
    fault(tmp_path, "foreign-in-group", "--gpu", "0")  # an NVMe drive: no vGPU there
    (nvme,) = {f.bus for f in h.source.sim.vm_state.functions} - {
        g.bus for g in h.source.sim.model.gpus
    }
    with pytest.raises(PciHostError, match="offers no vGPUs"):
        host.creatable(nvme)
