"""The ``nvidia-smi topo -m`` matrix and the DOT graph."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable

import pytest

from agent.discovery.build import build_inventory
from agent.discovery.inventory import NodeInventory
from agent.discovery.render import render_dot, render_matrix
from agent.discovery.sysfs import read_sysfs
from agent.sim.model import load_model, model_names
from agent.sim.sysfs import write_sysfs

from .conftest import gpu_devices, system_info

MODELS = model_names()
Inventory = Callable[[str], NodeInventory]

NVIDIA_SMI_LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""  # noqa: E501  (nvidia-smi's own words, copied from a real capture)


def rows(text: str) -> dict[str, list[str]]:
    """Matrix rows by their first cell (the header under "")."""
    table = text.split("\n\nLegend:")[0]
    return {line.split("\t")[0]: line.split("\t")[1:] for line in table.splitlines()}


@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_matrix_has_nvidia_smis_legend_and_shape(inventory: Inventory, name: str) -> None:
    inv = inventory(name)
    text = render_matrix(inv)
    assert NVIDIA_SMI_LEGEND in text
    table = rows(text)
    n = len(inv.gpus) + len(inv.nics)
    header = table[""]
    assert header[-3:] == ["CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    assert header[:n] == [f"GPU{g.index}" for g in inv.gpus] + [
        f"NIC{i}" for i in range(len(inv.nics))
    ]
    assert len(table) == n + 1
    for label, cells in table.items():
        if label:
            assert len(cells) == len(header) + 1, (
                label
            )  # NUMA Affinity is followed by an empty cell
    for i, label in enumerate(header[:n]):
        assert table[label][i] == " X "


def test_matrix_dgx_h100_words(inventory: Inventory) -> None:
    text = render_matrix(inventory("dgx-h100"))
    gpu0 = rows(text)["GPU0"]
    assert gpu0[:8] == [" X "] + ["NV18"] * 7
    assert gpu0[8] == "PXB"  # NIC0 = mlx5_0, its rail NIC
    assert gpu0[9:14] == ["NODE"] * 5 and gpu0[14:20] == ["SYS"] * 6
    assert gpu0[20:] == ["0-55,112-167", "0", "", "N/A"]
    assert rows(text)["GPU4"][20:22] == ["56-111,168-223", "1"]
    assert rows(text)["NIC0"][20:] == ["", "", "", ""]
    legend = text.split("NIC Legend:\n\n")[1].splitlines()
    assert legend[0] == "  NIC0: mlx5_0" and legend[11] == "  NIC11: mlx5_11"


def test_matrix_l40s_has_no_nvlink(inventory: Inventory) -> None:
    table = rows(render_matrix(inventory("l40s-pcie")))
    cells = [c for label, r in table.items() if label for c in r]
    assert not any(re.fullmatch(r"NV\d+", c) for c in cells)
    assert table["GPU0"][1] == "PIX" and table["GPU0"][2] == "SYS"


def test_matrix_without_nics_has_no_nic_legend(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = load_model("mixed")
    root = tmp_path_factory.mktemp("mixed")
    write_sysfs(model, root)
    snapshot = dataclasses.replace(read_sysfs(root), nics=())
    inv = build_inventory(
        hostname="h", system=system_info(model), gpus=gpu_devices(model), sysfs=snapshot
    )
    text = render_matrix(inv)
    assert "NIC Legend" not in text and "NIC0" not in text
    assert text.endswith("  NV#  = Connection traversing a bonded set of # NVLinks\n")
    assert rows(text)["GPU0"][:4] == [" X ", "NV12", "SYS", "SYS"]


# --- DOT ---------------------------------------------------------------------------------------

QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def check_dot(text: str) -> list[str]:
    """Structural DOT checks (no Graphviz here); returns the lines with quoted strings blanked."""
    assert text.startswith("graph ") and text.rstrip().endswith("}")
    bare = [QUOTED.sub('""', line) for line in text.splitlines()]
    depth = 0
    for line in bare:
        assert '"' not in line.replace('""', ""), f"unbalanced quote: {line}"
        depth += line.count("{") - line.count("}")
        assert depth >= 0
        stripped = line.strip()
        assert stripped.endswith(("{", "}", ";")), f"unterminated statement: {line}"
        assert "->" not in stripped, "an undirected graph uses --"
    assert depth == 0
    return bare


@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_dot_structure(inventory: Inventory, name: str) -> None:
    inv = inventory(name)
    text = render_dot(inv)
    check_dot(text)
    for g in inv.gpus:
        assert re.search(rf'^\s+"GPU{g.index}" \[', text, re.M), g.index
    for n in inv.nics:
        assert re.search(rf'^\s+"{n.name}" \[', text, re.M), n.name
    for numa in inv.numa_nodes:
        assert f'subgraph "cluster_numa{numa.id}" {{' in text
    for root in {g.pcie.pcie_root for g in inv.gpus}:
        assert f'subgraph "cluster_{root}" {{' in text
    nv = re.findall(r'"GPU(\d+)" -- "GPU(\d+)" \[label="NV(\d+)"', text)
    assert sorted((int(a), int(b), int(n)) for a, b, n in nv) == [
        (e.a, e.b, e.links) for e in inv.nvlink_edges
    ]


def test_dot_pcie_edges_follow_the_tree(inventory: Inventory) -> None:
    text = render_dot(inventory("dgx-h100"))
    chain = [
        "NUMA0",
        "pci0000:16",
        "0000:16:01.0",
        "0000:17:00.0",
        "0000:18:00.0",
        "0000:19:00.0",
        "0000:1a:00.0",
        "GPU0",
    ]
    for a, b in itertools.pairwise(chain):
        assert f'"{a}" -- "{b}"' in text
    assert text.count('[label="NV18"') == 28


def test_dot_escapes_quotes(inventory: Inventory) -> None:
    inv = dataclasses.replace(inventory("mixed"), hostname='odd"host\\name')
    text = render_dot(inv)
    check_dot(text)
    assert 'graph "odd\\"host\\\\name" {' in text
