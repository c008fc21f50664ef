"""What the sampler and the energy accounting need to know about each GPU, besides its samples.

``GpuInfo`` is a frozen value built once per inventory (``gpu_info(device, virtualization)``):
identity for labels and for mapping checkpoint entries to GPUs, the SM counts that split a MIG
GPU's energy, and whether the host can read the GPU at all (``passthrough``).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.nvml.types import GpuDevice
from agent.pcihost.vm_types import NVIDIA, GpuVirtualization
from agent.usage.weights import GpuCapacity, capacity_of, mig_profile_id


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    """Product name (the ``model`` label)."""
    pci_bus_id: str
    minor: int
    mig_profiles: tuple[tuple[int, str], ...] = ()
    """(GPU instance id, profile name) of the GPU's existing MIG devices, for labels."""
    multiprocessors: int | None = None
    """SMs of the whole GPU as MIG divides it: the largest MIG profile's SMs (``7g``: 98 on an
    A100, 132 on an H100). None on a GPU without MIG (no MIG share is ever computed there)."""
    profile_multiprocessors: tuple[tuple[int, int], ...] = ()
    """(MIG profile id, SMs) for every profile the GPU offers. A MIG device's name carries its
    profile id (``gpu-0-mig-1g10gb-19-0``), so devices created after this value was built
    (dynamic MIG) are still known."""
    mig_multiprocessors: tuple[tuple[int, int], ...] = ()
    """(GPU instance id, SMs) of the existing MIG devices: the fallback when a device name does
    not carry a profile id."""
    capacity: GpuCapacity | None = None
    """What the GPU divides into (memory, MIG slices, vGPU framebuffers): the usage weights of
    its devices."""
    passthrough: bool = False
    """The GPU is handed to virtual machines: bound to another driver than nvidia (``vfio-pci``)
    or to none, so NVML does not see it (its ``index`` is -1) and the host reads nothing from
    it. The sampler does not read it; its claims' GPU-seconds still accrue."""

    def mig_device_multiprocessors(self, device: str, gpu_instance_id: int | None) -> int | None:
        """SMs of the MIG device named ``device`` (profile id from the name, else the GPU
        instance), None when neither is known."""
        profile = mig_profile_id(device)
        if profile is not None:
            by_profile = dict(self.profile_multiprocessors)
            if profile in by_profile:
                return by_profile[profile]
        if gpu_instance_id is not None:
            return dict(self.mig_multiprocessors).get(gpu_instance_id)
        return None


def gpu_info(device: GpuDevice, virtualization: GpuVirtualization | None = None) -> GpuInfo:
    """The ``GpuInfo`` of a GPU as discovery read it, with what it offers virtual machines
    (``Gpu.virtualization``; None where discovery was not asked) (pure). A GPU NVML no longer
    sees (index -1: discovery kept it from its last facts) is passed through whatever else is
    known."""
    instances = sorted(device.mig_instances, key=lambda i: i.gpu_instance_id)
    sms = [p.multiprocessors for p in device.mig_profiles]
    return GpuInfo(
        index=device.index,
        uuid=device.uuid,
        name=device.name,
        pci_bus_id=device.pci_bus_id,
        minor=device.minor,
        mig_profiles=tuple((i.gpu_instance_id, i.profile_name) for i in instances),
        multiprocessors=max(sms) if sms else None,
        profile_multiprocessors=tuple(
            sorted((p.profile_id, p.multiprocessors) for p in device.mig_profiles)
        ),
        mig_multiprocessors=tuple((i.gpu_instance_id, i.multiprocessors) for i in instances),
        capacity=capacity_of(device, virtualization),
        passthrough=device.index < 0
        or (virtualization is not None and virtualization.driver != NVIDIA),
    )
