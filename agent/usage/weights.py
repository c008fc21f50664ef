"""How much of a physical GPU a prepared device holds: the weight its allocated GPU-seconds are
counted with (pure). docs/budgets.md states the rules; in short:

- ``whole-gpu``: a whole GPU held by one claim (not shared, or with the claim's own MPS daemon)
  weighs 1. Ten seconds of it are 10 GPU-seconds.
- ``mig-slices``: a MIG device weighs the mean of its fractions of the GPU's compute slices and
  memory slices, ``(g / G + m / M) / 2``: on an A100 or H100 (G = 7 compute slices, M = 8 memory
  slices) a ``1g.10gb`` weighs (1/7 + 1/8) / 2 = 0.134, a ``3g.40gb`` (3/7 + 4/8) / 2 = 0.464, a
  ``7g.80gb`` 1. The mean, not the larger fraction: MIG devices never share a slice, so the
  weights of the devices on one GPU never sum to more than 1 (with the larger fraction, a
  ``3g.40gb`` and a ``4g.40gb`` side by side would be 1.07 GPUs). ``g`` is the profile's
  compute slices and ``m`` the size of its placements (NVML counts placements in memory slices).
- ``memory-share``: a share of a whole GPU's memory (``MemoryShare``; Tessera offers memory
  shares of whole GPUs only) weighs the memory it holds over the GPU's: 20 GiB of an 80 GiB GPU
  weighs 0.25.
- ``time-sliced``: the claims holding one unit (a whole GPU, or one MIG device) with time-slicing
  split its weight evenly: three claims on one GPU weigh 1/3 each, whatever their load (their
  busy GPU-seconds say who used it).
- ``vgpu-framebuffer``: a vGPU (device kind ``vgpu``) weighs its type's framebuffer over the
  GPU's memory, as a memory share does: an ``H200X-35C`` (35 GiB) of a 140 GiB H200 weighs 0.25.
  A GPU of one vGPU type holds ``max_instances`` of them, and they fill it. A device passed
  through to a virtual machine whole (kind ``vfio``) is a whole GPU: ``whole-gpu``.

A GPU's weights sum to at most 1: if a malformed checkpoint makes them larger, they are scaled
down together. A device whose MIG profile or vGPU type is unknown weighs nothing and is returned
in ``unknown`` (its caller logs it): counting a guess would be worse than counting nothing that is
visible.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from agent.nvml.types import GpuDevice
from agent.pcihost.vm_types import GpuVirtualization

WHOLE_GPU = "whole-gpu"
MIG_SLICES = "mig-slices"
MEMORY_SHARE = "memory-share"
TIME_SLICED = "time-sliced"
VGPU_FRAMEBUFFER = "vgpu-framebuffer"
RULES = (WHOLE_GPU, MIG_SLICES, MEMORY_SHARE, TIME_SLICED, VGPU_FRAMEBUFFER)
VGPU = "vgpu"
"""The device kind of a vGPU (a VM's share of a GPU the vGPU host driver divides)."""
VFIO = "vfio"
"""The device kind of a whole GPU passed through to a virtual machine (bound to vfio-pci)."""
VM_KINDS = (VFIO, VGPU)
"""Devices used inside virtual machines: the host sees none of their processes or busy time."""

_MIG_DEVICE = re.compile(r"^gpu-\d+-mig-[a-z0-9]+-(\d+)-\d+$")


def mig_profile_id(device: str) -> int | None:
    """The GPU-instance profile id a MIG device's name carries (``gpu-0-mig-1g10gb-19-0``:
    19); None for another name."""
    m = _MIG_DEVICE.match(device)
    return None if m is None else int(m.group(1))


@dataclass(frozen=True)
class GpuCapacity:
    """What a GPU can be divided into, as discovery read it."""

    uuid: str
    memory_bytes: int
    compute_slices: int = 0
    """MIG compute slices of the whole GPU (the largest profile's ``g``: 7); 0 without MIG."""
    memory_slices: int = 0
    """MIG memory slices of the whole GPU (the largest placement's size: 8); 0 without MIG."""
    profiles: tuple[tuple[int, int, int], ...] = ()
    """(profile id, compute slices, memory slices) of every MIG profile the GPU offers."""
    instances: tuple[tuple[int, int], ...] = ()
    """(GPU instance id, profile id) of the MIG devices that exist."""
    profile_names: tuple[tuple[int, str], ...] = ()
    """(profile id, name as NVML gives it: ``1g.10gb``) of every MIG profile."""
    vgpu_framebuffers: tuple[tuple[int, int], ...] = ()
    """(vGPU type id, framebuffer bytes) of every vGPU type the GPU supports (NVML's, through
    discovery's ``Gpu.virtualization``); empty where it offers none."""

    def vgpu_fraction(self, type_id: int | None) -> float | None:
        """The fraction of the GPU's memory a vGPU of type ``type_id`` holds; None when the
        type (or the GPU's memory) is not known."""
        framebuffer = dict(self.vgpu_framebuffers).get(type_id) if type_id is not None else None
        if framebuffer is None or self.memory_bytes <= 0:
            return None
        return min(1.0, framebuffer / self.memory_bytes)

    def mig_profile_of(self, device: str, gpu_instance_id: int | None) -> int | None:
        """The profile id of the MIG device ``device``: its name's, else its GPU instance's."""
        profile = mig_profile_id(device)
        if profile is None and gpu_instance_id is not None:
            profile = self._instance_profiles.get(gpu_instance_id)
        return profile

    def mig_fraction(self, device: str, gpu_instance_id: int | None) -> float | None:
        """``(g / G + m / M) / 2`` of the MIG device ``device``; None when its profile is not
        known."""
        if not self.compute_slices or not self.memory_slices:
            return None
        profile = self.mig_profile_of(device, gpu_instance_id)
        return None if profile is None else self._fractions.get(profile)

    def mig_profile_name(self, device: str, gpu_instance_id: int | None) -> str | None:
        """The name of the MIG device's profile (``1g.10gb``); None when not known."""
        profile = self.mig_profile_of(device, gpu_instance_id)
        return None if profile is None else dict(self.profile_names).get(profile)

    @functools.cached_property
    def _fractions(self) -> dict[int, float]:
        """Profile id -> its weight (made once: the weights are found every tick)."""
        return {
            p: (g / self.compute_slices + s / self.memory_slices) / 2 for p, g, s in self.profiles
        }

    @functools.cached_property
    def _instance_profiles(self) -> dict[int, int]:
        return dict(self.instances)


def capacity_of(device: GpuDevice, virtualization: GpuVirtualization | None = None) -> GpuCapacity:
    """The ``GpuCapacity`` of a discovered GPU and what it offers virtual machines (pure)."""
    profiles = tuple(
        sorted(
            (p.profile_id, p.slice_count, max((pl.size for pl in p.placements), default=0))
            for p in device.mig_profiles
        )
    )
    return GpuCapacity(
        uuid=device.uuid,
        memory_bytes=device.memory.total,
        compute_slices=max((g for _, g, _ in profiles), default=0),
        memory_slices=max((s for _, _, s in profiles), default=0),
        profiles=profiles,
        instances=tuple(sorted((i.gpu_instance_id, i.profile_id) for i in device.mig_instances)),
        profile_names=tuple(sorted((p.profile_id, p.name) for p in device.mig_profiles)),
        vgpu_framebuffers=tuple(
            sorted((t.type_id, t.framebuffer_bytes) for t in virtualization.vgpu_types)
        )
        if virtualization is not None
        else (),
    )


class Held(Protocol):
    """A device a claim holds, as the weights need to know it (the driver's checkpoint records
    satisfy it)."""

    @property
    def pool(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def kind(self) -> str:
        """``gpu``, ``mig``, ``vfio`` (a whole GPU passed through to a VM) or ``vgpu``."""
        ...

    @property
    def gpu_uuid(self) -> str: ...
    @property
    def gpu_instance_id(self) -> int | None: ...
    @property
    def sharing(self) -> str | None:
        """None (exclusive), ``TimeSlicing``, ``MPS`` or ``MemoryShare``."""
        ...

    @property
    def memory_bytes(self) -> int | None:
        """``MemoryShare``: the memory the claim holds."""
        ...

    @property
    def vgpu_type_id(self) -> int | None:
        """A ``vgpu`` device's NVML vGPU type id."""
        ...


@dataclass(frozen=True)
class Holding:
    """One claim's device, as the weights see it."""

    claim_uid: str
    device: Held


@dataclass(frozen=True)
class Weight:
    claim_uid: str
    pool: str
    device: str
    gpu_uuid: str
    weight: float
    """The share of the physical GPU, 0 to 1."""
    rule: str


def weights(
    holdings: Sequence[Holding], gpus: Sequence[GpuCapacity]
) -> tuple[tuple[Weight, ...], tuple[Holding, ...]]:
    """Each holding's weight on its GPU, and the holdings that cannot be weighed (on no known
    GPU, or a MIG device of an unknown profile). Pure; the rules are in the module docstring."""
    by_uuid = {g.uuid: g for g in gpus}
    unknown: list[Holding] = []
    units: dict[tuple[str, str], set[str]] = defaultdict(set)
    for h in holdings:
        if h.device.sharing == "TimeSlicing":
            units[(h.device.gpu_uuid, h.device.device)].add(h.claim_uid)
    out: list[Weight] = []
    for h in holdings:
        d = h.device
        gpu = by_uuid.get(d.gpu_uuid)
        if gpu is None:
            unknown.append(h)
            continue
        unit, rule = 1.0, WHOLE_GPU
        if d.kind == "mig":
            fraction = gpu.mig_fraction(d.device, d.gpu_instance_id)
            if fraction is None:
                unknown.append(h)
                continue
            unit, rule = fraction, MIG_SLICES
        elif d.kind == VGPU:
            fraction = gpu.vgpu_fraction(d.vgpu_type_id)
            if fraction is None:
                unknown.append(h)
                continue
            unit, rule = fraction, VGPU_FRAMEBUFFER
        if d.sharing == "MemoryShare" and d.memory_bytes is not None and gpu.memory_bytes > 0:
            # memory shares are of whole GPUs (plan.py); a MIG device's would be of its memory
            unit, rule = unit * min(1.0, d.memory_bytes / gpu.memory_bytes), MEMORY_SHARE
        elif d.sharing == "TimeSlicing":
            unit, rule = unit / len(units[(d.gpu_uuid, d.device)]), TIME_SLICED
        out.append(Weight(h.claim_uid, d.pool, d.device, d.gpu_uuid, unit, rule))
    return _capped(out), tuple(unknown)


def _capped(found: list[Weight]) -> tuple[Weight, ...]:
    """Scale each GPU's weights down together where they sum to more than 1."""
    total: dict[str, float] = defaultdict(float)
    for w in found:
        total[w.gpu_uuid] += w.weight
    return tuple(
        Weight(w.claim_uid, w.pool, w.device, w.gpu_uuid, w.weight / total[w.gpu_uuid], w.rule)
        if total[w.gpu_uuid] > 1.0 + 1e-9
        else w
        for w in found
    )
