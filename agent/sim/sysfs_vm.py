"""The VFIO and vGPU part of the simulated sysfs tree and driver root, written from the VM state
(:mod:`agent.sim.vmstate`). Layout (as Linux has it; docs/gpu-facts.md, "GPUs for virtual
machines" and docs/design of issue 24, section 1)::

    devices/<path>/<bdf>/iommu_group -> …/kernel/iommu_groups/<N>       (absent: IOMMU off)
    devices/<path>/<bdf>/driver -> …/bus/pci/drivers/<drv>              (absent: unbound)
    devices/<path>/<bdf>/driver_override                                ((null) when unset)
    devices/<path>/<pf>/{sriov_totalvfs,sriov_numvfs,virtfn<N> -> ../<vf>}       SR-IOV PF
    devices/<path>/<vf>/physfn -> ../<pf>                                        VF
    devices/<path>/<vf>/nvidia/{creatable_vgpu_types,current_vgpu_type}  VF on nvidia (vf)
    devices/<path>/<pf>/mdev_supported_types/nvidia-<id>/{name,available_instances,
        device_api,description,create}                                  PF on nvidia (mdev)
    devices/<path>/<pf>/<uuid>/{mdev_type -> ../mdev_supported_types/nvidia-<id>,
        iommu_group -> …, remove}                                       a mediated device
    kernel/iommu_groups/<N>/devices/<bdf or uuid> -> the function's directory
    bus/pci/drivers/<drv>/{bind,unbind,<bdf> -> the function's directory}
    bus/pci/drivers_probe
    bus/mdev/devices/<uuid> -> the mdev's directory; class/mdev_bus/<bdf> -> the parent's
    <driver root>/proc/driver/nvidia/gpus/<bdf>/unbindLock              (1: taken, 0: free)
    <driver root>/dev/vfio/vfio, dev/vfio/<N>          (vfio-pci loaded; <N>: a group in use)

IOMMU group numbers are stable: the model's functions (bridges too, as Linux groups root ports)
in :func:`agent.sim.sysfs.pci_functions` order, then a block of ``sriov_totalvfs`` per GPU for
its VFs; a mediated device gets the next free number when it is created.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from agent.sim.model import NVIDIA_VENDOR, GpuSlot, NodeModel
from agent.sim.pcifunction import SimFunction
from agent.sim.tree import remove, symlink, write_text
from agent.sim.vmstate import (
    FOREIGN_DRIVER,
    FOREIGN_ID,
    NVIDIA_DRIVER,
    VFIO_DRIVER,
    VmState,
    available,
    gpu_creatable,
    sriov_total,
    vf_bus,
    vfs_of,
)

CLASS_3D = 0x030200
"""A VF's class: the PF's (3D controller)."""
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
DRIVER_FILES = {"bind", "unbind"}
UNBIND_LOCK = "proc/driver/nvidia/gpus"


def vm_functions(
    model: NodeModel, state: VmState, removed: frozenset[str] = frozenset()
) -> list[SimFunction]:
    """The enabled VFs and the foreign functions, beside their GPU (none for a removed GPU)."""
    out = []
    for g in model.gpus:
        if g.bus in removed:
            continue
        device = g.spec.pci_device_id >> 16  # the VF's own device id: unverified; the PF's
        for vf in vfs_of(model, state, g):
            out.append(SimFunction(vf, g.parent, g.numa, NVIDIA_VENDOR, device, CLASS_3D))
        for bus, gpu in state.foreign:
            if gpu == g.bus:
                vendor, dev, cls = FOREIGN_ID
                out.append(SimFunction(bus, g.parent, g.numa, vendor, dev, cls))
    return out


def iommu_groups(model: NodeModel, state: VmState, static: Sequence[str]) -> dict[str, int]:
    """Group number per function bus: ``static`` (every function of the model, in order) first,
    then per GPU a block of its ``sriov_totalvfs``; a foreign function joins its GPU's group."""
    groups = {bus: i for i, bus in enumerate(static)}
    base = len(static)
    for g in model.gpus:
        total = sriov_total(model, g)
        for n in range(state.num_vfs(g.bus)):
            groups[vf_bus(g.bus, n)] = base + g.index * total + n
    for bus, gpu in state.foreign:
        groups[bus] = groups[gpu]
    return groups


def next_group(model: NodeModel, state: VmState, static: Sequence[str]) -> int:
    """The number a new mediated device's IOMMU group gets: one past every number in use."""
    top = len(static) + sum(sriov_total(model, g) for g in model.gpus)
    return max([top, *(m.group + 1 for m in state.mdevs)])


class _Out:
    """How entries are written: into an empty tree (``fresh``) each is made once, directly;
    else atomically and only when changed (:func:`agent.sim.tree.write_text`, ``symlink``),
    so a concurrent reader never sees a gap."""

    def __init__(self, fresh: bool) -> None:
        self.fresh = fresh
        self._dirs: set[Path] = set()

    def _parent(self, path: Path) -> None:
        if path.parent not in self._dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent)

    def text(self, path: Path, text: str) -> None:
        if not self.fresh:
            return write_text(path, text)
        self._parent(path)
        path.write_text(text)

    def link(self, path: Path, target: str) -> None:
        if not self.fresh:
            return symlink(path, target)
        self._parent(path)
        path.symlink_to(target)


