"""Where node facts come from: a ``NodeSource`` is an NVML facade, a sysfs root and the node's
identity. ``real_node`` opens this machine (pynvml and ``/sys``); the simulator builds the same
value for a node model (``agent.sim.node``); the composition root chooses. Everything above sees
a ``NodeSource`` and cannot tell the difference.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.bootid import read_boot_id, read_boot_time
from agent.discovery.build import build_inventory
from agent.discovery.inventory import NodeInventory
from agent.discovery.sysfs import SysfsSnapshot, read_sysfs
from agent.discovery.topology import normalize_bus_id
from agent.discovery.vm import VmDiscovery, read_vm_view
from agent.nvml.errors import NvmlGpuLost, NvmlInvalidArgument, NvmlNotFound
from agent.nvml.facade import Nvml
from agent.nvml.loader import NvmlLibrary, open_real_nvml
from agent.nvml.types import GpuDevice
from agent.pcihost.vm_types import KernelWrite


@dataclass(frozen=True)
class NodeSource:
    nvml: Nvml
    sysfs_root: Path
    hostname: str
    model: str | None
    """Simulated model name, None on real hardware."""
    driver_root: Path
    """Where the NVIDIA driver's files are visible to the agent (libraries, binaries,
    /proc/driver/nvidia): every path the agent opens is under it."""
    boot_id: str
    """Changes when the node reboots (prepared state does not survive a reboot)."""
    boot_time: float
    """When this boot started (unix seconds): files written before it are from an earlier boot."""
    sim: Any = None
    """The simulator object (FakeNvml) when simulating, for simulator controls."""
    proc_root: Path = Path("/proc")
    """Where the processes NVML reports (by host PID) are: ``<proc_root>/<pid>/cgroup``."""
    host_driver_root: Path | None = None
    """Where the same driver files are on the host, which CDI specs name (the container
    runtime reads them there). None: the same as ``driver_root``."""
    nvml_library: NvmlLibrary | None = None
    """Which ``libnvidia-ml.so.1`` NVML uses and why (None: not decided yet)."""
    pci_write: KernelWrite | None = None
    """How sysfs attributes are written (driver bind/unbind, ``driver_override``, vGPU types,
    mdevs, the NVIDIA unbind lock): the simulator's kernel (:class:`agent.sim.pcikernel.
    SimPciKernel`) on a simulated node; None on this machine, where the composition root uses
    the real one (``agent.pcihost.kernel.write_attribute``)."""

    @property
    def host_root(self) -> Path:
        """The host's view of the driver root (``host_driver_root``, else ``driver_root``)."""
        return self.driver_root if self.host_driver_root is None else self.host_driver_root


def real_node(
    *,
    node_name: str | None,
    sysfs_root: Path | None,
    driver_root: Path | None,
    proc_root: Path | None = None,
    host_driver_root: Path | None = None,
) -> NodeSource:
    """This machine: pynvml (not yet initialized, its library loaded from the driver root when
    found there), ``/sys`` and ``/proc`` unless told otherwise."""
    root = driver_root or Path("/")
    nvml, library = open_real_nvml(root)
    return NodeSource(
        nvml=nvml,
        sysfs_root=sysfs_root or Path("/sys"),
        hostname=node_name or socket.gethostname(),
        model=None,
        driver_root=root,
        boot_id=read_boot_id(),
        boot_time=read_boot_time(),
        proc_root=proc_root or Path("/proc"),
        host_driver_root=host_driver_root,
        nvml_library=library,
    )


def discover(source: NodeSource, vm: VmDiscovery | None = None) -> NodeInventory:
    """Read NVML and sysfs once and build the node inventory. NVML must be initialized.

    ``vm`` (``--virtualization`` not none, :func:`agent.discovery.vm.vm_discovery`): every GPU's
    ``virtualization`` is filled, and GPUs lent to virtual machines (bound to vfio-pci, which
    NVML does not enumerate) are kept from their cached facts with index -1."""
    sysfs = read_sysfs(source.sysfs_root)
    return _inventory(source, list(source.nvml.devices()), sysfs, vm)


def _inventory(
    source: NodeSource,
    gpus: list[GpuDevice],
    sysfs: SysfsSnapshot,
    vm: VmDiscovery | None,
    known: tuple[GpuDevice, ...] = (),
) -> NodeInventory:
    virtualization = None
    if vm is not None:
        view = read_vm_view(source.sysfs_root, sysfs, gpus, vm, known)
        gpus = [*gpus, *view.parked]
        virtualization = view.virtualization
    return build_inventory(
        hostname=source.hostname,
        system=source.nvml.system(),
        gpus=gpus,
        sysfs=sysfs,
        virtualization=virtualization,
    )


@dataclass(frozen=True)
class Reread:
    """A rediscovery's inventory and what it left out, for the log."""

    inventory: NodeInventory
    kept_unreadable: tuple[int, ...] = ()
    """NVML indexes of GPUs NVML counts but cannot read (lost) whose PCI function is still in
    sysfs: kept as the previous inventory had them (the health code reports them)."""
    gone: tuple[str, ...] = ()
    """What NVML still lists but the node no longer has (no PCI function in sysfs, or a lost
    GPU the previous inventory did not know), each as ``index/bus id``."""
    unlisted: tuple[str, ...] = ()
    """NVIDIA display/3D functions sysfs has that NVML does not enumerate (sysfs bus ids): a GPU
    hot-added after this process's ``nvmlInit`` (it is advertised after a restart; gpu-facts.md),
    or one bound to another driver (vfio-pci for a VM) whose facts are not known (a GPU lent to a
    VM that the inventory keeps, index -1, is not listed here)."""


NVIDIA_VENDOR_ID = 0x10DE
DISPLAY_CLASS = 0x03
"""PCI base class of display controllers (VGA 0x0300, 3D 0x0302: every NVIDIA GPU; NVSwitches
are bridges, 0x0680, and the GPUs' audio functions 0x0403)."""


def rediscover(
    source: NodeSource, previous: NodeInventory | None, vm: VmDiscovery | None = None
) -> Reread:
    """Read NVML and sysfs again after a hot-plug event or on the periodic re-read.

    Unlike :func:`discover` (the start), a GPU that is gone never fails the read: NVML may still
    enumerate a hot-removed GPU (its enumeration is not documented to follow hot-plug within
    one ``nvmlInit``; docs/gpu-facts.md) and answers GPU_IS_LOST for its handle, while sysfs
    drops its PCI function at once. So a GPU whose function sysfs no longer has is left out,
    and a lost GPU whose function is still there (fallen off the bus, not removed) is kept as
    ``previous`` had it at the same index, so that its devices stay advertised and the health
    code, not rediscovery, decides about them. With ``vm`` (see :func:`discover`) a GPU lent to
    a virtual machine stays in the inventory, neither gone nor unlisted."""
    sysfs = read_sysfs(source.sysfs_root)
    present = {f.bus for f in sysfs.functions}
    before = (
        {g.device.index: g.device for g in previous.gpus if g.device.index >= 0} if previous else {}
    )
    gpus: list[GpuDevice] = []
    kept: list[int] = []
    gone: list[str] = []
    for index in range(source.nvml.device_count()):
        try:
            device = source.nvml.device(index)
        except (NvmlGpuLost, NvmlNotFound, NvmlInvalidArgument):
            old = before.get(index)
            if old is not None and normalize_bus_id(old.pci_bus_id) in present:
                gpus.append(old)
                kept.append(index)
            else:
                gone.append(f"{index}/{old.pci_bus_id if old else 'unknown'}")
            continue
        if normalize_bus_id(device.pci_bus_id) not in present:
            gone.append(f"{index}/{device.pci_bus_id}")
            continue
        gpus.append(device)
    previous_gpus = tuple(g.device for g in previous.gpus) if previous else ()
    inventory = _inventory(source, gpus, sysfs, vm, previous_gpus)
    known = {
        normalize_bus_id(g.device.pci_bus_id)
        for g in (*inventory.gpus, *(previous.gpus if previous else ()))
    }
    unlisted = sorted(
        f.bus
        for f in sysfs.functions
        if f.vendor == NVIDIA_VENDOR_ID
        and f.pci_class >> 16 == DISPLAY_CLASS
        and f.bus not in known
    )
    return Reread(inventory, tuple(kept), tuple(gone), tuple(unlisted))
