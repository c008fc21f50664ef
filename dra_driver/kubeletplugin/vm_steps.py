"""The steps of a claim for a virtual machine's device (kinds ``vfio``, ``vgpu``): what
:class:`dra_driver.kubeletplugin.effects.Effects` does for them, between the claim's records and
the tools of :mod:`dra_driver.vm` (which know nothing of the checkpoint).

Each step that changes the node is preceded by a durable record of what it will change (a
``PrepareStarted`` commit through ``keep``): the functions of the GPU's IOMMU group with the
drivers they had (vfio), the VF or the mdev parent and UUID (vgpu). A crash at any point is then
undone from the record by ``undo`` (the kubelet's retry, or the start's rollback), and what no
record names is found again by ``sweep`` at the start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from agent.logs import fields_
from dra_driver.device_model import DeviceModel
from dra_driver.errors import SharingError
from dra_driver.kubeletplugin.checkpoint import VFIO, VGPU, Checkpoint, PreparedDevice
from dra_driver.kubeletplugin.plan import PlannedDevice
from dra_driver.vm.passthrough import Passthrough
from dra_driver.vm.tools import VmTools
from dra_driver.vm.vgpu import VgpuMaker

Keep = Callable[[PreparedDevice], None]
"""Record a device's progress durably (a ``PrepareStarted`` commit of the claim)."""


