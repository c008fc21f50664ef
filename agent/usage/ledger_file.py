"""The usage ledger's file (``<state-dir>/usage.json``): its stored form and the reader of it
(pure). :mod:`agent.usage.counters` writes it; ``tessera usage`` and the crash matrix read it.

Version 2 added the 15-minute buckets (:mod:`agent.usage.buckets`) and each holding's device
class; a version 1 file reads as having no buckets and device classes "" (unknown).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.decode import fields, load_json
from agent.usage.buckets import Buckets

KIND = "TesseraUsageLedger"
VERSION = 2
VERSIONS = (1, 2)
"""The versions read: 1 had no buckets and no device classes."""
MAX_BYTES = 64 * 1024 * 1024

HoldingKey = tuple[str, str, str]
"""(claim UID, pool, device)."""


@dataclass(frozen=True)
class Counters:
    """One holding's counters, as stored."""

    namespace: str
    claim: str
    gpu_uuid: str
    weight: float
    """Its weight in the latest interval: what the gap after a restart is counted with."""
    rule: str
    allocated_gpu_seconds: float = 0.0
    busy_gpu_seconds: float = 0.0
    energy_joules: float = 0.0
    unobserved_seconds: float = 0.0
    released_at: float | None = None
    """Wall-clock second it was first seen gone; None while held."""
    product: str = ""
    """The GPU's product name (what a price table matches)."""
    mig_profile: str | None = None
    """A MIG device's profile (``1g.10gb``); None for a whole GPU."""
    device_class: str = ""
    """The DeviceClass its claim's request named ("" when not known)."""


def _weight(value: object, path: str) -> float:
    w = fields.number(value, path, low=0)
    if w > 1:
        raise fields.FieldError(path, f"must be <= 1 (a share of one GPU), got {w:g}")
    return w


def decode(
    raw: bytes,
) -> tuple[str, float | None, dict[str, float], dict[HoldingKey, Counters]]:
    """(boot id, through, GPU energy readings, counters) of a ledger file; pure. Raises
    ValueError (a FieldError naming the field) or DecodeError."""
    return decode_state(raw)[:4]


def decode_state(
    raw: bytes,
) -> tuple[str, float | None, dict[str, float], dict[HoldingKey, Counters], Buckets]:
    """:func:`decode`, and the buckets (none in a version 1 file)."""
    obj = fields.obj(load_json(raw, "usage ledger", MAX_BYTES), "usage ledger")
    if obj.get("kind") != KIND:
        raise ValueError(f"not a {KIND} object")
    version = obj.get("version")
    if version not in VERSIONS:
        raise ValueError(f"unsupported version {version!r}; this agent reads {list(VERSIONS)}")
    boot = fields.text(obj.get("bootID"), "bootID")
    raw_through = obj.get("through")
    through = None if raw_through is None else fields.number(raw_through, "through", low=0)
    energy = {
        uuid: fields.number(v, f"gpuEnergyJoules[{uuid!r}]", low=0)
        for uuid, v in fields.obj(obj.get("gpuEnergyJoules"), "gpuEnergyJoules").items()
    }
    counters: dict[HoldingKey, Counters] = {}
    for i, h in enumerate(fields.objects(obj.get("holdings"), "holdings", required=True)):
        p = f"holdings[{i}]"
        key = (
            fields.text(h.get("uid"), f"{p}.uid"),
            fields.text(h.get("pool"), f"{p}.pool"),
            fields.text(h.get("device"), f"{p}.device"),
        )
        released = h.get("releasedAt")
        counters[key] = Counters(
            namespace=fields.text(h.get("namespace"), f"{p}.namespace"),
            claim=fields.text(h.get("claim"), f"{p}.claim"),
            gpu_uuid=fields.text(h.get("gpuUUID"), f"{p}.gpuUUID"),
            product=fields.opt_text(h.get("product"), f"{p}.product") or "",
            mig_profile=fields.opt_text(h.get("migProfile"), f"{p}.migProfile"),
            device_class=fields.opt_text(h.get("deviceClass"), f"{p}.deviceClass") or "",
            weight=_weight(h.get("weight"), f"{p}.weight"),
            rule=fields.text(h.get("rule"), f"{p}.rule"),
            allocated_gpu_seconds=fields.number(
                h.get("allocatedGpuSeconds"), f"{p}.allocatedGpuSeconds", low=0
            ),
            busy_gpu_seconds=fields.number(h.get("busyGpuSeconds"), f"{p}.busyGpuSeconds", low=0),
            energy_joules=fields.number(h.get("energyJoules"), f"{p}.energyJoules", low=0),
            unobserved_seconds=fields.number(
                h.get("unobservedSeconds"), f"{p}.unobservedSeconds", low=0
            ),
            released_at=None
            if released is None
            else fields.number(released, f"{p}.releasedAt", low=0),
        )
    buckets = (
        Buckets(horizon=through or 0.0)
        if version == 1
        else Buckets.decode(obj.get("buckets"), "buckets")
    )
    return boot, through, energy, counters, buckets
