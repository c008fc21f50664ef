"""What the checkpoint records of a claim and its devices, and the CDI spec made from a record.

Prepare (``transaction``) records the devices it plans, and the start (``reconcile``) describes
the devices of a recovered or rebuilt claim, the same way: :meth:`Records.device`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from dra_driver.kubeletplugin.cdi import CdiWriter
from dra_driver.kubeletplugin.cdi_spec import CdiRequest
from dra_driver.kubeletplugin.checkpoint import (
    VFIO,
    VM_KINDS,
    ClaimEntry,
    MpsRecord,
    PreparedDevice,
)
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.effects import mps_edits
from dra_driver.kubeletplugin.plan import PlannedDevice


def cdi_requests(devices: Sequence[PreparedDevice]) -> list[CdiRequest]:
    """What the CDI spec of a claim's recorded devices contains."""
    return [
        CdiRequest(
            device_name=d.device,
            gpu_minor=d.gpu_minor,
            gpu_instance_id=d.gpu_instance_id,
            compute_instance_id=d.compute_instance_id,
            vfio_group=d.iommu_group if d.kind in VM_KINDS else None,
        )
        for d in devices
    ]


def gpus(devices: Iterable[PreparedDevice]) -> set[str]:
    return {d.gpu_uuid for d in devices if d.gpu_uuid}


def claim_key(entry: ClaimEntry) -> ClaimKey:
    return ClaimKey(entry.namespace, entry.name, entry.uid)


def claim_entry(
    claim: ClaimKey,
    state: str,
    devices: tuple[PreparedDevice, ...],
    pods: tuple[str, ...] = (),
    mps: MpsRecord | None = None,
) -> ClaimEntry:
    return ClaimEntry(
        uid=claim.uid,
        namespace=claim.namespace,
        name=claim.name,
        state=state,
        devices=devices,
        updated_at=time.time(),
        mps=mps,
        pods=pods,
    )


class Records:
    """Device records and CDI specs of this driver's pool."""

    def __init__(self, pool: str, cdi: CdiWriter) -> None:
        self._pool = pool
        self._cdi = cdi

    def device(self, uid: str, p: PlannedDevice) -> PreparedDevice:
        """The checkpoint's record of planned device ``p`` for claim ``uid`` (a dynamic MIG
        device's UUID and instance ids are added once it is created; a VM's device gets its
        functions, VF or mdev as prepare chooses them, and only its own CDI device: the base
        spec's NVIDIA nodes and driver files are not for a virtual machine)."""
        d = p.device
        placement = None
        if p.dynamic and d.mig_profile_id is not None and d.mig_placement_start is not None:
            placement = (d.mig_profile_id, d.mig_placement_start, d.mig_placement_size or 0)
        vm = d.kind in VM_KINDS
        own = self._cdi.device_id(uid, d.name)
        return PreparedDevice(
            request_names=p.request_names,
            pool=self._pool,
            device=d.name,
            cdi_device_ids=(own,) if vm else (own, self._cdi.base_device_id),
            kind=d.kind,
            gpu_uuid=d.parent_uuid,
            gpu_minor=d.gpu_minor,
            mig_uuid=d.uuid if d.kind == "mig" else None,
            gpu_instance_id=d.gpu_instance_id,
            compute_instance_id=d.compute_instance_id,
            placement=placement,
            sharing=p.sharing,
            interval=p.interval,
            share_id=p.share_id,
            memory_bytes=p.memory_bytes,
            power_limit_mw=p.power_limit_mw,
            device_class=p.device_class,
            pci_bus_id=d.bus_id if d.kind == VFIO else None,
            iommu_group=d.iommu_group if d.kind == VFIO else None,
            vgpu_type_id=d.vgpu_type.type_id if d.vgpu_type is not None else None,
        )

    def write_spec(self, entry: ClaimEntry, *, fresh: bool = False) -> None:
        """Write the CDI spec of ``entry``'s devices (and its MPS daemon); ``fresh``: as
        ``CdiWriter.write_claim``'s, after :meth:`ensure_base`."""
        self._cdi.write_claim(
            entry.uid, cdi_requests(entry.devices), mps_edits(entry.mps), fresh=fresh
        )

    def ensure_base(self) -> None:
        """Write the driver's base CDI spec when it is missing."""
        self._cdi.ensure_base()
