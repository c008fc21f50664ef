"""What preparing a claim means, decided before anything is touched (pure).

``plan_claim`` turns a claim's allocation into the devices to prepare, each with its effective
opaque config and how it is shared; ``conflicts`` is the one rule for who may hold a device at
the same time as whom. Neither does I/O: prepare calls them under its checkpoint lock, and
``tessera explain`` can too.

How a device is shared (``PlannedDevice.sharing``):

- ``None``: exclusive, the claim alone (the default);
- ``TimeSlicing`` (a whole GPU, from a GpuConfig): the claim's pods and containers take turns,
  at the config's interval; with ``--sharing time-slicing`` other claims may share the GPU too,
  when they ask for the same interval;
- ``MPS`` (a whole GPU or a MIG device, from a config): the claim's processes share it through
  the claim's own MPS control daemon, with the config's thread percentage and memory limits;
- ``MemoryShare`` (a whole GPU under ``--sharing memory-shares``): the claim gets the memory it
  consumed (the allocation's ``consumedCapacity.memory``, the request policy's default when
  absent) as its MPS daemon's pinned-memory limit, and a thread percentage proportional to its
  share unless its MPS config says otherwise; the shares of one GPU never add up to more than
  its memory.

What a claim asks must be what the node's ``--sharing`` mode offers; when it is not (the
scheduler placed a claim that the node cannot prepare: a class or selector that does not look at
the device's ``sharing`` attribute), the refusal is a ClaimError with reason
``sharing_mismatch`` that names what the claim asked, where that came from (the claim's config
or its class's) and what the node offers:

- under ``memory-shares`` a whole GPU is never time-sliced nor held exclusively by a config that
  says so (the scheduler may place other shares on it);
- under ``time-slicing`` a claim that consumed only part of a GPU's memory shares the GPU, so it
  must time-slice it; exclusive or with MPS it would be refused next to the next share (the
  scheduler places other claims on the memory left).

A power limit (``powerLimit``, ``PlannedDevice.power_limit_mw``) is for a whole GPU the claim holds
alone: refused (ParamsError naming the device, the value and the allowed range) on a shared GPU
(``--sharing memory-shares``; TimeSlicing and MPS configs are refused by ``params``), on a GPU
whose power limit NVML cannot set (no ``AdvertisedDevice.power_limits``: NOT_SUPPORTED) and
outside the GPU's range (``nvmlDeviceGetPowerManagementLimitConstraints``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dra_driver.device_model import AdvertisedDevice, DeviceModel
from dra_driver.errors import ClaimError, ParamsError
from dra_driver.kubeletplugin import params
from dra_driver.kubeletplugin.checkpoint import Checkpoint, ClaimEntry, PreparedDevice
from dra_driver.kubeletplugin.claims import Allocation, ClaimKey, OpaqueConfig, shown
from dra_driver.kubeletplugin.vm_conflicts import vm_or_containers

TIME_SLICING, MPS, MEMORY_SHARE = "TimeSlicing", "MPS", "MemoryShare"


@dataclass(frozen=True)
class SharingPolicy:
    """The node's sharing settings (from ``--sharing``, ``--mig-mode``)."""

    mode: str = "none"
    """``none``, ``time-slicing`` or ``memory-shares``."""
    dynamic_mig: bool = False
    memory_share_min: int = 1024**3


@dataclass(frozen=True)
class PlannedDevice:
    device: AdvertisedDevice
    request_names: tuple[str, ...]
    config: params.DeviceConfig | None
    sharing: str | None = None
    """None (exclusive), TimeSlicing, MPS or MemoryShare (see the module docstring)."""
    interval: str | None = None
    """TimeSlicing: Default, Short, Medium or Long."""
    share_id: str | None = None
    memory_bytes: int | None = None
    """MemoryShare: the memory the claim consumed."""
    thread_percentage: int | None = None
    """MPS and MemoryShare: the daemon's default active thread percentage (None: MPS's own)."""
    pinned_memory_bytes: int | None = None
    """MPS and MemoryShare: the pinned-memory limit of this device (None: none)."""
    power_limit_mw: int | None = None
    """A whole GPU held alone: the power limit to set while the claim holds it (None: none)."""
    device_class: str = ""
    """The DeviceClass of its (first) request ("" when not known): labels its usage."""

    @property
    def dynamic(self) -> bool:
        """A dynamic MIG placement: prepare creates the MIG device."""
        return self.device.kind == "mig" and self.device.gpu_instance_id is None

    @property
    def uses_mps(self) -> bool:
        return self.sharing in (MPS, MEMORY_SHARE)