def _rel(target: Path, link: Path) -> str:
    return os.path.relpath(target, link.parent)


def _prune(directory: Path, keep: set[str]) -> None:
    if directory.is_dir():
        for entry in directory.iterdir():
            if entry.name not in keep:
                remove(entry)


def write_vm_sysfs(
    root: Path,
    model: NodeModel,
    state: VmState,
    functions: Sequence[SimFunction],
    groups: Mapping[str, int],
    fresh: bool = False,
) -> None:
    """Write the VFIO/vGPU entries for ``functions`` (every function present, VFs included) under
    the sysfs ``root``, and remove those the state no longer has. Only the GPUs, their VFs and
    the functions put into their groups get ``iommu_group`` links (the others' groups are
    numbered, not written: nothing reads them, and each entry costs a file operation).
    ``fresh``: ``root`` held nothing before this write."""
    out = _Out(fresh)
    devices = root / "devices"
    managed = {f.bus for f in state.functions}
    by_bus = {f.bus: f for f in functions}
    _write_groups(out, root, state, [f for f in functions if f.bus in managed], groups)
    _write_drivers(out, root, state, by_bus)
    for g in model.gpus:
        if g.bus in by_bus:
            d = devices / by_bus[g.bus].rel_path
            if sriov_total(model, g):
                _write_sriov(out, d, model, state, g)
    if model.vgpu_interface == "mdev":
        _write_mdevs(out, root, model, state, by_bus)


def _write_groups(
    out: _Out,
    root: Path,
    state: VmState,
    functions: Sequence[SimFunction],
    groups: Mapping[str, int],
) -> None:
    groups_dir = root / "kernel" / "iommu_groups"
    groups_dir.mkdir(parents=True, exist_ok=True)
    members: dict[str, set[str]] = {}
    for fn in functions:
        d = root / "devices" / fn.rel_path
        if not state.iommu:
            remove(d / "iommu_group")
            continue
        g = str(groups[fn.bus])
        members.setdefault(g, set()).add(fn.bus)
        out.link(d / "iommu_group", _rel(groups_dir / g, d / "iommu_group"))
        link = groups_dir / g / "devices" / fn.bus
        out.link(link, _rel(d, link))
    if state.iommu:
        for m in state.mdevs:
            parent = next((f for f in functions if f.bus == m.parent), None)
            if parent is None:
                continue
            d = root / "devices" / parent.rel_path / m.uuid
            g = str(m.group)
            members.setdefault(g, set()).add(m.uuid)
            out.link(d / "iommu_group", _rel(groups_dir / g, d / "iommu_group"))
            link = groups_dir / g / "devices" / m.uuid
            out.link(link, _rel(d, link))
    _prune(groups_dir, set(members))
    for g, buses in members.items():
        _prune(groups_dir / g / "devices", buses)


def _write_drivers(
    out: _Out, root: Path, state: VmState, by_bus: Mapping[str, SimFunction]
) -> None:
    drivers = root / "bus" / "pci" / "drivers"
    loaded = {NVIDIA_DRIVER} | ({VFIO_DRIVER} if state.vfio_loaded else set())
    loaded |= {f.driver for f in state.functions if f.driver is not None}
    if state.foreign:
        loaded.add(FOREIGN_DRIVER)
    bound: dict[str, set[str]] = {d: set() for d in loaded}
    out.text(root / "bus" / "pci" / "drivers_probe", "")
    for drv in loaded:
        for name in DRIVER_FILES:
            out.text(drivers / drv / name, "")
    for fn in state.functions:
        if fn.bus not in by_bus:
            continue
        d = root / "devices" / by_bus[fn.bus].rel_path
        out.text(d / "driver_override", f"{fn.override or '(null)'}\n")
        if fn.driver is None:
            remove(d / "driver")
            continue
        bound[fn.driver].add(fn.bus)
        out.link(d / "driver", _rel(drivers / fn.driver, d / "driver"))
        link = drivers / fn.driver / fn.bus
        out.link(link, _rel(d, link))
    _prune(drivers, loaded)
    for drv, buses in bound.items():
        _prune(drivers / drv, buses | DRIVER_FILES)


