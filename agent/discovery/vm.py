"""Discovery of what each GPU offers virtual machines (``--virtualization`` not ``none``).

For every GPU NVML enumerates: :func:`agent.pcihost.read.read_gpu_functions` (sysfs: bound
driver, IOMMU group and members, vGPU interface and the vGPUs that exist) plus NVML's vGPU
types and heterogeneous mode. A GPU bound to ``vfio-pci`` (or unbound halfway through a change
of driver) is not enumerated by NVML; it stays in the inventory from the facts NVML last gave
for its PCI address (:mod:`agent.discovery.vm_cache`), with ``GpuDevice.index == -1``, so that
rediscovery and hot-plug do not take a GPU lent to a VM for a GPU that left the node. A GPU on
``nvidia`` that NVML does not enumerate is left out as before (hot-added after ``nvmlInit``).
Design: issue 24, section 6; facts: docs/gpu-facts.md, "GPUs for virtual machines"."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from agent.discovery.sysfs import SysfsSnapshot
from agent.discovery.topology import normalize_bus_id
from agent.discovery.vm_cache import CACHE_NAME, CacheUnreadable, lasting_facts, load, save
from agent.errors import ConfigError
from agent.logs import fields_
from agent.nvml.types import GpuDevice
from agent.pcihost.attrs import bound_driver
from agent.pcihost.read import read_gpu_functions
from agent.pcihost.vm_types import NVIDIA, GpuVirtualization, VgpuType

MODES = ("none", "passthrough", "vgpu")
"""The values of ``--virtualization``."""


class VgpuFacts(Protocol):
    """NVML's vGPU facts of a GPU by NVML index (the facade's ``Nvml.vgpu_types`` and
    ``Nvml.vgpu_heterogeneous``)."""

    def vgpu_types(self, index: int) -> tuple[VgpuType, ...]: ...

    def vgpu_heterogeneous(self, index: int) -> bool: ...


@dataclass(frozen=True)
class VmDiscovery:
    """Discovery is asked to fill ``Gpu.virtualization`` (``--virtualization`` not none)."""

    vgpu: VgpuFacts
    """Where the vGPU types come from (the node's NVML facade)."""
    cache: Path | None
    """``<state dir>/vm-gpus.json``; None: GPUs NVML does not enumerate are left out."""
    log: logging.Logger
    """Where a cache that cannot be read or written is reported (discovery goes on)."""


def vm_discovery(
    virtualization: bool | str,
    state_dir: Path | None,
    nvml: VgpuFacts,
    log: logging.Logger,
) -> VmDiscovery | None:
    """The composition root's one call: ``virtualization`` is ``--virtualization`` (a mode of
    :data:`MODES`) or a plain bool; None for ``none``/False (discovery as before). ConfigError
    naming the value and the modes for any other string."""
    if isinstance(virtualization, str):
        if virtualization not in MODES:
            raise ConfigError(
                f"--virtualization {virtualization!r} is not a mode: choose one of"
                f" {', '.join(MODES)}"
            )
        virtualization = virtualization != "none"
    if not virtualization:
        return None
    cache = None if state_dir is None else state_dir / CACHE_NAME
    return VmDiscovery(vgpu=nvml, cache=cache, log=log)


@dataclass(frozen=True)
class VmView:
    """What discovery adds to NVML's GPUs for virtual machines."""

    parked: tuple[GpuDevice, ...]
    """GPUs NVML does not enumerate that are kept (index -1), by PCI address."""
    virtualization: Mapping[str, GpuVirtualization]
    """PCI address (sysfs form) -> what the GPU offers VMs, for every GPU of the inventory."""


def read_vm_view(
    sys_root: Path,
    sysfs: SysfsSnapshot,
    gpus: Sequence[GpuDevice],
    vm: VmDiscovery,
    known: Sequence[GpuDevice] = (),
) -> VmView:
    """The GPUs to keep that NVML does not enumerate and every GPU's virtualization facts;
    saves the cache when its facts changed. ``known``: GPUs of the previous inventory (a
    rediscovery), trusted over the cache file (they are newer when its write failed).

    A GPU is kept when NVML does not enumerate it, the cache or ``known`` has its facts, sysfs
    still has its PCI function and the driver bound to it is not ``nvidia``. PciHostError (from
    :mod:`agent.pcihost`) when sysfs cannot be read."""
    visible = {normalize_bus_id(g.pci_bus_id): g for g in gpus}
    present = {f.bus for f in sysfs.functions}
    facts = _load(vm)
    facts.update({normalize_bus_id(g.pci_bus_id): lasting_facts(g) for g in known})
    parked = tuple(
        device
        for bus, device in sorted(facts.items())
        if bus not in visible and bus in present and bound_driver(sys_root, bus) != NVIDIA
    )
    view: dict[str, GpuVirtualization] = {}
    for bus, g in visible.items():
        view[bus] = replace(
            read_gpu_functions(sys_root, bus),
            vgpu_types=vm.vgpu.vgpu_types(g.index),
            heterogeneous=vm.vgpu.vgpu_heterogeneous(g.index),
        )
    for device in parked:
        bus = normalize_bus_id(device.pci_bus_id)
        view[bus] = read_gpu_functions(sys_root, bus)
    kept = {bus: lasting_facts(g) for bus, g in visible.items()}
    kept.update({normalize_bus_id(d.pci_bus_id): d for d in parked})
    _save(vm, kept)
    return VmView(parked=parked, virtualization=view)


def _load(vm: VmDiscovery) -> dict[str, GpuDevice]:
    if vm.cache is None:
        return {}
    try:
        return load(vm.cache)
    except (OSError, CacheUnreadable) as exc:
        vm.log.warning(
            "the facts of GPUs lent to virtual machines cannot be read; a GPU bound to vfio-pci"
            " now is not advertised until it is back on nvidia",
            extra=fields_(path=str(vm.cache), error=str(exc)),
        )
        return {}


def _save(vm: VmDiscovery, kept: Mapping[str, GpuDevice]) -> None:
    if vm.cache is None:
        return
    try:
        save(vm.cache, kept)
    except OSError as exc:
        vm.log.warning(
            "cannot save the facts of GPUs for virtual machines; a GPU bound to vfio-pci at the"
            " next start is not advertised until it is back on nvidia",
            extra=fields_(path=str(vm.cache), error=str(exc)),
        )
