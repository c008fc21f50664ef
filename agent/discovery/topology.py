"""Connection levels between devices, NVLink edges and NVLink cliques. Every function is pure.

Levels are ``nvidia-smi topo -m``'s words (docs/gpu-facts.md, "Topology"):

- ``X`` a device with itself; ``NV#`` two GPUs joined by # bonded NVLinks (checked first);
- otherwise from the PCIe tree: different NUMA node -> ``SYS``; same NUMA node, different root
  complex -> ``NODE``; the deepest common ancestor is the root complex -> ``PHB``; the common
  ancestor is a bridge -> ``PIX`` when each side has at most one bridge below it, else ``PXB``.

An unknown NUMA node (sysfs ``-1``) equals another unknown one (a machine without NUMA reports
-1 everywhere) and differs from every known node.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from agent.discovery.inventory import NvlinkEdge, PcieLocation, Topology
from agent.nvml.types import GpuDevice

PCIE_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
"""PCIe levels, closest first."""
NVML_TOPOLOGY_LEVEL = {"X": 0, "PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}
"""Level word -> ``nvmlDeviceGetTopologyCommonAncestor`` value."""
NEAR_NIC_LEVELS = ("PIX", "PXB", "PHB")
"""Levels at which a NIC counts as near a GPU (``Gpu.near_nics``)."""

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders ``mlx5_2`` before ``mlx5_10``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in _DIGITS.split(name) if p)


def normalize_bus_id(bus_id: str) -> str:
    """A PCI address in sysfs form: ``00000000:1B:00.0`` -> ``0000:1b:00.0``.

    Accepts NVML's 8-digit domain, sysfs' 4-digit one and a missing domain (``1b:00.0``).
    Domains above 0xffff (VMD) keep their digits.
    """
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3:
        return bus_id.strip().lower()
    try:
        domain = int(parts[0], 16)
    except ValueError:
        return bus_id.strip().lower()
    return f"{domain:04x}:{parts[1]}:{parts[2]}"


def pcie_level(a: PcieLocation, b: PcieLocation) -> str:
    """The PCIe level between two functions (``X`` for the same one)."""
    if a.bus_id == b.bus_id:
        return "X"
    if a.numa_node != b.numa_node:
        return "SYS"
    if a.pcie_root != b.pcie_root:
        return "NODE"
    common = 0
    for x, y in zip(a.path, b.path, strict=False):
        if x != y:
            break
        common += 1
    if common <= 1:
        return "PHB"
    below = max(len(a.path) - common, len(b.path) - common)
    return "PIX" if below <= 1 else "PXB"


def level_rank(level: str) -> int:
    """Order of a level word, closest first: X, NV#, PIX, PXB, PHB, NODE, SYS."""
    if level == "X":
        return 0
    if level.startswith("NV"):
        return 1
    return 2 + PCIE_LEVELS.index(level)


def active_nvlinks(gpu: GpuDevice) -> int:
    """How many of the GPU's NVLinks are up."""
    return sum(1 for link in gpu.nvlinks if link.active)


def nvlink_edges(gpus: Sequence[GpuDevice]) -> tuple[NvlinkEdge, ...]:
    """NVLink connectivity between GPU pairs, sorted by ``(a, b)``.

    Links whose remote is a ``switch`` join the GPU to the NVSwitch fabric: two GPUs that both
    have active switch links are connected with ``min`` of their switch-link counts. Links whose
    remote is a ``gpu`` join it to the GPU at the remote bus id: the pair has as many links as
    either end reports (the larger count, so one side's missing report does not hide the link).
    Inactive links, links to unknown devices and links to a GPU not in ``gpus`` are ignored.
    """
    by_bus = {normalize_bus_id(g.pci_bus_id): g.index for g in gpus}
    switch_links: dict[int, int] = {}
    direct: dict[tuple[int, int], int] = {}
    for g in gpus:
        for link in g.nvlinks:
            if not link.active:
                continue
            kind = link.remote_device_type.lower()
            if kind == "switch":
                switch_links[g.index] = switch_links.get(g.index, 0) + 1
            elif kind == "gpu" and link.remote_pci_bus_id is not None:
                peer = by_bus.get(normalize_bus_id(link.remote_pci_bus_id))
                if peer is not None and peer != g.index:
                    direct[(g.index, peer)] = direct.get((g.index, peer), 0) + 1
    indices = sorted(by_bus.values())
    edges: list[NvlinkEdge] = []
    for i, a in enumerate(indices):
        for b in indices[i + 1 :]:
            d = max(direct.get((a, b), 0), direct.get((b, a), 0))
            s = min(switch_links.get(a, 0), switch_links.get(b, 0))
            if d:
                edges.append(NvlinkEdge(a=a, b=b, links=d + s, via="direct"))
            elif s:
                edges.append(NvlinkEdge(a=a, b=b, links=s, via="switch"))
    return tuple(edges)


def nvlink_cliques(edges: Iterable[NvlinkEdge]) -> tuple[tuple[int, ...], ...]:
    """Groups of GPUs joined over NVLink (the connected components of the edges).

    On NVSwitch fabrics and bridged pairs every component is a full clique. Each group is
    sorted, groups are sorted by their first GPU; GPUs without NVLink are in none.
    """
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for e in edges:
        ra, rb = find(e.a), find(e.b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for x in list(parent):
        groups.setdefault(find(x), []).append(x)
    return tuple(sorted(tuple(sorted(g)) for g in groups.values()))


def clique_id(members: Iterable[int]) -> str:
    """``clique-`` and the sorted GPU indices: ``clique-0-1-2-3``."""
    return "clique-" + "-".join(str(i) for i in sorted(members))


def near_nics(gpu: PcieLocation, nics: Sequence[tuple[str, PcieLocation]]) -> tuple[str, ...]:
    """Names of the NICs at PIX, PXB or PHB from ``gpu``: PIX first, then PXB, then PHB,
    ties by name (natural order)."""
    ranked = []
    for name, loc in nics:
        level = pcie_level(gpu, loc)
        if level in NEAR_NIC_LEVELS:
            ranked.append((NEAR_NIC_LEVELS.index(level), natural_key(name), name))
    return tuple(name for _, _, name in sorted(ranked))


def build_topology(
    gpus: Sequence[tuple[int, PcieLocation]],
    nics: Sequence[tuple[str, PcieLocation]],
    edges: Iterable[NvlinkEdge],
) -> Topology:
    """The full matrix over GPUs (``GPU<index>``, by index) then NICs (in the order given).

    NVLink first: a GPU pair with an edge is ``NV<links>``; everything else is its PCIe level.
    """
    nv = {(e.a, e.b): e.links for e in edges}
    ordered = sorted(gpus, key=lambda g: g[0])
    nodes: list[tuple[str, int | None, PcieLocation]] = [(f"GPU{i}", i, loc) for i, loc in ordered]
    nodes += [(name, None, loc) for name, loc in nics]
    levels: list[tuple[str, ...]] = []
    for r, (_, gi, la) in enumerate(nodes):
        row: list[str] = []
        for c, (_, gj, lb) in enumerate(nodes):
            if r == c:
                row.append("X")
            elif gi is not None and gj is not None and (min(gi, gj), max(gi, gj)) in nv:
                row.append(f"NV{nv[(min(gi, gj), max(gi, gj))]}")
            else:
                row.append(pcie_level(la, lb))
        levels.append(tuple(row))
    return Topology(labels=tuple(label for label, _, _ in nodes), levels=tuple(levels))
