"""NVIDIA's vGPU host interfaces in sysfs: making and removing vGPUs on a GPU.

Two interfaces (docs/gpu-facts.md, "NVIDIA vGPU host driver"):
- ``vf`` (Ada Lovelace, Hopper and newer, vGPU 17+; NVIDIA/kubevirt-gpu-device-plugin README,
  NVIDIA/vgpu-device-manager ``pkg/vgpu/vfio``): a vGPU is an SR-IOV VF given a type by writing
  the numeric type id to its ``nvidia/current_vgpu_type`` (``0`` clears it);
  ``nvidia/creatable_vgpu_types`` lists ``<id> : <name>`` lines of the types the VF can take now.
- ``mdev`` (before Ampere on the GPU itself, Ampere on its VFs; sysfs-bus-vfio-mdev): a parent's
  ``mdev_supported_types/nvidia-<id>/`` with ``available_instances`` and ``name``; writing a UUID
  to its ``create`` makes the mediated device, which then appears as ``bus/mdev/devices/<uuid>``
  (a link into the parent's directory) with an ``mdev_type`` link and an ``iommu_group``;
  writing ``1`` to its ``remove`` destroys it (KubeVirt ``cmd/virt-chroot/mdev-handler.go``).

Writes go through the :data:`KernelWrite` given; every change is idempotent."""

from __future__ import annotations

import os
import uuid as uuids
from pathlib import Path

from agent.pcihost import attrs
from agent.pcihost.errors import PciHostError, read_failed, write_failed
from agent.pcihost.vm_types import KernelWrite, Vgpu

MDEV_TYPE_PREFIX = "nvidia-"
"""The NVIDIA driver's prefix of mdev type directories: ``nvidia-<type id>``."""


def current_vgpu_type_path(sys_root: Path, vf: str) -> Path:
    return attrs.function_dir(sys_root, vf) / "nvidia" / "current_vgpu_type"


def creatable_path(sys_root: Path, function: str) -> Path:
    return attrs.function_dir(sys_root, function) / "nvidia" / "creatable_vgpu_types"


def mdev_types_dir(sys_root: Path, function: str) -> Path:
    return attrs.function_dir(sys_root, function) / "mdev_supported_types"


def mdev_link(sys_root: Path, uuid: str) -> Path:
    return sys_root / "bus" / "mdev" / "devices" / check_uuid(uuid)


def check_uuid(uuid: str) -> str:
    """``uuid`` when it is a UUID in the canonical lower-case form the kernel names mdevs by."""
    try:
        canonical = str(uuids.UUID(uuid))
    except ValueError:
        canonical = ""
    if canonical != uuid:
        raise PciHostError(
            f"{uuid!r} is not a mediated device UUID: expected the canonical lower-case form,"
            " e.g. 4b20d080-1b54-4048-85b3-a6a62d165c01",
            value=uuid,
        )
    return uuid


def parse_creatable(text: str) -> dict[int, str]:
    """``<id> : <name>`` lines to {id: name}; a line whose id is not a number (a header such as
    ``ID : vGPU Name``) is skipped."""
    types: dict[int, str] = {}
    for line in text.splitlines():
        key, sep, name = line.partition(":")
        if sep and key.strip().isdigit():
            types[int(key.strip())] = name.strip()
    return types


def mdev_type_id(name: str) -> int | None:
    """``nvidia-63`` -> 63; None for another driver's type."""
    if not name.startswith(MDEV_TYPE_PREFIX) or not name[len(MDEV_TYPE_PREFIX) :].isdigit():
        return None
    return int(name[len(MDEV_TYPE_PREFIX) :])


def vf_vgpu_type(sys_root: Path, vf: str) -> int | None:
    """The VF's ``current_vgpu_type`` (0: none), None when the VF has no such file."""
    text = attrs.read_optional(current_vgpu_type_path(sys_root, vf))
    if text is None:
        return None
    if text in ("", "0"):  # KubeVirt's HasVGPUProfile treats both as none
        return 0
    try:
        return int(text)
    except ValueError as exc:
        raise PciHostError(
            f"{current_vgpu_type_path(sys_root, vf)} holds {text!r}, not a vGPU type id"
        ) from exc


