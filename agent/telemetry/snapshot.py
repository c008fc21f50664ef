"""The sampler's output: one immutable ``Snapshot`` per tick. Scrapes, the gRPC stream and
`tessera top` only ever read the latest snapshot; nothing on those paths calls NVML."""

from __future__ import annotations

from dataclasses import dataclass

from agent.nvml.samples import GpuSample


@dataclass(frozen=True)
class GpuTelemetry:
    sample: GpuSample
    name: str
    """Product name (the ``model`` label)."""
    pci_bus_id: str
    minor: int
    """The GPU's minor number (``gpu-<minor>``, ``/dev/nvidia<minor>``): the ``gpu`` label and
    `top`'s GPU column. NVML's index (``sample.index``) shifts when a GPU before it is removed;
    the minor number does not (docs/metrics.md, "GPU identity")."""
    energy_joules_total: float | None
    """Tessera's energy counter for the GPU: monotonic across driver reloads and agent restarts."""
    xid_counts: tuple[tuple[int, int], ...]
    """(XID, times seen since the agent started counting), sorted by XID."""
    healthy: bool
    mig_profiles: tuple[tuple[int, str], ...] = ()
    """(GPU instance id, profile name) of the GPU's MIG devices, for labels."""


@dataclass(frozen=True)
class PassthroughGpu:
    """A GPU of the inventory handed to virtual machines (bound to vfio-pci, or unbound): the
    host reads nothing from it, so it has no sample; only its identity, for its
    ``tessera_gpu_passthrough`` series."""

    uuid: str
    name: str
    """Product name (the ``model`` label)."""
    pci_bus_id: str
    minor: int


@dataclass(frozen=True)
class ClaimUsage:
    """What one prepared device has cost one claim so far (counters, monotonic)."""

    namespace: str
    claim: str
    uid: str
    pool: str
    device: str
    gpu_index: int
    rule: str
    """How the device's share is found: ``exclusive``, ``mig-sm-share``, ``shared`` or
    ``vgpu-framebuffer`` (see docs/metrics.md); the same for as long as the claim holds the
    device."""
    energy_joules_total: float
    gpu_seconds_total: float
    share: float | None = None
    """Fraction (0-1) of its GPU's energy and time the device got in the latest interval; None
    once released (or before its first interval)."""


@dataclass(frozen=True)
class PreparedDevice:
    pool: str
    device: str
    gpu_index: int
    namespace: str
    claim: str
    uid: str
    gpu_instance_id: int | None = None
    """The MIG device's GPU instance (its `top` row shows the claim); None for a whole GPU."""


@dataclass(frozen=True)
class Snapshot:
    node: str
    tick: int
    wall_time: float
    """Unix seconds when the tick finished."""
    monotonic: float
    interval_seconds: float
    gpus: tuple[GpuTelemetry, ...]
    claims: tuple[ClaimUsage, ...]
    prepared: tuple[PreparedDevice, ...]
    tick_duration_seconds: float
    """How long the tick's reads took."""
    lag_seconds: float
    """How late the tick started against its schedule."""
    passthrough: tuple[PassthroughGpu, ...] = ()
    """The GPUs handed to virtual machines, not read this tick (none of them is in ``gpus``)."""
