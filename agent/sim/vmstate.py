"""The simulated node's PCI functions as VFIO and NVIDIA's vGPU host driver see them: which driver
each function is bound to, ``driver_override``, the NVIDIA unbind lock, SR-IOV VFs, the vGPU type
of each VF, mediated devices, IOMMU on or off, vfio-pci loaded or not, the faults that put a
foreign function into a GPU's IOMMU group or a process on a GPU's device node.

A sibling of :mod:`agent.sim.state` (MIG): ``<sim dir>/vm-state.json`` under ``vm-state.lock``
(:class:`agent.sim.jsonstore.SharedJsonStore`: lock, reload, pure change, atomic save), so that
the agent, ``tessera sim fault`` and the simulator's kernel (:mod:`agent.sim.pcikernel`) see the
same node. The sysfs tree is rewritten from this state (:mod:`agent.sim.sysfs_vm`).

Everything here except :class:`VmStore` is pure. Facts: docs/gpu-facts.md, "GPUs for virtual
machines (VFIO and vGPU)".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from agent.sim.jsonstore import SharedJsonStore
from agent.sim.model import GpuSlot, NodeModel
from agent.sim.specs import VgpuTypeSpec

STATE_FILE = "vm-state.json"
LOCK_FILE = "vm-state.lock"
API_VERSION = "tessera.sim/v1"
KIND = "VmState"

NVIDIA_DRIVER = "nvidia"
VFIO_DRIVER = "vfio-pci"
FOREIGN_DRIVER = "nvme"
"""The driver of the function ``tessera sim fault foreign-in-group`` adds (an NVMe drive)."""
FOREIGN_ID = (0x144D, 0xA80A, 0x010802)
"""vendor, device, class of that function: a Samsung NVMe SSD controller (class 0x010802)."""
VF_OFFSET = 4
"""First VF's routing-id offset from its PF (``First VF Offset`` of the SR-IOV capability) and
stride 1: A100 listings show VFs from ``.4``; for H200 unverified."""


class VmFormatError(ValueError):
    """A VM state file that cannot be decoded."""


@dataclass(frozen=True)
class FunctionState:
    """One PCI function the VM machinery manages: a GPU, an enabled VF or a foreign function."""

    bus: str
    driver: str | None
    """The bound driver (``nvidia``, ``vfio-pci``, ``nvme``); None: unbound."""
    override: str | None = None
    """``driver_override``; None: unset (sysfs prints ``(null)``)."""
    unbind_lock: bool = False
    """The NVIDIA driver's unbind lock is taken (``/proc/driver/nvidia/gpus/<BDF>/unbindLock``)."""
    vgpu_type: int = 0
    """A VF's ``nvidia/current_vgpu_type``; 0: none."""


@dataclass(frozen=True)
class Mdev:
    """A mediated device (a vGPU of the ``mdev`` interface)."""

    uuid: str
    parent: str
    type_id: int
    group: int
    """Its own IOMMU group (``/dev/vfio/<group>``)."""


@dataclass(frozen=True)
class Holder:
    """A process that holds ``/dev/nvidia<minor>`` open (``tessera sim fault hold-gpu``)."""

    pid: int
    minor: int


@dataclass(frozen=True)
class VmState:
    model: str
    functions: tuple[FunctionState, ...]
    """Sorted by bus."""
    iommu: bool = True
    vfio_loaded: bool = True
    numvfs: tuple[tuple[str, int], ...] = ()
    """(PF bus, ``sriov_numvfs``) of every GPU with SR-IOV."""
    mdevs: tuple[Mdev, ...] = ()
    foreign: tuple[tuple[str, str], ...] = ()
    """(foreign function's bus, bus of the GPU whose IOMMU group it joined)."""
    holders: tuple[Holder, ...] = ()

    def function(self, bus: str) -> FunctionState | None:
        return next((f for f in self.functions if f.bus == bus), None)

    def with_function(self, fn: FunctionState) -> VmState:
        """A copy where ``fn`` replaces (or joins) the function of its bus (pure)."""
        others = [f for f in self.functions if f.bus != fn.bus]
        return replace(self, functions=tuple(sorted((*others, fn), key=lambda f: f.bus)))

    def without_functions(self, buses: set[str]) -> VmState:
        return replace(self, functions=tuple(f for f in self.functions if f.bus not in buses))

    def num_vfs(self, pf: str) -> int:
        return dict(self.numvfs).get(pf, 0)

    def with_num_vfs(self, pf: str, n: int) -> VmState:
        return replace(self, numvfs=tuple(sorted({**dict(self.numvfs), pf: n}.items())))


