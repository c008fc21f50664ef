"""Which prepared devices get KEP-5304 metadata, with which attributes, and where their CDI
device ids go.

Devices of kind ``vfio`` and ``vgpu`` (a GPU or vGPU handed to a virtual machine): KubeVirt's
virt-launcher finds the device it gives the VM only there (``pkg/dra/utils.go``
``GetMDevUUIDForClaim``, then ``GetPCIAddressForClaim``). Container devices get none: no
consumer reads it, and each file is one more bind mount in every container of the request.
The attributes are the device's ResourceSlice attributes (as NVIDIA's driver copies them for
its VFIO devices, ``cmd/gpu-kubelet-plugin/device_state.go``) with what only prepare knows on
top: ``mdevUUID`` for a mediated vGPU, else ``resource.kubernetes.io/pciBusID`` = the function
the VM gets (the GPU's for passthrough, the VF's for an SR-IOV vGPU), as strings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from dra_driver.device_model import AdvertisedDevice
from dra_driver.kubeletplugin.checkpoint import PreparedDevice
from dra_driver.kubeletplugin.claims import ClaimKey
from dra_driver.kubeletplugin.device_metadata.documents import (
    MDEV_UUID,
    PCI_BUS_ID,
    POD_CLAIM_NAME_ANNOTATION,
    MetadataDevice,
    base_request,
)
from dra_driver.kubeletplugin.device_metadata.writer import DeviceMetadataWriter

VM_KINDS = frozenset({"vfio", "vgpu"})


def pod_claim_name(claim: Mapping[str, object]) -> str | None:
    """The claim's ``resource.kubernetes.io/pod-claim-name`` annotation (claims made from a
    pod's ResourceClaimTemplate); None when it has none."""
    meta = claim.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    value = annotations.get(POD_CLAIM_NAME_ANNOTATION) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) else None


def metadata_device(record: PreparedDevice, advertised: AdvertisedDevice | None) -> MetadataDevice:
    """``record`` as its metadata file describes it."""
    attributes: dict[str, Mapping[str, object]] = dict(advertised.attributes if advertised else ())
    if record.mdev_uuid:
        attributes[MDEV_UUID] = {"string": record.mdev_uuid}
    elif record.pci_bus_id:
        attributes[PCI_BUS_ID] = {"string": record.pci_bus_id}
    return MetadataDevice(pool=record.pool, name=record.device, attributes=attributes)


def metadata_requests(
    records: Sequence[PreparedDevice], advertised: Callable[[str], AdvertisedDevice | None]
) -> dict[str, list[MetadataDevice]]:
    """Request (as allocated) -> its VM devices, in the records' order."""
    out: dict[str, list[MetadataDevice]] = {}
    for r in records:
        if r.kind not in VM_KINDS:
            continue
        for request in r.request_names:
            out.setdefault(request, []).append(metadata_device(r, advertised(r.device)))
    return out


def with_device_ids(
    records: Sequence[PreparedDevice], ids: Mapping[str, str]
) -> tuple[PreparedDevice, ...]:
    """``records`` with each base request's metadata CDI device id (``ids``) added to the
    first device of that request, as the helper injects it (``draplugin.go``
    ``NodePrepareResources``): the runtime mounts the file once per container."""
    done: set[str] = set()
    out = []
    for r in records:
        extra = []
        for request in r.request_names:
            base = base_request(request)
            device_id = ids.get(base)
            if device_id is not None and base not in done:
                done.add(base)
                if device_id not in r.cdi_device_ids and device_id not in extra:
                    extra.append(device_id)
        out.append(r if not extra else replace(r, cdi_device_ids=(*r.cdi_device_ids, *extra)))
    return tuple(out)


def prepare_metadata(
    writer: DeviceMetadataWriter,
    claim: ClaimKey,
    claim_pod_name: str | None,
    records: Sequence[PreparedDevice],
    advertised: Callable[[str], AdvertisedDevice | None],
) -> tuple[PreparedDevice, ...]:
    """Write the metadata of ``records``' VM devices (nothing when there is none) and return the
    records with its CDI device ids. Raises CdiError."""
    requests = metadata_requests(records, advertised)
    if not requests:
        return tuple(records)
    ids = writer.write(claim, claim_pod_name, requests)
    bases = list(dict.fromkeys(base_request(r) for r in requests))
    return with_device_ids(records, dict(zip(bases, ids, strict=True)))
