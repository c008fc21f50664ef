"""The simulated sysfs writer: layout, ids, links, NUMA files, idempotent rewrites."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from agent.errors import ConfigError
from agent.sim.errors import ModelError
from agent.sim.model import NodeModel, load_model, model_names
from agent.sim.sysfs import (
    cpulist_to_mask,
    format_cpulist,
    parse_cpulist,
    pci_functions,
    write_sysfs,
)

MODELS = model_names()
H100_GPU0 = (
    "devices/pci0000:16/0000:16:01.0/0000:17:00.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0"
    "/0000:1b:00.0"
)


def tree(root: Path) -> dict[str, str]:
    """Every file (content) and link (``-> target``) under root, by relative path."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = p.read_text()
    return out


def read(root: Path, rel: str) -> str:
    return (root / rel).read_text().strip()


@pytest.fixture(scope="module")
def h100(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dgx-h100")
    write_sysfs(load_model("dgx-h100"), root)
    return root


def test_gpu_function_files(h100: Path) -> None:
    assert read(h100, f"{H100_GPU0}/vendor") == "0x10de"
    assert read(h100, f"{H100_GPU0}/device") == "0x2330"  # upper half of NVML's 0x233010DE
    assert read(h100, f"{H100_GPU0}/class") == "0x030200"
    assert read(h100, f"{H100_GPU0}/numa_node") == "0"
    assert read(h100, f"{H100_GPU0}/local_cpulist") == "0-55,112-167"
    mask = int(read(h100, f"{H100_GPU0}/local_cpus").replace(",", ""), 16)
    assert mask == sum(1 << c for c in [*range(56), *range(112, 168)])
    assert "PCI_SLOT_NAME=0000:1b:00.0" in read(h100, f"{H100_GPU0}/uevent")


def test_every_bridge_on_the_path_has_bridge_files(h100: Path) -> None:
    parts = H100_GPU0.split("/")
    for depth in range(2, len(parts) - 1):
        d = "/".join(parts[: depth + 1])
        assert read(h100, f"{d}/class") == "0x060400", d
        assert read(h100, f"{d}/numa_node") == "0", d
        assert read(h100, f"{d}/local_cpulist") == "0-55,112-167", d
        assert read(h100, f"{d}/vendor").startswith("0x"), d
        assert read(h100, f"{d}/device").startswith("0x"), d


@pytest.mark.parametrize(
    ("model", "bus", "vendor", "device", "cls"),
    [
        ("dgx-h100", "0000:1b:00.0", "0x10de", "0x2330", "0x030200"),
        ("dgx-h100", "0000:e7:00.0", "0x10de", "0x22a3", "0x068000"),
        ("dgx-h100", "0000:1c:00.0", "0x15b3", "0x1021", "0x020700"),
        ("dgx-h100", "0000:2b:00.1", "0x15b3", "0x1021", "0x020000"),
        ("dgx-a100", "0000:07:00.0", "0x10de", "0x20b0", "0x030200"),
        ("dgx-a100", "0000:10:00.0", "0x15b3", "0x101b", "0x020700"),
        ("hgx-h200", "0000:18:00.0", "0x10de", "0x2335", "0x030200"),
        ("l40s-pcie", "0000:19:00.0", "0x10de", "0x26b9", "0x030200"),
        ("l40s-pcie", "0000:31:00.0", "0x15b3", "0x101d", "0x020000"),
        ("mixed", "0000:b3:00.0", "0x10de", "0x27b8", "0x030200"),
    ],
    ids=[
        "h100-gpu",
        "h100-nvswitch",
        "h100-ib-nic",
        "h100-eth-nic",
        "a100-gpu",
        "a100-cx6",
        "h200-gpu",
        "l40s-gpu",
        "l40s-cx6dx",
        "mixed-l4",
    ],
)
def test_function_ids(
    tmp_path: Path, model: str, bus: str, vendor: str, device: str, cls: str
) -> None:
    write_sysfs(load_model(model), tmp_path)
    link = tmp_path / "bus" / "pci" / "devices" / bus
    assert read(link, "vendor") == vendor
    assert read(link, "device") == device
    assert read(link, "class") == cls


@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_bus_links_are_relative_and_resolve_into_devices(tmp_path: Path, name: str) -> None:
    model = load_model(name)
    write_sysfs(model, tmp_path)
    functions = pci_functions(model)
    assert len(functions) > len(model.gpus) + len(model.nics) + len(model.nvswitches)
    for fn in functions:
        link = tmp_path / "bus" / "pci" / "devices" / fn.bus
        assert os.readlink(link) == f"../../../devices/{fn.rel_path}"
        assert link.resolve() == (tmp_path / "devices" / fn.rel_path).resolve()
        assert read(link, "numa_node") == str(fn.numa)
        assert read(link, "local_cpulist") == model.numa_nodes[fn.numa]


@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_numa_node_files(tmp_path: Path, name: str) -> None:
    model = load_model(name)
    write_sysfs(model, tmp_path)
    node_dir = tmp_path / "devices" / "system" / "node"
    assert read(node_dir, "online") == "0-1"
    assert read(node_dir, "possible") == "0-1"
    for node, cpulist in model.numa_nodes.items():
        assert read(node_dir, f"node{node}/cpulist") == cpulist


def test_nic_rdma_and_netdev_entries(h100: Path) -> None:
    model = load_model("dgx-h100")
    for nic in model.nics:
        fn_dir = (h100 / "bus" / "pci" / "devices" / nic.bus).resolve()
        ib = h100 / "class" / "infiniband" / nic.name
        net = h100 / "class" / "net" / nic.netdev
        assert os.readlink(ib).startswith("../../devices/pci")
        assert os.readlink(net).startswith("../../devices/pci")
        assert ib.resolve() == fn_dir / "infiniband" / nic.name
        assert net.resolve() == fn_dir / "net" / nic.netdev
        assert read(ib, "ports/1/link_layer") == nic.link_layer
        assert os.readlink(ib / "device") == f"../../../{nic.bus}"
        assert (ib / "device").resolve() == fn_dir
        assert (net / "device").resolve() == fn_dir
        assert read(net, "type") == ("32" if nic.link_layer == "InfiniBand" else "1")


def test_rewrite_is_idempotent(tmp_path: Path) -> None:
    model = load_model("dgx-h100")
    write_sysfs(model, tmp_path)
    first = tree(tmp_path)
    write_sysfs(model, tmp_path)
    assert tree(tmp_path) == first


def test_rewrite_repairs_changed_files_and_links(tmp_path: Path) -> None:
    model = load_model("mixed")
    write_sysfs(model, tmp_path)
    first = tree(tmp_path)
    gpu = tmp_path / "bus" / "pci" / "devices" / "0000:3d:00.0"
    (gpu / "numa_node").write_text("7\n")
    (tmp_path / "class" / "net" / "ibp63s0").unlink()
    (tmp_path / "class" / "net" / "ibp63s0").symlink_to("/nowhere")
    write_sysfs(model, tmp_path)
    assert tree(tmp_path) == first


def test_rewrite_removes_what_the_model_no_longer_has(tmp_path: Path) -> None:
    model = load_model("dgx-h100")
    write_sysfs(model, tmp_path)
    smaller = dataclasses.replace(model, gpus=model.gpus[:-1], nics=model.nics[:-1])
    write_sysfs(smaller, tmp_path)
    fresh = tmp_path.parent / (tmp_path.name + "-fresh")
    write_sysfs(smaller, fresh)
    assert tree(tmp_path) == tree(fresh)
    assert not (tmp_path / "bus" / "pci" / "devices" / "0000:df:00.0").exists()
    assert not (tmp_path / "class" / "infiniband" / "mlx5_11").is_symlink()


def test_rewrite_with_another_model_leaves_only_that_model(tmp_path: Path) -> None:
    write_sysfs(load_model("dgx-h100"), tmp_path)
    write_sysfs(load_model("l40s-pcie"), tmp_path)
    fresh = tmp_path.parent / (tmp_path.name + "-fresh")
    write_sysfs(load_model("l40s-pcie"), fresh)
    assert tree(tmp_path) == tree(fresh)


def test_refuses_the_real_sys() -> None:
    with pytest.raises(ConfigError, match="/sys"):
        write_sysfs(load_model("mixed"), Path("/sys"))


def test_unwritable_root_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="file"):
        write_sysfs(load_model("mixed"), blocker)


