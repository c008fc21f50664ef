"""The core of the simulated NVML: construction, simulator controls, init state, handle lookup.

:class:`NvmlCore` is the base of :class:`agent.sim.nvml.FakeNvml`; the pynvml-named methods live
in the subclasses (``nvml_mig.py`` for MIG, ``nvml.py`` for the rest). Nothing here reads the
wall clock, the environment or a random source: the same model and state give the same answers.
"""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pynvml

from agent.errors import ConfigError
from agent.nvml import api_types as api
from agent.sim import handles, layouts, mig
from agent.sim.errors import ModelError
from agent.sim.handles import Ref
from agent.sim.mig import nvml_error
from agent.sim.model import GpuSlot, NodeModel
from agent.sim.sharing import SharingStore, initial_sharing
from agent.sim.state import (
    ComputeInstance,
    GpuInstance,
    GpuState,
    SimState,
    StateStore,
    initial_state,
)
from agent.sim.vmstate import VmState, VmStore, initial_vm_state, nvidia_bound

T = TypeVar("T")

_CONSTANT_TYPES = (int, float, str, bytes, tuple, ctypes._SimpleCData)
_NOT_COPIED = {"nvmlLib"}


def pynvml_constants() -> dict[str, Any]:
    """pynvml's public non-function attributes: constants, error classes and ctypes types.

    This includes the ``nvml``-prefixed structs and version constants callers need
    (``nvmlMemory_v2``, ``nvmlPciInfo_t``), but no functions, modules or library state.
    """
    out: dict[str, Any] = {}
    for name, value in vars(pynvml).items():
        if name.startswith("_") or name in _NOT_COPIED:
            continue
        if inspect.isclass(value) or isinstance(value, _CONSTANT_TYPES):
            out[name] = value
    return out


def sysfs_to_nvml_bus_id(bus: str) -> str:
    """``0000:1b:00.0`` -> ``00000000:1B:00.0`` (pure)."""
    domain, b, rest = bus.split(":")
    dev, fn = rest.split(".")
    return f"{int(domain, 16):08X}:{int(b, 16):02X}:{int(dev, 16):02X}.{int(fn, 16):X}"


def pci_info(bus: str, device_id: int, subsystem_id: int) -> api.PciInfo:
    """A filled ``nvmlPciInfo_t`` for a device at sysfs address ``bus``."""
    domain, b, rest = bus.split(":")
    dev, _fn = rest.split(".")
    info = pynvml.nvmlPciInfo_t()
    info.domain = int(domain, 16)
    info.bus = int(b, 16)
    info.device = int(dev, 16)
    info.pciDeviceId = device_id
    info.pciSubSystemId = subsystem_id
    info.busId = sysfs_to_nvml_bus_id(bus)
    info.busIdLegacy = pynvml.NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT % (
        info.domain,
        info.bus,
        info.device,
    )
    return cast(api.PciInfo, info)