# -- the PCI layout of VFs and foreign functions (pure) -------------------------------------------


def _routing_id(bus: str) -> tuple[str, int]:
    domain, b, rest = bus.split(":")
    dev, fn = rest.split(".")
    return domain, (int(b, 16) << 8) | (int(dev, 16) << 3) | int(fn, 16)


def vf_bus(pf: str, n: int) -> str:
    """The BDF of VF ``n`` (0-based) of the PF at ``pf``: routing id + offset + n (pure)."""
    domain, rid = _routing_id(pf)
    rid += VF_OFFSET + n
    return f"{domain}:{rid >> 8:02x}:{(rid >> 3) & 0x1F:02x}.{rid & 7:x}"


def sriov_total(model: NodeModel, gpu: GpuSlot) -> int:
    """``sriov_totalvfs`` of a GPU: its product's under the ``vf`` vGPU host driver, else 0."""
    return gpu.spec.sriov_total_vfs if model.vgpu_interface == "vf" else 0


def vfs_of(model: NodeModel, state: VmState, gpu: GpuSlot) -> list[str]:
    """The BDFs of the GPU's enabled VFs, in VF order."""
    return [vf_bus(gpu.bus, n) for n in range(state.num_vfs(gpu.bus))]


def parent_of_vf(model: NodeModel, bus: str) -> tuple[GpuSlot, int] | None:
    """(the PF's GPU, VF number) of a VF's BDF, or None when ``bus`` is no VF of the model."""
    for g in model.gpus:
        for n in range(sriov_total(model, g)):
            if vf_bus(g.bus, n) == bus:
                return g, n
    return None


def foreign_bus(gpu_bus: str) -> str:
    """Where ``foreign-in-group`` puts its function: the GPU's bus, device 0x1f (pure)."""
    domain, b, _ = gpu_bus.split(":")
    return f"{domain}:{b}:1f.0"


def initial_vm_state(model: NodeModel) -> VmState:
    """A booted host: IOMMU on, vfio-pci loaded, every GPU on ``nvidia``; under the ``vf`` vGPU
    host driver every VF enabled (``sriov-manage -e`` at boot) and on ``nvidia`` (pure)."""
    functions = [FunctionState(g.bus, NVIDIA_DRIVER) for g in model.gpus]
    numvfs: list[tuple[str, int]] = []
    for g in model.gpus:
        total = sriov_total(model, g)
        if total:
            numvfs.append((g.bus, total))
            functions += [FunctionState(vf_bus(g.bus, n), NVIDIA_DRIVER) for n in range(total)]
    return VmState(
        model=model.name,
        functions=tuple(sorted(functions, key=lambda f: f.bus)),
        numvfs=tuple(numvfs),
    )


def nvidia_bound(state: VmState, bus: str) -> bool:
    """Whether the GPU at ``bus`` is bound to ``nvidia`` (NVML enumerates only those)."""
    fn = state.function(bus)
    return fn is not None and fn.driver == NVIDIA_DRIVER


# -- vGPU rules (pure) ----------------------------------------------------------------------------


def types_in_use(model: NodeModel, state: VmState, gpu: GpuSlot) -> list[int]:
    """The type of every vGPU that exists on the GPU (one entry per vGPU)."""
    if model.vgpu_interface == "mdev":
        return [m.type_id for m in state.mdevs if m.parent == gpu.bus]
    used = []
    for vf in vfs_of(model, state, gpu):
        fn = state.function(vf)
        if fn is not None and fn.vgpu_type:
            used.append(fn.vgpu_type)
    return used


def available(model: NodeModel, state: VmState, gpu: GpuSlot, t: VgpuTypeSpec) -> int:
    """How many more vGPUs of type ``t`` the GPU can take now: homogeneous (only the type in use,
    once one exists), at most ``t.max_instances`` (pure)."""
    used = types_in_use(model, state, gpu)
    if any(u != t.type_id for u in used):
        return 0
    return max(0, t.max_instances - len(used))


