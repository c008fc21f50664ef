"""What handing a GPU to a virtual machine asks of NVML: find a GPU by its PCI bus id (NVML
indexes shift as GPUs leave the nvidia driver and come back), and turn its persistence mode off
before it is unbound (``nvmlDeviceSetPersistenceMode``, as NVIDIA's passthrough guides do with
``nvidia-smi -pm 0``: a GPU in persistence mode is held open by the driver).

Every call goes through ``Nvml.api(device)``, so failures are ``agent.nvml.errors`` naming the
call and the GPU.
"""

from __future__ import annotations

from agent.nvml.errors import NvmlNotSupported
from agent.nvml.facade import Nvml, sysfs_bus_id

FEATURE_DISABLED = 0
"""pynvml's NVML_FEATURE_DISABLED."""


def index_of(nvml: Nvml, bus_id: str) -> int | None:
    """The NVML index of the GPU at sysfs BDF ``bus_id`` (``0000:1b:00.0``), None when NVML
    does not list it (bound to another driver, or not yet back after a rebind)."""
    for index in range(nvml.device_count()):
        pci = nvml.api(str(index)).nvmlDeviceGetPciInfo(nvml.handle(index))
        if sysfs_bus_id(pci.busId) == bus_id:
            return index
    return None


def persistence_off(nvml: Nvml, bus_id: str) -> bool:
    """Turn persistence mode off on the GPU at ``bus_id``; False where it is not listed or the
    driver does not support the setting (nothing to turn off)."""
    index = index_of(nvml, bus_id)
    if index is None:
        return False
    try:
        nvml.api(str(index)).nvmlDeviceSetPersistenceMode(nvml.handle(index), FEATURE_DISABLED)
    except NvmlNotSupported:
        return False
    return True
