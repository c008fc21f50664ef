"""Hand-built sysfs trees laid out as issue 24's design, section 1, and a small fake kernel: the
tests' one stand-in for the simulator (``agent.sim.node.simulated_node``, whose ``pci_write`` is
the simulator's kernel), kept for what no simulated board has: a GPU's audio function in its
IOMMU group, SR-IOV without the vGPU host driver, mdevs on Ampere VFs, and a driver's probe that
fails (``refuse_bind``).

``SysTree`` writes PCI functions, drivers, IOMMU groups, SR-IOV VFs and mdev types under a tmp
root; ``FakeKernel.write`` is a :data:`KernelWrite` that does to that tree what Linux does on a
binding write (moves the ``driver`` link, sets ``driver_override``, takes the unbind lock), so
the code under test sees the kernel's effect, not just a file holding what it wrote."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path


def _link(at: Path, target: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    if at.is_symlink():
        at.unlink()
    at.symlink_to(os.path.relpath(target, at.parent))


@dataclass
class SysTree:
    """A sysfs root (``sys``) and a driver root (``driver``) under ``base``."""

    base: Path

    @property
    def sys(self) -> Path:
        return self.base / "sys"

    @property
    def driver_root(self) -> Path:
        return self.base / "driver"

    def fn(self, bdf: str) -> Path:
        return self.sys / "devices" / "pci0000:00" / bdf

    def add_driver(self, name: str) -> None:
        d = self.sys / "bus" / "pci" / "drivers" / name
        d.mkdir(parents=True, exist_ok=True)
        for f in ("bind", "unbind"):
            (d / f).touch()

    def add_function(
        self,
        bdf: str,
        *,
        device: int = 0x2335,
        vendor: int = 0x10DE,
        driver: str | None = "nvidia",
        group: int | None = None,
        unbind_lock: bool | None = None,
    ) -> Path:
        fn = self.fn(bdf)
        fn.mkdir(parents=True)
        (fn / "vendor").write_text(f"0x{vendor:04x}\n")
        (fn / "device").write_text(f"0x{device:04x}\n")
        (fn / "class").write_text("0x030200\n")
        (fn / "driver_override").write_text("(null)\n")
        _link(self.sys / "bus" / "pci" / "devices" / bdf, fn)
        if driver is not None:
            self.add_driver(driver)
            _link(fn / "driver", self.sys / "bus" / "pci" / "drivers" / driver)
        if group is not None:
            self.join_group(bdf, group)
        if unbind_lock if unbind_lock is not None else driver == "nvidia":
            lock = self.driver_root / "proc/driver/nvidia/gpus" / bdf / "unbindLock"
            lock.parent.mkdir(parents=True, exist_ok=True)
            lock.write_text("0\n")
        return fn

    def join_group(self, bdf: str, group: int) -> None:
        g = self.sys / "kernel" / "iommu_groups" / str(group)
        (g / "devices").mkdir(parents=True, exist_ok=True)
        _link(self.fn(bdf) / "iommu_group", g)
        _link(g / "devices" / bdf, self.fn(bdf))

    def add_vf(self, pf: str, n: int, vf: str) -> Path:
        """VF ``n`` of ``pf``, without the vGPU host driver's files."""
        fn = self.add_function(vf, driver="nvidia", unbind_lock=False)
        (self.fn(pf) / "sriov_totalvfs").write_text("16\n")
        _link(self.fn(pf) / f"virtfn{n}", fn)
        _link(fn / "physfn", self.fn(pf))
        (self.fn(pf) / "sriov_numvfs").write_text(f"{n + 1}\n")
        return fn

    def add_mdev_type(self, parent: str, type_id: int, name: str, available: int) -> Path:
        t = self.fn(parent) / "mdev_supported_types" / f"nvidia-{type_id}"
        t.mkdir(parents=True)
        (t / "name").write_text(f"{name}\n")
        (t / "available_instances").write_text(f"{available}\n")
        (t / "device_api").write_text("vfio-pci\n")
        (t / "create").touch()
        _link(self.sys / "class" / "mdev_bus" / parent, self.fn(parent))
        return t

    def driver_of(self, bdf: str) -> str | None:
        link = self.fn(bdf) / "driver"
        return os.path.basename(os.readlink(link)) if link.is_symlink() else None

    def override_of(self, bdf: str) -> str:
        return (self.fn(bdf) / "driver_override").read_text().strip()


@dataclass
class FakeKernel:
    """Acts on binding writes as Linux does (design section 1); records every write."""

    tree: SysTree
    refuse_bind: set[str] = field(default_factory=set)
    """Functions whose probe fails (the bind write answers ENODEV)."""
    writes: list[tuple[str, str]] = field(default_factory=list)

    def write(self, path: Path, value: str) -> None:
        self.writes.append((str(path), value))
        if not path.exists():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if path.name in ("bind", "unbind") and "drivers" in path.parts:
            self._bind(path.parent.name, value, path.name == "bind")
        elif path.name == "driver_override":
            path.write_text((value.rstrip("\n") or "(null)") + "\n")
        elif path.name == "unbindLock":
            path.write_text(value + "\n")
        else:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    def _fail(self, code: int, path: str) -> OSError:
        return OSError(code, os.strerror(code), path)

    def _bind(self, driver: str, bdf: str, bind: bool) -> None:
        tree = self.tree
        fn = tree.fn(bdf)
        if not fn.is_dir():
            raise self._fail(errno.ENODEV, bdf)
        if not bind:
            if tree.driver_of(bdf) != driver:
                raise self._fail(errno.ENODEV, bdf)
            (fn / "driver").unlink()
            return
        if tree.driver_of(bdf) is not None:
            raise self._fail(errno.EBUSY, bdf)
        override = tree.override_of(bdf)
        if override != "(null)" and override != driver:
            raise self._fail(errno.ENODEV, bdf)
        if driver == "vfio-pci" and override != "vfio-pci":  # vfio-pci has no id table
            raise self._fail(errno.ENODEV, bdf)
        if bdf in self.refuse_bind:
            raise self._fail(errno.ENODEV, bdf)
        _link(fn / "driver", tree.sys / "bus" / "pci" / "drivers" / driver)
