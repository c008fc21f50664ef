"""Reading sysfs (simulated trees and hand-made minimal ones) and joining it with NVML's GPUs."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.discovery.build import build_inventory
from agent.discovery.errors import DiscoveryError
from agent.discovery.inventory import NodeInventory
from agent.discovery.sysfs import (
    SysfsSnapshot,
    parse_hex,
    parse_numa_node,
    read_sysfs,
)
from agent.sim.model import load_model, model_names
from agent.sim.sysfs import pci_functions, write_sysfs

from .conftest import gpu_devices, system_info

MODELS = model_names()


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SysfsSnapshot]:
    out = {}
    for name in MODELS:
        root = tmp_path_factory.mktemp(name)
        write_sysfs(load_model(name), root)
        out[name] = read_sysfs(root)
    return out


@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_reads_every_function_of_the_model(snapshots: dict[str, SysfsSnapshot], name: str) -> None:
    snap = snapshots[name]
    expected = pci_functions(load_model(name))
    assert [f.bus for f in snap.functions] == sorted(f.bus for f in expected)
    for sim in expected:
        fn = snap.function(sim.bus)
        assert fn is not None
        assert fn.path == sim.parent
        assert (fn.vendor, fn.device, fn.pci_class) == (sim.vendor, sim.device, sim.pci_class)
        assert fn.numa_node == sim.numa
        assert fn.is_bridge == (sim.pci_class == 0x060400)


@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_numa_nodes_and_nics(snapshots: dict[str, SysfsSnapshot], name: str) -> None:
    model = load_model(name)
    snap = snapshots[name]
    assert {n.id: n.cpus for n in snap.numa_nodes} == model.numa_nodes
    got = {(n.bus, n.rdma_name, n.netdev, n.link_layer) for n in snap.nics}
    assert got == {(n.bus, n.name, n.netdev, n.link_layer) for n in model.nics}


@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_pcie_root_is_the_first_path_component(
    inventory: Callable[[str], NodeInventory], name: str
) -> None:
    model = load_model(name)
    inv = inventory(name)
    for slot in model.gpus:
        loc = inv.gpu(slot.index).pcie
        assert loc.pcie_root == slot.parent[0] == loc.path[0]
        assert loc.path == slot.parent
        assert loc.bus_id == slot.bus


def test_dgx_h100_gpu0_pcie_root(inventory: Callable[[str], NodeInventory]) -> None:
    assert inventory("dgx-h100").gpu(0).pcie.pcie_root == "pci0000:16"


@pytest.mark.parametrize("name", MODELS, ids=MODELS)
def test_gpu_cpus_are_its_numa_nodes_cpulist(
    inventory: Callable[[str], NodeInventory], name: str
) -> None:
    model = load_model(name)
    for g in inventory(name).gpus:
        assert g.pcie.numa_node is not None
        assert g.pcie.cpus == model.numa_nodes[g.pcie.numa_node]


# --- a hand-made minimal tree, shaped like a small real machine -----------------------------


def make_function(
    root: Path,
    rel: str,
    *,
    vendor: str = "0x8086",
    device: str = "0x1234",
    cls: str = "0x060400",
    numa: str | None = "-1",
    cpulist: str | None = None,
) -> Path:
    d = root / "devices" / rel
    d.mkdir(parents=True)
    for name, value in [("vendor", vendor), ("device", device), ("class", cls)]:
        (d / name).write_text(value + "\n")
    if numa is not None:
        (d / "numa_node").write_text(numa + "\n")
    if cpulist is not None:
        (d / "local_cpulist").write_text(cpulist + "\n")
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    (links / d.name).symlink_to(os.path.relpath(d, links))
    return d


@pytest.fixture
def minimal(tmp_path: Path) -> Path:
    make_function(tmp_path, "pci0000:00/0000:00:00.0", cls="0x060000", cpulist="0-3")
    make_function(tmp_path, "pci0000:00/0000:00:01.0")
    make_function(
        tmp_path,
        "pci0000:00/0000:00:01.0/0000:01:00.0",
        vendor="0x10de",
        device="0x27b8",
        cls="0x030200",
    )
    nic = make_function(tmp_path, "pci0000:00/0000:00:03.0", cls="0x020000", numa=None)
    (nic / "net" / "eth0").mkdir(parents=True)
    return tmp_path


def test_minimal_tree(minimal: Path) -> None:
    snap = read_sysfs(minimal)
    assert [f.bus for f in snap.functions] == [
        "0000:00:00.0",
        "0000:00:01.0",
        "0000:00:03.0",
        "0000:01:00.0",
    ]
    gpu = snap.function("0000:01:00.0")
    assert gpu is not None
    assert gpu.path == ("pci0000:00", "0000:00:01.0")
    assert gpu.pcie_root == "pci0000:00"
    assert (gpu.vendor, gpu.device, gpu.pci_class) == (0x10DE, 0x27B8, 0x030200)
    assert gpu.numa_node is None  # -1
    assert gpu.local_cpulist is None  # file missing
    host = snap.function("0000:00:00.0")
    assert host is not None and host.local_cpulist == "0-3" and host.path == ("pci0000:00",)
    assert snap.numa_nodes == ()
    assert len(snap.nics) == 1
    nic = snap.nics[0]
    assert (nic.name, nic.rdma_name, nic.netdev, nic.link_layer) == ("eth0", None, "eth0", None)
    assert snap.function("0000:00:03.0") is not None


def test_minimal_tree_builds_an_inventory(minimal: Path) -> None:
    model = load_model("mixed")
    gpu = dataclasses.replace(gpu_devices(model)[2], index=0, minor=0, pci_bus_id="0000:01:00.0")
    inv = build_inventory(
        hostname="small", system=system_info(model), gpus=[gpu], sysfs=read_sysfs(minimal)
    )
    assert inv.gpu(0).pcie.numa_node is None
    assert inv.gpu(0).pcie.cpus is None
    assert inv.gpu(0).near_nics == ("eth0",)  # PHB: both under pci0000:00, unknown NUMA
    assert inv.topology.level("GPU0", "eth0") == "PHB"
    assert inv.nvlink_cliques == ()


def test_vanished_function_is_left_out(minimal: Path) -> None:
    links = minimal / "bus" / "pci" / "devices"
    (links / "0000:05:00.0").symlink_to("../../../devices/pci0000:00/0000:05:00.0")
    assert read_sysfs(minimal).function("0000:05:00.0") is None


@pytest.mark.parametrize("exists", [False, True], ids=["no-root", "empty-root"])
def test_unreadable_root_names_the_path(tmp_path: Path, exists: bool) -> None:
    root = tmp_path / "sys"
    if exists:
        root.mkdir()
    with pytest.raises(DiscoveryError, match="cannot read the sysfs tree") as exc:
        read_sysfs(root)
    assert str(root / "bus" / "pci" / "devices") in str(exc.value)


def test_malformed_vendor_names_the_file(minimal: Path) -> None:
    vendor = minimal / "devices/pci0000:00/0000:00:01.0/0000:01:00.0/vendor"
    vendor.write_text("nvidia\n")
    with pytest.raises(DiscoveryError, match=r"0000:01:00\.0/vendor: expected a hex number"):
        read_sysfs(minimal)


def test_missing_class_names_the_file(minimal: Path) -> None:
    (minimal / "devices/pci0000:00/0000:00:01.0/class").unlink()
    with pytest.raises(DiscoveryError, match=r"0000:00:01\.0/class is missing"):
        read_sysfs(minimal)


def test_link_outside_devices_is_an_error(minimal: Path) -> None:
    elsewhere = minimal / "elsewhere" / "0000:07:00.0"
    elsewhere.mkdir(parents=True)
    (minimal / "bus/pci/devices/0000:07:00.0").symlink_to(elsewhere)
    with pytest.raises(DiscoveryError, match="not under"):
        read_sysfs(minimal)


@pytest.mark.parametrize(
    ("text", "value"),
    [("0x10de\n", 0x10DE), ("0x030200", 0x030200), ("15b3", 0x15B3)],
    ids=["vendor", "class", "no-prefix"],
)
def test_parse_hex(text: str, value: int) -> None:
    assert parse_hex(text, "f") == value


@pytest.mark.parametrize(
    ("text", "value"), [("0\n", 0), ("1", 1), ("-1\n", None)], ids=["zero", "one", "unknown"]
)
def test_parse_numa_node(text: str, value: int | None) -> None:
    assert parse_numa_node(text, "f") == value


def test_parse_numa_node_rejects_garbage() -> None:
    with pytest.raises(DiscoveryError, match="numa_node"):
        parse_numa_node("x", "/sys/x/numa_node")


# --- joining NVML and sysfs ------------------------------------------------------------------


def test_gpu_missing_from_sysfs_is_named(snapshots: dict[str, SysfsSnapshot]) -> None:
    model = load_model("dgx-h100")
    gpus = list(gpu_devices(model))
    gpus[3] = dataclasses.replace(gpus[3], pci_bus_id="0000:ff:00.0")
    with pytest.raises(DiscoveryError, match=r"GPU 3 .*0000:ff:00\.0.*not in sysfs") as exc:
        build_inventory(
            hostname="h", system=system_info(model), gpus=gpus, sysfs=snapshots["dgx-h100"]
        )
    assert gpus[3].uuid in str(exc.value)


def test_nvml_form_bus_ids_are_accepted(snapshots: dict[str, SysfsSnapshot]) -> None:
    model = load_model("mixed")
    gpus = [
        dataclasses.replace(g, pci_bus_id="0000" + g.pci_bus_id.upper()) for g in gpu_devices(model)
    ]
    inv = build_inventory(
        hostname="h", system=system_info(model), gpus=gpus, sysfs=snapshots["mixed"]
    )
    assert inv.gpu(0).pcie.bus_id == "0000:3d:00.0"
    assert inv.topology.level("GPU0", "GPU1") == "NV12"


@pytest.mark.parametrize("field", ["index", "pci_bus_id"], ids=["index", "bus"])
def test_duplicate_gpus_are_an_error(snapshots: dict[str, SysfsSnapshot], field: str) -> None:
    model = load_model("mixed")
    gpus = list(gpu_devices(model))
    gpus[1] = dataclasses.replace(gpus[1], **{field: getattr(gpus[0], field)})
    with pytest.raises(DiscoveryError, match="GPU"):
        build_inventory(
            hostname="h", system=system_info(model), gpus=gpus, sysfs=snapshots["mixed"]
        )
