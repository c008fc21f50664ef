"""The tools prepare hands GPUs to virtual machines with (``--virtualization``): the host's PCI
layer (:mod:`agent.pcihost`) over the node's sysfs, NVML for persistence mode and for seeing a
GPU come back, and the relay that reads the inventory again once a GPU is back on nvidia."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from agent.driverfiles.discover import has_dev_dir
from agent.logs import fields_
from agent.node import NodeSource
from agent.nvml.vfio import index_of, persistence_off
from agent.pcihost.vm_types import GpuVirtualization, KernelWrite
from dra_driver.vm.passthrough import Passthrough
from dra_driver.vm.tools import VmTools
from dra_driver.vm.vgpu import VgpuMaker


def vm_tools(
    virtualization: str,
    source: NodeSource,
    *,
    kernel_write: KernelWrite | None,
    rebound: Callable[[str], None],
    handing: Callable[[str], None],
    handed: Callable[[str], None],
    log: logging.Logger,
    crash: Callable[[str], None],
) -> VmTools | None:
    """None for ``--virtualization none`` (VM claims are refused, saying so). ``kernel_write``
    is the node's: the simulator's under ``--simulate`` (it does what Linux does), None for the
    real one (:func:`agent.pcihost.kernel.write_attribute`). ``rebound`` is told the BDF of a
    GPU given back to nvidia, ``handing`` that of a GPU about to leave nvidia for vfio-pci,
    ``handed`` that of a GPU now on vfio-pci (:class:`Passthrough`) and that of a function a
    vGPU was made on or removed from (:class:`VgpuMaker`): the inventory is read again."""
    if virtualization == "none":
        return None
    # the host layer is loaded only on a node that hands GPUs to VMs
    from agent.pcihost.binding import PciBinding
    from agent.pcihost.holders import holders
    from agent.pcihost.kernel import write_attribute
    from agent.pcihost.read import read_gpu_functions
    from agent.pcihost.vgpu_host import VgpuHost

    write = kernel_write or write_attribute
    binding = PciBinding(source.sysfs_root, source.driver_root, write)
    nvml = source.nvml

    def gpu(bus_id: str) -> GpuVirtualization:
        found = read_gpu_functions(source.sysfs_root, bus_id)
        index = index_of(nvml, bus_id)
        heterogeneous = index is not None and nvml.vgpu_heterogeneous(index)
        return replace(found, heterogeneous=heterogeneous)

    dev_root = source.driver_root if has_dev_dir(source.driver_root) else Path("/")
    return VmTools(
        passthrough=Passthrough(
            binding=binding,
            holders=holders,
            proc_root=source.proc_root,
            dev_root=dev_root,
            sys_root=source.sysfs_root,
            persistence_off=partial(_persistence_off, source, log),
            visible=lambda bus_id: index_of(nvml, bus_id) is not None,
            rebound=rebound,
            handing=handing,
            handed=handed,
            log=log.getChild("passthrough"),
            crash_hook=crash,
        )
        if virtualization == "passthrough"
        else None,
        vgpu=VgpuMaker(
            host=VgpuHost(source.sysfs_root, write),
            binding=binding,
            gpu=gpu,
            log=log.getChild("vgpu"),
            crash_hook=crash,
            changed=handed,
        )
        if virtualization == "vgpu"
        else None,
    )


def _persistence_off(source: NodeSource, log: logging.Logger, bus_id: str) -> None:
    if not persistence_off(source.nvml, bus_id):
        log.info(
            "persistence mode left as it is (NVML does not support setting it here)",
            extra=fields_(bus_id=bus_id),
        )
