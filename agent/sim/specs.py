"""GPU product specifications the simulator models (data in ``gpus.yaml``).

Pure data loading and the MIG profile naming rule; no state, no I/O beyond reading the package file.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from agent.decode.bounds import YamlLoader
from agent.sim.errors import ModelError

MIB = 1024 * 1024
GIB = 1024 * MIB


@dataclass(frozen=True)
class MigProfileSpec:
    """One GPU-instance profile of a product (NVML's view: ids, enum, MiB, engine counts)."""

    name: str
    profile_id: int
    enum: int
    slice_count: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    max_instances: int
    memory_slots: int
    placement_starts: tuple[int, ...]

    @property
    def media_extensions(self) -> bool:
        return self.name.endswith("+me")


@dataclass(frozen=True)
class VgpuTypeSpec:
    """One vGPU type of a product as the vGPU host driver offers it (NVML's view)."""

    type_id: int
    name: str
    """With the driver's prefix: ``NVIDIA H200X-35C``, ``GRID T4-4Q``."""
    framebuffer_mib: int
    max_instances: int


@dataclass(frozen=True)
class GpuSpec:
    """A GPU product: identity, sizes and its MIG profile table (empty when not MIG-capable)."""

    key: str
    name: str
    pci_device_id: int
    architecture: int
    compute_capability: tuple[int, int]
    brand: int
    memory_mib: int
    multiprocessors: int
    nvlinks: int
    power_limit_w: int
    mig_hopper_style: bool
    mig_profiles: tuple[MigProfileSpec, ...]
    vgpu_types: tuple[VgpuTypeSpec, ...] = ()
    """The vGPU types the vGPU host driver offers on this product (empty: none known)."""
    sriov_total_vfs: int = 0
    """``sriov_totalvfs`` of the GPU under the vGPU host driver (0: no SR-IOV)."""

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    def profile(self, profile_id: int) -> MigProfileSpec:
        for p in self.mig_profiles:
            if p.profile_id == profile_id:
                return p
        raise KeyError(profile_id)

    def profile_by_name(self, name: str) -> MigProfileSpec:
        for p in self.mig_profiles:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.mig_profiles) or "none (not MIG-capable)"
        raise ModelError(f"GPU {self.key} has no MIG profile {name!r}; known profiles: {known}")


def profile_name(slice_count: int, profile_mib: int, total_mib: int, media: bool = False) -> str:
    """MIG profile name from slot fractions, as NVIDIA derives it (docs/gpu-facts.md).

    ``GB = round(ceil(8 * profileBytes / totalBytes) / 8 * ceil(totalBytes / GiB))``, rounding
    halves up.
    """
    eighths = math.ceil(8 * profile_mib / total_mib)
    total_gib = math.ceil(total_mib * MIB / GIB)
    gb = math.floor(eighths / 8 * total_gib + 0.5)
    return f"{slice_count}g.{gb}gb" + ("+me" if media else "")


def _profile(row: list[Any]) -> MigProfileSpec:
    name, pid, enum, g, mib, sms, ce, dec, enc, jpg, ofa, max_n, slots, starts = row
    return MigProfileSpec(
        name=str(name),
        profile_id=int(pid),
        enum=int(enum),
        slice_count=int(g),
        memory_mib=int(mib),
        multiprocessors=int(sms),
        copy_engines=int(ce),
        decoders=int(dec),
        encoders=int(enc),
        jpeg_engines=int(jpg),
        ofa_engines=int(ofa),
        max_instances=int(max_n),
        memory_slots=int(slots),
        placement_starts=tuple(int(s) for s in starts),
    )


def _vgpu_type(row: list[Any]) -> VgpuTypeSpec:
    type_id, name, mib, max_n = row
    return VgpuTypeSpec(int(type_id), str(name), int(mib), int(max_n))


@cache
def gpu_specs() -> Mapping[str, GpuSpec]:
    """All known products, keyed by the name node models use (``H100-SXM5-80GB``)."""
    text = resources.files("agent.sim").joinpath("gpus.yaml").read_text()
    return parse_gpu_specs(text, "gpus.yaml")


def load_gpu_specs(path: Path) -> Mapping[str, GpuSpec]:
    """A product file laid out like the bundled ``gpus.yaml`` (a copy with a change, to compare
    the simulator against itself: ``make gpu-check``)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ModelError(f"cannot read GPU spec file {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ModelError(f"GPU spec file {str(path)!r} is not UTF-8 text: {exc.reason}") from exc
    return parse_gpu_specs(text, str(path))


def parse_gpu_specs(text: str, source: str) -> Mapping[str, GpuSpec]:
    """The products of one ``gpus.yaml`` document; ModelError naming ``source`` when malformed."""
    try:
        raw = yaml.load(text, Loader=YamlLoader)["products"]
        specs: dict[str, GpuSpec] = {}
        for key, d in raw.items():
            specs[key] = GpuSpec(
                key=key,
                name=d["name"],
                pci_device_id=int(d["pciDeviceId"]),
                architecture=int(d["architecture"]),
                compute_capability=(
                    int(d["computeCapability"][0]),
                    int(d["computeCapability"][1]),
                ),
                brand=int(d["brand"]),
                memory_mib=int(d["memoryMiB"]),
                multiprocessors=int(d["multiprocessors"]),
                nvlinks=int(d["nvlinks"]),
                power_limit_w=int(d["powerLimitW"]),
                mig_hopper_style=bool(d.get("migHopperStyle", False)),
                mig_profiles=tuple(_profile(r) for r in d.get("migProfiles", [])),
                vgpu_types=tuple(_vgpu_type(r) for r in d.get("vgpuTypes", [])),
                sriov_total_vfs=int(d.get("sriovTotalVfs", 0)),
            )
    except yaml.YAMLError as exc:
        raise ModelError(f"{source} is not valid YAML: {' '.join(str(exc).split())}") from exc
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ModelError(f"{source}: malformed GPU spec file: {exc!r}") from exc
    return types.MappingProxyType(specs)  # cached and shared: read-only
