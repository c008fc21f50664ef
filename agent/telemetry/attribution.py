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

EXCLUSIVE = "exclusive"
MIG_SM_SHARE = "mig-sm-share"
PROCESS_UTILIZATION = "process-utilization"
EVEN = "even"
RULES = (EXCLUSIVE, MIG_SM_SHARE, PROCESS_UTILIZATION, EVEN)

HoldingKey = tuple[str, str, str]
"""(claim uid, pool, device)."""


class HeldDevice(Protocol):
    """One device a claim holds, as telemetry needs to know it (a read-only view: the driver's
    checkpoint records satisfy it; telemetry never imports the driver)."""

    @property
    def pool(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def kind(self) -> str:
        """``gpu`` or ``mig``."""
        ...

    @property
    def gpu_uuid(self) -> str: ...
    @property
    def gpu_minor(self) -> int: ...
    @property
    def gpu_instance_id(self) -> int | None: ...


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


Holders = Callable[[], Sequence[ClaimHolder] | None]
"""The claims holding devices now (prepare completed); None when that cannot be known."""


@dataclass(frozen=True)
class Holding:
    """One prepared device of one claim, placed on a GPU of this node."""

    uid: str
    namespace: str
    claim: str
    pool: str
    device: str
    kind: str
    """``gpu`` or ``mig`` (anything but ``mig`` is treated as the whole GPU)."""
    gpu_index: int
    gpu_uuid: str
    gpu_instance_id: int | None

    @property
    def key(self) -> HoldingKey:
        return (self.uid, self.pool, self.device)


@dataclass(frozen=True)
class Share:
    key: HoldingKey
    share: float
    """Fraction (0-1) of the GPU's energy and elapsed time that goes to this holding."""
    rule: str


def holdings(
    claims: Sequence[ClaimHolder], gpus: Sequence[GpuInfo]
) -> tuple[list[Holding], list[HoldingKey]]:
    """The holders' devices mapped to GPUs, and the keys of devices on no known GPU.

    A device's GPU is found by ``gpu_uuid`` (stable across reboots and index renumbering), else
    by ``gpu_minor``. Pure.
    """
    by_uuid = {g.uuid: g for g in gpus}
    by_minor = {g.minor: g for g in gpus}
    found: list[Holding] = []
    unknown: list[HoldingKey] = []
    for entry in sorted(claims, key=lambda c: c.uid):
        uid = entry.uid
        for d in entry.devices:
            gpu = by_uuid.get(d.gpu_uuid) or by_minor.get(d.gpu_minor)
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
                )
            )
    return found, unknown


def _split_unit(
    unit_share: float,
    members: Sequence[Holding],
    single_rule: str,
    sample: GpuSample | None,
    gpu_instance_id: int | None,
    process_claim: Callable[[int], str | None] | None,
) -> list[Share]:
    """Split one physical unit (a whole GPU or one MIG device) between the holdings on it."""
    if len(members) == 1:
        return [Share(members[0].key, unit_share, single_rule)]
    per_claim: dict[str, float] = defaultdict(float)
    claims = {h.uid for h in members}
    if sample is not None and process_claim is not None:
        for p in sample.processes:
            if p.sm_utilization is None or p.sm_utilization <= 0:
                continue
            if gpu_instance_id is not None and p.gpu_instance_id != gpu_instance_id:
                continue
            owner = process_claim(p.pid)
            if owner in claims:
                per_claim[owner] += p.sm_utilization
    total = sum(per_claim.values())
    if total > 0:
        count = Counter(h.uid for h in members)
        return [
            Share(h.key, unit_share * per_claim[h.uid] / total / count[h.uid], PROCESS_UTILIZATION)
            for h in members
        ]
    return [Share(h.key, unit_share / len(members), EVEN) for h in members]


def shares(
    gpu: GpuInfo,
    members: Sequence[Holding],
    sample: GpuSample | None,
    process_claim: Callable[[int], str | None] | None = None,
) -> list[Share]:
    """Each holding's share of ``gpu`` for one interval (pure; see the energy module's rules).

    ``sample`` is the GPU's sample at the end of the interval (its processes drive the
    process-utilization split); ``process_claim`` maps a pid to the claim UID running it.
    The shares never sum to more than 1.
    """
    whole = [h for h in members if h.kind != "mig"]
    migs: dict[str, list[Holding]] = defaultdict(list)
    for h in members:
        if h.kind == "mig":
            migs[h.device].append(h)
    out: list[Share] = []
    if whole:
        out += _split_unit(1.0, whole, EXCLUSIVE, sample, None, process_claim)
    for device in sorted(migs):
        group = migs[device]
        gi = group[0].gpu_instance_id
        sms = gpu.mig_device_multiprocessors(device, gi)
        parent = gpu.multiprocessors
        unit = sms / parent if sms is not None and parent else 0.0
        out += _split_unit(min(unit, 1.0), group, MIG_SM_SHARE, sample, gi, process_claim)
    total = sum(s.share for s in out)
    if total > 1.0:
        out = [Share(s.key, s.share / total, s.rule) for s in out]
    return out
