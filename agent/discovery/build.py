"""Join what NVML says about the GPUs with what sysfs says about the node into a NodeInventory.

``build_inventory`` is pure: it reads nothing, so the same inputs always give the same inventory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agent.discovery.errors import DiscoveryError
from agent.discovery.inventory import Gpu, Nic, NodeInventory, PcieLocation
from agent.discovery.sysfs import PciFunction, SysfsSnapshot
from agent.discovery.topology import (
    active_nvlinks,
    build_topology,
    clique_id,
    natural_key,
    near_nics,
    normalize_bus_id,
    nvlink_cliques,
    nvlink_edges,
)
from agent.nvml.types import GpuDevice, SystemInfo
from agent.pcihost.vm_types import GpuVirtualization


def build_inventory(
    *,
    hostname: str,
    system: SystemInfo,
    gpus: Sequence[GpuDevice],
    sysfs: SysfsSnapshot,
    virtualization: Mapping[str, GpuVirtualization] | None = None,
) -> NodeInventory:
    """The node inventory. Pure.

    GPUs are ordered by NVML index, then the GPUs NVML does not enumerate (index -1: lent to a
    virtual machine, agent.discovery.vm) by bus id; NICs by name (natural order: ``mlx5_2``
    before ``mlx5_10``). NVLinks and the topology matrix are NVML's, so they cover the
    enumerated GPUs only. ``virtualization`` (bus id -> facts) fills ``Gpu.virtualization``.
    Raises DiscoveryError naming the GPU when its bus id is not in sysfs, or when two GPUs share
    an index or a bus id.
    """
    functions: dict[str, PciFunction] = {f.bus: f for f in sysfs.functions}
    vm_facts = virtualization or {}
    ordered = sorted(gpus, key=lambda g: (g.index < 0, g.index, normalize_bus_id(g.pci_bus_id)))
    enumerated = [g for g in ordered if g.index >= 0]
    seen_index: set[int] = set()
    seen_bus: dict[str, int] = {}
    location_of: dict[str, PcieLocation] = {}
    for g in ordered:
        bus = normalize_bus_id(g.pci_bus_id)
        if g.index in seen_index:
            raise DiscoveryError(f"NVML reports GPU index {g.index} twice")
        if bus in seen_bus:
            raise DiscoveryError(f"GPU {g.index} and GPU {seen_bus[bus]} both report PCI bus {bus}")
        if g.index >= 0:
            seen_index.add(g.index)
        seen_bus[bus] = g.index
        fn = functions.get(bus)
        if fn is None:
            raise DiscoveryError(
                f"GPU {g.index} ({g.uuid}) at PCI bus {bus} is not in sysfs: "
                f"no {sysfs.root}/bus/pci/devices/{bus}"
            )
        location_of[bus] = fn.location()
    locations = [(g.index, location_of[normalize_bus_id(g.pci_bus_id)]) for g in enumerated]

    nics: list[Nic] = []
    for n in sorted(sysfs.nics, key=lambda n: natural_key(n.name)):
        fn = functions[n.bus]
        nics.append(
            Nic(
                name=n.name,
                netdev=n.netdev,
                link_layer=n.link_layer,
                vendor_id=fn.vendor,
                device_id=fn.device,
                pcie=fn.location(),
            )
        )
    nic_locations = [(n.name, n.pcie) for n in nics]

    edges = nvlink_edges(enumerated)
    cliques = nvlink_cliques(edges)
    clique_of = {i: clique_id(c) for c in cliques for i in c}
    inventory_gpus = tuple(
        Gpu(
            device=g,
            pcie=location_of[bus],
            nvlink_clique=clique_of.get(g.index) if g.index >= 0 else None,
            nvlink_links=active_nvlinks(g),
            near_nics=near_nics(location_of[bus], nic_locations),
            virtualization=vm_facts.get(bus),
        )
        for g in ordered
        for bus in (normalize_bus_id(g.pci_bus_id),)
    )
    return NodeInventory(
        hostname=hostname,
        system=system,
        gpus=inventory_gpus,
        nics=tuple(nics),
        numa_nodes=sysfs.numa_nodes,
        nvlink_edges=edges,
        nvlink_cliques=cliques,
        topology=build_topology(locations, nic_locations, edges),
    )
