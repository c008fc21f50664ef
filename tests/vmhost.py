"""A hand-built sysfs tree of GPUs for virtual machines (design of issue 24, section 1), a fake
``KernelWrite`` that does to it what Linux does, and small stand-ins for ``agent.pcihost``'s
``PciBinding`` and ``VgpuHost`` that read the tree and write through the fake kernel: what the
prepare tests drive ``dra_driver.vm`` with until they run on the simulator's node.

Links are absolute (Linux makes them relative); every reader here takes the link's last part.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from agent.pcihost.vm_types import NVIDIA, VFIO_PCI, VGPU_MDEV, VGPU_VF, GpuVirtualization, Vgpu


def _link_name(path: Path) -> str | None:
    return Path(os.readlink(path)).name if path.is_symlink() else None


@dataclass
class FakeKernel:
    """Applies sysfs writes as the kernel does; ``writes`` keeps (path under root, value)."""

    root: Path
    writes: list[tuple[str, str]] = field(default_factory=list)
    next_group: int = 100

    def dev(self, bdf: str) -> Path:
        return self.root / "bus" / "pci" / "devices" / bdf

    def write(self, path: Path, value: str) -> None:
        rel = path.relative_to(self.root).parts
        self.writes.append(("/".join(rel), value))
        text = value.strip()
        if rel[:3] == ("bus", "pci", "drivers") and rel[4] == "unbind":
            link = self.dev(text) / "driver"
            if _link_name(link) != rel[3]:
                raise OSError(errno.ENODEV, "No such device")
            link.unlink()
        elif rel[:3] == ("bus", "pci", "drivers") and rel[4] == "bind":
            dev = self.dev(text)
            override = (dev / "driver_override").read_text().strip()
            if (dev / "driver").is_symlink():
                raise OSError(errno.EBUSY, "Device or resource busy")
            if override not in ("(null)", rel[3]):
                raise OSError(errno.ENODEV, "No such device")
            if rel[3] == VFIO_PCI and not (dev / "iommu_group").is_symlink():
                raise OSError(errno.EINVAL, "Invalid argument")
            (dev / "driver").symlink_to(self.root / "bus" / "pci" / "drivers" / rel[3])
        elif rel[-1] == "driver_override":
            path.write_text((text or "(null)") + "\n")
        elif rel[-1] == "current_vgpu_type":
            now = int(path.read_text())
            if now and int(text) and now != int(text):
                raise OSError(errno.EBUSY, "Device or resource busy")
            path.write_text(f"{int(text)}\n")
        elif rel[-1] == "create":
            self._create_mdev(path.parent, text)
        elif rel[:3] == ("bus", "mdev", "devices") and rel[-1] == "remove":
            self._remove_mdev(rel[3])
        else:
            raise OSError(errno.EACCES, f"not writable here: {path}")

    def _create_mdev(self, type_dir: Path, uuid: str) -> None:
        available = type_dir / "available_instances"
        if int(available.read_text()) == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        parent = type_dir.parent.parent
        mdev = parent / uuid
        mdev.mkdir()
        (mdev / "mdev_type").symlink_to(type_dir)
        group = self.root / "kernel" / "iommu_groups" / str(self.next_group)
        self.next_group += 1
        (group / "devices").mkdir(parents=True)
        (mdev / "iommu_group").symlink_to(group)
        (mdev / "remove").write_text("")
        (self.root / "bus" / "mdev" / "devices").mkdir(parents=True, exist_ok=True)
        (self.root / "bus" / "mdev" / "devices" / uuid).symlink_to(mdev)
        available.write_text(f"{int(available.read_text()) - 1}\n")

    def _remove_mdev(self, uuid: str) -> None:
        link = self.root / "bus" / "mdev" / "devices" / uuid
        mdev = link.resolve()
        type_dir = Path(os.readlink(mdev / "mdev_type"))
        available = type_dir / "available_instances"
        available.write_text(f"{int(available.read_text()) + 1}\n")
        for child in mdev.iterdir():
            child.unlink()
        mdev.rmdir()
        link.unlink()


class Tree:
    """Builds the tree: PCI functions, their drivers, IOMMU groups, VFs and vGPU files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.kernel = FakeKernel(root)
        for drv in (NVIDIA, VFIO_PCI, "snd_hda_intel", "nvme"):
            d = root / "bus" / "pci" / "drivers" / drv
            d.mkdir(parents=True)
            (d / "bind").write_text("")
            (d / "unbind").write_text("")

    def function(self, bdf: str, driver: str | None, group: int | None) -> Path:
        real = self.root / "devices" / "pci0000:00" / bdf
        real.mkdir(parents=True)
        (real / "vendor").write_text("0x10de\n")
        (real / "driver_override").write_text("(null)\n")
        devices = self.root / "bus" / "pci" / "devices"
        devices.mkdir(parents=True, exist_ok=True)
        (devices / bdf).symlink_to(real)
        if driver is not None:
            (real / "driver").symlink_to(self.root / "bus" / "pci" / "drivers" / driver)
        if group is not None:
            g = self.root / "kernel" / "iommu_groups" / str(group)
            (g / "devices").mkdir(parents=True, exist_ok=True)
            (g / "devices" / bdf).symlink_to(real)
            (real / "iommu_group").symlink_to(g)
        return real

    def vf(self, pf: str, n: int, bdf: str, group: int, types: dict[int, str]) -> None:
        """A VF of ``pf`` with per-VF vGPU files (vGPU 17+); ``types`` creatable there."""
        real = self.function(bdf, NVIDIA, group)
        (self.kernel.dev(pf) / f"virtfn{n}").symlink_to(real)
        (real / "physfn").symlink_to(self.kernel.dev(pf).resolve())
        (real / "nvidia").mkdir()
        lines = "".join(f"{i} : {name}\n" for i, name in types.items())
        (real / "nvidia" / "creatable_vgpu_types").write_text(lines)
        (real / "nvidia" / "current_vgpu_type").write_text("0\n")

    def mdev_types(self, bdf: str, types: dict[int, tuple[str, int]]) -> None:
        """``mdev_supported_types`` of parent ``bdf``: type id -> (name, available instances)."""
        for i, (name, available) in types.items():
            t = self.kernel.dev(bdf) / "mdev_supported_types" / f"nvidia-{i}"
            t.mkdir(parents=True)
            (t / "name").write_text(name + "\n")
            (t / "available_instances").write_text(f"{available}\n")
            (t / "device_api").write_text("vfio-pci\n")
            (t / "create").write_text("")

    def driver(self, bdf: str) -> str | None:
        return _link_name(self.kernel.dev(bdf) / "driver")

    def override(self, bdf: str) -> str:
        return (self.kernel.dev(bdf) / "driver_override").read_text().strip()