class VmSteps:
    """Prepare, undo, sweep and restore of VM devices (see the module docstring)."""

    def __init__(
        self, tools: VmTools | None, devices: Callable[[], DeviceModel], log: logging.Logger
    ) -> None:
        """``tools`` None: this node hands no GPU to VMs (``--virtualization none``)."""
        self._tools = tools
        self._devices = devices
        self._log = log

    def _passthrough(self, device: str) -> Passthrough:
        tool = self._tools.passthrough if self._tools is not None else None
        if tool is None:
            raise SharingError(
                f"{device}: this node does not hand GPUs to virtual machines through VFIO (it"
                " runs without --virtualization passthrough)",
                "virtualization_unavailable",
            )
        return tool

    def _vgpu(self, device: str) -> VgpuMaker:
        tool = self._tools.vgpu if self._tools is not None else None
        if tool is None:
            raise SharingError(
                f"{device}: this node makes no vGPUs (it runs without --virtualization vgpu)",
                "virtualization_unavailable",
            )
        return tool

    # -- prepare -----------------------------------------------------------------------------
    def apply(self, p: PlannedDevice, d: PreparedDevice, keep: Keep) -> PreparedDevice:
        """Make VM device ``p`` (its record ``d`` so far); the record made. Raises
        SharingError; the caller rolls back with :meth:`undo`."""
        a = p.device
        if d.kind == VFIO:
            tool = self._passthrough(a.name)
            bus_id = d.pci_bus_id or a.bus_id
            if bus_id is None:
                raise SharingError(f"{a.name}: its GPU's PCI bus id is not known", "vfio_error")
            if not d.vfio_functions:
                functions = tool.functions(a.name, bus_id, a.gpu_minor)
                d = replace(d, pci_bus_id=bus_id, vfio_functions=functions)
                keep(d)  # what is rebound, and to what it goes back, before anything is
            tool.take(a.name, bus_id, d.vfio_functions)
            return d
        tool_ = self._vgpu(a.name)
        if a.bus_id is None or a.vgpu_type is None:
            raise SharingError(f"{a.name}: not a vGPU device of a known GPU", "vgpu_error")
        type_id = a.vgpu_type.type_id
        if d.pci_bus_id is None:
            function, mdev = tool_.choose(a.name, a.bus_id, type_id)
            d = replace(d, pci_bus_id=function, mdev_uuid=mdev, vgpu_type_id=type_id)
            keep(d)  # the VF (or the mdev's UUID) is durable before it is written
        group = tool_.make(a.name, d.pci_bus_id or "", type_id, d.mdev_uuid)
        return replace(d, iommu_group=group)

    # -- unprepare, rollback -----------------------------------------------------------------
    def undo(self, d: PreparedDevice) -> None:
        """Undo VM device ``d`` as far as its record goes (nothing recorded: nothing made).
        Idempotent; raises SharingError (the claim keeps its record and its GPU)."""
        if d.kind == VFIO and d.vfio_functions:
            self._passthrough(d.device).give_back(d.device, d.pci_bus_id or "", d.vfio_functions)
        elif d.kind == VFIO and d.pci_bus_id and self._tools and self._tools.passthrough:
            # no functions recorded (a claim rebuilt from its CDI spec): a GPU bound to
            # vfio-pci through its override is this claim's doing (no other claim can hold it)
            if self._tools.passthrough.stray(d.pci_bus_id):
                self._tools.passthrough.release_stray(d.pci_bus_id)
        elif d.kind == VGPU and d.pci_bus_id is not None:
            self._vgpu(d.device).remove(d.device, d.pci_bus_id, d.mdev_uuid)

    # -- start -------------------------------------------------------------------------------
    def sweep(self, cp: Checkpoint) -> None:
        """Give back what no claim of ``cp`` records on the GPUs this node has VM devices of: a
        GPU bound to vfio-pci through its override, a vGPU. A failure is logged (the next
        start tries again)."""
        if self._tools is None:
            return
        held = [d for e in cp.claims.values() for d in e.devices]
        model = self._devices()
        vfio_gpus = sorted({a.bus_id for a in model.devices if a.kind == VFIO and a.bus_id})
        vgpu_gpus = sorted({a.bus_id for a in model.devices if a.kind == VGPU and a.bus_id})
        recorded = {f for d in held if d.kind == VFIO for f, _ in d.vfio_functions}
        recorded |= {d.pci_bus_id for d in held if d.kind == VFIO and d.pci_bus_id}
        pt, maker = self._tools.passthrough, self._tools.vgpu
        for bus_id in vfio_gpus:
            if pt is not None and bus_id not in recorded and pt.stray(bus_id):
                self._fix("a GPU bound to vfio-pci that no claim records, back to nvidia", bus_id,
                          partial(pt.release_stray, bus_id))  # fmt: skip
        functions = {d.pci_bus_id for d in held if d.kind == VGPU and d.mdev_uuid is None}
        mdevs = {d.mdev_uuid for d in held if d.kind == VGPU and d.mdev_uuid is not None}
        for bus_id in vgpu_gpus:
            if maker is None:
                break
            try:
                strays = maker.strays(bus_id, {f for f in functions if f}, {m for m in mdevs if m})
            except SharingError as exc:
                self._log.error("cannot read a GPU's vGPUs at start",
                                extra=fields_(bus_id=bus_id, error=str(exc)))  # fmt: skip
                continue
            for v in strays:
                self._fix("a vGPU no claim records, removed", v.function,
                          partial(maker.remove, "stray vGPU", v.function, v.mdev_uuid))  # fmt: skip

    def _fix(self, what: str, where: str, step: Callable[[], None]) -> None:
        """Give back one thing the start found that no claim records (``what``), logged."""
        try:
            step()
        except SharingError as exc:
            self._log.error(
                "cannot give back what no claim records at start; tried again at the next start",
                extra=fields_(what=what, function=where, error=str(exc)),
            )
            return
        self._log.warning(
            "gave back what no claim records", extra=fields_(what=what, function=where)
        )

    def restore(self, d: PreparedDevice) -> PreparedDevice:
        """A completed claim's VM device made what its record says again (bound to vfio-pci, its
        vGPU there): a change behind the agent's back, or an unprepare cut short after its undo
        (the kubelet's retry undoes it again)."""
        if d.kind == VFIO and d.vfio_functions:
            self._passthrough(d.device).take(d.device, d.pci_bus_id or "", d.vfio_functions)
        elif d.kind == VGPU and d.pci_bus_id is not None and d.vgpu_type_id is not None:
            group = self._vgpu(d.device).make(d.device, d.pci_bus_id, d.vgpu_type_id, d.mdev_uuid)
            return replace(d, iommu_group=group)
        return d
