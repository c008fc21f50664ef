"""Read a sysfs tree (the real ``/sys`` or a simulated one) into a plain frozen snapshot.

Only what Linux itself provides is used:

- ``bus/pci/devices/<bdf>`` symlinks, resolved to ``devices/<root complex>/<bridge>/…/<bdf>``;
  the path components after ``devices/`` are the root complex (``pcieRoot``, as Kubernetes
  derives it) and then every bridge from the root port down;
- per PCI function: ``vendor``, ``device``, ``class`` (hex), ``numa_node`` (``-1`` = unknown)
  and ``local_cpulist``;
- ``devices/system/node/node<N>/cpulist`` for the NUMA nodes;
- ``<function>/infiniband/<rdma>/ports/<n>/link_layer`` and ``<function>/net/<netdev>`` for NICs.

``read_sysfs`` is the only function here that does I/O; the parsers are pure.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from agent.discovery.errors import DiscoveryError
from agent.discovery.inventory import NumaNode, PcieLocation

_NODE_RE = re.compile(r"^node(\d+)$")
_NETWORK_CLASS = 0x02
"""PCI base class of network controllers (Ethernet 0x0200xx, InfiniBand 0x0207xx)."""


@dataclass(frozen=True)
class PciFunction:
    """One PCI function as sysfs shows it."""

    bus: str
    """sysfs form, ``0000:1b:00.0``."""
    path: tuple[str, ...]
    """Root complex (``pci0000:16``), then every bridge down to (not including) this function."""
    vendor: int
    device: int
    pci_class: int
    """24-bit class code, e.g. ``0x030200``."""
    numa_node: int | None
    """None when sysfs says -1 or has no ``numa_node`` file."""
    local_cpulist: str | None
    """cpulist form (``0-55,112-167``), None when the file is absent."""

    @property
    def pcie_root(self) -> str:
        return self.path[0]

    @property
    def is_bridge(self) -> bool:
        return self.pci_class >> 8 == 0x0604

    def location(self) -> PcieLocation:
        """This function's place in the tree as the inventory records it (pure)."""
        return PcieLocation(
            bus_id=self.bus,
            pcie_root=self.pcie_root,
            path=self.path,
            numa_node=self.numa_node,
            cpus=self.local_cpulist,
        )


@dataclass(frozen=True)
class SysfsNic:
    """A network function: its RDMA device and/or network interface."""

    bus: str
    rdma_name: str | None
    """``mlx5_0``; None for a NIC without an RDMA device."""
    netdev: str | None
    link_layer: str | None
    """``InfiniBand`` or ``Ethernet`` (from the RDMA port), None without an RDMA device."""

    @property
    def name(self) -> str:
        """The RDMA device name, else the network interface name, else the bus id."""
        return self.rdma_name or self.netdev or self.bus


@dataclass(frozen=True)
class SysfsSnapshot:
    """Everything discovery reads from sysfs, as plain values."""

    root: str
    """The sysfs root that was read (``/sys`` in production)."""
    functions: tuple[PciFunction, ...]
    """Every PCI function (bridges included), sorted by bus id."""
    numa_nodes: tuple[NumaNode, ...]
    """Sorted by id; empty on a kernel without NUMA."""
    nics: tuple[SysfsNic, ...]
    """Functions with an RDMA device or a network interface, sorted by bus id."""

    def function(self, bus: str) -> PciFunction | None:
        """The function at ``bus`` (sysfs form), None when sysfs has none."""
        for f in self.functions:
            if f.bus == bus:
                return f
        return None


def parse_hex(text: str, where: str) -> int:
    """Parse a sysfs hex attribute (``0x10de\\n``). Pure; raises DiscoveryError naming ``where``."""
    try:
        return int(text.strip(), 16)
    except ValueError:
        raise DiscoveryError(f"{where}: expected a hex number, got {text.strip()!r}") from None


def parse_numa_node(text: str, where: str) -> int | None:
    """Parse ``numa_node``: a node id, or None for ``-1`` (unknown). Pure."""
    try:
        value = int(text.strip())
    except ValueError:
        raise DiscoveryError(
            f"{where}: expected a NUMA node number, got {text.strip()!r}"
        ) from None
    return None if value < 0 else value