class NvmlCore:
    """State, lifecycle and handle resolution shared by every simulated NVML call."""

    def __init__(self, model: NodeModel, state_dir: Path, *, mig_layout: str | None = None) -> None:
        """Simulate ``model`` with its driver state in ``state_dir``.

        A fresh directory gets ``mig_layout`` (else the model's ``default_mig_layout``); an
        existing one keeps its state unless ``mig_layout`` is given, which is then re-applied
        (instances destroyed first), as an administrator applying a layout would.
        """
        if mig_layout is not None:
            layouts.layout_profiles(mig_layout)  # ConfigError for an unknown name, before any I/O
        else:
            try:
                layouts.layout_profiles(model.default_mig_layout)
            except ConfigError as exc:
                raise ModelError(f"model {model.name}: defaultMigLayout: {exc}") from exc
        self.model = model
        self._slots = {g.index: g for g in model.gpus}
        self._store = StateStore(Path(state_dir), model)
        self._init_count = 0

        def init(stored: SimState | None) -> SimState:
            if stored is None:
                base = initial_state(model)
                return layouts.apply_layout(base, model, mig_layout or model.default_mig_layout)
            if mig_layout is not None:
                return layouts.apply_layout(stored, model, mig_layout)
            return stored

        self._store.open(init)
        self._sharing = SharingStore(Path(state_dir), model)
        self._sharing.open(lambda stored: stored if stored is not None else initial_sharing(model))
        self._vm = VmStore(Path(state_dir), model)
        self._vm.open(lambda stored: stored if stored is not None else initial_vm_state(model))

    # -- simulator controls (not pynvml functions) -------------------------------------------
    @property
    def state_dir(self) -> Path:
        return self._store.dir

    @property
    def state(self) -> SimState:
        """The current driver state (reloaded when another process changed it)."""
        return self._store.read()

    def reset_gpu(self, index: int) -> None:
        """Simulate a GPU reset: a pending MIG mode becomes current, MIG instances are gone."""
        if index not in self._slots:
            raise ConfigError(
                f"GPU index {index} does not exist; model {self.model.name} has GPUs "
                f"0..{len(self._slots) - 1}"
            )
        self._store.update(lambda s: (s.with_gpu(mig.reset(s.gpus[index])), None))

    @property
    def vm_state(self) -> VmState:
        """Bound drivers, VFs, vGPUs, IOMMU (:mod:`agent.sim.vmstate`), reloaded when changed."""
        return self._vm.read()

    def update_vm(self, change: Callable[[VmState], tuple[VmState, T]]) -> T:
        """Lock, reload, apply ``change`` to the VM state, save (one atomic step)."""
        return self._vm.update(change)

    def present(self) -> list[GpuSlot]:
        """The GPUs NVML enumerates: on the bus (not hot-removed) and bound to ``nvidia`` (one
        on vfio-pci or unbound is not NVIDIA's driver's), in NVML's enumeration order (the
        model's, which is PCI bus order): a GPU's NVML index is its place here, so indexes after
        a missing GPU shift down by one, as a fresh enumeration numbers them."""
        state = self._store.read()
        vm = self._vm.read()
        return [
            g
            for g in self.model.gpus
            if not state.gpus[g.index].removed and nvidia_bound(vm, g.bus)
        ]

    def removed(self) -> list[int]:
        """The model indexes of the hot-removed GPUs."""
        return [g.index for g in self._store.read().gpus if g.removed]

    def set_removed(self, index: int, removed: bool) -> bool:
        """Take GPU ``index`` (the model's index) off the bus or put it back; False when it was
        already so. A GPU that leaves loses its MIG instances (the driver forgets them), and
        one that comes back starts with MIG as it was configured (mode kept, no instances)."""
        self._check_index(index)

        def change(state: SimState) -> tuple[SimState, bool]:
            gpu = state.gpus[index]
            if gpu.removed == removed:
                return state, False
            gone = mig.destroy_all(gpu) if gpu.gpu_instances else gpu
            return state.with_gpu(replace(gone, removed=removed)), True

        return self._store.update(change)

    def _check_index(self, index: int) -> None:
        if index not in self._slots:
            raise ConfigError(
                f"GPU index {index} does not exist; model {self.model.name} has GPUs "
                f"0..{len(self._slots) - 1}"
            )

    def apply_mig_layout(self, name: str) -> None:
        """Apply a named layout (agent.sim.layouts) to every MIG GPU, destroying what exists."""
        layouts.layout_profiles(name)
        self._store.update(lambda s: (layouts.apply_layout(s, self.model, name), None))

    # -- helpers for the NVML calls --------------------------------------------------------------
    def _require_init(self) -> None:
        if self._init_count <= 0:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED, "nvmlInit() has not been called")

    def _gpu_state(self, index: int) -> GpuState:
        return self._store.read().gpus[index]

    def _update_gpu(self, index: int, change: Callable[[GpuState], tuple[GpuState, T]]) -> T:
        """Lock, reload, apply ``change`` to GPU ``index``, save; returns its result."""

        def whole(state: SimState) -> tuple[SimState, T]:
            gpu, result = change(state.gpus[index])
            return state.with_gpu(gpu), result

        return self._store.update(whole)

    def _ref(self, handle: object, pointer_type: Any, kinds: tuple[int, ...]) -> Ref:
        self._require_init()
        ref = handles.decode(handle, pointer_type)
        if ref is None or ref.gpu not in self._slots:
            raise nvml_error(
                pynvml.NVML_ERROR_INVALID_ARGUMENT, f"{handle!r} is not a valid handle"
            )
        if self._store.read().gpus[ref.gpu].removed:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST, f"GPU {ref.gpu} left the PCI bus")
        if not nvidia_bound(self._vm.read(), self._slots[ref.gpu].bus):
            raise nvml_error(
                pynvml.NVML_ERROR_GPU_IS_LOST, f"GPU {ref.gpu} is not bound to the nvidia driver"
            )
        if ref.kind not in kinds:
            if ref.kind == handles.KIND_MIG:
                raise nvml_error(
                    pynvml.NVML_ERROR_NOT_SUPPORTED, "this call does not take a MIG device handle"
                )
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT, f"{handle!r} is the wrong kind")
        return ref

    def _gpu(self, handle: object) -> GpuSlot:
        """The GPU of a whole-GPU handle; NOT_SUPPORTED for MIG device handles."""
        return self._slots[self._ref(handle, pynvml.c_nvmlDevice_t, (handles.KIND_GPU,)).gpu]

    def _device(self, handle: object) -> tuple[GpuSlot, tuple[GpuInstance, ComputeInstance] | None]:
        """A GPU or MIG device handle: the GPU, and for a MIG device its (GI, CI)."""
        ref = self._ref(handle, pynvml.c_nvmlDevice_t, (handles.KIND_GPU, handles.KIND_MIG))
        if ref.kind == handles.KIND_GPU:
            return self._slots[ref.gpu], None
        gi, ci = self._live(ref, handle)
        assert ci is not None
        return self._slots[ref.gpu], (gi, ci)

    def _live(self, ref: Ref, handle: object) -> tuple[GpuInstance, ComputeInstance | None]:
        """The GI (and CI) a handle names; INVALID_ARGUMENT once they were destroyed."""
        gi = self._gpu_state(ref.gpu).gpu_instance(ref.gi)
        ci = gi.compute_instance(ref.ci) if gi is not None else None
        if gi is None or (ref.kind in (handles.KIND_MIG, handles.KIND_CI) and ci is None):
            raise nvml_error(
                pynvml.NVML_ERROR_INVALID_ARGUMENT, f"{handle!r} names a destroyed MIG instance"
            )
        return gi, ci

    def _gpu_instance(self, handle: object) -> tuple[GpuSlot, GpuInstance]:
        ref = self._ref(handle, pynvml.c_nvmlGpuInstance_t, (handles.KIND_GI,))
        gi, _ = self._live(ref, handle)
        return self._slots[ref.gpu], gi

    def _compute_instance(self, handle: object) -> tuple[GpuSlot, GpuInstance, ComputeInstance]:
        ref = self._ref(handle, pynvml.c_nvmlComputeInstance_t, (handles.KIND_CI,))
        gi, ci = self._live(ref, handle)
        assert ci is not None
        return self._slots[ref.gpu], gi, ci

    if not TYPE_CHECKING:  # hidden from mypy so that typos in this package stay type errors

        def __getattr__(self, name: str) -> Any:
            """Reached only for names that are neither simulated calls nor pynvml constants."""
            raise AttributeError(
                f"the simulated NVML has no {name!r} (not simulated, or not in pynvml)"
            )
