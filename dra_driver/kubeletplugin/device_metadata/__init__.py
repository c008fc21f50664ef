"""KEP-5304 DRA device metadata: the file a VM's launcher reads to find its GPU.

Kubernetes' Go kubelet-plugin helper writes it for Go drivers (``EnableDeviceMetadata``); this
package writes the same bytes (``documents``, ``gojson``) and files (``writer``) for the devices
that need it (``selection``). docs/virtualization.md, "What the VM's launcher reads: device
metadata"; docs/gpu-facts.md, "KEP-5304, DRA device metadata".
"""

from dra_driver.kubeletplugin.device_metadata.documents import MetadataDevice
from dra_driver.kubeletplugin.device_metadata.selection import (
    VM_KINDS,
    pod_claim_name,
    prepare_metadata,
)
from dra_driver.kubeletplugin.device_metadata.writer import DeviceMetadataWriter

__all__ = [
    "VM_KINDS",
    "DeviceMetadataWriter",
    "MetadataDevice",
    "pod_claim_name",
    "prepare_metadata",
]