def mdev_parent(sys_root: Path, uuid: str) -> str:
    """The BDF of the function whose directory holds mediated device ``uuid``."""
    return Path(os.path.realpath(mdev_link(sys_root, uuid))).parent.name


def mdev_type_of(sys_root: Path, uuid: str) -> int | None:
    """The NVIDIA vGPU type id of mediated device ``uuid`` (its ``mdev_type`` link)."""
    name = attrs.link_name(mdev_link(sys_root, uuid) / "mdev_type")
    return None if name is None else mdev_type_id(name)


def mdev_uuids(sys_root: Path) -> list[str]:
    """Every mediated device on the node (``bus/mdev/devices``; absent: none)."""
    path = sys_root / "bus" / "mdev" / "devices"
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise read_failed(path, exc) from exc


def read_vgpus(sys_root: Path, gpu_bus_id: str) -> tuple[Vgpu, ...]:
    """The vGPUs that exist now on the GPU ``gpu_bus_id``: its VFs with a vGPU type, and the
    mediated devices whose parent is the GPU or one of its VFs; sorted by function, then UUID."""
    vfs = attrs.virtual_functions(sys_root, gpu_bus_id)
    found: list[Vgpu] = []
    for vf in vfs:
        type_id = vf_vgpu_type(sys_root, vf)
        if type_id:
            found.append(Vgpu(type_id=type_id, function=vf, mdev_uuid=None))
    parents = {gpu_bus_id, *vfs}
    for uuid in mdev_uuids(sys_root):
        parent = mdev_parent(sys_root, uuid)
        type_id = mdev_type_of(sys_root, uuid)
        if parent in parents and type_id is not None:
            found.append(Vgpu(type_id=type_id, function=parent, mdev_uuid=uuid))
    return tuple(sorted(found, key=lambda v: (v.function, v.mdev_uuid or "")))