@dataclass(frozen=True)
class ClaimPlan:
    devices: tuple[PlannedDevice, ...]
    pods: tuple[str, ...] = ()
    mps_thread_percentage: int | None = field(default=None)
    """The claim's MPS daemon's default thread percentage (the largest its devices ask)."""

    @property
    def uses_mps(self) -> bool:
        return any(p.uses_mps for p in self.devices)


def _memory(device: AdvertisedDevice) -> int:
    return int(dict(device.capacity).get("memory", "0"))


OFFERS = {
    "time-slicing": "shares a whole GPU between claims only when each of them time-slices it at"
    " one interval",
    "memory-shares": "shares every whole GPU by memory, each claim through an MPS daemon of its"
    " own, and never time-slices one",
}
"""What each sharing ``--sharing`` mode offers a claim for a whole GPU, in a refusal's words
(``none`` refuses nothing by mode: a GPU is one claim's, shared by its pods as it asks)."""


@dataclass(frozen=True)
class Asked:
    """Where a device's effective config came from, for a refusal to name it."""

    claim: ClaimKey
    source: str | None
    """``FromClass``, ``FromClaim`` or None (no config)."""
    device_class: str

    def origin(self) -> str:
        if self.source == "FromClass":
            return f"the config of its class {self.device_class}".rstrip()
        return "its own config" if self.source is not None else "no config"


def _mismatch(asked: Asked, device: AdvertisedDevice, what: str, mode: str, fix: str) -> ClaimError:
    """The refusal of a claim that asks what the node's sharing mode does not offer."""
    return ClaimError(
        f"claim {asked.claim}: {device.name}: the claim asks {what} ({asked.origin()}), but this"
        f" node runs --sharing {mode}, which {OFFERS[mode]}; {fix}",
        "sharing_mismatch",
    )


def _sharing(
    asked: Asked,
    device: AdvertisedDevice,
    config: params.DeviceConfig | None,
    policy: SharingPolicy,
    consumed: int | None,
    share_id: str | None,
) -> PlannedDevice:
    """How ``device`` is shared for this claim (raises ClaimError ``sharing_mismatch`` for what
    the node's sharing does not offer)."""
    claim = asked.claim
    sharing = config.sharing if config is not None else params.Exclusive()
    base = PlannedDevice(device, (), config, share_id=share_id)
    if policy.mode == "memory-shares" and device.kind == "gpu":
        if isinstance(sharing, params.TimeSlicing):
            raise _mismatch(
                asked,
                device,
                "to time-slice it with strategy TimeSlicing",
                policy.mode,
                "use MPS or leave sharing unset, or run the claim where --sharing is none or"
                " time-slicing (class shared-gpu.tessera.dev selects only those GPUs)",
            )
        if config is not None and isinstance(sharing, params.Exclusive):
            raise _mismatch(
                asked,
                device,
                "to hold it alone with strategy Exclusive",
                policy.mode,
                "request the GPU's whole memory as capacity for a GPU of one's own, use MPS or"
                " leave sharing unset",
            )
        total = _memory(device)
        memory = consumed if consumed is not None else policy.memory_share_min
        if not 0 < memory <= total:
            source = (
                "consumedCapacity 'memory' (its allocation results together)"
                if consumed is not None
                else "--memory-share-min"
            )
            raise ClaimError(
                f"claim {claim}: {device.name}: a memory share of {memory} bytes from {source}"
                f" does not fit its {total} bytes",
                "invalid_claim",
            )
        mps = sharing if isinstance(sharing, params.Mps) else params.Mps()
        percentage = mps.active_thread_percentage or max(1, math.ceil(100 * memory / total))
        pinned = mps.pinned_memory_limit_for(device.name, device.uuid)
        return PlannedDevice(
            device,
            (),
            config,
            sharing=MEMORY_SHARE,
            share_id=share_id,
            memory_bytes=memory,
            thread_percentage=min(100, percentage),
            pinned_memory_bytes=min(memory, pinned) if pinned else memory,
        )
    if (
        policy.mode == "time-slicing"
        and device.kind == "gpu"
        and consumed is not None
        and consumed < _memory(device)
        and not isinstance(sharing, params.TimeSlicing)
    ):
        how = "with MPS" if isinstance(sharing, params.Mps) else "without time-slicing it"
        raise _mismatch(
            asked,
            device,
            f"a share of {consumed} of its {_memory(device)} bytes of memory (consumedCapacity"
            f" 'memory', its allocation results together) {how}",
            policy.mode,
            "time-slice it (class time-sliced.gpu.tessera.dev), request no memory for a GPU of"
            " one's own, or run memory shares where --sharing is memory-shares",
        )
    if isinstance(sharing, params.TimeSlicing):
        return PlannedDevice(
            device, (), config, sharing=TIME_SLICING, interval=sharing.interval, share_id=share_id
        )
    if isinstance(sharing, params.Mps):
        return PlannedDevice(
            device,
            (),
            config,
            sharing=MPS,
            share_id=share_id,
            thread_percentage=sharing.active_thread_percentage,
            pinned_memory_bytes=sharing.pinned_memory_limit_for(device.name, device.uuid),
        )
    return base


