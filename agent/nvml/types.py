"""Plain frozen values returned by the NVML facade. Nothing here touches pynvml."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Placement:
    """A MIG GPU-instance placement: memory slots ``[start, start + size)``."""

    start: int
    size: int

    def slots(self) -> range:
        return range(self.start, self.start + self.size)

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of a MIG-capable GPU, as NVML reports it."""

    profile_id: int
    """GPU-instance profile id used by the create calls (e.g. 19 for 1g)."""
    enum: int
    """The NVML_GPU_INSTANCE_PROFILE_* value passed to nvmlDeviceGetGpuInstanceProfileInfo."""
    name: str
    """Profile name, e.g. ``1g.10gb`` or ``1g.10gb+me``."""
    slice_count: int
    """Compute slices (the ``g``)."""
    memory_bytes: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    max_instances: int
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class MigInstance:
    """An existing MIG device: a GPU instance with one compute instance."""

    gpu_instance_id: int
    compute_instance_id: int
    profile_id: int
    profile_name: str
    placement: Placement
    uuid: str
    memory_bytes: int
    multiprocessors: int


@dataclass(frozen=True)
class MigMode:
    current: bool
    pending: bool


@dataclass(frozen=True)
class MemoryInfo:
    """Device memory in bytes; ``reserved`` is absent where NVML has no v2 memory info."""

    total: int
    free: int
    used: int
    reserved: int | None = None


@dataclass(frozen=True)
class NvLink:
    """One NVLink of a GPU."""

    link: int
    active: bool
    remote_pci_bus_id: str | None
    """Remote end in sysfs form (``0000:1b:00.0``); absent when the link is down."""
    remote_device_type: str
    """``gpu``, ``switch``, ``ibmnpu`` or ``unknown``."""


@dataclass(frozen=True)
class PowerLimits:
    """A GPU's power-limit range and default, in milliwatts, as NVML reports them
    (``nvmlDeviceGetPowerManagementLimitConstraints``, ``...DefaultLimit``)."""

    min_mw: int
    max_mw: int
    default_mw: int


@dataclass(frozen=True)
class GpuDevice:
    """Everything discovery needs to know about one GPU, read through NVML."""

    index: int
    minor: int
    uuid: str
    name: str
    brand: str
    architecture: str
    """Name as the reference driver publishes it: ``Ampere``, ``Hopper``, ``Ada Lovelace``."""
    compute_capability: tuple[int, int]
    pci_bus_id: str
    """sysfs form, lower case: ``0000:1b:00.0``."""
    pci_device_id: int
    """Combined device/vendor id as NVML reports it, e.g. ``0x233010DE``."""
    serial: str | None
    memory: MemoryInfo
    mig_mode: MigMode | None
    """None when the GPU is not MIG-capable."""
    mig_profiles: tuple[MigProfile, ...] = ()
    mig_instances: tuple[MigInstance, ...] = ()
    nvlinks: tuple[NvLink, ...] = field(default=())
    power_limits: PowerLimits | None = None
    """None when the GPU cannot have its power limit set (NVML answers NOT_SUPPORTED)."""

    @property
    def mig_capable(self) -> bool:
        return self.mig_mode is not None

    @property
    def mig_enabled(self) -> bool:
        return self.mig_mode is not None and self.mig_mode.current


@dataclass(frozen=True)
class SystemInfo:
    driver_version: str
    """e.g. ``550.90.07``."""
    cuda_driver_version: str
    """e.g. ``12.4`` (from nvmlSystemGetCudaDriverVersion_v2's 12040)."""
    nvml_version: str | None = None
