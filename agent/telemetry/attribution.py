"""Who holds what on each GPU, and how a GPU's energy and time are split between them (pure).

The rules are documented in :mod:`agent.telemetry.energy`; this module only computes them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from agent.nvml.samples import GpuSample
from agent.telemetry.gpuinfo import GpuInfo
from agent.usage.weights import VGPU, Held

EXCLUSIVE = "exclusive"
MIG_SM_SHARE = "mig-sm-share"
SHARED = "shared"
VGPU_FRAMEBUFFER = "vgpu-framebuffer"
RULES = (EXCLUSIVE, MIG_SM_SHARE, SHARED, VGPU_FRAMEBUFFER)
LEGACY_RULES = {"process-utilization": SHARED, "even": SHARED}
"""Rules of earlier builds, which named how the latest interval was split (and so changed from
tick to tick); their state files are read with the stable rule that replaced them."""
UNSHARED = (None, "MPS")
"""``HeldDevice.sharing`` values of a device no other claim holds with it: exclusive, or MPS
(the claim's own MPS daemon: its processes share the device, other claims' do not)."""

HoldingKey = tuple[str, str, str]
"""(claim uid, pool, device)."""


class HeldDevice(Held, Protocol):
    """One device a claim holds, as telemetry needs to know it (a read-only view: the driver's
    checkpoint records satisfy it; telemetry never imports the driver): what the usage weights
    read (:class:`agent.usage.weights.Held`), and the GPU's minor number, the fallback that
    places a device whose GPU UUID was never recorded (``gpu_uuid`` empty) and only then."""

    @property
    def gpu_minor(self) -> int: ...
    @property
    def device_class(self) -> str:
        """The DeviceClass its claim's request named ("" when not known): labels its usage."""
        ...


