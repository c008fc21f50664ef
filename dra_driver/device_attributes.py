"""Which attributes a device carries: the values a claim's CEL selector compares.

Names and value types follow the reference NVIDIA DRA driver (see dra_driver/device_model.py);
the API server limits a string or version attribute to 64 characters, hence ``bounded`` and
``semver``'s length check. Pure functions of the inventory.
"""

from __future__ import annotations

import hashlib
import re

from agent.discovery.inventory import Gpu
from agent.nvml.types import PowerLimits, SystemInfo

STANDARD_DOMAIN = "resource.kubernetes.io"
MAX_STRING_LENGTH = 64


def semver(version: str) -> str | None:
    """A dotted numeric version as valid semver: ``550.90.07`` -> ``550.90.7``, ``12.4`` ->
    ``12.4.0``; parts beyond three become build metadata. None when not numeric."""
    parts = version.strip().split(".")
    if not all(re.fullmatch(r"[0-9]+", p) for p in parts):
        return None
    nums = [str(int(p)) for p in parts]
    nums += ["0"] * (3 - len(nums))
    out = ".".join(nums[:3])
    if len(nums) > 3:
        out += "+" + ".".join(nums[3:])
    return out if len(out) <= MAX_STRING_LENGTH else None


def bounded(value: str) -> str:
    """A string attribute value within the 64-character limit; longer values keep a prefix and a
    hash of the whole, so equal inputs still give equal outputs (matchAttribute keeps working)."""
    if len(value) <= MAX_STRING_LENGTH:
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    return f"{value[: MAX_STRING_LENGTH - 9]}-{digest}"


def string_value(value: str) -> dict[str, object]:
    """A v1 string attribute value, bounded to the 64-character limit."""
    return {"string": bounded(value)}


def int_value(value: int) -> dict[str, object]:
    """A v1 int attribute value."""
    return {"int": value}


def parent_attributes(gpu: Gpu, system: SystemInfo) -> dict[str, dict[str, object]]:
    """Attributes a GPU shares with its MIG devices."""
    d = gpu.device
    attrs: dict[str, dict[str, object]] = {
        "productName": string_value(d.name),
        "brand": string_value(d.brand),
        "architecture": string_value(d.architecture),
        "index": int_value(d.index),
        "minor": int_value(d.minor),
        f"{STANDARD_DOMAIN}/pciBusID": string_value(d.pci_bus_id),
        f"{STANDARD_DOMAIN}/pcieRoot": string_value(gpu.pcie.pcie_root),
    }
    versions = {
        "cudaComputeCapability": "{}.{}".format(*d.compute_capability),
        "driverVersion": system.driver_version,
        "cudaDriverVersion": system.cuda_driver_version,
    }
    for key, raw in versions.items():
        v = semver(raw)
        if v is not None:
            attrs[key] = {"version": v}
    if gpu.pcie.numa_node is not None:
        attrs[f"{STANDARD_DOMAIN}/numaNode"] = int_value(gpu.pcie.numa_node)
    if gpu.nvlink_clique is not None:
        attrs["nvlinkClique"] = string_value(gpu.nvlink_clique)
    return attrs


def power_attributes(limits: PowerLimits | None) -> dict[str, dict[str, object]]:
    """A whole GPU's power-limit attributes, in whole watts (a claim's CEL selector compares
    them: docs/claims-cookbook.md, "Prefer efficient GPUs"): ``powerLimitMinWatts`` rounded up
    and ``powerLimitMaxWatts`` rounded down (every whole number of watts between them can be
    set), ``powerLimitDefaultWatts`` (what the GPU boots with, its rated board power) rounded
    down. None of them where NVML cannot set a limit on the GPU."""
    if limits is None:
        return {}
    return {
        "powerLimitMinWatts": int_value(-(-limits.min_mw // 1000)),
        "powerLimitMaxWatts": int_value(limits.max_mw // 1000),
        "powerLimitDefaultWatts": int_value(limits.default_mw // 1000),
    }