class Binding:
    """What ``agent.pcihost.binding.PciBinding`` does, over a :class:`Tree`."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.write = tree.kernel.write

    def driver(self, bdf: str) -> str | None:
        return self.tree.driver(bdf)

    def iommu_group(self, bdf: str) -> int | None:
        name = _link_name(self.tree.kernel.dev(bdf) / "iommu_group")
        return int(name) if name is not None else None

    def group_members(self, bdf: str) -> tuple[str, ...]:
        group = self.iommu_group(bdf)
        if group is None:
            return ()
        devices = self.tree.root / "kernel" / "iommu_groups" / str(group) / "devices"
        return tuple(sorted(p.name for p in devices.iterdir()))

    def unbind(self, bdf: str) -> None:
        drv = self.driver(bdf)
        if drv is not None:
            self.write(self.tree.root / "bus" / "pci" / "drivers" / drv / "unbind", bdf)

    def bind(self, bdf: str, driver: str) -> None:
        if self.driver(bdf) == driver:
            return
        override = self.tree.kernel.dev(bdf) / "driver_override"
        self.write(override, driver)
        try:
            self.write(self.tree.root / "bus" / "pci" / "drivers" / driver / "bind", bdf)
        except OSError:
            self.write(override, "\n")
            raise

    def release_override(self, bdf: str) -> None:
        if self.tree.override(bdf) != "(null)":
            self.write(self.tree.kernel.dev(bdf) / "driver_override", "\n")


class VgpuHost:
    """What ``agent.pcihost.vgpu_host.VgpuHost`` does, over a :class:`Tree`."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.write = tree.kernel.write

    def _dev(self, bdf: str) -> Path:
        return self.tree.kernel.dev(bdf)

    def creatable(self, function: str) -> dict[int, str]:
        per_vf = self._dev(function) / "nvidia" / "creatable_vgpu_types"
        if per_vf.exists():
            if self.current_type(function):
                return {}
            pairs = (line.split(":", 1) for line in per_vf.read_text().splitlines() if line)
            return {int(i): name.strip() for i, name in pairs}
        types = self._dev(function) / "mdev_supported_types"
        if not types.exists():
            return {}
        return {
            int(t.name.removeprefix("nvidia-")): (t / "name").read_text().strip()
            for t in types.iterdir()
            if int((t / "available_instances").read_text()) > 0
        }

    def current_type(self, vf: str) -> int:
        return int((self._dev(vf) / "nvidia" / "current_vgpu_type").read_text())

    def set_type(self, vf: str, type_id: int) -> None:
        if self.current_type(vf) != type_id:
            self.write(self._dev(vf) / "nvidia" / "current_vgpu_type", str(type_id))

    def clear_type(self, vf: str) -> None:
        if self.current_type(vf):
            self.write(self._dev(vf) / "nvidia" / "current_vgpu_type", "0")

    def create_mdev(self, parent: str, type_id: int, uuid: str) -> None:
        if not (self.tree.root / "bus" / "mdev" / "devices" / uuid).exists():
            types = self._dev(parent) / "mdev_supported_types"
            self.write(types / f"nvidia-{type_id}" / "create", uuid)

    def remove_mdev(self, uuid: str) -> None:
        link = self.tree.root / "bus" / "mdev" / "devices" / uuid
        if link.exists():
            self.write(link / "remove", "1")

    def mdev_group(self, uuid: str) -> int | None:
        name = _link_name(self.tree.root / "bus" / "mdev" / "devices" / uuid / "iommu_group")
        return int(name) if name is not None else None

    def functions(self, gpu_bus_id: str) -> tuple[str, ...]:
        pf = self._dev(gpu_bus_id)
        vfs = sorted(_link_name(p) or "" for p in pf.glob("virtfn*"))
        return tuple(vfs) if vfs else (gpu_bus_id,)

    def vgpus(self, gpu_bus_id: str) -> tuple[Vgpu, ...]:
        out = []
        for f in self.functions(gpu_bus_id):
            per_vf = (self._dev(f) / "nvidia" / "current_vgpu_type").exists()
            if per_vf and self.current_type(f):
                out.append(Vgpu(self.current_type(f), f, None))
            for m in sorted(self._dev(f).iterdir()):
                if (m / "mdev_type").is_symlink():
                    type_id = int((_link_name(m / "mdev_type") or "").removeprefix("nvidia-"))
                    out.append(Vgpu(type_id, f, m.name))
        return tuple(out)

    def gpu(self, gpu_bus_id: str, heterogeneous: bool = False) -> GpuVirtualization:
        """The GPU's vGPU facts as discovery gives them (no NVML types: not needed here)."""
        functions = self.functions(gpu_bus_id)
        per_vf = (self._dev(functions[0]) / "nvidia" / "current_vgpu_type").exists()
        return GpuVirtualization(
            bus_id=gpu_bus_id,
            vendor_id=0x10DE,
            device_id=0x2335,
            driver=self.tree.driver(gpu_bus_id),
            iommu_group=None,
            group_members=(),
            vgpu_interface=VGPU_VF if per_vf else VGPU_MDEV,
            heterogeneous=heterogeneous,
            vgpu_functions=functions,
            vgpus=self.vgpus(gpu_bus_id),
        )
