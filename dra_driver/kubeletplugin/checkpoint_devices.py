"""A prepared device in the checkpoint file: its JSON object (every version's fields; those of a
later version written only when set) and back. Pure; :mod:`dra_driver.kubeletplugin.checkpoint`
describes the format and its versions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.decode import fields
from dra_driver.kubeletplugin.checkpoint_records import VM_KINDS, PreparedDevice

DEVICE_KINDS = ("gpu", "mig", *VM_KINDS)


def device_json(d: PreparedDevice) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requestNames": list(d.request_names),
        "pool": d.pool,
        "device": d.device,
        "cdiDeviceIDs": list(d.cdi_device_ids),
        "kind": d.kind,
        "gpuUUID": d.gpu_uuid,
        "gpuMinor": d.gpu_minor,
        "migUUID": d.mig_uuid,
        "gpuInstanceID": d.gpu_instance_id,
        "computeInstanceID": d.compute_instance_id,
    }
    v2 = {
        "placement": list(d.placement) if d.placement is not None else None,
        "sharing": d.sharing,
        "interval": d.interval,
        "shareID": d.share_id,
        "memoryBytes": d.memory_bytes,
        "powerLimitMilliwatts": d.power_limit_mw,
        "powerRestoreMilliwatts": d.power_restore_mw,
        "deviceClass": d.device_class or None,
        "pciBusID": d.pci_bus_id,
        "iommuGroup": d.iommu_group,
        "vfioFunctions": [list(f) for f in d.vfio_functions] or None,
        "vgpuTypeID": d.vgpu_type_id,
        "mdevUUID": d.mdev_uuid,
    }
    out.update({k: v for k, v in v2.items() if v is not None})
    return out


def device_from(obj: Mapping[str, Any], where: str) -> PreparedDevice:
    g = obj.get
    return PreparedDevice(
        request_names=fields.texts(g("requestNames"), f"{where}.requestNames", required=True),
        pool=fields.text(g("pool"), f"{where}.pool"),
        device=fields.text(g("device"), f"{where}.device"),
        cdi_device_ids=fields.texts(g("cdiDeviceIDs"), f"{where}.cdiDeviceIDs", required=True),
        kind=fields.one_of(g("kind"), f"{where}.kind", DEVICE_KINDS),
        gpu_uuid=fields.text(g("gpuUUID"), f"{where}.gpuUUID"),
        gpu_minor=fields.integer(g("gpuMinor"), f"{where}.gpuMinor"),
        mig_uuid=fields.opt_text(g("migUUID"), f"{where}.migUUID"),
        gpu_instance_id=fields.opt_integer(g("gpuInstanceID"), f"{where}.gpuInstanceID"),
        compute_instance_id=fields.opt_integer(
            g("computeInstanceID"), f"{where}.computeInstanceID"
        ),
        placement=_placement(g("placement"), f"{where}.placement"),
        sharing=fields.opt_text(g("sharing"), f"{where}.sharing"),
        interval=fields.opt_text(g("interval"), f"{where}.interval"),
        share_id=fields.opt_text(g("shareID"), f"{where}.shareID"),
        memory_bytes=fields.opt_integer(g("memoryBytes"), f"{where}.memoryBytes"),
        power_limit_mw=fields.opt_integer(
            g("powerLimitMilliwatts"), f"{where}.powerLimitMilliwatts"
        ),
        power_restore_mw=fields.opt_integer(
            g("powerRestoreMilliwatts"), f"{where}.powerRestoreMilliwatts"
        ),
        device_class=fields.opt_text(g("deviceClass"), f"{where}.deviceClass") or "",
        pci_bus_id=fields.opt_text(g("pciBusID"), f"{where}.pciBusID"),
        iommu_group=fields.opt_integer(g("iommuGroup"), f"{where}.iommuGroup"),
        vfio_functions=_functions(g("vfioFunctions"), f"{where}.vfioFunctions"),
        vgpu_type_id=fields.opt_integer(g("vgpuTypeID"), f"{where}.vgpuTypeID"),
        mdev_uuid=fields.opt_text(g("mdevUUID"), f"{where}.mdevUUID"),
    )


def _functions(v: Any, where: str) -> tuple[tuple[str, str], ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(
        isinstance(f, list) and len(f) == 2 and all(isinstance(x, str) for x in f) for f in v
    ):
        raise fields.FieldError(where, f"expected [[BDF, driver], ...], got {fields.got(v)}")
    return tuple((f[0], f[1]) for f in v)


def _placement(v: Any, where: str) -> tuple[int, int, int] | None:
    if v is None:
        return None
    if (
        not isinstance(v, list)
        or len(v) != 3
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    ):
        raise fields.FieldError(where, f"expected [profile id, start, size], got {fields.got(v)}")
    return (v[0], v[1], v[2])
