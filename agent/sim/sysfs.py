"""Write a realistic sysfs tree for a simulated node, so discovery reads it as it reads ``/sys``.

Layout (as Linux has it; ``<path>`` = root complex, then every bridge from the root port down)::

    devices/<path>/<bdf>/{vendor,device,class,numa_node,local_cpulist,local_cpus,uevent}
    devices/<path>/<bdf>/infiniband/<mlx5_N>/ports/1/{link_layer,state}    NICs
    devices/<path>/<bdf>/infiniband/<mlx5_N>/device -> ../../../<bdf>
    devices/<path>/<bdf>/net/<netdev>/{type,device -> ../../../<bdf>}     NICs
    devices/system/node/{online,possible,has_cpu}, node<N>/cpulist
    bus/pci/devices/<bdf> -> ../../../devices/<path>/<bdf>        every function, bridges too
    class/infiniband/<mlx5_N> -> ../../devices/<path>/<bdf>/infiniband/<mlx5_N>
    class/net/<netdev> -> ../../devices/<path>/<bdf>/net/<netdev>

Bridges get ``class`` 0x060400; a root port (the first bridge below a root complex) is given
Intel's Sapphire Rapids root-port id and every deeper bridge a Broadcom PEX890xx switch-port id
(nothing reads these ids; they only make ``lspci``-style listings look real).

``pci_functions`` and the cpulist helpers are pure; ``write_sysfs`` does the I/O.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

from agent.sim.errors import ModelError
from agent.sim.model import BDF_RE, MELLANOX_VENDOR, NVIDIA_VENDOR, ROOT_RE, NodeModel
from agent.sim.pcifunction import SimFunction
from agent.sim.sysfs_vm import iommu_groups, vm_functions, write_vm_sysfs
from agent.sim.tree import remove, symlink, write_text, write_tree
from agent.sim.vmstate import VmState, initial_vm_state, tree_view

CLASS_3D_CONTROLLER = 0x030200
CLASS_NVSWITCH = 0x068000
CLASS_INFINIBAND = 0x020700
CLASS_ETHERNET = 0x020000
CLASS_PCI_BRIDGE = 0x060400
ROOT_PORT_ID = (0x8086, 0x352A)
"""vendor, device of a root port: Intel Sapphire Rapids PCIe root port."""
SWITCH_PORT_ID = (0x1000, 0xC030)
"""vendor, device of a PCIe switch port: Broadcom PEX890xx Gen 5 switch."""
ARPHRD = {"InfiniBand": 32, "Ethernet": 1}
"""``net/<netdev>/type`` per link layer (ARPHRD_INFINIBAND, ARPHRD_ETHER)."""


def parse_cpulist(cpulist: str) -> list[int]:
    """CPU numbers of a cpulist (``0-2,8`` -> ``[0, 1, 2, 8]``). Pure."""
    cpus: list[int] = []
    for part in cpulist.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def cpulist_to_mask(cpulist: str, nr_cpus: int) -> str:
    """The ``local_cpus`` form of a cpulist: 32-bit hex words, most significant first. Pure.

    ``cpulist_to_mask("0-3", 64) == "00000000,0000000f"``.
    """
    bits = 0
    for cpu in parse_cpulist(cpulist):
        bits |= 1 << cpu
    words = max(1, math.ceil(nr_cpus / 32))
    return ",".join(f"{(bits >> (32 * i)) & 0xFFFFFFFF:08x}" for i in reversed(range(words)))


def format_cpulist(ids: list[int]) -> str:
    """The kernel's list form of some ids: ``[0, 1, 2, 5]`` -> ``0-2,5``. Pure."""
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pci_functions(
    model: NodeModel, removed: frozenset[str] = frozenset()
) -> tuple[SimFunction, ...]:
    """Every PCI function of the model's tree, bridges first then endpoints, each sorted by bus.
    The GPUs at the bus ids in ``removed`` were hot-removed: their functions are left out, the
    bridges above them stay (the slot is still there).

    Pure. Raises ModelError when the model's paths disagree (a bridge reached through two
    different parents or from two NUMA nodes, or a bridge address that is also an endpoint).
    """
    endpoints: list[SimFunction] = []
    for g in model.gpus:
        device = g.spec.pci_device_id >> 16  # NVML's 0x233010DE -> sysfs 0x2330
        endpoints.append(
            SimFunction(g.bus, g.parent, g.numa, NVIDIA_VENDOR, device, CLASS_3D_CONTROLLER)
        )
    for n in model.nics:
        cls = CLASS_INFINIBAND if n.link_layer == "InfiniBand" else CLASS_ETHERNET
        endpoints.append(SimFunction(n.bus, n.parent, n.numa, MELLANOX_VENDOR, n.device_id, cls))
    switch_device = (model.switch_device_id or 0) >> 16
    for s in model.nvswitches:
        endpoints.append(
            SimFunction(s.bus, s.parent, s.numa, NVIDIA_VENDOR, switch_device, CLASS_NVSWITCH)
        )
    endpoint_buses = {e.bus for e in endpoints}
    bridges: dict[str, SimFunction] = {}
    for e in endpoints:
        for depth in range(1, len(e.parent)):
            bus = e.parent[depth]
            vendor, device = ROOT_PORT_ID if depth == 1 else SWITCH_PORT_ID
            bridge = SimFunction(bus, e.parent[:depth], e.numa, vendor, device, CLASS_PCI_BRIDGE)
            seen = bridges.setdefault(bus, bridge)
            if bus in endpoint_buses:
                raise ModelError(f"{model.name}: {bus} is both a bridge and a device")
            if seen.parent != bridge.parent or seen.numa != bridge.numa:
                raise ModelError(
                    f"{model.name}: bridge {bus} is reached as {seen.rel_path} (NUMA {seen.numa})"
                    f" and as {bridge.rel_path} (NUMA {bridge.numa})"
                )
    return (
        *sorted(bridges.values(), key=lambda f: f.bus),
        *sorted((e for e in endpoints if e.bus not in removed), key=lambda f: f.bus),
    )


