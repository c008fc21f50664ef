"""Topology levels, NVLink edges and cliques: pure cases, then the reference nodes' facts."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest

from agent.discovery.inventory import NodeInventory, NvlinkEdge, PcieLocation
from agent.discovery.topology import (
    NVML_TOPOLOGY_LEVEL,
    build_topology,
    clique_id,
    level_rank,
    natural_key,
    near_nics,
    normalize_bus_id,
    nvlink_cliques,
    nvlink_edges,
    pcie_level,
)
from agent.nvml.types import GpuDevice, MemoryInfo, NvLink
from agent.sim.model import load_model, model_names

MODELS = model_names()
Inventory = Callable[[str], NodeInventory]


def loc(bus: str, path: str, numa: int | None = 0) -> PcieLocation:
    parts = tuple(path.split("/"))
    return PcieLocation(bus_id=bus, pcie_root=parts[0], path=parts, numa_node=numa, cpus=None)


SW = "pci0000:16/0000:16:01.0/0000:17:00.0"
PCIE_CASES = {
    "self": (loc("0000:1b:00.0", SW), loc("0000:1b:00.0", SW), "X"),
    "other-numa": (loc("0000:1b:00.0", SW), loc("0000:9d:00.0", SW, numa=1), "SYS"),
    "other-root": (loc("0000:1b:00.0", SW), loc("0000:43:00.0", "pci0000:3e/0000:3e:01.0"), "NODE"),
    "root-ports": (
        loc("0000:1b:00.0", "pci0000:16/0000:16:01.0"),
        loc("0000:1c:00.0", "pci0000:16/0000:16:02.0"),
        "PHB",
    ),
    "same-root-port": (
        loc("0000:1b:00.0", "pci0000:16/0000:16:01.0"),
        loc("0000:1b:00.1", "pci0000:16/0000:16:01.0"),
        "PIX",
    ),
    "siblings-under-switch": (
        loc("0000:19:00.0", f"{SW}/0000:18:00.0"),
        loc("0000:1a:00.0", f"{SW}/0000:18:01.0"),
        "PIX",
    ),
    "one-side-deeper": (
        loc("0000:1b:00.0", f"{SW}/0000:18:00.0/0000:19:00.0/0000:1a:00.0"),
        loc("0000:1c:00.0", f"{SW}/0000:18:01.0"),
        "PXB",
    ),
    "two-switch-levels": (
        loc("0000:1b:00.0", f"{SW}/0000:18:00.0/0000:19:00.0"),
        loc("0000:1c:00.0", f"{SW}/0000:18:01.0/0000:1d:00.0"),
        "PXB",
    ),
    "unknown-numa-both": (
        loc("0000:01:00.0", "pci0000:00/0000:00:01.0", numa=None),
        loc("0000:02:00.0", "pci0000:00/0000:00:02.0", numa=None),
        "PHB",
    ),
    "unknown-numa-one": (
        loc("0000:01:00.0", "pci0000:00/0000:00:01.0", numa=None),
        loc("0000:02:00.0", "pci0000:00/0000:00:02.0", numa=0),
        "SYS",
    ),
}


@pytest.mark.parametrize(("a", "b", "level"), PCIE_CASES.values(), ids=PCIE_CASES.keys())
def test_pcie_level(a: PcieLocation, b: PcieLocation, level: str) -> None:
    assert pcie_level(a, b) == level
    assert pcie_level(b, a) == level


def test_level_order_matches_nvml() -> None:
    words = ["X", "NV12", "PIX", "PXB", "PHB", "NODE", "SYS"]
    assert sorted(words, key=level_rank) == words
    assert [NVML_TOPOLOGY_LEVEL[w] for w in ("X", "PIX", "PXB", "PHB", "NODE", "SYS")] == [
        0,
        10,
        20,
        30,
        40,
        50,
    ]


@pytest.mark.parametrize(
    ("raw", "sysfs"),
    [
        ("00000000:1B:00.0", "0000:1b:00.0"),
        ("0000:1b:00.0", "0000:1b:00.0"),
        ("1B:00.0", "0000:1b:00.0"),
        ("00010000:E0:1D.0", "10000:e0:1d.0"),
    ],
    ids=["nvml", "sysfs", "no-domain", "vmd-domain"],
)
def test_normalize_bus_id(raw: str, sysfs: str) -> None:
    assert normalize_bus_id(raw) == sysfs


def test_natural_key_orders_nic_names() -> None:
    names = ["mlx5_10", "mlx5_2", "mlx5_1", "eth0"]
    assert sorted(names, key=natural_key) == ["eth0", "mlx5_1", "mlx5_2", "mlx5_10"]


# --- NVLink ----------------------------------------------------------------------------------


def gpu(index: int, links: Sequence[tuple[bool, str | None, str]]) -> GpuDevice:
    return GpuDevice(
        index=index,
        minor=index,
        uuid=f"GPU-{index}",
        name="test",
        brand="NVIDIA",
        architecture="Hopper",
        compute_capability=(9, 0),
        pci_bus_id=f"0000:{index + 1:02x}:00.0",
        pci_device_id=0x233010DE,
        serial=None,
        memory=MemoryInfo(total=1, free=1, used=0),
        mig_mode=None,
        nvlinks=tuple(
            NvLink(link=i, active=a, remote_pci_bus_id=r, remote_device_type=t)
            for i, (a, r, t) in enumerate(links)
        ),
    )


def switch_links(n: int, active: bool = True) -> list[tuple[bool, str | None, str]]:
    return [(active, "0000:e7:00.0", "switch")] * n


def test_switch_links_use_the_smaller_count() -> None:
    edges = nvlink_edges([gpu(0, switch_links(18)), gpu(1, switch_links(12)), gpu(2, [])])
    assert edges == (NvlinkEdge(a=0, b=1, links=12, via="switch"),)


def test_inactive_links_do_not_count() -> None:
    g0 = gpu(0, switch_links(16) + switch_links(2, active=False))
    g1 = gpu(1, switch_links(1, active=False))
    assert nvlink_edges([g0, g1]) == ()


def test_direct_links_count_per_peer() -> None:
    g0 = gpu(0, [(True, "0000:02:00.0", "gpu")] * 4 + [(True, "0000:03:00.0", "gpu")] * 2)
    g1 = gpu(1, [(True, "00000000:01:00.0", "gpu")] * 4)  # NVML form names GPU 0
    g2 = gpu(2, [])  # reports nothing: GPU 0's view still counts
    g3 = gpu(3, [(True, "0000:99:00.0", "gpu"), (True, None, "gpu"), (True, "x", "unknown")])
    assert nvlink_edges([g0, g1, g2, g3]) == (
        NvlinkEdge(a=0, b=1, links=4, via="direct"),
        NvlinkEdge(a=0, b=2, links=2, via="direct"),
    )


def test_cliques_are_connected_groups() -> None:
    edges = [
        NvlinkEdge(a=2, b=3, links=4, via="direct"),
        NvlinkEdge(a=0, b=1, links=4, via="direct"),
        NvlinkEdge(a=5, b=6, links=4, via="direct"),
        NvlinkEdge(a=4, b=5, links=4, via="direct"),
    ]
    assert nvlink_cliques(edges) == ((0, 1), (2, 3), (4, 5, 6))
    assert nvlink_cliques([]) == ()
    assert clique_id((3, 1, 2)) == "clique-1-2-3"


def test_near_nics_closest_first_then_by_name() -> None:
    g = loc("0000:1b:00.0", f"{SW}/0000:18:00.0")
    nics = [
        ("mlx5_10", loc("0000:1c:00.0", f"{SW}/0000:18:01.0")),  # PIX
        ("mlx5_2", loc("0000:1d:00.0", f"{SW}/0000:18:02.0")),  # PIX
        ("mlx5_0", loc("0000:1e:00.0", f"{SW}/0000:18:03.0/0000:20:00.0")),  # PXB
        ("mlx5_1", loc("0000:21:00.0", "pci0000:16/0000:16:02.0")),  # PHB
        ("mlx5_3", loc("0000:41:00.0", "pci0000:3e/0000:3e:01.0")),  # NODE: not near
        ("mlx5_4", loc("0000:91:00.0", "pci0000:8e/0000:8e:01.0", numa=1)),  # SYS
    ]
    assert near_nics(g, nics) == ("mlx5_2", "mlx5_10", "mlx5_0", "mlx5_1")


def test_build_topology_puts_nvlink_first() -> None:
    a = loc("0000:19:00.0", f"{SW}/0000:18:00.0")
    b = loc("0000:1a:00.0", f"{SW}/0000:18:01.0")
    nic = loc("0000:1c:00.0", f"{SW}/0000:18:02.0")
    topo = build_topology(
        [(1, b), (0, a)], [("mlx5_0", nic)], [NvlinkEdge(a=0, b=1, links=4, via="direct")]
    )
    assert topo.labels == ("GPU0", "GPU1", "mlx5_0")
    assert topo.levels == (("X", "NV4", "PIX"), ("NV4", "X", "PIX"), ("PIX", "PIX", "X"))
    assert topo.gpu_matrix() == {0: {0: "X", 1: "NV4"}, 1: {0: "NV4", 1: "X"}}


# --- the reference nodes (docs/gpu-facts.md, "Reference nodes") ---------------------------


@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_matrix_is_symmetric_with_x_on_the_diagonal(inventory: Inventory, name: str) -> None:
    topo = inventory(name).topology
    n = len(topo.labels)
    for i, j in itertools.product(range(n), repeat=2):
        assert topo.levels[i][j] == topo.levels[j][i]
        assert (topo.levels[i][j] == "X") == (i == j)


def all_pairs(inv: NodeInventory, level: str) -> bool:
    m = inv.topology.gpu_matrix()
    return all(m[a][b] == level for a in m for b in m if a != b)


def test_dgx_h100(inventory: Inventory) -> None:
    inv = inventory("dgx-h100")
    assert [g.pcie.numa_node for g in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.pcie.bus_id[5:7] for g in inv.gpus] == [
        "1b",
        "43",
        "52",
        "61",
        "9d",
        "c3",
        "d1",
        "df",
    ]
    assert all_pairs(inv, "NV18")
    assert len(inv.nvlink_edges) == 28
    assert all(e.via == "switch" and e.links == 18 for e in inv.nvlink_edges)
    assert inv.nvlink_cliques == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert {g.nvlink_clique for g in inv.gpus} == {"clique-0-1-2-3-4-5-6-7"}
    assert all(g.nvlink_links == 18 for g in inv.gpus)
    assert len(inv.nics) == 12
    rails = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]
    for g, rail in zip(inv.gpus, rails, strict=True):
        assert inv.topology.level(f"GPU{g.index}", rail) == "PXB"
        assert g.near_nics == (rail,)
    numa = {n.name: n.pcie.numa_node for n in inv.nics}
    root = {n.name: n.pcie.pcie_root for n in inv.nics}
    for a, b in itertools.combinations(numa, 2):
        level = inv.topology.level(a, b)
        if numa[a] != numa[b]:
            assert level == "SYS", (a, b)
        elif root[a] != root[b]:
            assert level == "NODE", (a, b)
    assert inv.topology.level("mlx5_1", "mlx5_2") == "PIX"  # two ports of one card


def test_dgx_a100(inventory: Inventory) -> None:
    inv = inventory("dgx-a100")
    assert [g.pcie.bus_id[5:7] for g in inv.gpus] == [
        "07",
        "0f",
        "47",
        "4e",
        "87",
        "90",
        "b7",
        "bd",
    ]
    assert [g.pcie.numa_node for g in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert inv.gpu(0).pcie.pcie_root == "pci0000:00"
    assert all_pairs(inv, "NV12")
    assert inv.nvlink_cliques == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert len(inv.nics) == 8
    for g in inv.gpus:
        pair = (f"mlx5_{g.index // 2 * 2}", f"mlx5_{g.index // 2 * 2 + 1}")
        assert g.near_nics == pair
        for nic in pair:
            assert inv.topology.level(f"GPU{g.index}", nic) == "PXB"


def test_hgx_h200(inventory: Inventory) -> None:
    inv = inventory("hgx-h200")
    assert all_pairs(inv, "NV18")
    assert inv.nvlink_cliques == ((0, 1, 2, 3, 4, 5, 6, 7),)
    assert len(inv.nics) == 8
    for g in inv.gpus:
        assert inv.topology.level(f"GPU{g.index}", f"mlx5_{g.index}") == "PIX"
        assert g.near_nics == (f"mlx5_{g.index}",)
    numa0 = next(n for n in inv.numa_nodes if n.id == 0)
    assert numa0.cpus == "0-63,128-191"
    assert [g.pcie.cpus for g in inv.gpus[:4]] == ["0-63,128-191"] * 4


def test_l40s_pcie(inventory: Inventory) -> None:
    inv = inventory("l40s-pcie")
    levels = {lvl for row in inv.topology.levels for lvl in row}
    assert not any(lvl.startswith("NV") for lvl in levels)
    m = inv.topology.gpu_matrix()
    assert m[0][1] == m[2][3] == "PIX"
    assert m[0][2] == m[0][3] == m[1][2] == m[1][3] == "SYS"
    assert inv.nvlink_edges == () and inv.nvlink_cliques == ()
    assert all(g.nvlink_clique is None and g.nvlink_links == 0 for g in inv.gpus)
    assert all(g.near_nics == () for g in inv.gpus)  # NICs hang off other root complexes


def test_mixed(inventory: Inventory) -> None:
    inv = inventory("mixed")
    m = inv.topology.gpu_matrix()
    assert m[0][1] == "NV12"
    assert inv.nvlink_edges == (NvlinkEdge(a=0, b=1, links=12, via="direct"),)
    assert inv.nvlink_cliques == ((0, 1),)
    assert inv.gpu(0).nvlink_clique == inv.gpu(1).nvlink_clique == "clique-0-1"
    assert inv.gpu(2).nvlink_clique is None and inv.gpu(3).nvlink_clique is None
    assert [g.nvlink_links for g in inv.gpus] == [12, 12, 0, 0]
    for a, b in itertools.product((0, 1), (2, 3)):
        assert m[a][b] == "SYS"
    assert m[2][3] == "PIX"
    assert inv.gpu(0).near_nics == ("mlx5_0",) and inv.gpu(2).near_nics == ("mlx5_1",)


@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_inventory_matches_the_model(inventory: Inventory, name: str) -> None:
    model = load_model(name)
    inv = inventory(name)
    assert inv.hostname == model.hostname
    assert [g.device.uuid for g in inv.gpus] == [g.uuid for g in model.gpus]
    assert inv.topology.labels[: len(inv.gpus)] == tuple(f"GPU{g.index}" for g in model.gpus)
    assert inv.topology.labels[len(inv.gpus) :] == tuple(n.name for n in inv.nics)
    assert {n.name for n in inv.nics} == {n.name for n in model.nics}
    assert all(n.vendor_id == 0x15B3 for n in inv.nics)
