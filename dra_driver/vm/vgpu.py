"""NVIDIA vGPUs made at prepare and undone at unprepare (docs/gpu-facts.md, "GPUs for virtual
machines": the per-VF ``nvidia/current_vgpu_type`` of vGPU 17+ on Ada, Hopper and newer, and
mediated devices, ``mdev_supported_types/nvidia-<id>/create``, before).

Prepare (the kubelet plugin's ``effects`` drives it):

1. ``choose``: on a homogeneous GPU (NVML's heterogeneous mode off) every vGPU has one type: a
   claim for another type than the GPU's vGPUs is refused (``vgpu_type_conflict``, naming the
   type there); then a free function is picked: a VF with no type whose ``creatable_vgpu_types``
   lists the type (``vf``), or a parent that can create one more (``mdev``) with a new UUID;
2. the VF, or the parent and the UUID, recorded durably (``PrepareStarted``) BEFORE the write;
3. ``make``: the VF given its type / the mdev created (both idempotent: a VF that has it, an
   mdev that exists, is left); crash point ``after-vgpu-create``; the IOMMU group the VM gets;
   ``changed`` told (the inventory is read again: a homogeneous GPU now offers only this type).

Unprepare and rollback (``remove``): the VF's type cleared / the mdev removed (idempotent);
``changed`` told.
The start: a vGPU on a GPU of the node's vgpu devices that no claim records is removed
(``strays``).
"""

from __future__ import annotations

import logging
import uuid as uuids
from collections.abc import Callable, Collection

from agent.errors import TesseraError
from agent.logs import fields_
from agent.pcihost.vm_types import VGPU_VF, GpuVirtualization, Vgpu
from dra_driver.errors import SharingError
from dra_driver.vm.host_tools import Binding, VgpuSysfs

CrashHook = Callable[[str], None]


class VgpuMaker:
    """Makes and removes vGPUs (see the module docstring)."""

    def __init__(
        self,
        *,
        host: VgpuSysfs,
        binding: Binding,
        gpu: Callable[[str], GpuVirtualization],
        log: logging.Logger,
        crash_hook: CrashHook = lambda point: None,
        new_uuid: Callable[[], str] = lambda: str(uuids.uuid4()),
        changed: Callable[[str], None] = lambda function: None,
    ) -> None:
        """``gpu(bus_id)`` reads a GPU's vGPU interface and functions now (sysfs) with NVML's
        heterogeneous mode; ``binding`` gives a VF's IOMMU group; ``changed(function)`` is told
        the VF or mdev parent a vGPU was made on or removed from (the inventory is read again:
        a homogeneous GPU advertises only the type it hosts, and every type once it hosts
        none; nothing else tells the agent, as no udev event comes)."""
        self._host = host
        self._binding = binding
        self._gpu = gpu
        self._log = log
        self._crash = crash_hook
        self._new_uuid = new_uuid
        self._changed = changed

    def choose(
        self, device: str, bus_id: str, type_id: int, taken: Collection[str] = ()
    ) -> tuple[str, str | None]:
        """Where to make a vGPU of ``type_id`` on GPU ``bus_id``: (the VF, None) or (the mdev
        parent, a new UUID); ``taken``: functions other claims' records hold. Raises
        SharingError (``vgpu_type_conflict``, ``vgpu_unavailable``, ``vgpu_error``)."""
        try:
            gpu = self._gpu(bus_id)
            existing = self._host.vgpus(bus_id)
            other = [v for v in existing if v.type_id != type_id]
            free = [
                f
                for f in gpu.vgpu_functions
                if f not in taken
                and type_id in self._host.creatable(f)
                and (gpu.vgpu_interface != VGPU_VF or self._host.current_type(f) == 0)
            ]
        except (TesseraError, OSError) as exc:
            raise SharingError(
                f"{device}: cannot read GPU {bus_id}'s vGPUs: {exc}", "vgpu_error"
            ) from exc
        if other and not gpu.heterogeneous:
            raise SharingError(
                f"{device}: GPU {bus_id} hosts vGPUs of type {other[0].type_id} (on"
                f" {other[0].function}) and its vGPUs must all have one type; type {type_id} can"
                " only be made once they are gone",
                "vgpu_type_conflict",
            )
        if not free:
            raise SharingError(
                f"{device}: GPU {bus_id} has no function left that can make vGPU type"
                f" {type_id} ({len(existing)} vGPU(s) there)",
                "vgpu_unavailable",
            )
        return free[0], None if gpu.vgpu_interface == VGPU_VF else self._new_uuid()

    def make(self, device: str, function: str, type_id: int, mdev_uuid: str | None) -> int:
        """Give VF ``function`` type ``type_id``, or create mdev ``mdev_uuid`` of that type on
        parent ``function``; the IOMMU group of the vGPU. Idempotent. Raises SharingError."""
        try:
            if mdev_uuid is None:
                self._host.set_type(function, type_id)
            else:
                self._host.create_mdev(function, type_id, mdev_uuid)
            self._crash("after-vgpu-create")
            group = (
                self._binding.iommu_group(function)
                if mdev_uuid is None
                else self._host.mdev_group(mdev_uuid)
            )
        except (TesseraError, OSError) as exc:
            raise SharingError(
                f"{device}: cannot make vGPU type {type_id} on {function}: {exc}", "vgpu_error"
            ) from exc
        if group is None:
            raise SharingError(
                f"{device}: the vGPU on {function} has no IOMMU group (the IOMMU is off?)",
                "no_iommu",
            )
        self._log.info(
            "made a vGPU",
            extra=fields_(device=device, function=function, type_id=type_id, mdev_uuid=mdev_uuid),
        )
        self._tell(function)
        return group

    def remove(self, device: str, function: str, mdev_uuid: str | None) -> None:
        """Clear VF ``function``'s type, or remove mdev ``mdev_uuid``. Idempotent."""
        try:
            if mdev_uuid is None:
                self._host.clear_type(function)
            else:
                self._host.remove_mdev(mdev_uuid)
        except (TesseraError, OSError) as exc:
            raise SharingError(
                f"{device}: cannot remove the vGPU on {function}: {exc}", "vgpu_error"
            ) from exc
        self._tell(function)

    def _tell(self, function: str) -> None:
        try:
            self._changed(function)
        except Exception:  # the vGPU is what it is; the next rediscovery reads it
            self._log.exception("telling a vGPU change failed", extra=fields_(function=function))

    def strays(self, bus_id: str, functions: Collection[str], mdevs: Collection[str]) -> list[Vgpu]:
        """The vGPUs on GPU ``bus_id`` no claim records (``functions``: the VFs claims hold,
        ``mdevs``: their mdev UUIDs). Raises SharingError."""
        try:
            found = self._host.vgpus(bus_id)
        except (TesseraError, OSError) as exc:
            raise SharingError(f"GPU {bus_id}: cannot read its vGPUs: {exc}", "vgpu_error") from exc
        return [v for v in found if (v.mdev_uuid or v.function) not in {*mdevs, *functions}]