def _write_sriov(out: _Out, d: Path, model: NodeModel, state: VmState, g: GpuSlot) -> None:
    """A PF's SR-IOV files and links, and each enabled VF's ``physfn`` and ``nvidia/`` files."""
    vfs = vfs_of(model, state, g)
    out.text(d / "sriov_totalvfs", f"{sriov_total(model, g)}\n")
    out.text(d / "sriov_numvfs", f"{len(vfs)}\n")
    # what a free VF lists (vmstate.creatable), computed once for the GPU's VFs: per VF it
    # counted every VF's type again, quadratic in the VFs (32 on vgpu-h200)
    free = "".join(f"{t.type_id} : {t.name}\n" for t in gpu_creatable(model, state, g))
    for n, vf in enumerate(vfs):
        out.link(d / f"virtfn{n}", f"../{vf}")
        vd = d.parent / vf
        out.link(vd / "physfn", f"../{g.bus}")
        fn = state.function(vf)
        if fn is None or fn.driver != NVIDIA_DRIVER:
            remove(vd / "nvidia")  # the vGPU host driver's files come with its binding
            continue
        out.text(vd / "nvidia" / "creatable_vgpu_types", "" if fn.vgpu_type else free)
        out.text(vd / "nvidia" / "current_vgpu_type", f"{fn.vgpu_type}\n")
    for entry in d.iterdir() if d.is_dir() else ():
        if entry.name.startswith("virtfn") and int(entry.name[6:]) >= len(vfs):
            remove(entry)


def _write_mdevs(
    out: _Out, root: Path, model: NodeModel, state: VmState, by_bus: Mapping[str, SimFunction]
) -> None:
    """mdev parents' type directories, the mediated devices, ``bus/mdev`` and
    ``class/mdev_bus`` (sysfs-bus-vfio-mdev ABI; the description as NVIDIA's driver writes it)."""
    class_dir = root / "class" / "mdev_bus"
    bus_dir = root / "bus" / "mdev" / "devices"
    class_dir.mkdir(parents=True, exist_ok=True)
    bus_dir.mkdir(parents=True, exist_ok=True)
    parents: set[str] = set()
    uuids: set[str] = set()
    for g in model.gpus:
        if g.bus not in by_bus:
            continue
        d = root / "devices" / by_bus[g.bus].rel_path
        fn = state.function(g.bus)
        if fn is None or fn.driver != NVIDIA_DRIVER:
            remove(d / "mdev_supported_types")
            continue
        parents.add(g.bus)
        out.link(class_dir / g.bus, _rel(d, class_dir / g.bus))
        types = d / "mdev_supported_types"
        for t in g.spec.vgpu_types:
            td = types / f"nvidia-{t.type_id}"
            out.text(td / "name", f"{t.name}\n")
            out.text(td / "available_instances", f"{available(model, state, g, t)}\n")
            out.text(td / "device_api", "vfio-pci\n")
            out.text(
                td / "description",
                f"num_heads=1, frl_config=60, framebuffer={t.framebuffer_mib}M,"
                f" max_resolution=4096x2160, max_instance={t.max_instances}\n",
            )
            out.text(td / "create", "")
        _prune(types, {f"nvidia-{t.type_id}" for t in g.spec.vgpu_types})
        mine = {m.uuid: m for m in state.mdevs if m.parent == g.bus}
        for uuid, m in mine.items():
            md = d / uuid
            out.link(md / "mdev_type", f"../mdev_supported_types/nvidia-{m.type_id}")
            out.text(md / "remove", "")
            out.link(bus_dir / uuid, _rel(md, bus_dir / uuid))
            if not state.iommu:
                remove(md / "iommu_group")
        uuids |= set(mine)
        for entry in d.iterdir():
            if UUID_RE.match(entry.name) and entry.name not in mine:
                remove(entry)
    _prune(class_dir, parents)
    _prune(bus_dir, uuids)


def vfio_groups(state: VmState, groups: Mapping[str, int]) -> set[int]:
    """The IOMMU groups with a ``/dev/vfio/<N>`` node: those with a function on vfio-pci, and
    every mediated device's (vfio_mdev binds it)."""
    used = {groups[f.bus] for f in state.functions if f.driver == VFIO_DRIVER and f.bus in groups}
    return used | {m.group for m in state.mdevs}


def write_vm_driver_root(
    driver_root: Path, model: NodeModel, state: VmState, groups: Mapping[str, int]
) -> None:
    """The NVIDIA unbind lock of every GPU on ``nvidia`` and the ``/dev/vfio`` nodes (regular
    files, as :func:`agent.sim.driverroot.make_device_node` makes device nodes)."""
    locks = driver_root / UNBIND_LOCK
    on_nvidia = set()
    for g in model.gpus:
        fn = state.function(g.bus)
        if fn is not None and fn.driver == NVIDIA_DRIVER:
            on_nvidia.add(g.bus)
            write_text(locks / g.bus / "unbindLock", f"{int(fn.unbind_lock)}\n")
    _prune(locks, on_nvidia)
    vfio = driver_root / "dev" / "vfio"
    if not state.vfio_loaded:
        remove(vfio)
        return
    nodes = {"vfio", *(str(g) for g in vfio_groups(state, groups))} if state.iommu else {"vfio"}
    for name in nodes:
        if not (vfio / name).exists():
            write_text(vfio / name, f"simulated character device for /dev/vfio/{name}\n")
    _prune(vfio, nodes)