def _prune(directory: Path, keep: set[str]) -> None:
    """Remove the entries of ``directory`` not named in ``keep`` (temp files included)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name not in keep:
            remove(entry)


def _prune_pci(directory: Path, rel: str, expected: set[str]) -> None:
    """Remove PCI directories below ``directory`` that the model no longer has."""
    for entry in directory.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            continue
        child = f"{rel}/{entry.name}" if rel else entry.name
        is_pci = ROOT_RE.match(entry.name) if not rel else BDF_RE.match(entry.name)
        if not is_pci:
            continue
        if child in expected:
            _prune_pci(entry, child, expected)
        else:
            shutil.rmtree(entry)


Put = Callable[[Path, str], None]
"""Writes a file (``write_text``, or ``_new_text`` into an empty tree)."""


def _new_text(path: Path, text: str) -> None:
    """A file of a first write: its directory exists, nothing is there yet to compare."""
    path.write_text(text)


def _new_link(link: Path, target: str) -> None:
    link.symlink_to(target)


def _write_function(
    devices: Path, fn: SimFunction, model: NodeModel, nr_cpus: int, put: Put
) -> None:
    d = devices / fn.rel_path
    d.mkdir(parents=True, exist_ok=True)
    cpulist = model.numa_nodes[fn.numa]
    put(d / "vendor", f"0x{fn.vendor:04x}\n")
    put(d / "device", f"0x{fn.device:04x}\n")
    put(d / "class", f"0x{fn.pci_class:06x}\n")
    put(d / "numa_node", f"{fn.numa}\n")
    put(d / "local_cpulist", f"{cpulist}\n")
    put(d / "local_cpus", f"{cpulist_to_mask(cpulist, nr_cpus)}\n")
    put(
        d / "uevent",
        f"PCI_CLASS={fn.pci_class:X}\nPCI_ID={fn.vendor:04X}:{fn.device:04X}\n"
        f"PCI_SLOT_NAME={fn.bus}\n",
    )


def _nr_cpus(model: NodeModel) -> int:
    return 1 + max((max(parse_cpulist(c), default=0) for c in model.numa_nodes.values()), default=0)


def _write_tree(model: NodeModel, root: Path, removed: frozenset[str], vm: VmState | None) -> None:
    # a first write, into an empty root, makes each entry once: no comparison, temporary name
    # or pruning (a rewrite keeps every entry readable while it changes the tree)
    fresh = not root.exists() or not any(root.iterdir())
    put, link = (_new_text, _new_link) if fresh else (write_text, symlink)
    devices = root / "devices"
    vm = vm if vm is not None else initial_vm_state(model)
    functions = (*pci_functions(model, removed), *vm_functions(model, vm, removed))
    nr_cpus = _nr_cpus(model)
    by_bus = {f.bus: f for f in functions}

    expected: set[str] = set()
    bus_links = root / "bus" / "pci" / "devices"
    bus_links.mkdir(parents=True, exist_ok=True)
    for fn in functions:
        _write_function(devices, fn, model, nr_cpus, put)
        parts = fn.rel_path.split("/")
        expected.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        link(bus_links / fn.bus, f"../../../devices/{fn.rel_path}")

    nic_keep: dict[str, tuple[set[str], set[str]]] = {}
    for nic in model.nics:
        rel = by_bus[nic.bus].rel_path
        d = devices / rel
        ib = d / "infiniband" / nic.name
        (ib / "ports" / "1").mkdir(parents=True, exist_ok=True)
        put(ib / "ports" / "1" / "link_layer", f"{nic.link_layer}\n")
        put(ib / "ports" / "1" / "state", "4: ACTIVE\n")
        link(ib / "device", f"../../../{nic.bus}")
        net = d / "net" / nic.netdev
        net.mkdir(parents=True, exist_ok=True)
        put(net / "type", f"{ARPHRD.get(nic.link_layer, 1)}\n")
        link(net / "device", f"../../../{nic.bus}")
        keep = nic_keep.setdefault(rel, (set(), set()))
        keep[0].add(nic.name)
        keep[1].add(nic.netdev)
    ib_class = root / "class" / "infiniband"
    net_class = root / "class" / "net"
    ib_class.mkdir(parents=True, exist_ok=True)
    net_class.mkdir(parents=True, exist_ok=True)
    for nic in model.nics:
        rel = by_bus[nic.bus].rel_path
        link(ib_class / nic.name, f"../../devices/{rel}/infiniband/{nic.name}")
        link(net_class / nic.netdev, f"../../devices/{rel}/net/{nic.netdev}")

    node_dir = devices / "system" / "node"
    node_dir.mkdir(parents=True, exist_ok=True)
    ids = format_cpulist(list(model.numa_nodes))
    for name in ("online", "possible", "has_cpu"):
        put(node_dir / name, f"{ids}\n")
    for node, cpulist in model.numa_nodes.items():
        (node_dir / f"node{node}").mkdir(exist_ok=True)
        put(node_dir / f"node{node}" / "cpulist", f"{cpulist}\n")

    static = [f.bus for f in pci_functions(model)]  # group numbers stay when a GPU leaves
    write_vm_sysfs(root, model, vm, functions, iommu_groups(model, vm, static), fresh)
    if fresh:
        return
    # What an earlier write (of another model) left behind goes; readers never see a gap.
    _prune(bus_links, {f.bus for f in functions})
    _prune(ib_class, {n.name for n in model.nics})
    _prune(net_class, {n.netdev for n in model.nics})
    _prune(node_dir, {"online", "possible", "has_cpu", *(f"node{n}" for n in model.numa_nodes)})
    _prune_pci(devices, "", expected)
    for fn in functions:
        rdma, netdevs = nic_keep.get(fn.rel_path, (set(), set()))
        _prune(devices / fn.rel_path / "infiniband", rdma)
        _prune(devices / fn.rel_path / "net", netdevs)


def write_sysfs(
    model: NodeModel,
    root: Path,
    removed: frozenset[str] = frozenset(),
    vm: VmState | None = None,
) -> None:
    """Write (or rewrite) the sysfs tree of ``model`` under ``root``, without the GPUs at the bus
    ids in ``removed`` (hot-removed: their device directories and ``bus/pci/devices`` links go),
    with the IOMMU groups, bound drivers, SR-IOV VFs, vGPU files and mediated devices of ``vm``
    (:mod:`agent.sim.sysfs_vm`; default: the model's freshly booted state).

    Idempotent: rewriting the same root leaves unchanged files untouched, replaces changed files
    and links atomically, then removes what the model no longer has (devices, NICs, NUMA nodes),
    so a concurrent reader sees either the old or the new value of each entry, never a gap.
    Raises ConfigError for ``/sys`` itself or when the tree cannot be written, ModelError when
    the model's PCIe paths are inconsistent.
    """
    write_tree(root, "/sys", "sysfs tree", lambda r: _write_tree(model, r, removed, vm))


def rewrite_vm_part(
    model: NodeModel, root: Path, removed: frozenset[str], before: VmState, after: VmState
) -> None:
    """Bring the tree :func:`write_sysfs` wrote for ``before`` (and ``removed``) to the one it
    writes for ``after``, touching only what the VM state decides: the VFs and foreign functions
    that came or went (their directories and ``bus/pci/devices`` links), then the VFIO/vGPU
    entries (:func:`agent.sim.sysfs_vm.write_vm_sysfs`, compared entry by entry). The models'
    own functions, NICs and NUMA nodes do not depend on the VM state, so they are not read
    again (the simulated kernel's write, :mod:`agent.sim.pcikernel`: a third to a tenth of the
    entries of a whole rewrite). Nothing is done when the tree's part of the state is the same
    (:func:`agent.sim.vmstate.tree_view`: an unbind lock is the driver root's).

    The caller vouches that the tree is ``before``'s (the kernel marks a write in progress and
    rewrites the whole tree after one that did not finish). Same errors as :func:`write_sysfs`.
    """
    if tree_view(before) == tree_view(after):
        return
    write_tree(
        root, "/sys", "sysfs tree", lambda r: _write_vm_part(model, r, removed, before, after)
    )


def _write_vm_part(
    model: NodeModel, root: Path, removed: frozenset[str], before: VmState, after: VmState
) -> None:
    devices = root / "devices"
    bus_links = root / "bus" / "pci" / "devices"
    old = {f.bus: f for f in vm_functions(model, before, removed)}
    new = {f.bus: f for f in vm_functions(model, after, removed)}
    for bus, fn in old.items():
        if new.get(bus) != fn:  # gone (or changed: written again below)
            remove(bus_links / bus)
            remove(devices / fn.rel_path)
    nr_cpus = _nr_cpus(model)
    for bus, fn in new.items():
        if old.get(bus) != fn:
            _write_function(devices, fn, model, nr_cpus, write_text)
            symlink(bus_links / bus, f"../../../devices/{fn.rel_path}")
    functions = (*pci_functions(model, removed), *new.values())
    static = [f.bus for f in pci_functions(model)]
    write_vm_sysfs(root, model, after, functions, iommu_groups(model, after, static))
