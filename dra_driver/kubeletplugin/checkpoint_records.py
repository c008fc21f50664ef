"""The records of the driver's checkpoint: a prepared claim (``ClaimEntry``), its devices
(``PreparedDevice``) and MPS daemon (``MpsRecord``), and the checkpoint of one boot that holds
them (``Checkpoint``). Immutable values; :mod:`dra_driver.kubeletplugin.checkpoint` encodes,
decodes and stores them (and re-exports them: callers import them from there)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

VFIO, VGPU = "vfio", "vgpu"
VM_KINDS = (VFIO, VGPU)
"""The kinds of device a virtual machine gets (version 4)."""


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device of a claim, as prepared on this node."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    """Device name in the pool: ``gpu-0`` or ``gpu-0-mig-1g5gb-19-0``."""
    cdi_device_ids: tuple[str, ...]
    kind: str
    """``gpu``, ``mig``, ``vfio`` (a whole GPU handed to a VM) or ``vgpu`` (version 4)."""
    gpu_uuid: str
    gpu_minor: int
    mig_uuid: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    # -- version 2: partitions made and sharing set up at prepare --------------------------------
    placement: tuple[int, int, int] | None = None
    """Dynamic MIG: (profile id, placement start, size) of the instance prepare created (so
    unprepare and rollback find it without the device model)."""
    sharing: str | None = None
    """How the device is shared: None (exclusive), ``TimeSlicing``, ``MPS`` or ``MemoryShare``."""
    interval: str | None = None
    """TimeSlicing: the interval set on the GPU."""
    share_id: str | None = None
    """The allocation's share ID (a device several claims hold), echoed to the kubelet."""
    memory_bytes: int | None = None
    """MemoryShare: the memory the claim consumed (its MPS pinned-memory limit)."""
    # -- version 3: a power limit set at prepare -------------------------------------------------
    power_limit_mw: int | None = None
    """A whole GPU's power limit the claim asked for (``powerLimit``), in milliwatts."""
    power_restore_mw: int | None = None
    """The GPU's power limit found before prepare changed it, recorded durably BEFORE the
    change: what unprepare, a rollback and the start's reconcile set back. None: not changed."""
    device_class: str = ""
    """The DeviceClass its request named (labels its usage); "" when not known, as in every
    checkpoint written before it was recorded. Written only when known; readers of any version
    ignore fields they do not know, so it needs no version of its own."""
    # -- version 4: a GPU handed to a virtual machine (kinds ``vfio`` and ``vgpu``) --------------
    pci_bus_id: str | None = None
    """vfio: the GPU's BDF; a vGPU on a virtual function: the VF's BDF; an mdev vGPU: its
    parent's BDF (recorded durably BEFORE the VF is given its type)."""
    iommu_group: int | None = None
    """The group whose ``/dev/vfio/<group>`` the VM gets (the GPU's, the VF's, the mdev's)."""
    vfio_functions: tuple[tuple[str, str], ...] = ()
    """vfio: (BDF, the driver it had, "" for none) of every function of the GPU's IOMMU group
    that prepare binds to vfio-pci, recorded durably BEFORE the first unbind: what unprepare, a
    rollback and the start's reconcile bind each back to."""
    vgpu_type_id: int | None = None
    """vgpu: NVML's vGPU type id made."""
    mdev_uuid: str | None = None
    """An mdev vGPU: the UUID it is created with, recorded durably BEFORE it is created."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_names", tuple(self.request_names))
        object.__setattr__(self, "cdi_device_ids", tuple(self.cdi_device_ids))
        object.__setattr__(
            self, "vfio_functions", tuple((str(b), str(d)) for b, d in self.vfio_functions)
        )

    @property
    def needs_v2(self) -> bool:
        return (
            any(
                v is not None
                for v in (
                    self.placement,
                    self.sharing,
                    self.interval,
                    self.share_id,
                    self.memory_bytes,
                )
            )
            or self.needs_v3
        )

    @property
    def needs_v3(self) -> bool:
        return self.power_limit_mw is not None or self.power_restore_mw is not None

    @property
    def needs_v4(self) -> bool:
        """A VM device: a build that does not know them must refuse the file, never read it and
        leave a GPU bound to vfio-pci (or a vGPU) that nothing undoes."""
        return self.kind in VM_KINDS


@dataclass(frozen=True)
class MpsRecord:
    """The MPS control daemon a claim runs (version 2)."""

    pid: int
    started_at: float
    """The process's start time: the PID alone could be another process's after a restart."""
    pipe_dir: str
    log_dir: str
    shm_dir: str
    devices: tuple[str, ...]
    """The UUIDs (GPU or MIG) it serves."""
    thread_percentage: int | None = None
    """The default active thread percentage it was given (None: MPS's own)."""
    pinned: tuple[tuple[str, int], ...] = ()
    """(device UUID, bytes): the pinned-memory limits it was given (to start it again)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "pinned", tuple((u, int(b)) for u, b in self.pinned))


@dataclass(frozen=True)
class ClaimEntry:
    """A claim's record: its identity, where prepare got to, and its devices."""

    uid: str
    namespace: str
    name: str
    state: str
    """``PREPARE_STARTED`` or ``PREPARE_COMPLETED``."""
    devices: tuple[PreparedDevice, ...]
    updated_at: float
    """Unix seconds."""
    recovered: bool = False
    """Rebuilt from a CDI spec found on disk when the checkpoint could not vouch for it (lost or
    corrupt): its devices stay held until the claim is unprepared or prepared again, but its
    namespace and name are unknown (empty) until the kubelet calls with them."""
    mps: MpsRecord | None = None
    """The claim's MPS control daemon (version 2)."""
    pods: tuple[str, ...] = ()
    """UIDs of the pods the claim is reserved for (``status.reservedFor``), to attribute their
    processes' GPU use to the claim (version 2)."""
    rebuilt_from: str | None = None
    """Set when the entry was rebuilt after a lost or corrupt checkpoint: what it was rebuilt
    from (``cdi-spec+api`` or ``cdi-spec+claim-files``); written only when set."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "pods", tuple(self.pods))

    @property
    def needs_v2(self) -> bool:
        return self.mps is not None or bool(self.pods) or any(d.needs_v2 for d in self.devices)

    @property
    def needs_v3(self) -> bool:
        return any(d.needs_v3 for d in self.devices)

    @property
    def needs_v4(self) -> bool:
        return any(d.needs_v4 for d in self.devices)


def _empty_claims() -> Mapping[str, ClaimEntry]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Checkpoint:
    """The prepared claims of one boot of this node. Immutable (and so not hashable)."""

    boot_id: str
    claims: Mapping[str, ClaimEntry] = field(default_factory=_empty_claims)
    """By claim UID; a read-only copy of what was passed in."""

    def __post_init__(self) -> None:
        claims = dict(self.claims)
        for uid, entry in claims.items():
            if uid != entry.uid:
                raise ValueError(f"claim stored under {uid!r} has uid {entry.uid!r}")
        object.__setattr__(self, "claims", MappingProxyType(claims))

    def with_claim(self, entry: ClaimEntry) -> Checkpoint:
        """A copy with ``entry`` added, or replacing the entry of the same UID."""
        return Checkpoint(self.boot_id, {**self.claims, entry.uid: entry})

    def without_claim(self, uid: str) -> Checkpoint:
        """A copy without the claim ``uid`` (an equal copy when it is not there)."""
        return Checkpoint(self.boot_id, {k: v for k, v in self.claims.items() if k != uid})

    def with_claims(self, entries: Iterable[ClaimEntry]) -> Checkpoint:
        """``with_claim`` of every entry, in one copy (a batch's claims)."""
        return Checkpoint(self.boot_id, {**self.claims, **{e.uid: e for e in entries}})

    def without_claims(self, uids: Iterable[str]) -> Checkpoint:
        """``without_claim`` of every UID, in one copy (a batch's claims)."""
        gone = set(uids)
        return Checkpoint(self.boot_id, {k: v for k, v in self.claims.items() if k not in gone})

    def holder_of(self, pool: str, device: str) -> ClaimEntry | None:
        """The claim (in any state) that holds ``device`` of ``pool``; the lowest UID if several."""
        for uid in sorted(self.claims):
            entry = self.claims[uid]
            if any(d.pool == pool and d.device == device for d in entry.devices):
                return entry
        return None