def _power_limit(p: PlannedDevice, policy: SharingPolicy) -> int | None:
    """The power limit ``p``'s config asks for, checked against the device (see the module
    docstring); raises ParamsError."""
    asked = p.config.power_limit_mw if p.config is not None else None
    if asked is None:
        return None
    device, value = p.device, params.watts(asked)
    if device.kind != "gpu":  # params refuses it on a MigDeviceConfig; kept as a guard
        raise ParamsError(f"{device.name}: powerLimit {value}: {params.NO_POWER_LIMIT_ON_MIG}")
    if p.sharing is not None:
        how = (
            "whole GPUs are shared by memory under --sharing memory-shares"
            if p.sharing == MEMORY_SHARE
            else f"it is shared ({p.sharing})"
        )
        raise ParamsError(
            f"{device.name}: powerLimit {value} needs the GPU held by this claim alone, and {how};"
            " a power limit caps the whole GPU, so it would throttle the other claims on it"
        )
    limits = device.power_limits
    if limits is None:
        raise ParamsError(
            f"{device.name}: powerLimit {value}: this GPU's power limit cannot be set (NVML"
            " answers NOT_SUPPORTED for its power-limit range); leave powerLimit unset or select"
            " GPUs that advertise powerLimitMaxWatts"
        )
    if not limits.min_mw <= asked <= limits.max_mw:
        raise ParamsError(
            f"{device.name}: powerLimit {value} is outside the GPU's range; allowed:"
            f" {params.watts(limits.min_mw)} to {params.watts(limits.max_mw)} (its default:"
            f" {params.watts(limits.default_mw)})"
        )
    return asked


def _check_limit_keys(planned: Sequence[PlannedDevice]) -> None:
    """Per-device memory limits must name devices of the claim (by name or UUID)."""
    names = {p.device.name for p in planned} | {p.device.uuid for p in planned if p.device.uuid}
    for p in planned:
        if isinstance(p.config, params.DeviceConfig) and isinstance(p.config.sharing, params.Mps):
            for key, _ in p.config.sharing.per_device_pinned_memory_limit_bytes:
                if key not in names:
                    raise ParamsError(
                        f"sharing.mps.perDevicePinnedMemoryLimit: {shown(key)} is not a device of"
                        f" this claim; its devices: {', '.join(sorted(n for n in names if n))}"
                    )


