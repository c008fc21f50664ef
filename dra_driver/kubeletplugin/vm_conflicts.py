"""Who may hold a GPU for a virtual machine: part of ``plan.conflicts``, the one rule for who may
hold a device at the same time as whom (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from dra_driver.device_model import AdvertisedDevice
from dra_driver.errors import ClaimError
from dra_driver.kubeletplugin.checkpoint import VFIO, VM_KINDS, ClaimEntry, PreparedDevice
from dra_driver.kubeletplugin.claims import ClaimKey


def _view(kind: str) -> str:
    return kind if kind in VM_KINDS else "containers"


def vm_or_containers(
    others: Sequence[tuple[ClaimEntry, PreparedDevice]],
    claim: ClaimKey,
    pool: str,
    device: AdvertisedDevice,
) -> None:
    """A GPU held for a virtual machine (a vfio device or vGPUs) is never prepared for
    containers, and a GPU containers hold never for a virtual machine, whatever came first
    (``device_in_use``); a vfio device is the whole GPU, so never next to a vGPU either. The
    scheduler's shared counters keep them apart; this keeps prepare safe regardless."""
    view = _view(device.kind)
    for entry, held in others:
        if held.pool != pool or held.gpu_uuid != device.parent_uuid:
            continue
        if held.device == device.name or (_view(held.kind) == view and view != VFIO):
            continue
        whose = "a virtual machine" if held.kind in VM_KINDS else "containers"
        raise ClaimError(
            f"{device.name}: its GPU {held.gpu_uuid} is in use: {held.device} is prepared for"
            f" {whose} by claim {entry.namespace}/{entry.name} ({entry.uid}); claim {claim}"
            " cannot have it until that claim is unprepared (a GPU serves virtual machines or"
            " containers, never both at once)",
            "device_in_use",
        )