def creatable(model: NodeModel, state: VmState, function: str) -> tuple[VgpuTypeSpec, ...]:
    """The types ``nvidia/creatable_vgpu_types`` of a VF lists now: none on a VF that has a type
    or is not on ``nvidia``; else every type the GPU can take one more of (pure)."""
    found = parent_of_vf(model, function)
    fn = state.function(function)
    if found is None or fn is None or fn.driver != NVIDIA_DRIVER or fn.vgpu_type:
        return ()
    return gpu_creatable(model, state, found[0])


def gpu_creatable(model: NodeModel, state: VmState, gpu: GpuSlot) -> tuple[VgpuTypeSpec, ...]:
    """Every type the GPU can take one more vGPU of now: what each free VF on ``nvidia`` lists
    (one computation for all of a GPU's VFs; pure)."""
    return tuple(t for t in gpu.spec.vgpu_types if available(model, state, gpu, t) > 0)


def tree_view(state: VmState) -> VmState:
    """The part of ``state`` the sysfs tree shows: all but the unbind locks (the driver root's)
    and the holders of ``/dev/nvidia<N>`` (the processes'); two states with the same view have
    the same tree (pure)."""
    functions = tuple(replace(f, unbind_lock=False) for f in state.functions)
    return replace(state, functions=functions, holders=())


# -- JSON codec (pure) ----------------------------------------------------------------------------


def vm_to_json(state: VmState) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "model": state.model,
        "iommu": state.iommu,
        "vfioLoaded": state.vfio_loaded,
        "functions": [
            {
                "bus": f.bus,
                "driver": f.driver,
                "override": f.override,
                "unbindLock": f.unbind_lock,
                "vgpuType": f.vgpu_type,
            }
            for f in state.functions
        ],
        "numvfs": [{"pf": pf, "n": n} for pf, n in state.numvfs],
        "mdevs": [
            {"uuid": m.uuid, "parent": m.parent, "typeId": m.type_id, "group": m.group}
            for m in state.mdevs
        ],
        "foreign": [{"bus": b, "gpu": g} for b, g in state.foreign],
        "holders": [{"pid": h.pid, "minor": h.minor} for h in state.holders],
    }


def _opt_str(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise VmFormatError(f"expected a string or null, got {value!r}")
    return value


def vm_from_json(raw: object) -> VmState:
    """Decode :func:`vm_to_json`'s output; :class:`VmFormatError` when it is not (pure)."""
    try:
        if not isinstance(raw, dict):
            raise VmFormatError("VM state must be a JSON object")
        if raw.get("apiVersion") != API_VERSION or raw.get("kind") != KIND:
            raise VmFormatError(f"unsupported VM state {raw.get('apiVersion')}/{raw.get('kind')}")
        return VmState(
            model=str(raw["model"]),
            iommu=bool(raw["iommu"]),
            vfio_loaded=bool(raw["vfioLoaded"]),
            functions=tuple(
                FunctionState(
                    bus=str(f["bus"]),
                    driver=_opt_str(f["driver"]),
                    override=_opt_str(f["override"]),
                    unbind_lock=bool(f["unbindLock"]),
                    vgpu_type=int(f["vgpuType"]),
                )
                for f in raw["functions"]
            ),
            numvfs=tuple((str(v["pf"]), int(v["n"])) for v in raw["numvfs"]),
            mdevs=tuple(
                Mdev(str(m["uuid"]), str(m["parent"]), int(m["typeId"]), int(m["group"]))
                for m in raw["mdevs"]
            ),
            foreign=tuple((str(f["bus"]), str(f["gpu"])) for f in raw["foreign"]),
            holders=tuple(Holder(int(h["pid"]), int(h["minor"])) for h in raw["holders"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, VmFormatError):
            raise
        raise VmFormatError(f"malformed VM state: {exc!r}") from exc


# -- the store (I/O) ------------------------------------------------------------------------------


class VmStore(SharedJsonStore[VmState]):
    """The VM state of one model in ``<sim dir>/vm-state.json``, shared between processes."""

    def __init__(self, sim_dir: Path, model: NodeModel) -> None:
        super().__init__(
            Path(sim_dir),
            STATE_FILE,
            LOCK_FILE,
            encode=vm_to_json,
            decode=vm_from_json,
            belongs=lambda s: s.model == model.name,
            empty=initial_vm_state(model),
            format_error=VmFormatError,
        )