def _moved_nic(model: NodeModel) -> NodeModel:
    nic = model.nics[0]
    moved = dataclasses.replace(nic, parent=("pci0000:99", *nic.parent[1:]))
    return dataclasses.replace(model, nics=(moved, *model.nics[1:]))


def test_inconsistent_paths_are_a_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="bridge"):
        write_sysfs(_moved_nic(load_model("dgx-h100")), tmp_path)


@pytest.mark.parametrize(
    ("cpulist", "cpus"),
    [("0", [0]), ("0-2,8", [0, 1, 2, 8]), ("0-1,4-5", [0, 1, 4, 5]), ("", [])],
    ids=["single", "range-and-one", "two-ranges", "empty"],
)
def test_parse_and_format_cpulist(cpulist: str, cpus: list[int]) -> None:
    assert parse_cpulist(cpulist) == cpus
    assert format_cpulist(cpus) == cpulist


@pytest.mark.parametrize(
    ("cpulist", "nr_cpus", "mask"),
    [
        ("0-3", 64, "00000000,0000000f"),
        ("32", 33, "00000001,00000000"),
        ("0-31", 32, "ffffffff"),
        ("56-111,168-223", 224, "ffffffff,ffffff00,00000000,0000ffff,ffffffff,ff000000,00000000"),
    ],
    ids=["low-nibble", "second-word", "one-word", "dgx-h100-numa1"],
)
def test_cpulist_to_mask(cpulist: str, nr_cpus: int, mask: str) -> None:
    assert cpulist_to_mask(cpulist, nr_cpus) == mask