def _effective_config(
    requests: Sequence[str],
    configs: Sequence[tuple[OpaqueConfig, params.DeviceConfig]],
    kind: str,
) -> tuple[OpaqueConfig, params.DeviceConfig] | None:
    """The config of a device allocated for ``requests`` (in order): of the configs for its kind
    that apply to a request (``configs_for``), later entries win, and the device's later
    requests over its earlier ones. In one pass over the configs and one over the requests, so
    a claim with thousands of both costs milliseconds, not minutes."""
    everyone = -1  # the last config of this kind naming no request (it applies to all)
    named: dict[str, int] = {}  # request name -> the last config of this kind naming it
    for index, (c, cfg) in enumerate(configs):
        if not cfg.applies_to(kind):
            continue
        if not c.requests:
            everyone = index
        for r in c.requests:
            named[r] = index
    for r in reversed(requests):
        best = max(everyone, named.get(r, -1), named.get(r.split("/", 1)[0], -1))
        if best >= 0:
            return configs[best]
    return None


def plan_claim(
    allocation: Allocation, model: DeviceModel, policy: SharingPolicy = SharingPolicy()
) -> ClaimPlan:
    """Our devices of the allocation, each with its request names, effective config and how it
    is shared. Pure.

    Raises ClaimError for devices this node does not advertise and for what the node's sharing
    does not offer (``sharing_mismatch``), ParamsError for configs that do not parse or
    validate."""
    requests: dict[str, dict[str, None]] = {}  # device -> its request names, in order
    consumed: dict[str, int] = {}
    share_ids: dict[str, str] = {}
    classes: dict[str, str] = {}
    for d in allocation.devices:
        requests.setdefault(d.device, {})[d.request] = None
        if d.device_class:
            classes.setdefault(d.device, d.device_class)
        if d.consumed_memory is not None:
            consumed[d.device] = consumed.get(d.device, 0) + d.consumed_memory
        if d.share_id is not None:
            share_ids[d.device] = d.share_id
    # every config of ours must be valid; each is validated once (a claim may list many)
    configs = [
        (c, params.validate(c.parameters, f"config[{i}].opaque.parameters"))
        for i, c in enumerate(allocation.configs)
    ]
    advertised: dict[str, AdvertisedDevice] = {}
    for ad in model.devices:
        advertised.setdefault(ad.name, ad)
    planned = []
    for name, reqs in requests.items():
        dev = advertised.get(name)
        if dev is None:
            raise ClaimError(
                f"claim {allocation.claim}: device {shown(name)} is not advertised by this node",
                "unknown_device",
            )
        effective = _effective_config(tuple(reqs), configs, dev.kind)
        config = effective[1] if effective is not None else None
        source = effective[0].source if effective is not None else None
        asked = Asked(allocation.claim, source, classes.get(name, ""))
        p = _sharing(asked, dev, config, policy, consumed.get(name), share_ids.get(name))
        power = _power_limit(p, policy)
        planned.append(
            dataclasses.replace(
                p,
                request_names=tuple(reqs),
                power_limit_mw=power,
                device_class=asked.device_class,
            )
        )
    _check_limit_keys(planned)
    percentages = [p.thread_percentage for p in planned if p.thread_percentage is not None]
    return ClaimPlan(
        devices=tuple(planned),
        pods=allocation.pods,
        mps_thread_percentage=max(percentages) if percentages else None,
    )


def _holders(cp: Checkpoint, claim: ClaimKey) -> list[tuple[ClaimEntry, PreparedDevice]]:
    return [
        (entry, d) for entry in cp.claims.values() if entry.uid != claim.uid for d in entry.devices
    ]