def _read(path: Path) -> str | None:
    """File content, None when the file does not exist; other errors become DiscoveryError."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DiscoveryError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _require(path: Path) -> str:
    text = _read(path)
    if text is None:
        raise DiscoveryError(f"{path} is missing: the sysfs tree is incomplete")
    return text


def _listdir(path: Path) -> list[str]:
    """Sorted entries of a directory, empty when it does not exist."""
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise DiscoveryError(f"cannot list {path}: {exc.strerror or exc}") from exc


def _read_function(link: Path, devices_dir: str) -> PciFunction | None:
    bus = link.name
    target = os.path.realpath(link)
    if not os.path.isdir(target):
        return None  # removed between listing and reading (hot-unplug): not there any more
    rel = os.path.relpath(target, devices_dir)
    parts = tuple(rel.split(os.sep))
    if rel.startswith(os.pardir) or len(parts) < 2:
        raise DiscoveryError(f"{link} resolves to {target}, which is not under {devices_dir}")
    if parts[-1] != bus:
        raise DiscoveryError(f"{link} resolves to {target}, which does not end in {bus}")
    dev = Path(target)
    numa_text = _read(dev / "numa_node")
    cpulist = _read(dev / "local_cpulist")
    return PciFunction(
        bus=bus,
        path=parts[:-1],
        vendor=parse_hex(_require(dev / "vendor"), str(dev / "vendor")),
        device=parse_hex(_require(dev / "device"), str(dev / "device")),
        pci_class=parse_hex(_require(dev / "class"), str(dev / "class")),
        numa_node=None if numa_text is None else parse_numa_node(numa_text, str(dev / "numa_node")),
        local_cpulist=None if cpulist is None else cpulist.strip(),
    )


def _read_nic(function: PciFunction, dev: Path) -> SysfsNic | None:
    rdma = _listdir(dev / "infiniband")
    netdevs = _listdir(dev / "net")
    if not rdma and not netdevs:
        return None
    link_layer: str | None = None
    if rdma:
        ports_dir = dev / "infiniband" / rdma[0] / "ports"
        ports = sorted(_listdir(ports_dir), key=lambda p: (len(p), p))  # numeric order
        for port in ports:
            text = _read(ports_dir / port / "link_layer")
            if text is not None and text.strip():
                link_layer = text.strip()
                break
    return SysfsNic(
        bus=function.bus,
        rdma_name=rdma[0] if rdma else None,
        netdev=netdevs[0] if netdevs else None,
        link_layer=link_layer,
    )


def _read_numa_nodes(root: Path) -> tuple[NumaNode, ...]:
    node_dir = root / "devices" / "system" / "node"
    nodes: list[NumaNode] = []
    for entry in _listdir(node_dir):
        m = _NODE_RE.match(entry)
        if m is None:
            continue
        text = _read(node_dir / entry / "cpulist")
        nodes.append(NumaNode(id=int(m.group(1)), cpus="" if text is None else text.strip()))
    return tuple(sorted(nodes, key=lambda n: n.id))


def read_sysfs(root: Path) -> SysfsSnapshot:
    """Read PCI functions, NUMA nodes and NICs under ``root`` (``/sys`` in production).

    Raises DiscoveryError naming the path when the tree cannot be read. A function whose
    directory vanishes while reading (hot-unplug) is left out; one with a malformed or missing
    ``vendor``/``device``/``class`` is an error.
    """
    pci_dir = Path(root) / "bus" / "pci" / "devices"
    try:
        entries = sorted(os.listdir(pci_dir))
    except OSError as exc:
        raise DiscoveryError(
            f"cannot read the sysfs tree at {root}: {pci_dir}: {exc.strerror or exc}"
        ) from exc
    devices_dir = os.path.realpath(Path(root) / "devices")
    functions: list[PciFunction] = []
    nics: list[SysfsNic] = []
    for bus in entries:
        link = pci_dir / bus
        function = _read_function(link, devices_dir)
        if function is None:
            continue
        functions.append(function)
        dev = Path(os.path.realpath(link))
        if function.pci_class >> 16 == _NETWORK_CLASS or (dev / "infiniband").is_dir():
            nic = _read_nic(function, dev)
            if nic is not None:
                nics.append(nic)
    return SysfsSnapshot(
        root=str(root),
        functions=tuple(functions),
        numa_nodes=_read_numa_nodes(Path(root)),
        nics=tuple(nics),
    )
