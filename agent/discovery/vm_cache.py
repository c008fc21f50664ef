"""The last facts NVML gave about each GPU, kept for GPUs handed to virtual machines.

A GPU bound to ``vfio-pci`` leaves NVML's enumeration (NVML sees only GPUs the ``nvidia`` driver
holds; docs/gpu-facts.md, "GPUs for virtual machines"), yet it stays on the node and in the
inventory, with what NVML last said about it (UUID, minor, product, memory, MIG profiles). Those
facts are kept in ``<state dir>/vm-gpus.json``: written atomically (:func:`agent.fsutil.
atomic_write`) and only when they change, so a steady node never rewrites it.

What is kept is a GPU's lasting facts (:func:`lasting_facts`): its NVML index is ``-1`` (NVML does
not enumerate it, and the index of a GPU back on ``nvidia`` may differ), and what only holds while
the host driver has it is dropped: used memory, MIG devices, NVLink states.

Encoded by hand rather than with a library: the standard library has no typed decoder of nested
dataclasses (and no serialisation library is a dependency); the few types here are decoded
explicitly, and a file that does not decode is reported and ignored, never trusted in part."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from agent.fsutil import atomic_write, holds
from agent.nvml.types import (
    GpuDevice,
    MemoryInfo,
    MigMode,
    MigProfile,
    Placement,
    PowerLimits,
)

CACHE_NAME = "vm-gpus.json"
VERSION = 1
NOT_ENUMERATED = -1
"""``GpuDevice.index`` of a GPU NVML does not enumerate now (bound to vfio-pci)."""


class CacheUnreadable(ValueError):
    """The cache file exists but does not hold what :func:`encode` writes."""


def lasting_facts(device: GpuDevice) -> GpuDevice:
    """What is kept of ``device``: index ``-1``, memory all free, no MIG devices or NVLinks."""
    total = device.memory.total
    return replace(
        device,
        index=NOT_ENUMERATED,
        memory=MemoryInfo(total=total, free=total, used=0, reserved=device.memory.reserved),
        mig_instances=(),
        nvlinks=(),
    )


def encode(devices: Mapping[str, GpuDevice]) -> bytes:
    """The file's bytes for ``devices`` (bus id -> lasting facts); the same facts give the
    same bytes."""
    gpus = {bus: asdict(lasting_facts(d)) for bus, d in sorted(devices.items())}
    return (
        json.dumps({"version": VERSION, "gpus": gpus}, sort_keys=True, indent=1) + "\n"
    ).encode()


def _profile(p: Mapping[str, Any]) -> MigProfile:
    fields = dict(p)
    fields["placements"] = tuple(Placement(**pl) for pl in p["placements"])
    return MigProfile(**fields)


def _device(d: Mapping[str, Any]) -> GpuDevice:
    fields = dict(d)
    fields["compute_capability"] = (
        int(d["compute_capability"][0]),
        int(d["compute_capability"][1]),
    )
    fields["memory"] = MemoryInfo(**d["memory"])
    fields["mig_mode"] = None if d["mig_mode"] is None else MigMode(**d["mig_mode"])
    fields["mig_profiles"] = tuple(_profile(p) for p in d["mig_profiles"])
    fields["mig_instances"] = ()
    fields["nvlinks"] = ()
    limits = d.get("power_limits")
    fields["power_limits"] = None if limits is None else PowerLimits(**limits)
    return lasting_facts(GpuDevice(**fields))


def decode(data: bytes) -> dict[str, GpuDevice]:
    """Bus id -> lasting facts; CacheUnreadable saying why when ``data`` is not such a file."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise CacheUnreadable(f"not a version {VERSION} {CACHE_NAME}")
        return {str(bus): _device(d) for bus, d in doc["gpus"].items()}
    except CacheUnreadable:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise CacheUnreadable(f"{type(exc).__name__}: {exc}") from exc


def load(path: Path) -> dict[str, GpuDevice]:
    """The facts in ``path``; empty when there is no file. CacheUnreadable or OSError when it
    cannot be read or decoded."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    return decode(data)


def save(path: Path, devices: Mapping[str, GpuDevice]) -> bool:
    """Write ``devices`` to ``path`` unless it holds them already; whether it wrote. OSError
    when the write fails (the file then holds what it held)."""
    data = encode(devices)
    if holds(path, data):
        return False
    atomic_write(path, data)
    return True