def conflicts(
    cp: Checkpoint,
    claim: ClaimKey,
    pool: str,
    planned: Sequence[PlannedDevice],
    policy: SharingPolicy,
) -> None:
    """The one rule for who may hold a device at the same time as whom (ClaimError naming the
    other claim and what differs):

    - a device held by another claim is refused, except under ``--sharing time-slicing`` when
      every holder time-slices it at the same interval as this claim, and under
      ``--sharing memory-shares`` when every holder has a memory share of it and the shares,
      this one included, fit the GPU's memory;
    - a whole GPU and a MIG device of the same GPU are never held by two claims at once, nor two
      dynamic MIG placements whose slices overlap (the scheduler's counters keep them apart;
      this keeps prepare safe regardless);
    - a GPU serves virtual machines or containers, never both (``device_in_use``).
    """
    others = _holders(cp, claim)
    for p in planned:
        same = [(e, d) for e, d in others if d.pool == pool and d.device == p.device.name]
        for entry, held in same:
            who = f"claim {entry.namespace}/{entry.name} ({entry.uid})"
            if policy.mode == "time-slicing" and p.sharing == TIME_SLICING:
                if held.sharing == TIME_SLICING and held.interval == p.interval:
                    continue
                if held.sharing != TIME_SLICING:
                    how = "with MPS" if held.sharing == MPS else "exclusively"
                    raise ClaimError(
                        f"device {p.device.name} is held {how} by {who}; claim {claim} asks to"
                        " time-slice it: only time-sliced claims share a GPU",
                        "device_busy",
                    )
                raise ClaimError(
                    f"device {p.device.name} is time-sliced by {who} at interval"
                    f" {held.interval}; claim {claim} asks {p.interval}: sharers must agree",
                    "device_busy",
                )
            if policy.mode == "memory-shares" and p.sharing == MEMORY_SHARE:
                if held.sharing == MEMORY_SHARE:
                    continue
                raise ClaimError(
                    f"device {p.device.name} is held by {who} without a memory share; claim"
                    f" {claim} cannot share it",
                    "device_busy",
                )
            raise ClaimError(
                f"device {p.device.name} is already prepared for {who}; claim {claim} cannot"
                " have it too",
                "device_busy",
            )
        if p.sharing == MEMORY_SHARE and p.memory_bytes is not None:
            total = _memory(p.device)
            used = sum(d.memory_bytes or 0 for _, d in same)
            if used + p.memory_bytes > total:
                raise ClaimError(
                    f"device {p.device.name}: memory shares would total {used + p.memory_bytes}"
                    f" bytes, more than its {total} (held: {used} by {len(same)} claim(s));"
                    f" claim {claim} asks {p.memory_bytes}",
                    "device_busy",
                )
        _overlap(others, claim, pool, p)
        vm_or_containers(others, claim, pool, p.device)
        mixed = [
            (e, d)
            for e, d in others
            if d.pool == pool
            and d.gpu_uuid == p.device.parent_uuid
            and d.device != p.device.name
            and (d.kind == "gpu") != (p.device.kind == "gpu")
        ]
        if mixed:
            entry, held = mixed[0]
            raise ClaimError(
                f"{p.device.name} and {held.device} are on the same GPU, and {held.device} is"
                f" prepared for claim {entry.namespace}/{entry.name} ({entry.uid}): a whole GPU"
                " and its MIG devices are never held at once",
                "device_busy",
            )


def _overlap(
    others: Sequence[tuple[ClaimEntry, PreparedDevice]],
    claim: ClaimKey,
    pool: str,
    p: PlannedDevice,
) -> None:
    """A dynamic MIG placement whose memory slices overlap one another claim holds on the same
    GPU is refused (the scheduler's counters keep them apart; NVML would refuse to create it)."""
    start, size = p.device.mig_placement_start, p.device.mig_placement_size
    if not p.dynamic or start is None or size is None:
        return
    for entry, held in others:
        if held.pool != pool or held.gpu_uuid != p.device.parent_uuid or held.placement is None:
            continue
        _, held_start, held_size = held.placement
        if start < held_start + held_size and held_start < start + size:
            raise ClaimError(
                f"{p.device.name} (slices {start}-{start + size - 1}) overlaps {held.device}"
                f" (slices {held_start}-{held_start + held_size - 1}), prepared for claim"
                f" {entry.namespace}/{entry.name} ({entry.uid}); claim {claim} cannot have it",
                "device_busy",
            )


def limits(planned: Sequence[PlannedDevice], uuids: Mapping[str, str]) -> dict[str, int]:
    """Pinned-memory limits by device UUID for the claim's MPS daemon: ``uuids`` maps each
    device name to its UUID (a dynamic MIG device's is known once created)."""
    return {
        uuids[p.device.name]: p.pinned_memory_bytes
        for p in planned
        if p.uses_mps and p.pinned_memory_bytes is not None and p.device.name in uuids
    }