class ClaimHolder(Protocol):
    """A claim whose prepare completed, with the devices it holds on this node."""

    @property
    def uid(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def devices(self) -> Sequence[HeldDevice]: ...
    @property
    def pods(self) -> Sequence[str]:
        """UIDs of the pods the claim is reserved for: their processes are the claim's."""
        ...


Holders = Callable[[], Sequence[ClaimHolder] | None]
"""The claims holding devices now (prepare completed); None when that cannot be known."""

ProcessPod = Callable[[int], str | None]
"""The UID of the pod running a process (by PID); None when unknown."""


def rule_for(kind: str, sharing: str | None) -> str:
    """A holding's rule, from how its device was prepared (pure). It never depends on who else
    holds the unit now, so it stays the same for the holding's whole life: ``vgpu-framebuffer``
    for a vGPU, ``shared`` for a device prepared to be shared with other claims (time-slicing,
    memory shares), else ``mig-sm-share`` for a MIG device and ``exclusive`` for a whole GPU
    (a GPU passed through to a virtual machine, kind ``vfio``, too)."""
    if kind == VGPU:
        return VGPU_FRAMEBUFFER
    if sharing not in UNSHARED:
        return SHARED
    return MIG_SM_SHARE if kind == "mig" else EXCLUSIVE


@dataclass(frozen=True)
class Holding:
    """One prepared device of one claim, placed on a GPU of this node."""

    uid: str
    namespace: str
    claim: str
    pool: str
    device: str
    kind: str
    """``gpu``, ``mig`` or ``vgpu`` (anything else, ``vfio`` too, is treated as the whole
    GPU)."""
    gpu_index: int
    gpu_uuid: str
    gpu_instance_id: int | None
    sharing: str | None = None
    pods: tuple[str, ...] = ()
    """The claim's pods (``ClaimHolder.pods``)."""
    vgpu_type_id: int | None = None
    """A ``vgpu`` device's vGPU type."""

    @property
    def key(self) -> HoldingKey:
        return (self.uid, self.pool, self.device)

    @property
    def rule(self) -> str:
        return rule_for(self.kind, self.sharing)


@dataclass(frozen=True)
class Share:
    key: HoldingKey
    share: float
    """Fraction (0-1) of the GPU's energy and elapsed time that goes to this holding."""
    rule: str
    """The holding's rule (:func:`rule_for`): the same every interval."""


def holdings(
    claims: Sequence[ClaimHolder], gpus: Sequence[GpuInfo]
) -> tuple[list[Holding], list[HoldingKey]]:
    """The holders' devices mapped to GPUs, and the keys of devices on no known GPU.

    A device's GPU is found by ``gpu_uuid`` (stable across reboots and index renumbering). A
    device whose recorded UUID no GPU has is on no known GPU, even when a GPU has its minor
    number: that is another GPU (the old one was lost or replaced, or the node's model changed),
    and its energy and time are never the claim's. Only a device with no recorded UUID is placed
    by ``gpu_minor``. Pure.
    """
    by_uuid = {g.uuid: g for g in gpus}
    by_minor = {g.minor: g for g in gpus}
    found: list[Holding] = []
    unknown: list[HoldingKey] = []
    for entry in sorted(claims, key=lambda c: c.uid):
        uid = entry.uid
        pods = tuple(entry.pods)
        for d in entry.devices:
            gpu = by_uuid.get(d.gpu_uuid) if d.gpu_uuid else by_minor.get(d.gpu_minor)
            if gpu is None:
                unknown.append((uid, d.pool, d.device))
                continue
            found.append(
                Holding(
                    uid=uid,
                    namespace=entry.namespace,
                    claim=entry.name,
                    pool=d.pool,
                    device=d.device,
                    kind=d.kind,
                    gpu_index=gpu.index,
                    gpu_uuid=gpu.uuid,
                    gpu_instance_id=d.gpu_instance_id,
                    sharing=d.sharing,
                    pods=pods,
                    vgpu_type_id=d.vgpu_type_id,
                )
            )
    return found, unknown


def _utilization_by_claim(
    members: Sequence[Holding],
    sample: GpuSample | None,
    gpu_instance_id: int | None,
    process_pod: ProcessPod | None,
) -> dict[str, float]:
    """The SM utilization of each member claim's processes on one unit: a process counts for the
    claims reserved for its pod (split evenly when the pod has several on the unit)."""
    per_claim: dict[str, float] = defaultdict(float)
    claims_of_pod: dict[str, set[str]] = defaultdict(set)
    for h in members:
        for pod in h.pods:
            claims_of_pod[pod].add(h.uid)
    if sample is None or process_pod is None or not claims_of_pod:
        return per_claim  # no pod known: no process can be matched (and none is looked up)
    for p in sample.processes:
        if p.sm_utilization is None or p.sm_utilization <= 0:
            continue
        if gpu_instance_id is not None and p.gpu_instance_id != gpu_instance_id:
            continue
        runs_in = process_pod(p.pid)
        owners = claims_of_pod.get(runs_in, set()) if runs_in is not None else set()
        for uid in owners:
            per_claim[uid] += p.sm_utilization / len(owners)
    return per_claim


def _split_unit(
    unit_share: float,
    members: Sequence[Holding],
    sample: GpuSample | None,
    gpu_instance_id: int | None,
    process_pod: ProcessPod | None,
) -> list[Share]:
    """Split one physical unit (a whole GPU or one MIG device) between the holdings on it: by
    the SM utilization of each claim's processes when any is known, else evenly."""
    if len(members) == 1:
        return [Share(members[0].key, unit_share, members[0].rule)]
    per_claim = _utilization_by_claim(members, sample, gpu_instance_id, process_pod)
    total = sum(per_claim.values())
    if total > 0:
        count = Counter(h.uid for h in members)
        return [
            Share(h.key, unit_share * per_claim[h.uid] / total / count[h.uid], h.rule)
            for h in members
        ]
    return [Share(h.key, unit_share / len(members), h.rule) for h in members]


def shares(
    gpu: GpuInfo,
    members: Sequence[Holding],
    sample: GpuSample | None,
    process_pod: ProcessPod | None = None,
) -> list[Share]:
    """Each holding's share of ``gpu`` for one interval (pure given ``process_pod``; see the
    energy module's rules).

    ``sample`` is the GPU's sample at the end of the interval (its processes drive the
    utilization split of a unit several claims hold); ``process_pod`` maps a pid to the UID of
    the pod running it, which the holders' ``pods`` map to claims. It is only called for the
    processes of a unit several claims hold. The shares never sum to more than 1.
    """
    whole = [h for h in members if h.kind not in ("mig", VGPU)]
    parts: dict[str, list[Holding]] = defaultdict(list)
    for h in members:
        if h.kind in ("mig", VGPU):
            parts[h.device].append(h)
    out: list[Share] = []
    if whole:
        out += _split_unit(1.0, whole, sample, None, process_pod)
    for device in sorted(parts):
        group = parts[device]
        gi = group[0].gpu_instance_id
        if group[0].kind == VGPU:
            # its framebuffer's fraction of the GPU's memory, as its usage weight; the host sees
            # no VM's processes, so nothing finer is known
            fraction = gpu.capacity.vgpu_fraction(group[0].vgpu_type_id) if gpu.capacity else None
            out += _split_unit(fraction or 0.0, group, None, None, None)
            continue
        sms = gpu.mig_device_multiprocessors(device, gi)
        parent = gpu.multiprocessors
        unit = sms / parent if sms is not None and parent else 0.0
        out += _split_unit(min(unit, 1.0), group, sample, gi, process_pod)
    total = sum(s.share for s in out)
    if total > 1.0:
        out = [Share(s.key, s.share / total, s.rule) for s in out]
    return out
