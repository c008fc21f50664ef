"""Reading the PCI attributes and links every part of :mod:`agent.pcihost` needs (no writes).

Paths and meanings (docs/gpu-facts.md, "GPUs for virtual machines"): sysfs-bus-pci
(``bus/pci/devices/<BDF>`` with ``driver``, ``driver_override``, ``iommu_group``,
``sriov_totalvfs``, ``virtfn<N>``), vfio.rst (``kernel/iommu_groups/<N>/devices``). Only the
name a link points to is read (``driver`` -> ``.../drivers/nvidia``: ``nvidia``), never its depth,
so a tree with other relative links reads the same."""

from __future__ import annotations

import os
import re
from pathlib import Path

from agent.pcihost.errors import PciHostError, read_failed

BDF_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
"""A PCI function's address as sysfs names it, ``DDDD:BB:DD.F`` in lower case (PCI domains wider
than four digits exist behind Intel VMD)."""
NO_OVERRIDE = "(null)"
"""What ``driver_override`` reads when no override is set (Linux prints a NULL string so)."""


def check_bdf(bdf: str) -> str:
    """``bdf`` when it is a sysfs PCI address; else PciHostError naming it and the form."""
    if not BDF_RE.match(bdf):
        raise PciHostError(
            f"{bdf!r} is not a PCI address as sysfs names functions: expected DDDD:BB:DD.F in"
            " lower-case hex, e.g. 0000:1b:00.0",
            value=bdf,
        )
    return bdf


def function_dir(sys_root: Path, bdf: str) -> Path:
    """``<sys_root>/bus/pci/devices/<bdf>``; PciHostError when there is no such function."""
    path = sys_root / "bus" / "pci" / "devices" / check_bdf(bdf)
    if not path.is_dir():
        raise PciHostError(f"no PCI function {bdf}: {path} does not exist", path=path)
    return path


def read_text(path: Path) -> str:
    """The attribute's text without surrounding white space; PciHostError when unreadable."""
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise read_failed(path, exc) from exc


def read_optional(path: Path) -> str | None:
    """As :func:`read_text`, None when the attribute does not exist."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise read_failed(path, exc) from exc


def link_name(path: Path) -> str | None:
    """The last component of the link at ``path``, None when there is no link."""
    try:
        return os.path.basename(os.readlink(path))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise read_failed(path, exc) from exc


def read_hex(path: Path) -> int:
    """A hex attribute (``vendor``: ``0x10de``)."""
    text = read_text(path)
    try:
        return int(text, 16)
    except ValueError as exc:
        raise PciHostError(f"{path} holds {text!r}, not a hex number", path=path) from exc


def bound_driver(sys_root: Path, bdf: str) -> str | None:
    """The driver bound to ``bdf`` now (``nvidia``, ``vfio-pci``), None when unbound."""
    return link_name(function_dir(sys_root, bdf) / "driver")


def driver_override(sys_root: Path, bdf: str) -> str | None:
    """The function's ``driver_override``, None when unset (``(null)``, or empty)."""
    text = read_optional(function_dir(sys_root, bdf) / "driver_override")
    return None if text in (None, "", NO_OVERRIDE) else text


def iommu_group(sys_root: Path, bdf: str) -> int | None:
    """The function's IOMMU group, None without an IOMMU (no ``iommu_group`` link)."""
    name = link_name(function_dir(sys_root, bdf) / "iommu_group")
    if name is None:
        return None
    try:
        return int(name)
    except ValueError as exc:
        raise PciHostError(
            f"{function_dir(sys_root, bdf) / 'iommu_group'} points to {name!r}, not a group number"
        ) from exc


def group_devices(sys_root: Path, group: int) -> tuple[str, ...]:
    """Every function of IOMMU group ``group`` (``kernel/iommu_groups/<N>/devices``), sorted."""
    path = sys_root / "kernel" / "iommu_groups" / str(group) / "devices"
    try:
        return tuple(sorted(os.listdir(path)))
    except OSError as exc:
        raise read_failed(path, exc) from exc


def virtual_functions(sys_root: Path, bdf: str) -> tuple[str, ...]:
    """The SR-IOV VFs enabled on ``bdf`` now (its ``virtfn<N>`` links), sorted by address."""
    fn = function_dir(sys_root, bdf)
    try:
        names = [n for n in os.listdir(fn) if re.fullmatch(r"virtfn\d+", n)]
    except OSError as exc:
        raise read_failed(fn, exc) from exc
    return tuple(sorted(vf for n in names if (vf := link_name(fn / n)) is not None))
