"""The node inventory: one frozen snapshot of everything discovery found.

Everything downstream (devices, slices, telemetry labels, the CLI) is a pure function of a
``NodeInventory`` plus configuration. A change on the node produces a new inventory.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.nvml.types import GpuDevice, SystemInfo
from agent.pcihost.vm_types import GpuVirtualization


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: str
    """cpulist form, ``0-55,112-167``."""


@dataclass(frozen=True)
class PcieLocation:
    """Where a PCI function sits, read from sysfs."""

    bus_id: str
    """sysfs form, ``0000:1b:00.0``."""
    pcie_root: str
    """First path component under /sys/devices, as Kubernetes derives it: ``pci0000:16``."""
    path: tuple[str, ...]
    """Root complex, then every bridge from the root port down to (not including) the device."""
    numa_node: int | None
    """None when sysfs says -1 (unknown)."""
    cpus: str | None
    """``local_cpulist`` of the device (cpulist form), None when absent."""


@dataclass(frozen=True)
class Nic:
    name: str
    """RDMA device name (``mlx5_0``), else the network interface name."""
    netdev: str | None
    link_layer: str | None
    """``InfiniBand`` or ``Ethernet`` when known."""
    vendor_id: int
    device_id: int
    pcie: PcieLocation


@dataclass(frozen=True)
class Gpu:
    device: GpuDevice
    """What NVML says about the GPU."""
    pcie: PcieLocation
    """Where sysfs says it is."""
    nvlink_clique: str | None
    """Same value for GPUs that can all reach each other over NVLink; None without NVLink."""
    nvlink_links: int
    """Active NVLinks of this GPU."""
    near_nics: tuple[str, ...]
    """NICs behind the same PCIe switch or root complex (PIX/PXB/PHB), closest first."""
    virtualization: GpuVirtualization | None = None
    """What the GPU offers virtual machines (IOMMU group, bound driver, vGPU types); None where
    discovery was not asked (``--virtualization none``)."""

    @property
    def index(self) -> int:
        return self.device.index


@dataclass(frozen=True)
class NvlinkEdge:
    """NVLink connectivity between two GPUs (``a < b``), directly or through NVSwitches."""

    a: int
    b: int
    links: int
    via: str
    """``switch`` or ``direct``."""


@dataclass(frozen=True)
class Topology:
    """Pairwise connection levels in ``nvidia-smi topo -m`` words over GPUs then NICs."""

    labels: tuple[str, ...]
    """``GPU0``..``GPUn`` then NIC names."""
    levels: tuple[tuple[str, ...], ...]
    """``levels[i][j]``: ``X``, ``NV#``, ``PIX``, ``PXB``, ``PHB``, ``NODE`` or ``SYS``."""

    def level(self, a: str, b: str) -> str:
        return self.levels[self.labels.index(a)][self.labels.index(b)]

    def gpu_matrix(self) -> dict[int, dict[int, str]]:
        """GPU index -> GPU index -> level word."""
        gpus = [(i, int(lbl[3:])) for i, lbl in enumerate(self.labels) if lbl.startswith("GPU")]
        return {ga: {gb: self.levels[ia][ib] for ib, gb in gpus} for ia, ga in gpus}


@dataclass(frozen=True)
class NodeInventory:
    hostname: str
    system: SystemInfo
    gpus: tuple[Gpu, ...]
    nics: tuple[Nic, ...]
    numa_nodes: tuple[NumaNode, ...]
    nvlink_edges: tuple[NvlinkEdge, ...]
    nvlink_cliques: tuple[tuple[int, ...], ...]
    """Each clique's GPU indices, sorted; cliques sorted by their first GPU."""
    topology: Topology

    def gpu(self, index: int) -> Gpu:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)