class VgpuHost:
    """Make, list and remove vGPUs through the host driver's sysfs files (module docstring)."""

    def __init__(self, sys_root: Path, write: KernelWrite) -> None:
        self.sys_root = sys_root
        self._write = write

    def creatable(self, function: str) -> dict[int, str]:
        """Type id -> name of the vGPU types ``function`` can take now: a VF's
        ``creatable_vgpu_types`` (``vf``), else the mdev types with available instances
        (``mdev``). PciHostError when the function offers neither."""
        listing = creatable_path(self.sys_root, function)
        text = attrs.read_optional(listing)
        if text is not None:
            return parse_creatable(text)
        types_dir = mdev_types_dir(self.sys_root, function)
        if not types_dir.is_dir():
            raise PciHostError(
                f"{function} offers no vGPUs: neither {listing} nor {types_dir} exists (is the"
                " vGPU host driver loaded, and SR-IOV enabled with sriov-manage -e?)",
                path=types_dir,
            )
        types: dict[int, str] = {}
        for name in sorted(os.listdir(types_dir)):
            type_id = mdev_type_id(name)
            available = attrs.read_optional(types_dir / name / "available_instances")
            if type_id is None or available is None or not available.isdigit():
                continue
            if int(available) > 0:
                types[type_id] = attrs.read_optional(types_dir / name / "name") or name
        return types

    def current_type(self, vf: str) -> int:
        """The vGPU type ``vf`` has now, 0 when none. PciHostError when ``vf`` has no
        ``nvidia/current_vgpu_type`` (not a VF of a ``vf``-interface GPU)."""
        type_id = vf_vgpu_type(self.sys_root, vf)
        if type_id is None:
            raise PciHostError(
                f"{vf} is not a vGPU VF: {current_vgpu_type_path(self.sys_root, vf)} does not"
                " exist",
                path=current_vgpu_type_path(self.sys_root, vf),
            )
        return type_id

    def set_type(self, vf: str, type_id: int) -> None:
        """Make ``vf`` a vGPU of ``type_id``; nothing when it has that type (idempotent).
        PciHostError when it has another type (clear it first) or the kernel refuses (the
        message lists the types creatable there now)."""
        if type_id <= 0:
            raise PciHostError(
                f"vGPU type id {type_id} for {vf}: a type id is positive (clear_type clears)",
                value=str(type_id),
            )
        current = self.current_type(vf)
        if current == type_id:
            return
        if current != 0:
            raise PciHostError(
                f"{vf} is a vGPU of type {current} already; clear it before setting type {type_id}",
                value=str(type_id),
            )
        path = current_vgpu_type_path(self.sys_root, vf)
        try:
            self._write(path, str(type_id))
        except OSError as exc:
            try:
                now = sorted(self.creatable(vf))
            except PciHostError:
                now = []
            raise write_failed(
                path, str(type_id), exc, f"creatable on {vf} now: {now or 'none'}"
            ) from exc

    def clear_type(self, vf: str) -> None:
        """Remove ``vf``'s vGPU (write ``0``); nothing when it has none (idempotent)."""
        if self.current_type(vf) == 0:
            return
        path = current_vgpu_type_path(self.sys_root, vf)
        try:
            self._write(path, "0")
        except OSError as exc:
            raise write_failed(path, "0", exc, f"clear {vf}'s vGPU (is a VM using it?)") from exc

    def create_mdev(self, parent: str, type_id: int, uuid: str) -> None:
        """Make mediated device ``uuid`` of ``type_id`` on ``parent``; nothing when it exists
        there with that type (idempotent). PciHostError when ``uuid`` exists otherwise, when
        ``parent`` has no such type, or when the kernel refuses."""
        link = mdev_link(self.sys_root, uuid)
        if link.exists():
            where, what = mdev_parent(self.sys_root, uuid), mdev_type_of(self.sys_root, uuid)
            if (where, what) == (parent, type_id):
                return
            raise PciHostError(
                f"mediated device {uuid} exists already on {where} with type {what}, not on"
                f" {parent} with type {type_id}",
                path=link,
            )
        types_dir = mdev_types_dir(self.sys_root, parent)
        create = types_dir / f"{MDEV_TYPE_PREFIX}{type_id}" / "create"
        if not create.exists():
            offered = sorted(t for n in _listdir(types_dir) if (t := mdev_type_id(n)) is not None)
            raise PciHostError(
                f"{parent} has no vGPU type {type_id}: {create} does not exist (types there:"
                f" {offered or 'none'})",
                path=create,
                value=uuid,
            )
        try:
            self._write(create, uuid)
        except OSError as exc:
            available = attrs.read_optional(create.parent / "available_instances")
            raise write_failed(create, uuid, exc, f"available_instances {available}") from exc

    def remove_mdev(self, uuid: str) -> None:
        """Destroy mediated device ``uuid`` (write ``1`` to its ``remove``); nothing when it does
        not exist (idempotent)."""
        link = mdev_link(self.sys_root, uuid)
        if not link.exists():
            return
        path = link / "remove"
        try:
            self._write(path, "1")
        except OSError as exc:
            raise write_failed(path, "1", exc, f"remove {uuid} (is a VM using it?)") from exc

    def mdev_group(self, uuid: str) -> int | None:
        """Mediated device ``uuid``'s IOMMU group, None when it has none. PciHostError when the
        device does not exist."""
        link = mdev_link(self.sys_root, uuid)
        if not link.exists():
            raise PciHostError(f"no mediated device {uuid}: {link} does not exist", path=link)
        name = attrs.link_name(link / "iommu_group")
        return None if name is None or not name.isdigit() else int(name)

    def vgpus(self, gpu_bus_id: str) -> tuple[Vgpu, ...]:
        """The vGPUs that exist now on the GPU (:func:`read_vgpus`)."""
        return read_vgpus(self.sys_root, gpu_bus_id)


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
